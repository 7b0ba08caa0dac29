"""Anthropic Messages (POST /v1/messages): Claude-Code-style agents.

llama-server b11434 turns a Messages body into a chat request but drops `id_slot` on the way, so a Messages request
cannot be pinned there. lpcache does the same conversion itself (`anthropic.to_chat`, a port of llama-server's),
sends the chat request pinned to /v1/chat/completions, and turns the answer back into a Message (JSON, or the
Anthropic event stream) the way llama-server does: the client gets what llama-server's own /v1/messages would answer.

The prompt is the converted chat request's: a Messages request and the chat request it becomes share their cache.
lpcache's own errors have Anthropic's shape; a backend's error passes on as it came (llama-server answers errors on
/v1/messages in OpenAI's shape too).
"""

from __future__ import annotations

from typing import Any

import orjson

from lpcache.apis import anthropic
from lpcache.apis.base import Api, Converter, View
from lpcache.apis.chat import check_messages
from lpcache.apis.llama_json import dumps
from lpcache.cache.identity import template_fields
from lpcache.errors import ProxyError


class MessagesApi(Api):
    name = "messages"
    paths = ("/v1/messages",)
    upstream = "/v1/chat/completions"

    def check(self, body: dict[str, Any]) -> None:
        check_messages(body.get("messages"))

    def view(self, body: dict[str, Any]) -> View:
        return self.prepare(body)[0]

    def outgoing(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.prepare(body)[1]

    def prepare(self, body: dict[str, Any]) -> tuple[View, dict[str, Any]]:
        chat = anthropic.chat_request(body)
        return View(chat["messages"], template_fields(chat)), chat

    def answer(self, raw: bytes, body: dict[str, Any]) -> bytes:
        return dumps(anthropic.answer(orjson.loads(raw), body)).encode()

    def converter(self, body: dict[str, Any]) -> Converter | None:
        return anthropic.MessagesStream()

    def error(self, err: ProxyError) -> tuple[bytes, str]:
        if getattr(err, "raw", None) is not None:
            return err.payload()
        return orjson.dumps({"type": "error", "error": {"type": err.type, "message": err.message}}), \
            "application/json"
