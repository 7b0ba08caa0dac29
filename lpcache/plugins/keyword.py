"""The keyword blocklist prefilter (`keyword`): rejects a chat request whose message contents contain a blocked
keyword, as a plain substring (case-insensitive by default), with a 400 error that does not repeat the keyword."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from lpcache.plugins.base import ChatRequest, PluginError, Prefilter, Reject, Verdict, param

REJECT_MESSAGE = "request rejected: the message contents contain a blocked keyword"


def _keywords(value: Any, plugin: str) -> list[str]:
    """The `keywords` param: a non-empty list of non-empty strings, or a comma-separated string of them."""
    if isinstance(value, str):
        words = [w.strip() for w in value.split(",") if w.strip()]
    elif isinstance(value, list) and all(isinstance(w, str) and w.strip() for w in value):
        words = list(value)
    else:
        words = []
    if not words:
        raise PluginError(f"plugin {plugin!r}: parameter 'keywords' must be a non-empty list of non-empty strings "
                          f"(or a comma-separated string), got {value!r}")
    return words


def message_texts(body: Mapping[str, Any]) -> Iterator[str]:
    """Every text of the request's messages, all roles: string contents, the text parts of content arrays (chat
    `text`, Responses `input_text` / `output_text`, Anthropic `text`), tool calls' arguments and tool results
    (Responses `function_call` / `function_call_output` items)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, dict):
            continue
        for field in ("arguments", "output"):
            if isinstance(message.get(field), str):
                yield message[field]
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                yield function["arguments"]
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


class KeywordPrefilter(Prefilter):
    """Rejects requests whose message contents contain any of `keywords`."""

    name: ClassVar[str] = "keyword"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        words = _keywords(self.params.get("keywords"), self.name)
        self.case_insensitive: bool = param(self.params, "case_insensitive", bool, True, plugin=self.name)
        if self.case_insensitive:
            words = [w.casefold() for w in words]
        self.keywords: tuple[str, ...] = tuple(dict.fromkeys(words))
        # One pass over each text whatever the number of keywords; longest first only for tidiness (any hit rejects).
        alternatives = sorted(self.keywords, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(w) for w in alternatives))

    def matches(self, text: str) -> bool:
        """Whether `text` contains a blocked keyword."""
        if self.case_insensitive:
            text = text.casefold()
        return self._pattern.search(text) is not None

    async def check(self, request: ChatRequest) -> Verdict:
        if any(self.matches(text) for text in message_texts(request.body)):
            return Reject(message=REJECT_MESSAGE, status=400, type="invalid_request_error", code="prefilter_rejected")
        return None
