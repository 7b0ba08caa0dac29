"""OpenAI Responses (POST /v1/responses, /responses): Codex-style agents. llama-server turns the body into a chat
request itself and passes `id_slot` on, so lpcache forwards it as it came, pinned, and its answer unchanged but for
a stream's missing indexes (`responses_stream`).

The prompt is the chat request llama-server makes of the body (`to_chat`, a port of b11434's
`server_chat_convert_responses_to_chatcmpl`, tools/server/server-chat.cpp): `instructions` as a system message, the
`input` items as chat messages (function calls as an assistant's tool calls, merged into the assistant message
before them as llama-server merges them; their outputs as tool messages), the tools as chat tools. So a Responses
request shares its cache with a chat or Messages request the server renders the same. A body the conversion
refuses (llama-server answers it 400) and one with `previous_response_id` (not supported by llama-server) go on
uncached.
"""

from __future__ import annotations

from typing import Any

from lpcache.apis.base import Api, Converter, View
from lpcache.apis.llama_json import json_value
from lpcache.apis.responses_stream import ResponsesStream
from lpcache.cache.identity import template_fields
from lpcache.errors import BadRequest


class Unconvertible(ValueError):
    """A body llama-server's conversion refuses (`std::invalid_argument`: it answers 400), with its message."""


def _string(item: dict[str, Any], key: str) -> bool:
    return isinstance(item.get(key), str)


def _array(item: dict[str, Any], key: str) -> bool:
    return isinstance(item.get(key), list)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request llama-server makes of a Responses body: every other field (`id_slot`, `stream`,
    `cache_prompt`...) passes on. Raises Unconvertible (with llama-server's message) where it answers 400."""
    if "input" not in body:
        raise Unconvertible("'input' is required")
    if json_value(body, "previous_response_id", ""):
        raise Unconvertible("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": json_value(body, "instructions", "")})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _add_item(messages, dict(item) if isinstance(item, dict) else {})
    else:
        raise Unconvertible("'input' must be a string or array of objects")
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
            previous["content"] = [*previous["content"], *parts]   # a new list: the client's is never changed
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
            previous["tool_calls"] = [*previous["tool_calls"], call]   # a new list: the client's is never changed
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
            raise Unconvertible("item['content'] is not an array")
        if not content:
            raise Unconvertible("item['content'] is empty")
        if not (isinstance(content[0], dict) and _string(content[0], "text")):
            raise Unconvertible("item['content']['text'] is not a string")
        if merge:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise Unconvertible("Cannot determine type of 'item'")


def _input_part(part: Any) -> dict[str, Any]:
    kind = json_value(part, "type", "")
    if kind == "input_text":
        if "text" not in part:
            raise Unconvertible("'Input text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "input_image":
        if "image_url" not in part:
            raise Unconvertible("'image_url' is required")
        return {"image_url": {"url": part["image_url"]}, "type": "image_url"}
    if kind == "input_file":
        raise Unconvertible("'input_file' is not supported by llamacpp at this moment")
    raise Unconvertible("'type' must be one of 'input_text', 'input_image', or 'input_file'")


def _output_part(part: Any) -> dict[str, Any]:
    kind = json_value(part, "type", "")
    if kind in ("output_text", "input_text"):
        if not _string(part, "text"):
            raise Unconvertible("'Output text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "refusal":
        if not _string(part, "refusal"):
            raise Unconvertible("'Refusal' requires 'refusal'")
        return {"refusal": part["refusal"], "type": "refusal"}
    raise Unconvertible("'type' must be one of 'output_text' or 'refusal'")


def _tool_output_part(part: Any) -> dict[str, Any]:
    if not isinstance(part, dict) or "type" not in part:
        raise Unconvertible("Output of tool call missing 'type' field")
    part = dict(part)
    if part["type"] == "input_text":
        part["type"] = "text"
    elif part["type"] == "input_image":
        if "image_url" not in part:
            raise Unconvertible("'image_url' is required")
        part["type"] = "image_url"
        part["image_url"] = {"url": part["image_url"]}
    else:
        raise Unconvertible("Output of tool call should be 'Input text' or 'Input image'")
    return part


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools in the chat shape (`strict` true unless given); other kinds have no chat equivalent."""
    if not isinstance(tools, list):
        raise Unconvertible("'tools' must be an array of objects")
    out = []
    for tool in tools:
        if json_value(tool, "type", "") != "function":
            continue
        function = {k: v for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


class ResponsesApi(Api):
    name = "responses"
    paths = ("/v1/responses", "/responses")

    def check(self, body: dict[str, Any]) -> None:
        if "input" not in body:
            raise BadRequest("'input' is required", code="invalid_input")
        if not isinstance(body["input"], str | list):   # as llama-server words it
            raise BadRequest("'input' must be a string or array of objects", code="invalid_input")

    def converter(self, body: dict[str, Any]) -> Converter | None:
        return ResponsesStream()   # the indexes OpenAI's SDKs build the response by

    def view(self, body: dict[str, Any]) -> View:
        try:
            chat = to_chat(body)
        except (Unconvertible, TypeError, AttributeError):
            # not keyed: what prefilters read is every item as it came, the instructions first
            given = body["input"]
            items = [{"role": "system", "content": body["instructions"]}] if "instructions" in body else []
            items += given if isinstance(given, list) else [{"role": "user", "content": given}]
            return View(items, {}, cacheable=False)
        return View(chat["messages"], template_fields(chat))
