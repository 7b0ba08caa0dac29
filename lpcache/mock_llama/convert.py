"""Responses and Anthropic request bodies turned into chat-completions bodies, as llama-server b11434 turns them
(`server_chat_convert_responses_to_chatcmpl` and `server_chat_convert_anthropic_to_oai` in server-chat.cpp).

The chat body then goes through the chat route's template, so a conversation gives the same prompt whichever API
carries it, and the same cache reuse. Field order follows the real server's (its JSON keeps insertion order).
"""

from __future__ import annotations

import json
from typing import Any

from .api import ApiError

DEFAULT_ANTHROPIC_MAX_TOKENS = 4096  # what llama-server sets when an Anthropic body has no max_tokens
ANTHROPIC_PASSED_ON = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
BILLING_HEADER = "x-anthropic-billing-header:"


def value(obj: Any, key: str, default: Any) -> Any:
    """`json_value`: the field if it is there, not null and of the default's type; else the default."""
    found = obj.get(key) if isinstance(obj, dict) else None
    if found is None:
        return default
    if isinstance(default, str | dict | list | int) and not isinstance(found, type(default)):
        return default
    return found


def _string(item: dict[str, Any], key: str) -> bool:
    return isinstance(item.get(key), str)


def _array(item: dict[str, Any], key: str) -> bool:
    return isinstance(item.get(key), list)


def invalid(message: str) -> ApiError:
    """The real server's `std::invalid_argument`: a 400."""
    return ApiError(400, message)


# --- OpenAI Responses -------------------------------------------------------------------------------------------


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body of a Responses body: every other field (`id_slot`, `stream`, `cache_prompt`...) passes on."""
    if "input" not in body:
        raise invalid("'input' is required")
    if value(body, "previous_response_id", ""):
        raise invalid("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": value(body, "instructions", "")})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _add_item(messages, dict(item) if isinstance(item, dict) else {})
    else:
        raise invalid("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        chat.pop("tools")
        tools = _responses_tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        chat.pop("max_output_tokens")
        chat["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = chat.pop("reasoning")
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """One input item, as a message of its own or merged into the assistant message just before it."""
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    if _string(item, "content"):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    kind = item.get("type")
    if _array(item, "content") and item.get("role") in ("user", "system", "developer"):
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = [_input_part(p) for p in item["content"]]
        messages.append(item)
    elif item.get("role") == "assistant" and kind == "message":
        parts = [_output_part(p) for p in item["content"]] if _array(item, "content") else []
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"] += parts
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            messages.append(item)
    elif all(_string(item, k) for k in ("arguments", "call_id", "name")) and kind == "function_call":
        call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"],
                "type": "function"}
        if merge:
            previous = messages[-1]
            if not _array(previous, "tool_calls"):
                previous["tool_calls"] = []
            previous["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif _string(item, "call_id") and (_string(item, "output") or _array(item, "output")) \
            and kind == "function_call_output":
        output = item["output"]
        result = output if isinstance(output, str) else [_tool_output_part(p) for p in output]
        messages.append({"content": result, "role": "tool", "tool_call_id": item["call_id"]})
    elif _array(item, "summary") and kind == "reasoning":
        content = item.get("content")
        if not isinstance(content, list):
            raise invalid("item['content'] is not an array")
        if not content:
            raise invalid("item['content'] is empty")
        if not (isinstance(content[0], dict) and _string(content[0], "text")):
            raise invalid("item['content']['text'] is not a string")
        if merge:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise invalid("Cannot determine type of 'item'")


def _input_part(part: Any) -> dict[str, Any]:
    kind = value(part, "type", "")
    if kind == "input_text":
        if "text" not in part:
            raise invalid("'Input text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "input_image":
        if "image_url" not in part:
            raise invalid("'image_url' is required")
        return {"image_url": {"url": part["image_url"]}, "type": "image_url"}
    if kind == "input_file":
        raise invalid("'input_file' is not supported by llamacpp at this moment")
    raise invalid("'type' must be one of 'input_text', 'input_image', or 'input_file'")


def _output_part(part: Any) -> dict[str, Any]:
    kind = value(part, "type", "")
    if kind in ("output_text", "input_text"):
        if not _string(part, "text"):
            raise invalid("'Output text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "refusal":
        if not _string(part, "refusal"):
            raise invalid("'Refusal' requires 'refusal'")
        return {"refusal": part["refusal"], "type": "refusal"}
    raise invalid("'type' must be one of 'output_text' or 'refusal'")


def _tool_output_part(part: Any) -> dict[str, Any]:
    if not isinstance(part, dict) or "type" not in part:
        raise invalid("Output of tool call missing 'type' field")
    part = dict(part)
    if part["type"] == "input_text":
        part["type"] = "text"
    elif part["type"] == "input_image":
        if "image_url" not in part:
            raise invalid("'image_url' is required")
        part["type"] = "image_url"
        part["image_url"] = {"url": part["image_url"]}
    else:
        raise invalid("Output of tool call should be 'Input text' or 'Input image'")
    return part


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools in the chat shape (`strict` true unless given); other kinds have no chat equivalent."""
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of objects")
    out = []
    for tool in tools:
        if value(tool, "type", "") != "function":
            continue
        function = {k: v for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


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
