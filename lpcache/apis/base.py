"""What every generation API shares: the parsed request (`Call`), the adapter interface (`Api`), and body checks.

An adapter says four things about its API: how a body becomes the prompt lpcache keys its cache by (a list of
messages and the template fields around them, as `identity` reads a chat request; or a plain text), what goes to
llama-server and where (the pin is `id_slot` in the body for every route that passes it on), how the answer is
turned into what the client expects (unchanged, except for Messages), and how lpcache's own errors look.

Bad input is the client's error: 422 for a body that is not JSON, 400 for JSON the API cannot take. A body an adapter
cannot cache but llama-server may serve (several prompts at once, `n` > 1) is not refused: its `View` is not
`cacheable`, the prefilters still read it, and it goes to a slot of the pool uncached (`forwarded`).

Parsing and hashing take time in proportion to the body (100-250 ns a byte: a 16 MiB body is seconds), so a body
above OFF_LOOP_BYTES is handled in a worker thread (`off_loop`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, TypeVar

import orjson

from lpcache.cache.prefix import Prompt, cache_key
from lpcache.config import Settings
from lpcache.errors import BadRequest, ProxyError

OFF_LOOP_BYTES = 64 * 1024   # about 10 ms of parsing: below it a thread hop costs more than it spares

T = TypeVar("T")


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, in a worker thread when it is about a body of more than OFF_LOOP_BYTES."""
    if size <= OFF_LOOP_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the client's error (422: not JSON; 400: not an object)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", status=422, code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_body")
    return body


def check_common(body: dict[str, Any]) -> None:
    """The fields every API reads the same way."""
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("'model' must be a string", code="invalid_model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false", code="invalid_stream")
    if "tools" in body and body["tools"] is not None and not isinstance(body["tools"], list):
        raise BadRequest("'tools' must be an array", code="invalid_tools")
    for name in LENGTH_FIELDS:
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
            # llama-server reads any negative as "until the context is full": a slot held for nothing
            raise BadRequest(f"'{name}' must be an integer >= 0 (or -1: until the context is full, as llama-server "
                             f"reads it), not {value!r}", code=f"invalid_{name}")


# The answer's length limit under each API's name (Responses: max_output_tokens; llama-server's own: n_predict).
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")


@dataclass(frozen=True)
class View:
    """A body as the cache sees it: messages and template fields (`identity`), and optionally the words' text
    (a token-array prompt has no words of its own: its token ids count as words). `cacheable` False: no one prompt
    for one slot (served uncached); `shown`: what prefilters read when it is more than the identity's messages."""

    messages: list[Any]
    template: dict[str, Any] = field(default_factory=dict)
    words: str | None = None
    cacheable: bool = True
    shown: list[Any] | None = None


class Converter(Protocol):
    """Turns the upstream's SSE bytes (whole events) into the client's."""

    def feed(self, data: bytes) -> bytes: ...

    def close(self) -> bytes: ...


class Api:
    """One generation API. Subclasses set `name` and `paths` and implement `check` and `view`."""

    name: ClassVar[str]
    paths: ClassVar[tuple[str, ...]]
    upstream: ClassVar[str | None] = None   # llama-server's path for it; None: the path the client used

    def check(self, body: dict[str, Any]) -> None:
        """Raise BadRequest for a body this API cannot take."""

    def view(self, body: dict[str, Any]) -> View:
        """The prompt as the cache sees it (`cacheable` False: the body is served uncached)."""
        raise NotImplementedError

    def outgoing(self, body: dict[str, Any]) -> dict[str, Any]:
        """What goes to llama-server (the pin is added when the slot is known)."""
        return body

    def prepare(self, body: dict[str, Any]) -> tuple[View, dict[str, Any]]:
        """`view` and `outgoing` together (an adapter that converts the body does it once for both)."""
        return self.view(body), self.outgoing(body)

    def answer(self, raw: bytes, body: dict[str, Any]) -> bytes:
        """A JSON answer to `body` as the client gets it."""
        return raw

    def converter(self, body: dict[str, Any]) -> Converter | None:
        """For a stream: what turns the upstream's events into the client's; None: passed on as they come."""
        return None

    def error(self, err: ProxyError) -> tuple[bytes, str]:
        """lpcache's own error as this API's clients read errors (a backend's error passes on as it came)."""
        return err.payload()

    def error_document(self, err: ProxyError) -> dict[str, Any]:
        """The error as a JSON object (what a failed request's coalesced followers answer): `error`'s body, or,
        when that is not one (a backend's HTML or plain-text error page, an empty body), the same error told in
        this API's own shape."""
        for told in (err, ProxyError(err.message, status=err.status, type=err.type, code=err.code)):
            try:
                doc = orjson.loads(self.error(told)[0])
            except orjson.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                return doc
        return ProxyError.body(err)

    def parse(self, raw: bytes, path: str, settings: Settings) -> Call:
        body = load_object(raw)
        check_common(body)
        self.check(body)
        model = body.get("model") or settings.model_id
        view, send = self.prepare(body)
        prompt = None
        if view.cacheable:
            prompt = Prompt.of(model, view.messages, settings.words_per_block, view.template, view.words)
            if self.name != "chat":   # its answers are another API's: never a chat request's result or coalesced
                prompt = replace(prompt, key=cache_key(self.name, prompt.key))
        # auto (None): every cacheable prompt may be worth a file; `saving.Saver.after` decides once it is answered
        threshold = settings.big_threshold_words
        big = prompt is not None and (threshold is None or prompt.n_words > threshold)
        return Call(self, path, body, send, model, bool(body.get("stream")), prompt, big, view.messages,
                    view.messages if view.shown is None else view.shown)


@dataclass(frozen=True)
class Call:
    """One parsed generation request. `prompt` None: not cacheable (served through a slot, uncached)."""

    api: Api
    path: str
    body: dict[str, Any]                # as the client sent it
    send: dict[str, Any]                # what goes to llama-server (the pin added when the slot is known)
    model: str
    stream: bool
    prompt: Prompt | None
    big: bool
    messages: list[Any]                 # the prompt as messages (identity, the session's comparison)
    shown: list[Any]                    # what prefilters read (all the prompt's text)

    @classmethod
    async def read(cls, api: Api, raw: bytes, path: str, settings: Settings) -> Call:
        """`api.parse`, off the event loop for a big body."""
        return await off_loop(len(raw), api.parse, raw, path, settings)

    def upstream_path(self) -> str:
        return self.api.upstream or self.path
