"""A stand-in for a llama-server running Qwen3Guard-Gen, for the `qwen_guard` tests.

`create_guard_app(rules)` answers `POST /v1/chat/completions` like the real guard, with the content
`"Safety: <Level>\\nCategories: <cats>"`: the first rule whose substring occurs in the user text (case-insensitive)
gives the level and categories, otherwise Safe / None. `app.state.guard` (a `GuardState`) counts requests, keeps the
last one, and has switches for faults: `status` (answer this error status), `garbage` (answer text that is no
verdict), `content` (answer exactly this text), `delay_ms` (wait before answering, cut short when the client goes).
Serve it with `lpcache.workloads.harness.ServerThread`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Rule = tuple[str, Sequence[str] | str]   # (level, categories as a list or "A, B")

GARBAGE = "I'm sorry, I can't help with classifying that."


@dataclass
class GuardState:
    """The stand-in's rules, fault switches and counters; tests change and read it between requests."""

    rules: dict[str, Rule] = field(default_factory=dict)
    status: int = 200
    garbage: bool = False
    content: str | None = None
    delay_ms: int = 0
    requests: int = 0
    last_body: dict[str, Any] | None = None
    last_headers: dict[str, str] = field(default_factory=dict)

    def reset(self) -> None:
        """Faults off, counters zero (rules kept)."""
        self.status, self.garbage, self.content, self.delay_ms = 200, False, None, 0
        self.requests, self.last_body, self.last_headers = 0, None, {}

    def answer(self, text: str) -> str:
        if self.content is not None:
            return self.content
        if self.garbage:
            return GARBAGE
        lowered = text.casefold()
        for needle, (level, cats) in self.rules.items():
            if needle.casefold() in lowered:
                names = cats if isinstance(cats, str) else ", ".join(cats)
                return f"Safety: {level}\nCategories: {names or 'None'}"
        return "Safety: Safe\nCategories: None"


def create_guard_app(rules: Mapping[str, Rule] | None = None, model: str = "qwen3guard") -> Starlette:
    """The stand-in guard app; `rules` maps a substring of the user text to (level, categories)."""
    state = GuardState(rules=dict(rules or {}))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def chat(request: Request) -> Response:
        state.requests += 1
        state.last_headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "Invalid JSON in request body")
        state.last_body = body if isinstance(body, dict) else None
        if state.delay_ms > 0:
            await _wait_unless_gone(request, state.delay_ms / 1000)
        if state.status != 200:
            return _error(state.status, f"stand-in fault: status {state.status}")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' is required")
        text = "\n".join(str(m.get("content") or "") for m in messages
                         if isinstance(m, dict) and m.get("role") == "user")
        content = state.answer(text)
        return JSONResponse({
            "id": f"chatcmpl-guard-{state.requests}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": len(text.split()), "completion_tokens": len(content.split()),
                      "total_tokens": len(text.split()) + len(content.split())},
        })

    app = Starlette(routes=[Route("/health", health, methods=["GET"]),
                            Route("/v1/chat/completions", chat, methods=["POST"])])
    app.state.guard = state
    return app


def _error(status: int, message: str) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}}, status_code=status)


async def _wait_unless_gone(request: Request, seconds: float) -> None:
    """Sleep `seconds`, or less if the client disconnects first (so a stopped server is not held up)."""
    try:
        async with asyncio.timeout(seconds):
            if (await request.receive())["type"] != "http.disconnect":
                await asyncio.sleep(seconds)   # not a disconnect: just wait the rest out
    except TimeoutError:
        pass
