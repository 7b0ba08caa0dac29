"""How a finished or streaming task is written out, per API flavour.

One engine serves three response shapes: OpenAI chat, OpenAI text completion, and
llama-server's native ``/completion``. Each shape gives the JSON body, or the events
of a stream: ``head`` before the tokens, one ``delta`` per token, ``tail`` after.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from lpcache.mock_llama.engine import Generation

FINISH_REASON = "length"  # the fake model never emits an end-of-generation token


def answer_text(pieces: list[str]) -> str:
    return " ".join(pieces)


def piece_text(index: int, piece: str) -> str:
    """The text a token adds to the answer: words are separated by one space."""
    return piece if index == 0 else " " + piece


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


class Shape:
    done_marker = True  # OpenAI streams end with ``data: [DONE]``

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    async def events(self, gen: Generation) -> AsyncGenerator[bytes, None]:
        """The stream, one event per yield so each one leaves as soon as it exists."""
        await gen.prefill()
        for event in self.head(gen):
            yield sse(event)
        index = 0
        async for piece in gen.tokens():
            yield sse(self.delta(gen, piece_text(index, piece)))
            index += 1
        for event in self.tail(gen):
            yield sse(event)
        if self.done_marker:
            yield b"data: [DONE]\n\n"

    def body(self, gen: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def head(self, gen: Generation) -> list[dict[str, Any]]:
        return []

    def delta(self, gen: Generation, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def tail(self, gen: Generation) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _openai_tail(self, gen: Generation, finish: dict[str, Any]) -> list[dict[str, Any]]:
        """Finish chunk, optional usage chunk; ``timings`` only on the last of them."""
        events = [finish]
        if self.include_usage:
            events.append(self._chunk([]) | {"usage": gen.usage()})
        events[-1]["timings"] = gen.timings()
        return events

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError


class ChatShape(Shape):
    """`per_token`: the request's `timings_per_token` (each token's chunk carries the timings so far, as the last
    chunk of each partial result does on llama-server)."""

    def __init__(self, model: str, include_usage: bool = False, per_token: bool = False) -> None:
        super().__init__(model, include_usage)
        self.id = "chatcmpl-" + secrets.token_urlsafe(24)
        self.per_token = per_token

    def body(self, gen: Generation) -> dict[str, Any]:
        message = {"role": "assistant", "content": answer_text(gen.generated)}
        return {
            **self._envelope("chat.completion"),
            "choices": [{"index": 0, "message": message, "finish_reason": FINISH_REASON}],
            "usage": gen.usage(),
            "timings": gen.timings(),
        }

    def head(self, gen: Generation) -> list[dict[str, Any]]:
        return [self._chunk([self._choice({"role": "assistant", "content": None})])]

    def delta(self, gen: Generation, text: str) -> dict[str, Any]:
        chunk = self._chunk([self._choice({"content": text})])
        return chunk | {"timings": gen.timings()} if self.per_token else chunk

    def tail(self, gen: Generation) -> list[dict[str, Any]]:
        return self._openai_tail(gen, self._chunk([self._choice({}, FINISH_REASON)]))

    def _choice(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk"), "choices": choices}

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "mock",
        }


class TextCompletionShape(Shape):
    """``/v1/completions``: OpenAI's legacy text completion."""

    def __init__(self, model: str, include_usage: bool = False) -> None:
        super().__init__(model, include_usage)
        self.id = "cmpl-" + secrets.token_urlsafe(24)

    def body(self, gen: Generation) -> dict[str, Any]:
        return {
            **self._chunk([self._choice(answer_text(gen.generated), FINISH_REASON)]),
            "usage": gen.usage(),
            "timings": gen.timings(),
        }

    def delta(self, gen: Generation, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text)])

    def tail(self, gen: Generation) -> list[dict[str, Any]]:
        return self._openai_tail(gen, self._chunk([self._choice("", FINISH_REASON)]))

    def _choice(self, text: str, finish: str | None = None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "mock",
            "choices": choices,
        }


class NativeShape(Shape):
    """``/completion``: the only response that says which slot served the request."""

    done_marker = False

    def __init__(self, model: str, prompt_text: str) -> None:
        super().__init__(model)
        self.prompt_text = prompt_text

    def body(self, gen: Generation) -> dict[str, Any]:
        return self._result(gen, answer_text(gen.generated))

    def delta(self, gen: Generation, text: str) -> dict[str, Any]:
        return {
            "index": 0,
            "content": text,
            "tokens": [],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": len(gen.generated),
            "tokens_evaluated": len(gen.params.prompt),
        }

    def tail(self, gen: Generation) -> list[dict[str, Any]]:
        return [self._result(gen, "")]

    def _result(self, gen: Generation, content: str) -> dict[str, Any]:
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": gen.slot.id,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(gen.generated),
            "tokens_evaluated": len(gen.params.prompt),
            "generation_settings": {"n_predict": gen.params.n_predict, "n_ctx": gen.slot.n_ctx},
            "prompt": self.prompt_text,
            "has_new_line": False,
            "truncated": False,
            "stop_type": "limit",
            "stopping_word": "",
            "tokens_cached": len(gen.slot.tokens),
            "timings": gen.timings(),
        }
