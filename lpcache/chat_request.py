"""A chat request as lpcache sees it: the body checked, and what the cache knows of it (key, words, blocks, exact
identity), with whether it is big enough to be saved.

Bad input is the client's error, in OpenAI's shape: 422 for a body that is not JSON, 400 for JSON that is not a chat
request. Nothing here knows slots or servers.

Parsing and hashing take time in proportion to the body (100-250 ns a byte: a 16 MiB body is seconds), so a body
above OFF_LOOP_BYTES is handled in a worker thread (`off_loop`): the event loop keeps serving the other requests'
streams meanwhile, instead of stalling them for the whole parse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from .config import Settings
from .errors import BadRequest
from .identity import template_fields
from .prefix import Prompt

OFF_LOOP_BYTES = 64 * 1024   # about 10 ms of parsing: below it a thread hop costs more than it spares

T = TypeVar("T")


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, in a worker thread when it is about a body of more than OFF_LOOP_BYTES."""
    if size <= OFF_LOOP_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def parse_chat_body(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, or the error the client should see: 422 for a body that is not JSON, 400 for
    JSON that is not a chat request."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", status=422, code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_body")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", code="invalid_messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", code="invalid_messages")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", code="invalid_messages")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string or an array of parts", code="invalid_messages")
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("'model' must be a string", code="invalid_model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false", code="invalid_stream")
    if "tools" in body and body["tools"] is not None and not isinstance(body["tools"], list):
        raise BadRequest("'tools' must be an array", code="invalid_tools")
    return body


@dataclass(frozen=True)
class ChatCall:
    """One parsed chat request."""

    body: dict[str, Any]
    model: str
    stream: bool
    prompt: Prompt
    big: bool

    @classmethod
    async def read(cls, raw: bytes, settings: Settings) -> ChatCall:
        """`parse`, off the event loop for a big body."""
        return await off_loop(len(raw), cls.parse, raw, settings)

    @classmethod
    def parse(cls, raw: bytes, settings: Settings) -> ChatCall:
        body = parse_chat_body(raw)
        model = body.get("model") or settings.model_id
        prompt = Prompt.of(model, body["messages"], settings.words_per_block, template_fields(body))
        return cls(body, model, bool(body.get("stream")), prompt, prompt.n_words > settings.big_threshold_words)
