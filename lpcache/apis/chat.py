"""Chat completions (POST /v1/chat/completions): the messages and the fields a chat template reads are the prompt."""

from __future__ import annotations

from typing import Any

from lpcache.apis.base import Api, View
from lpcache.cache.identity import template_fields
from lpcache.errors import BadRequest


def check_messages(messages: Any, field: str = "messages") -> None:
    """A non-empty array of objects with a string role and string or array content."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'{field}' must be a non-empty array", code=f"invalid_{field}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"{field}[{i}] must be an object", code=f"invalid_{field}")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"{field}[{i}].role must be a string", code=f"invalid_{field}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"{field}[{i}].content must be a string or an array of parts", code=f"invalid_{field}")


class ChatApi(Api):
    name = "chat"
    paths = ("/v1/chat/completions", "/chat/completions")

    def check(self, body: dict[str, Any]) -> None:
        check_messages(body.get("messages"))

    def view(self, body: dict[str, Any]) -> View:
        # n > 1: llama-server runs the extra answers unpinned, in any slot
        one = not (isinstance(body.get("n"), int) and body["n"] > 1)
        return View(body["messages"], template_fields(body), cacheable=one)
