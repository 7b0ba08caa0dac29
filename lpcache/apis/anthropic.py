"""Anthropic's Messages API (POST /v1/messages) through llama-server's chat completions, answered byte for byte as
llama-server (build 11434) answers it itself.

llama-server serves /v1/messages by converting the body to a chat-completions body
(`server_chat_convert_anthropic_to_oai`, server-chat.cpp) and formatting its result as Anthropic's
(`to_json_anthropic*`, server-task.cpp). That conversion drops `id_slot`, so such a request cannot be pinned to a
slot. lpcache converts the request itself instead (`to_chat`, `chat_request`), sends it to /v1/chat/completions
pinned, and converts the answer back: `answer` for JSON, `MessagesStream` for SSE. Only the random ids differ.

The chat answer holds all the Anthropic answer needs but two things, which `chat_request` asks for (neither changes
the prompt or the sampling): `timings_per_token` in a stream, whose timings on each partial result's last chunk tell
where one result's chunks end and give message_start its usage, and `verbose` when stop strings are set, whose
`__verbose.stopping_word` is the stop_sequence.

llama-server writes JSON with nlohmann's ordered_json: keys in insertion order, compact, UTF-8 unescaped. orjson
writes the same bytes for all but floats, which occur only in a tool_use's input: `llama_json.dumps` writes those.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from lpcache.apis.llama_json import dumps
from lpcache.errors import BadRequest

_BILLING = "x-anthropic-billing-header:"
_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use"}   # else "length": "max_tokens"


# json_value(): a missing key, a null, or a value of the wrong type gives the default

def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


def _str(obj: Any, key: str, default: str = "") -> str:
    value = _get(obj, key)
    return value if isinstance(value, str) else default


def _obj(obj: Any, key: str) -> Any:
    """`json_value(obj, key, json::object())`: the value whatever its type, `{}` when missing or null."""
    value = _get(obj, key)
    return {} if value is None else value


def _int(obj: Any, key: str, default: int) -> int:
    """`json_value<int>`: a number or a bool cast to a C int (wrapped, a float truncated), else the default."""
    value = _get(obj, key)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
    if isinstance(value, float):
        return int(value) if -2**31 - 1 < value < 2**31 else -2**31   # x86's answer to an out-of-range cast
    return default


# the request

def _billing_normalised(text: str) -> str:
    """`normalize_anthropic_billing_header`: Claude Code's per-request `cch=xxxxx;` stamp in its system prompt made
    `fffff`, so that the prefix stays cacheable. In bytes, as the C++ counts."""
    if not text.startswith(_BILLING):
        return text
    raw = text.encode()
    at = raw.find(b"cch=", len(_BILLING))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(raw) and raw[start + 5] == ord(";"):
        return (raw[:start] + b"fffff" + raw[start + 5:]).decode()
    return text


def _image(source: Any) -> dict[str, Any] | None:
    kind = _str(source, "type")
    if kind == "base64":
        url = "data:" + _str(source, "media_type", "image/jpeg") + ";base64," + _str(source, "data")
    elif kind == "url":
        url = _str(source, "url")
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(content: Any) -> Any:
    """A tool_result's content: a string as is, text parts joined into one string, parts kept when an image is
    among them, anything else ""."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    text, parts, images = "", [], False
    for part in content:
        kind = _str(part, "type")
        if kind == "text":
            piece = _str(part, "text")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif kind == "image":
            images = True
            image = _image(_obj(part, "source"))
            if image is not None:
                parts.append(image)
    return parts if images else text


def _messages(messages: Any, out: list[Any]) -> None:
    if not isinstance(messages, list):
        return
    for msg in messages:
        role = _str(msg, "role")
        if not isinstance(msg, dict) or "content" not in msg:
            if role != "assistant":
                out.append(msg)
            continue
        content = msg["content"]
        if not isinstance(content, list):
            out.append(msg)
            continue
        converted: list[Any] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        reasoning = ""
        for block in content:
            kind = _str(block, "type")
            if kind == "text":
                converted.append(block)
            elif kind == "thinking":
                reasoning += _str(block, "thinking")
            elif kind == "image":
                image = _image(_obj(block, "source"))
                if image is not None:
                    converted.append(image)
            elif kind == "tool_use":
                calls.append({"id": _str(block, "id"), "type": "function",
                              "function": {"name": _str(block, "name"), "arguments": dumps(_obj(block, "input"))}})
            elif kind == "tool_result":
                results.append({"role": "tool", "tool_call_id": _str(block, "tool_use_id"),
                                "content": _tool_result(_get(block, "content"))})
        if converted or calls or reasoning:
            new: dict[str, Any] = {"role": role, "content": converted or ""}
            if calls:
                new["tool_calls"] = calls
            if reasoning:
                new["reasoning_content"] = reasoning
            out.append(new)
        out.extend(results)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body llama-server makes of an Anthropic Messages body (`server_chat_convert_anthropic_
    to_oai`, b11434), keys in its order. Sub-objects of `body` are shared, not copied.

    Raises BadRequest without 'messages' (llama-server answers that with a 500 server_error)."""
    if not isinstance(body, dict) or "messages" not in body:
        raise BadRequest("'messages' is required", code="invalid_messages")
    messages: list[Any] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            text = _billing_normalised(system)
        elif isinstance(system, list):
            text = "".join(_billing_normalised(_str(b, "text")) for b in system if _str(b, "type") == "text")
        else:
            text = ""
        messages.append({"role": "system", "content": text})
    _messages(body["messages"], messages)
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [{"type": "function", "function": {
            "name": _str(tool, "name"), "description": _str(tool, "description"),
            "parameters": tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool else {}}}
            for tool in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = _str(choice, "type")
        if kind == "auto":
            chat["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            chat["tool_choice"] = "required"
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body["max_tokens"] if "max_tokens" in body else 4096
    for key in _PASSED:
        if key in body:
            chat[key] = body[key]
    if "thinking" in body:
        thinking = _obj(body, "thinking")
        if _str(thinking, "type") == "enabled":
            chat["thinking_budget_tokens"] = _int(thinking, "budget_tokens", 10000)
    if "metadata" in body:
        user = _str(_obj(body, "metadata"), "user_id")
        if user:
            chat["__metadata_user_id"] = user
    return chat


def chat_request(body: dict[str, Any], *, server_stops: bool = False) -> dict[str, Any]:
    """What lpcache sends to /v1/chat/completions for a Messages body (the caller adds `id_slot`): `to_chat`, the
    client's `model` (a router routes by it; a single model server ignores it), and what converting the answer
    needs, none of which changes the prompt or the sampling (llama-server reads `timings_per_token` only to attach
    timings to partial results, `verbose` only to add `__verbose`):

    - a stream: `timings_per_token`, so that each result's chunks can be told apart (see `MessagesStream`);
    - stop strings set (or `server_stops`: the server has its own, `--reverse-prompt` or a template's extra stops):
      `verbose`, whose `stopping_word` is the stop_sequence. Not always, as `__verbose` repeats the whole prompt.
    """
    chat = to_chat(body)
    if isinstance(body.get("model"), str):
        chat["model"] = body["model"]
    if chat.get("stream") is True:
        chat["timings_per_token"] = True
    if "stop" in chat or server_stops:
        chat["verbose"] = True
    return chat


# the answer

def _input(arguments: str) -> Any:
    """A tool call's arguments as its `input`: nlohmann's parse (a byte order mark skipped), `{}` when not JSON."""
    try:
        return orjson.loads(arguments[1:] if arguments.startswith("\ufeff") else arguments)
    except orjson.JSONDecodeError:
        return {}


def _stop_sequence(chunk: dict[str, Any]) -> str | None:
    return _str(_get(chunk, "__verbose"), "stopping_word") or None


def answer(chat: dict[str, Any], request: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Anthropic message llama-server answers (`to_json_anthropic`) for its chat.completion answer `chat`.
    `request` (the Messages body) is not needed: the answer depends on the chat answer alone. Write it with `dumps`
    for llama-server's bytes (orjson's differ only for floats in a tool_use's input)."""
    choice = chat["choices"][0]
    message = _obj(choice, "message")
    content: list[dict[str, Any]] = []
    reasoning = _str(message, "reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = _str(message, "content")
    if text:
        content.append({"type": "text", "text": text})
    for call in _get(message, "tool_calls") or ():
        function = _obj(call, "function")
        content.append({"type": "tool_use", "id": _str(call, "id"), "name": _str(function, "name"),
                        "input": _input(_str(function, "arguments"))})
    usage = _obj(chat, "usage")
    prompt = usage.get("prompt_tokens", 0)
    cached = _obj(usage, "prompt_tokens_details").get("cached_tokens", 0)
    return {"id": chat.get("id"), "type": "message", "role": "assistant", "content": content,
            "model": chat.get("model"), "stop_reason": _STOP_REASONS.get(choice.get("finish_reason"), "max_tokens"),
            "stop_sequence": _stop_sequence(chat),
            "usage": {"cache_read_input_tokens": cached, "input_tokens": prompt - cached,
                      "output_tokens": usage.get("completion_tokens", 0)}}


# the stream

class _Diff(NamedTuple):
    """One `common_chat_msg_diff`, read back from the chat chunk it became."""

    reasoning: str
    content: str
    tool: int | None   # the index of the tool call it adds to, None when none
    id: str
    name: str
    arguments: str


def _diff(chunk: dict[str, Any]) -> _Diff | None:
    choices = chunk.get("choices")
    if not choices or choices[0].get("finish_reason") is not None:
        return None
    delta = _obj(choices[0], "delta")
    if "role" in delta:   # the first result's opening chunk
        return None
    calls = delta.get("tool_calls")
    call = calls[0] if calls else None
    function = _obj(call, "function")
    return _Diff(_str(delta, "reasoning_content"), _str(delta, "content"),
                 call["index"] if call is not None else None, _str(call, "id"),
                 _str(function, "name"), _str(function, "arguments"))


def _finish_reason(chunk: dict[str, Any]) -> str | None:
    choices = chunk.get("choices")
    return choices[0].get("finish_reason") if choices else None


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _start(index: int, block: dict[str, Any]) -> bytes:
    return _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _stop(index: int) -> bytes:
    return _event("content_block_stop", {"type": "content_block_stop", "index": index})


def _text_events(d: _Diff, thinking: bool, text: bool, text_index: int, out: list[bytes]) -> tuple[bool, bool]:
    """A diff's thinking and text events (a block started at its first delta), as partial and final results write
    them alike; returns whether the thinking and text blocks are started."""
    if d.reasoning:
        if not thinking:
            out.append(_start(0, {"type": "thinking", "thinking": ""}))
            thinking = True
        out.append(_delta(0, {"type": "thinking_delta", "thinking": d.reasoning}))
    if d.content:
        if not text:
            out.append(_start(text_index, {"type": "text", "text": ""}))
            text = True
        out.append(_delta(text_index, {"type": "text_delta", "text": d.content}))
    return thinking, text


class MessagesStream:
    """llama-server's chat-completions SSE stream for a `chat_request` -> the Anthropic SSE stream its own
    /v1/messages sends for the same request.

    llama-server formats each result (one a generated token, then the final one) as a whole: a partial result
    (`to_json_anthropic`) starts blocks by the streaming state before it, a final one (`to_json_anthropic_stream`)
    numbers blocks by the whole message and starts again any block its own diffs touch. So the chunks of each result
    must be told apart: the last chunk of a partial result carries `timings` (`timings_per_token`), the final
    result's carries them too, after its `finish_reason`. Each result is one write upstream, and converted when its
    last chunk is in."""

    def __init__(self) -> None:
        self._buffer = b""
        self._result: list[dict[str, Any]] = []   # the chunks of the result being read
        self._reasoning = False    # the message so far has reasoning, text (task_result_state.chat_msg)
        self._text = False
        self._tools: list[list[str]] = []   # [id, name] of each of its tool calls
        self._thinking_started = False    # task_result_state.thinking_block_started, text_block_started
        self._text_started = False
        self.usage: dict[str, Any] = {}   # the last `timings` read: cache_n, prompt_n, predicted_n...
        self._started = False   # message_start sent

    def feed(self, chunk: bytes) -> bytes:
        """The Anthropic bytes for these bytes of the chat stream (empty until a result is complete)."""
        self._buffer += chunk
        *blocks, self._buffer = self._buffer.split(b"\n\n")
        return b"".join(self._block(block) for block in blocks)

    def close(self) -> bytes:
        """The end of the chat stream: a result cut short is converted as a partial one, without message_start."""
        result, self._result, self._buffer = self._result, [], b""
        return self._partial(result, None) if result else b""

    def _block(self, block: bytes) -> bytes:
        if block.startswith(b":"):   # llama-server's keep-alive ping
            return block + b"\n\n"
        if not block.startswith(b"data: ") or block == b"data: [DONE]":   # /v1/messages ends without [DONE]
            return b""
        data = block[6:]
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b""   # not llama-server's: nothing to convert
        if not isinstance(chunk, dict):
            return b""
        if "error" in chunk and "choices" not in chunk:
            # llama-server's own bytes of the error, as /v1/messages writes them
            inner = data[9:-1] if data.startswith(b'{"error":') else dumps(chunk["error"]).encode()
            return self.close() + b"event: error\ndata: " + inner + b"\n\n"
        self._result.append(chunk)
        timings = chunk.get("timings")
        if timings is None:
            return b""
        self.usage = timings
        result, self._result = self._result, []
        if any(_finish_reason(c) is not None for c in result):
            return self._final(result, timings)
        return self._partial(result, timings)

    def _diffs(self, result: list[dict[str, Any]]) -> list[_Diff]:
        """The result's diffs, added to the message so far."""
        diffs = [d for d in map(_diff, result) if d is not None]
        for d in diffs:
            self._reasoning = self._reasoning or bool(d.reasoning)
            self._text = self._text or bool(d.content)
            if d.tool is not None:
                while len(self._tools) <= d.tool:
                    self._tools.append(["", ""])
                if d.id:
                    self._tools[d.tool][0] = d.id
                if d.name:
                    self._tools[d.tool][1] = d.name
        return diffs

    def _message_start(self, result: list[dict[str, Any]], timings: dict[str, Any], out: list[bytes]) -> None:
        """message_start, before the first result's events. llama-server sends it with the partial result of the
        first token only (`n_decoded == 1`), so a stream whose first token was held back (the start of a stop
        string) or that ends at its first token has none, and Anthropic's SDKs refuse such a stream; here it goes
        with whatever result comes first, which is that partial one whenever the server sends it."""
        if self._started:
            return
        self._started = True
        head = result[0]
        out.append(_event("message_start", {"type": "message_start", "message": {
            "id": head.get("id"), "type": "message", "role": "assistant", "content": [],
            "model": head.get("model"), "stop_reason": None, "stop_sequence": None,
            "usage": {"cache_read_input_tokens": timings.get("cache_n", 0),
                      "input_tokens": timings.get("prompt_n", 0), "output_tokens": 0}}}))

    def _partial(self, result: list[dict[str, Any]], timings: dict[str, Any] | None) -> bytes:
        out: list[bytes] = []
        # a result cut short (`close`, no timings of its own): the usage last read, nothing if none
        self._message_start(result, self.usage if timings is None else timings, out)
        diffs = self._diffs(result)
        thinking, text = self._thinking_started, self._text_started
        text_index = 1 if self._reasoning else 0
        for d in diffs:
            thinking, text = _text_events(d, thinking, text, text_index, out)
            if d.tool is not None:
                index = (1 if self._reasoning else 0) + (1 if text else 0) + d.tool
                if d.name:
                    out.append(_start(index, {"type": "tool_use", "id": d.id, "name": d.name}))
                if d.arguments:
                    out.append(_delta(index, {"type": "input_json_delta", "partial_json": d.arguments}))
        self._thinking_started, self._text_started = thinking, text
        return b"".join(out)

    def _final(self, result: list[dict[str, Any]], timings: dict[str, Any]) -> bytes:
        finish = next(r for r in map(_finish_reason, result) if r is not None)
        diffs = self._diffs(result)
        thinking = text = False
        started: set[int] = set()
        text_index = 1 if self._reasoning else 0
        tools_index = text_index + (1 if self._text else 0)
        out: list[bytes] = []
        self._message_start(result, timings, out)
        for d in diffs:
            thinking, text = _text_events(d, thinking, text, text_index, out)
            if d.tool is not None:
                if d.tool not in started:
                    call_id, name = self._tools[d.tool]
                    out.append(_start(tools_index + d.tool, {"type": "tool_use", "id": call_id, "name": name}))
                    started.add(d.tool)
                if d.arguments:
                    out.append(_delta(tools_index + d.tool, {"type": "input_json_delta",
                                                              "partial_json": d.arguments}))
        if self._reasoning:
            out.append(_delta(0, {"type": "signature_delta", "signature": ""}))
            out.append(_stop(0))
        if self._text:
            out.append(_stop(text_index))
        out.extend(_stop(tools_index + i) for i in range(len(self._tools)))
        word = next((w for w in map(_stop_sequence, result) if w is not None), None)
        out.append(_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": _STOP_REASONS.get(finish, "max_tokens"),
                                               "stop_sequence": word},
            "usage": {"output_tokens": timings.get("predicted_n", 0)}}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)
