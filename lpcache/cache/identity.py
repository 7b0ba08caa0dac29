"""The exact identity of a chat request: what a llama-server slot holds once it has served it.

Word blocks (`prefix`) are a lookup: they drop case, punctuation, roles, names, tool calls, tool results, images and
the `tools` array, so two requests a chat template renders differently can share every word block. A restore, a
"hit" or the verdict that a model cannot reuse restores must not rest on that. The identity is the request's
*canonical text* (the fields that shape the rendered prompt, the tools as the server hands them to the template,
then every message: role, name, content parts, tool calls, tool call id and any other field, in order, JSON-escaped
so no text can fake a boundary) cut into blocks of `BLOCK_CHARS` characters, with a chain of digests: chain[i] is
the digest of the first i+1 blocks. Two requests whose chains agree up to i render the same first (i+1) x
BLOCK_CHARS canonical characters, so a template that renders messages in order gives them the same tokens up to
about there; what lies beyond is not claimed.

Images count by a digest of their URL or data (llama-server compares media chunks by content). Fields that only
steer sampling (temperature, max_tokens, stream...) are not part of it: the same prompt under other sampling
settings is the same cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

BLOCK_CHARS = 64
# Request fields a chat template reads besides the messages (llama-server's chat parameters).
TEMPLATE_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_format",
                   "reasoning_effort", "add_generation_prompt", "chat_template", "continue_final_message")
_MESSAGE_FIELDS = ("role", "name", "content", "tool_calls", "tool_call_id")


def _json(value: Any) -> str:
    """JSON in the order it came: llama-server keeps a body's key order (its JSON is ordered) and a template's
    `tojson` writes it so, so two tool schemas that differ only in the order of their keys render differently."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:   # nesting deeper than orjson writes: still an identity, just not a pretty one
        return repr(value)


def _digest(data: Any) -> str:
    raw = data.encode() if isinstance(data, str) else _json(data).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def part_text(part: Any) -> str:
    """One content part, canonical: text as JSON text, media as a digest of what it shows."""
    if isinstance(part, dict):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            return _json(part["text"])
        for media in ("image_url", "input_audio", "input_image", "file"):
            if media in part:
                value = part[media]
                source = value.get("url", value.get("data", value)) if isinstance(value, dict) else value
                return f"<{media}:{_digest(source)}>"
    return _json(part)


def message_text(message: Any) -> str:
    """One message, canonical. Role and name come first and the content before the tool calls, so a message whose
    text grows at its end keeps a canonical prefix in common with its earlier form."""
    if not isinstance(message, dict):
        return "\x1e" + _json(message)
    content = message.get("content")
    if isinstance(content, list):
        body = "[" + ",".join(part_text(p) for p in content) + "]"
    else:
        body = _json(content)
    out = ["\x1e", _json(message.get("role")), "\x1f", _json(message.get("name")), "\x1f", body]
    for name in ("tool_calls", "tool_call_id"):
        if message.get(name) is not None:
            out += ["\x1f", name, "=", _json(message[name])]
    rest = {k: v for k, v in message.items() if k not in _MESSAGE_FIELDS}
    if rest:
        out += ["\x1f", _json(rest)]
    return "".join(out)


def canonical_text(messages: Sequence[Any], template: Mapping[str, Any] | None = None) -> str:
    """The request as a template sees it: the template fields (`template_fields` of a chat body; another API's
    adapter names its own, and the API), then the messages in order."""
    return "\x1d" + _json(dict(template or {})) + "".join(message_text(m) for m in messages)


def chain_of(text: str) -> tuple[int, ...]:
    """chain[i]: a 64-bit digest of the first (i+1) x BLOCK_CHARS characters (whole blocks only)."""
    h = hashlib.blake2b(digest_size=8)
    out = []
    for start in range(0, len(text) - len(text) % BLOCK_CHARS, BLOCK_CHARS):
        h.update(text[start:start + BLOCK_CHARS].encode())
        out.append(int.from_bytes(h.copy().digest(), "big"))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Identity:
    """The exact identity of a prompt: its chain and the length of its canonical text."""

    chain: tuple[int, ...]
    chars: int

    @classmethod
    def of(cls, messages: Sequence[Any], template: Mapping[str, Any] | None = None) -> Identity:
        text = canonical_text(messages, template)
        return cls(chain_of(text), len(text))


def template_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a request body that shape its rendered prompt besides the messages. The tools as the template
    gets them: llama-server keeps of each only its name, description and parameters
    (`common_chat_tools_parse_oaicompat`), so tools that differ elsewhere (`strict`...) render the same."""
    fields = {k: body[k] for k in TEMPLATE_FIELDS if k in body}
    if "tools" in fields:
        fields["tools"] = rendered_tools(fields["tools"])
    return fields


def rendered_tools(tools: Any) -> Any:
    """`tools` as llama-server hands them to a chat template: [{type: function, function: {name, description,
    parameters}}], description "" and parameters {} when missing. Tools it would refuse (no function type or name:
    it answers 400) are kept as they came."""
    if not isinstance(tools, list):
        return tools
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or "name" not in function:
            return tools
        out.append({"type": "function", "function": {"name": function["name"],
                                                     "description": function.get("description", ""),
                                                     "parameters": function.get("parameters", {})}})
    return out
