"""OpenAI Responses (POST /v1/responses, /responses): Codex-style agents. llama-server turns the body into a chat
request itself and passes `id_slot` on, so lpcache forwards it as it came, pinned, and its answer unchanged.

The prompt is the chat request llama-server makes of the body (`to_chat`, a port of b11434's
`server_chat_convert_responses_to_chatcmpl`, tools/server/server-chat.cpp): `instructions` as a system message, the
`input` items as chat messages (function calls as an assistant's tool calls, merged into the assistant message
before them as llama-server merges them; their outputs as tool messages), the tools as chat tools. So a Responses
request shares its cache with a chat or Messages request the server renders the same. A body the conversion
refuses (llama-server answers it 400) and one with `previous_response_id` (not supported by llama-server) go on
uncached.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import BadRequest
from ..identity import template_fields
from .base import Api, View


class Unconvertible(ValueError):
    """A body llama-server's conversion refuses (it answers 400): there is no prompt to key."""


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request llama-server makes of a Responses body (the fields that shape the prompt exactly as its
    converter writes them; the rest of the body is copied, as it copies it)."""
    if "input" not in body:
        raise Unconvertible("'input' is required")
    if body.get("previous_response_id"):
        raise Unconvertible("llama.cpp does not support 'previous_response_id'")
    given = body["input"]
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        instructions = body["instructions"]
        messages.append({"role": "system", "content": instructions if isinstance(instructions, str) else ""})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _item(copy.deepcopy(item), messages)
    else:
        raise Unconvertible("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise Unconvertible("'tools' must be an array of objects")
        tools = []
        for tool in body["tools"]:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                continue   # no chat equivalent: llama-server skips it with a warning
            function = {k: v for k, v in tool.items() if k != "type"}
            function.setdefault("strict", True)
            tools.append({"type": "function", "function": function})
        chat.pop("tools")
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        chat["max_tokens"] = chat.pop("max_output_tokens")
    if "reasoning" in body:
        reasoning = chat.pop("reasoning")
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _text(item: dict[str, Any], key: str) -> bool:
    return isinstance(item.get(key), str)


def _item(item: Any, messages: list[dict[str, Any]]) -> None:
    """One `input` item onto the chat messages, as llama-server's converter adds it."""
    if not isinstance(item, dict):
        raise Unconvertible("Cannot determine type of 'item'")
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    if _text(item, "content"):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
        parts = []
        for part in item["content"]:
            kind_of = part.get("type") if isinstance(part, dict) else None
            if kind_of == "input_text" and "text" in part:
                parts.append({"text": part["text"], "type": "text"})
            elif kind_of == "input_image" and "image_url" in part:
                parts.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
            else:
                raise Unconvertible("unsupported input content")
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = parts
        messages.append(item)
    elif role == "assistant" and kind == "message":
        parts = []
        content = item.get("content")
        if isinstance(content, list):
            for part in content:
                kind_of = part.get("type") if isinstance(part, dict) else None
                if kind_of in ("output_text", "input_text") and _text(part, "text"):
                    parts.append({"text": part["text"], "type": "text"})
                elif kind_of == "refusal" and _text(part, "refusal"):
                    parts.append({"refusal": part["refusal"], "type": "refusal"})
                else:
                    raise Unconvertible("unsupported output content")
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"].extend(parts)
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            messages.append(item)
    elif (_text(item, "arguments") and _text(item, "call_id") and _text(item, "name")
          and kind == "function_call"):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"],
                "type": "function"}
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("tool_calls"), list):
                previous["tool_calls"] = []
            previous["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif (_text(item, "call_id") and isinstance(item.get("output"), str | list)
          and kind == "function_call_output"):
        output = item["output"]
        if isinstance(output, list):
            for part in output:
                kind_of = part.get("type") if isinstance(part, dict) else None
                if kind_of == "input_text":
                    part["type"] = "text"
                elif kind_of == "input_image" and "image_url" in part:
                    part["type"], part["image_url"] = "image_url", {"url": part["image_url"]}
                else:
                    raise Unconvertible("unsupported tool output content")
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif isinstance(item.get("summary"), list) and kind == "reasoning":
        content = item.get("content")
        if not (isinstance(content, list) and content and isinstance(content[0], dict) and _text(content[0], "text")):
            raise Unconvertible("a reasoning item needs content[0].text")
        if merge:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise Unconvertible("Cannot determine type of 'item'")


class ResponsesApi(Api):
    name = "responses"
    paths = ("/v1/responses", "/responses")

    def check(self, body: dict[str, Any]) -> None:
        if "input" not in body:
            raise BadRequest("'input' is required", code="invalid_input")
        if not isinstance(body["input"], str | list):
            raise BadRequest("'input' must be a string or an array of items", code="invalid_input")
        if "instructions" in body and not isinstance(body["instructions"], str | None):
            raise BadRequest("'instructions' must be a string", code="invalid_instructions")

    def view(self, body: dict[str, Any]) -> View:
        try:
            chat = to_chat(body)
        except (Unconvertible, TypeError, KeyError, AttributeError):
            # not keyed: what prefilters read is every item as it came, the instructions first
            given = body["input"]
            items = [{"role": "system", "content": body["instructions"]}] if "instructions" in body else []
            items += given if isinstance(given, list) else [{"role": "user", "content": given}]
            return View(items, {}, cacheable=False)
        return View(chat["messages"], template_fields(chat))
