"""Anthropic Messages <-> chat completions, as llama-server b11434 converts them (placeholder: text only; the exact
port replaces it)."""

from __future__ import annotations

from typing import Any

import orjson

from ..errors import BadRequest


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    if "messages" not in body:
        raise BadRequest("'messages' is required")
    messages: list[Any] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            content = [b for b in content if isinstance(b, dict) and b.get("type") == "text"]
        messages.append({"role": m.get("role"), "content": content})
    out: dict[str, Any] = {"messages": messages, "max_tokens": body.get("max_tokens", 4096)}
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            out[key] = body[key]
    return out


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    chat = to_chat(body)
    if chat.get("stream"):
        chat["timings_per_token"] = True
    return chat


def answer(chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    usage = chat.get("usage", {})
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    stop = {"length": "max_tokens", "tool_calls": "tool_use"}.get(choice.get("finish_reason"), "end_turn")
    text = choice["message"].get("content") or ""
    return {"id": chat.get("id"), "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": text}] if text else [], "model": chat.get("model"),
            "stop_reason": stop, "stop_sequence": None,
            "usage": {"cache_read_input_tokens": cached, "input_tokens": usage.get("prompt_tokens", 0) - cached,
                      "output_tokens": usage.get("completion_tokens", 0)}}


class MessagesStream:
    def __init__(self) -> None:
        self.started = False
        self.text = False
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        out: list[tuple[str, dict[str, Any]]] = []
        events = (self.tail + data).split(b"\n\n")
        self.tail = events.pop()
        for event in events:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            doc = orjson.loads(event[6:])
            timings = doc.get("timings") or {}
            if not self.started:
                self.started = True
                out.append(("message_start", {"type": "message_start", "message": {
                    "id": doc.get("id"), "type": "message", "role": "assistant", "content": [],
                    "model": doc.get("model"), "stop_reason": None, "stop_sequence": None,
                    "usage": {"cache_read_input_tokens": timings.get("cache_n", 0),
                              "input_tokens": timings.get("prompt_n", 0), "output_tokens": 0}}}))
            for choice in doc.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if not self.text:
                        self.text = True
                        out.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                                            "content_block": {"type": "text", "text": ""}}))
                    out.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                        "delta": {"type": "text_delta", "text": delta["content"]}}))
                if choice.get("finish_reason"):
                    if self.text:
                        out.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
                    stop = {"length": "max_tokens"}.get(choice["finish_reason"], "end_turn")
                    out.append(("message_delta", {"type": "message_delta", "delta": {
                        "stop_reason": stop, "stop_sequence": None},
                        "usage": {"output_tokens": timings.get("predicted_n", 0)}}))
                    out.append(("message_stop", {"type": "message_stop"}))
        return b"".join(b"event: " + n.encode() + b"\ndata: " + orjson.dumps(d) + b"\n\n" for n, d in out)

    def close(self) -> bytes:
        return b""
