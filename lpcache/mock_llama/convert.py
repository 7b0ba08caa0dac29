"""Responses and Anthropic request bodies turned into chat-completions bodies, as llama-server b11434 turns them
(`server_chat_convert_responses_to_chatcmpl` and `server_chat_convert_anthropic_to_oai` in server-chat.cpp).

The chat body then goes through the chat route's template, so a conversation gives the same prompt whichever API
carries it, and the same cache reuse. Field order follows the real server's (its JSON keeps insertion order).
"""

from __future__ import annotations

import json
from typing import Any

from lpcache.apis.llama_json import json_value as value
from lpcache.apis.responses import Unconvertible, to_chat
from lpcache.mock_llama.api import ApiError

DEFAULT_ANTHROPIC_MAX_TOKENS = 4096  # what llama-server sets when an Anthropic body has no max_tokens
ANTHROPIC_PASSED_ON = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
BILLING_HEADER = "x-anthropic-billing-header:"


def invalid(message: str) -> ApiError:
    """The real server's `std::invalid_argument`: a 400."""
    return ApiError(400, message)


# --- OpenAI Responses -------------------------------------------------------------------------------------------


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body of a Responses body (lpcache's port of the real server's conversion, `apis.responses`),
    its refusals as the real server's 400s."""
    try:
        return to_chat(body)
    except Unconvertible as e:
        raise invalid(str(e)) from None


# --- Anthropic Messages -----------------------------------------------------------------------------------------


def anthropic_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body of an Anthropic body. It is built anew, so `id_slot`, `cache_prompt` and `n_predict` are
    dropped: the server picks the slot as for any unpinned request."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            text = normalize_billing_header(system)
        elif isinstance(system, list):
            text = "".join(normalize_billing_header(value(b, "text", "")) for b in system
                           if value(b, "type", "") == "text")
        else:
            text = ""
        messages.append({"role": "system", "content": text})
    if "messages" not in body:
        raise ApiError(500, "'messages' is required")  # a runtime_error there, hence a 500
    if isinstance(body["messages"], list):
        for message in body["messages"]:
            messages += _anthropic_message(message)
    chat: dict[str, Any] = {"messages": messages}
    if isinstance(body.get("tools"), list):
        chat["tools"] = [
            {"type": "function", "function": {"name": value(t, "name", ""), "description": value(t, "description", ""),
                                              "parameters": t.get("input_schema", {}) if isinstance(t, dict) else {}}}
            for t in body["tools"]
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") == "auto":
            chat["tool_choice"] = "auto"
        elif choice.get("type") in ("any", "tool"):
            chat["tool_choice"] = "required"
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body["max_tokens"] if "max_tokens" in body else DEFAULT_ANTHROPIC_MAX_TOKENS
    chat.update({k: body[k] for k in ANTHROPIC_PASSED_ON if k in body})
    thinking = value(body, "thinking", {})
    if value(thinking, "type", "") == "enabled":
        chat["thinking_budget_tokens"] = value(thinking, "budget_tokens", 10000)
    user_id = value(value(body, "metadata", {}), "user_id", "")
    if user_id:
        chat["__metadata_user_id"] = user_id
    return chat


def normalize_billing_header(text: str) -> str:
    """Claude Code's system prompt starts with a billing header whose `cch=` stamp changes every request; the real
    server writes it as `fffff` so that the prefix cache gets past it."""
    if not text.startswith(BILLING_HEADER):
        return text
    at = text.find("cch=", len(BILLING_HEADER))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5 :]
    return text


def _anthropic_message(message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: its text, images, thinking and tool calls, then one tool message
    per tool result."""
    role = value(message, "role", "")
    if not isinstance(message, dict) or "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = value(block, "type", "")
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += value(block, "thinking", "")
        elif kind == "image":
            url = _image_url(value(block, "source", {}))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            arguments = json.dumps(value(block, "input", {}), separators=(",", ":"), ensure_ascii=False)
            calls.append({"id": value(block, "id", ""), "type": "function",
                          "function": {"name": value(block, "name", ""), "arguments": arguments}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": value(block, "tool_use_id", ""),
                            "content": _tool_result(block.get("content"))})
    out = []
    if parts or calls or reasoning:
        converted: dict[str, Any] = {"role": role}
        if parts:
            converted["content"] = parts
        else:
            converted["content"] = ""
        if calls:
            converted["tool_calls"] = calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + results


def _image_url(source: dict[str, Any]) -> str | None:
    kind = value(source, "type", "")
    if kind == "base64":
        return f"data:{value(source, 'media_type', 'image/jpeg')};base64,{value(source, 'data', '')}"
    if kind == "url":
        return str(value(source, "url", ""))
    return None


def _tool_result(content: Any) -> Any:
    """A tool result's content: a string as it is; an array of text blocks joined into one string, or with images
    as chat parts; anything else empty."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts: list[dict[str, Any]] = []
    images = False
    for block in content:
        kind = value(block, "type", "")
        if kind == "text":
            parts.append({"type": "text", "text": value(block, "text", "")})
        elif kind == "image":
            images = True
            url = _image_url(value(block, "source", {}))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    if images:
        return parts
    return "".join(p["text"] for p in parts)
