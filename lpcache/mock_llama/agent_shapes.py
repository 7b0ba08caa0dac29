"""The answers of the agent APIs: OpenAI Responses and Anthropic Messages, JSON and named-event streams.

They follow llama-server b11434's `to_json_oaicompat_resp(_stream)` and `to_json_anthropic(_stream)` (server-task.cpp)
field for field, in its key order. Their streams are `event: NAME` / `data: JSON` pairs with no `[DONE]`; the opening
events go out with the first token, as the real server sends them with its first partial result (a task that
produces no token sends only the closing ones). Timings: only the Responses stream has them, on its
`response.completed` event next to `response`; neither JSON answer nor the Anthropic stream does.
"""

from __future__ import annotations

import secrets
import string
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from lpcache.mock_llama.engine import Generation
from lpcache.mock_llama.shapes import Shape, answer_text, piece_text

ANTHROPIC_STOP_REASON = "max_tokens"  # the fake model never stops on its own (shapes.FINISH_REASON)
ALPHANUMERIC = string.ascii_letters + string.digits

Event = tuple[str, dict[str, Any]]


def random_string() -> str:
    """The real server's ids are a prefix and 32 random letters and digits."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(32))


def named(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class EventShape(Shape):
    """A stream of named events: the opening ones with the first token, one per token, the closing ones."""

    done_marker = False

    async def events(self, gen: Generation) -> AsyncGenerator[bytes, None]:
        await gen.prefill()
        index = 0
        async for piece in gen.tokens():
            for name, data in [*(self.opening(gen) if index == 0 else []), self.text_delta(piece_text(index, piece))]:
                yield named(name, data)
            index += 1
        for name, data in self.closing(gen):
            yield named(name, data)

    def opening(self, gen: Generation) -> list[Event]:
        raise NotImplementedError

    def text_delta(self, text: str) -> Event:
        raise NotImplementedError

    def closing(self, gen: Generation) -> list[Event]:
        raise NotImplementedError


class ResponsesShape(EventShape):
    """`/v1/responses`: usage counts the whole prompt as input, the reused part as `cached_tokens`."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.id = "resp_" + random_string()
        self.message_id = "msg_" + random_string()

    def body(self, gen: Generation) -> dict[str, Any]:
        text = answer_text(gen.generated)
        output = []
        if text:
            output.append({"content": [self._part(text)], "id": "msg_" + random_string(), "role": "assistant",
                           "status": "completed", "type": "message"})
        now = int(time.time())
        return {"completed_at": now, "created_at": now, "id": self.id, "model": self.model, "object": "response",
                "output": output, "status": "completed", "usage": self._usage(gen)}

    def opening(self, gen: Generation) -> list[Event]:
        state = {"id": self.id, "object": "response", "status": "in_progress"}
        item = {"content": [], "id": self.message_id, "role": "assistant", "status": "in_progress", "type": "message"}
        return [
            ("response.created", {"type": "response.created", "response": state}),
            ("response.in_progress", {"type": "response.in_progress", "response": state}),
            ("response.output_item.added", {"type": "response.output_item.added", "item": item}),
            ("response.content_part.added", {"type": "response.content_part.added", "item_id": self.message_id,
                                             "part": {"type": "output_text", "text": ""}}),
        ]

    def text_delta(self, text: str) -> Event:
        name = "response.output_text.delta"
        return name, {"type": name, "item_id": self.message_id, "delta": text}

    def closing(self, gen: Generation) -> list[Event]:
        text = answer_text(gen.generated)
        events: list[Event] = []
        output = []
        if text:
            part = self._part(text)
            item = {"type": "message", "status": "completed", "id": self.message_id, "content": [part],
                    "role": "assistant"}
            events += [
                ("response.output_text.done", {"type": "response.output_text.done", "item_id": self.message_id,
                                               "text": text}),
                ("response.content_part.done", {"type": "response.content_part.done", "item_id": self.message_id,
                                                "part": part}),
                ("response.output_item.done", {"type": "response.output_item.done", "item": item}),
            ]
            output.append(item)
        response = {"id": self.id, "object": "response", "created_at": int(time.time()), "status": "completed",
                    "model": self.model, "output": output, "usage": self._usage(gen)}
        events.append(("response.completed", {"type": "response.completed", "response": response,
                                              "timings": gen.timings()}))
        return events

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    @staticmethod
    def _usage(gen: Generation) -> dict[str, Any]:
        n_prompt, n_gen = len(gen.params.prompt), len(gen.generated)
        return {"input_tokens": n_prompt, "output_tokens": n_gen, "total_tokens": n_prompt + n_gen,
                "input_tokens_details": {"cached_tokens": gen.n_past}}


class AnthropicShape(EventShape):
    """`/v1/messages`: usage counts the reused prompt tokens as `cache_read_input_tokens` and only the rest as
    `input_tokens`. The id is a chat-completion id, as on the real server."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.id = "chatcmpl-" + random_string()

    def body(self, gen: Generation) -> dict[str, Any]:
        text = answer_text(gen.generated)
        return {"id": self.id, "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": text}] if text else [], "model": self.model,
                "stop_reason": ANTHROPIC_STOP_REASON, "stop_sequence": None,
                "usage": self._usage(gen, len(gen.generated))}

    def opening(self, gen: Generation) -> list[Event]:
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": self._usage(gen, 0),
        }
        return [
            ("message_start", {"type": "message_start", "message": message}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
        ]

    def text_delta(self, text: str) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": text}}

    def closing(self, gen: Generation) -> list[Event]:
        events: list[Event] = []
        if gen.generated:
            events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
        delta = {"stop_reason": ANTHROPIC_STOP_REASON, "stop_sequence": None}
        events.append(("message_delta", {"type": "message_delta", "delta": delta,
                                         "usage": {"output_tokens": len(gen.generated)}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    @staticmethod
    def _usage(gen: Generation, output_tokens: int) -> dict[str, Any]:
        return {"cache_read_input_tokens": gen.n_past, "input_tokens": gen.prompt_n, "output_tokens": output_tokens}
