"""Coalescing: concurrent identical chat requests share one backend call.

The first request of a key is the leader: it calls the backend and feeds the answer into a `Group`. The others are
followers: they read the same answer, converted when their mode (JSON or SSE) differs from the leader's. A group
keeps one list of chunks and each reader its own index into it, so a late follower still gets the whole answer from
the first byte, readers never copy chunks, and memory is bounded by the size of one answer.

Answers are shared only between requests that would each have got the same one alone: the key holds who asks (a
digest of the client's key) and the session besides the body. Followers outlive their leader: when the leader's client
leaves, the leader reads on for the followers still there; when the last of them leaves too, the work stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

import orjson

log = logging.getLogger("lpcache.coalesce")

_NOT_IN_KEY = ("stream", "stream_options")  # how the answer is delivered, not what it says


def coalesce_key(body: dict[str, Any], client: str | None = None, session: str | None = None,
                 route: str | None = None) -> str | None:
    """SHA-256 of the canonical JSON of everything that shapes the answer's content, of who asks (`client`: a digest
    of the client's key, never the key) and of its session (X-Session-ID); `route`: for an API other than chat, its
    path and whether it streams (answers are converted between JSON and SSE only for chat). None when the body
    cannot be written canonically (nested deeper than orjson writes): such a request is not coalesced, and fails
    alone as it would without coalescing."""
    kept = {k: v for k, v in body.items() if k not in _NOT_IN_KEY}
    try:
        raw = orjson.dumps({"body": kept, "client": client, "session": session, "route": route},
                           option=orjson.OPT_SORT_KEYS)
    except TypeError:   # orjson.JSONEncodeError: it reads 1024 levels of nesting but writes only 254
        return None
    return hashlib.sha256(raw).hexdigest()


def _envelope(error: dict[str, Any]) -> dict[str, Any]:
    return error if isinstance(error.get("error"), dict) else {"error": error}


def _sse_event(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class Group:
    """The shared answer of one backend call: fed by the leader, read by any number of subscribers.

    The leader must end every group with `finish` or `fail` (both are no-ops once the group is done, so a `fail` in
    a `finally` is safe); followers wait on it. A non-200 body should be fed right before `finish`, with no await in
    between, so streaming followers never see its bytes as SSE. `followers` counts the followers still there: each
    one calls `leave` when it is done or gone; `on_alone` is called when the last one leaves an unfinished group
    (the leader then stops the work if its own client is gone too).
    """

    def __init__(self, key: str, stream: bool) -> None:
        self._error_status: int | None = None
        self.key = key
        self.stream = stream
        self.followers = 0
        self.on_alone: Callable[[], None] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._started = False   # the leader's client got a 200 stream's head: the followers get one too
        self._status: int | None = None
        self._error: dict[str, Any] | None = None
        self._tail: bytes | None = None
        self._body: bytes | None = None
        self._changed = asyncio.Event()  # replaced after each wake-up: waiters hold the one they waited on

    @property
    def status(self) -> int | None:
        return self._status

    @property
    def error(self) -> dict[str, Any] | None:
        return self._error

    @property
    def done(self) -> bool:
        return self._status is not None or self._error is not None

    def leave(self) -> None:
        """A follower is done with the answer, or its client left."""
        self.followers = max(0, self.followers - 1)
        if self.followers == 0 and not self.done and self.on_alone is not None:
            self.on_alone()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def feed(self, chunk: bytes) -> None:
        if self.done:
            raise RuntimeError("feed() on a finished coalescing group")
        if chunk:
            self._chunks.append(chunk)
            self._wake()

    def finish(self, status: int, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        if self.done:
            return
        self._status = status
        self.headers = list(headers or [])
        self._wake()

    def fail(self, error: dict[str, Any], status: int | None = None, tail: bytes | None = None) -> None:
        """The leader failed: followers get `error` (its body, in the API's shape) with `status` (else the error's
        own HTTP code, else 502). `tail`: how the leader's client's stream ended, after the chunks fed (its error
        event, in the client's format): streaming followers end theirs the same way."""
        if self.done:
            return
        self._error = _envelope(error)
        self._error_status = status
        self._tail = tail
        self._wake()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Every chunk from the first, then live ones, until the group is done."""
        i = 0
        while True:
            while i < len(self._chunks):
                i += 1
                yield self._chunks[i - 1]
            if self.done:
                return
            await self._changed.wait()  # no await between the checks and here: no wake-up can be missed

    async def wait(self) -> None:
        while not self.done:
            await self._changed.wait()

    async def failed_before_start(self) -> bool:
        """Wait for a streamed answer's first chunk, or the group's end: True when no byte of a 200 answer came
        (an error answer, or a failure). A streaming follower then answers the error's status and JSON body, as the
        leader's client got it, not a 200 stream holding one error event."""
        while not self.done and not (self.stream and (self._chunks or self._started)):
            await self._changed.wait()
        if self._status is not None:
            return self._status != 200
        return self._error is not None and not (self.stream and (self._chunks or self._started))

    def start(self) -> None:
        """The leader's client got the head of a 200 stream (whatever follows, an error ends it as an event)."""
        self._started = True
        self._wake()

    def body(self) -> bytes:
        if self._body is None or not self.done:
            self._body = b"".join(self._chunks)
        return self._body

    def _error_doc(self) -> dict[str, Any]:
        """The group's outcome as an OpenAI error body (failed, or a non-200 answer: its message is kept)."""
        if self._error is not None:
            return self._error
        status = self._status or 502
        err = (_loads(self.body()) or {}).get("error")
        if not isinstance(err, dict):
            err = {"message": err if isinstance(err, str) else self.body().decode("utf-8", "replace")[:1000]}
        message = str(err.get("message") or f"backend answered HTTP {status}")
        return {"error": {"message": message, "type": str(err.get("type", "backend_error")), "code": status}}

    async def as_stream(self) -> AsyncIterator[bytes]:
        """What a streaming follower sends. After a mid-stream failure it gets the chunks so far, then the error."""
        if self.stream:
            async for chunk in self.chunks():
                if self._status not in (None, 200):
                    break  # an error body, not SSE
                yield chunk
        else:
            await self.wait()
            if self._status == 200 and self._error is None:
                doc = _loads(self.body())
                yield completion_to_sse(doc) if doc is not None else _sse_event(_bad(_NON_OBJECT))
                return
        if self._error is not None or self._status != 200:
            yield self._tail if self._tail is not None else _sse_event(self._error_doc())

    async def as_json(self) -> tuple[int, bytes]:
        """What a JSON follower sends: (HTTP status, body)."""
        await self.wait()
        if self._error is not None:
            return self._error_status or _http_code(self._error), orjson.dumps(self._error)
        if self._status != 200:
            return self._status or 502, self.body()
        if not self.stream:
            return (200, self.body()) if _loads(self.body()) is not None else (502, orjson.dumps(_bad(_NON_OBJECT)))
        docs = _sse_docs(self.body())
        for doc in docs:
            if isinstance(doc.get("error"), dict):  # llama-server reports some failures as an error event
                return _http_code(doc), orjson.dumps(doc)
        if not any("choices" in doc for doc in docs):
            return 502, orjson.dumps(_bad("backend stream held no completion chunk"))
        return 200, orjson.dumps(_aggregate(docs))


def _http_code(error: dict[str, Any]) -> int:
    """The error's `code` when it is an HTTP error status (OpenAI also uses string codes), else 502."""
    code = error["error"].get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else 502


_NON_OBJECT = "backend answered a body that is not a JSON object"


def _bad(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "backend_error", "code": 502}}


def _loads(raw: bytes) -> dict[str, Any] | None:
    """The JSON object in `raw`, or None when it is not one."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _sse_docs(raw: bytes) -> list[dict[str, Any]]:
    """The JSON objects of an SSE stream's `data:` events; `[DONE]`, comments and non-JSON are skipped."""
    docs: list[dict[str, Any]] = []
    text = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for event in text.split(b"\n\n"):
        data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if not data:
            continue
        doc = _loads(b"\n".join(data))
        if doc is not None:
            docs.append(doc)
    return docs


def aggregate_sse(raw: bytes) -> dict[str, Any]:
    """The `chat.completion` a JSON request would have got, from a whole chat SSE stream."""
    return _aggregate(_sse_docs(raw))


def _aggregate(docs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"object": "chat.completion"}
    choices: dict[int, dict[str, Any]] = {}
    for doc in docs:
        for name in ("id", "created", "model", "system_fingerprint"):
            if out.get(name) is None and doc.get(name) is not None:
                out[name] = doc[name]
        if isinstance(doc.get("usage"), dict):
            out["usage"] = doc["usage"]
        if isinstance(doc.get("timings"), dict):
            out["timings"] = doc["timings"]
        for choice in doc.get("choices") or []:
            if isinstance(choice, dict):
                _merge_choice(choices.setdefault(int(choice.get("index") or 0), _new_choice()), choice)
    out["choices"] = [_close_choice(i, choices[i]) for i in sorted(choices)]
    return out


def _new_choice() -> dict[str, Any]:
    return {"role": None, "content": [], "reasoning": [], "calls": {}, "finish_reason": None}


def _merge_choice(acc: dict[str, Any], choice: dict[str, Any]) -> None:
    if choice.get("finish_reason") is not None:
        acc["finish_reason"] = choice["finish_reason"]
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return
    acc["role"] = acc["role"] or delta.get("role")
    if isinstance(delta.get("content"), str):
        acc["content"].append(delta["content"])
    if isinstance(delta.get("reasoning_content"), str):
        acc["reasoning"].append(delta["reasoning_content"])
    calls: dict[int, dict[str, Any]] = acc["calls"]
    for part in delta.get("tool_calls") or []:
        if not isinstance(part, dict):
            continue
        index = part.get("index")
        if not isinstance(index, int):  # no index: a new call when it brings an id, else the last one goes on
            index = len(calls) if part.get("id") or not calls else max(calls)
        call = calls.setdefault(index, {"id": None, "type": None, "name": [], "arguments": []})
        call["id"] = call["id"] or part.get("id")
        call["type"] = call["type"] or part.get("type")
        function = part.get("function")
        if isinstance(function, dict):
            for name in ("name", "arguments"):
                if isinstance(function.get(name), str):
                    call[name].append(function[name])


def _close_choice(index: int, acc: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": acc["role"] or "assistant",
                               "content": "".join(acc["content"]) if acc["content"] else None}
    if acc["reasoning"]:
        message["reasoning_content"] = "".join(acc["reasoning"])
    if acc["calls"]:
        message["tool_calls"] = [
            {"id": call["id"], "type": call["type"] or "function",
             "function": {"name": "".join(call["name"]), "arguments": "".join(call["arguments"])}}
            for _, call in sorted(acc["calls"].items())]
    return {"index": index, "message": message, "finish_reason": acc["finish_reason"]}


def completion_to_sse(doc: dict[str, Any]) -> bytes:
    """A `chat.completion` as the SSE stream a streaming request would have got (role, content, finish, DONE)."""
    head = {"id": doc.get("id"), "object": "chat.completion.chunk", "created": doc.get("created"),
            "model": doc.get("model")}
    if doc.get("system_fingerprint") is not None:
        head["system_fingerprint"] = doc["system_fingerprint"]
    choices = [c for c in doc.get("choices") or [] if isinstance(c, dict)] or [{"index": 0, "message": {}}]
    roles, contents, ends = [], [], []
    for n, choice in enumerate(choices):
        index = choice.get("index", n)
        message: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
        roles.append(head | {"choices": [{"index": index, "delta": {"role": "assistant", "content": None},
                                          "finish_reason": None}]})
        delta: dict[str, Any] = {}
        if isinstance(message.get("content"), str):
            delta["content"] = message["content"]
        if isinstance(message.get("reasoning_content"), str):
            delta["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        if delta:
            contents.append(head | {"choices": [{"index": index, "delta": delta, "finish_reason": None}]})
        ends.append(head | {"choices": [{"index": index, "delta": {},
                                         "finish_reason": choice.get("finish_reason", "stop")}]})
    for name in ("usage", "timings"):
        if doc.get(name) is not None:
            ends[-1][name] = doc[name]
    return b"".join(_sse_event(event) for event in roles + contents + ends) + b"data: [DONE]\n\n"


class Watch(Protocol):
    """What the leader's client watch (`relay.ClientWatch`) offers: whether the client left, whether its work is to
    go on without it (`stay`), and a way to stop that work."""

    gone: bool
    stay: Callable[[], bool] | None

    def stop_work(self) -> None: ...


class Coalescer:
    """The running groups, by key. A group that is done is no longer joined: the next request starts a new one."""

    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}

    def join(self, key: str, stream: bool) -> tuple[Group, bool]:
        """(group, True) for a new leader, who calls the backend in `stream` mode; (group, False) for a follower."""
        group = self._groups.get(key)
        if group is not None and not group.done:
            group.followers += 1
            return group, False
        group = self._groups[key] = Group(key, stream)
        return group, True

    def lead(self, group: Group, watch: Watch) -> None:
        """The leader's work outlives its client while followers wait for the answer: when the client leaves, the
        work goes on if any follower is there; when the last follower leaves a leader whose client is gone, it
        stops (the backend call is closed, the slot freed). A group whose work stops is joined no more."""
        def stay() -> bool:
            if group.followers > 0:
                log.info("coalesce_leader_left followers=%d: the answer is read on for them", group.followers)
                return True
            self.close(group)
            return False

        def alone() -> None:
            if watch.gone:
                self.close(group)
                watch.stop_work()

        watch.stay, group.on_alone = stay, alone

    def close(self, group: Group) -> None:
        """Called by the leader when done, or when it stops (its client and every follower gone): no request joins
        the group after this. Leaves a newer group of the same key alone."""
        if self._groups.get(group.key) is group:
            del self._groups[group.key]

    def __len__(self) -> int:
        return len(self._groups)

    def active(self) -> list[tuple[str, int]]:
        return [(key, group.followers) for key, group in self._groups.items()]
