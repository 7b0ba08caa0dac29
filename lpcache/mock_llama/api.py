"""Request helpers shared by the route modules: reading bodies and raising API errors."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from lpcache.mock_llama.state import MockState


class ApiError(Exception):
    """An error answered in the server's envelope; raised by handlers, written by the app."""

    def __init__(self, status: int, message: str, type_: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.extra = extra


CHILD_KEY = "lpcache.mock.child"  # scope key: the router's child serving this request


def state_of(request: Request) -> MockState:
    """The state serving the request: the server's own, or in router mode the chosen model's."""
    state: MockState = request.scope.get(CHILD_KEY) or request.app.state.mock
    return state


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 like the real server's parse error."""
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON in request body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def body_int(body: dict[str, Any], key: str, default: int) -> int:
    """An integer field; a wrong type falls back to the default, as in llama-server."""
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return int(value)
