"""The toy tokenizer, chat template and answer generator of the stand-in server.

Everything here is a pure function: the same text always gives the same tokens, ids
and answer, in every process, so tests can predict cache hits exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

TOKEN_RE = re.compile(r"\w+|[^\w\s]")

# Words the fake model answers with. Each is one token under TOKEN_RE, so an answer
# echoed back in the next prompt tokenizes to exactly the tokens that were generated.
WORDS: tuple[str, ...] = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
    "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray",
    "yankee", "zulu", "amber", "basalt", "cedar", "dune", "ember", "fjord",
    "granite", "harbor", "island", "jasper", "kelp", "lagoon", "meadow", "nectar",
    "orchid", "pebble", "quartz", "river", "spruce", "tundra", "umber", "valley",
    "willow", "yarrow", "zephyr", "anchor", "beacon", "canyon", "drift", "estuary",
    "falcon", "glacier", "heron", "ivory", "juniper", "kestrel", "lantern", "marble",
)  # fmt: skip


def tokenize(text: str) -> list[str]:
    """Split text into token pieces: every word run and every single symbol is a token."""
    return TOKEN_RE.findall(text)


def token_id(piece: str) -> int:
    """A stable id for a piece, equal across processes (a hash, not a growing table)."""
    return int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=4).digest(), "big") & 0x7FFFFFFF


class Vocab:
    """Remembers which piece each id came from, so /detokenize can answer."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {token_id(w): w for w in WORDS}

    def ids(self, pieces: Sequence[str]) -> list[int]:
        out = []
        for piece in pieces:
            tid = token_id(piece)
            self._pieces[tid] = piece
            out.append(tid)
        return out

    def piece(self, tid: int) -> str | None:
        return self._pieces.get(tid)


def image_marker(url: str) -> str:
    """The stand-in's rendering of an image: one marker per image, named by a digest of its URL (a multimodal
    llama-server puts the image's own tokens there; another image gives other tokens)."""
    return f"<__image_{hashlib.sha256(url.encode()).hexdigest()[:8]}__>"


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the concatenated parts of an array: text parts as they are,
    image parts with a url as `image_marker(url)`; other parts (and image parts without a url) are left out."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif part.get("type") == "image_url":
                image = part.get("image_url")
                if isinstance(image, dict) and isinstance(image.get("url"), str):
                    out.append(image_marker(image["url"]))
        return "".join(out)
    raise ValueError("message content must be a string or an array of parts")


def to_json(value: Any) -> str:
    """JSON as a chat template's `tojson` writes it (Python's separators, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def render_tool_call(call: Any) -> str:
    r"""`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`; string arguments are parsed as JSON, as
    llama-server does before it renders them (a string that is not JSON is rendered as a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("every tool call must be an object with a 'function' that has a string 'name'")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f'<tool_call>\n{{"name": {to_json(function["name"])}, "arguments": {to_json(arguments)}}}\n</tool_call>'


def _header(message: dict[str, Any], role: str) -> str:
    name = message.get("name")
    return f"<|im_start|>{role} name={name}\n" if isinstance(name, str) and name else f"<|im_start|>{role}\n"


def render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None) -> str:
    r"""Render messages as a ChatML template does (Qwen 2.5's rules for tools) and open the assistant's turn.

    A plain message (a role, text content) is `<|im_start|>{role}\n{text}<|im_end|>\n`, as it always was here.
    The rest changes the prompt as it does on a real llama-server, so requests that differ only in it get
    different tokens:
    - `tools`: a system turn of their own before the messages, `<|im_start|>system\n# Tools\n\n<tools>\n` then
      one JSON per tool and line, then `\n</tools><|im_end|>\n`. (Qwen 2.5 appends them to the first system
      message instead; here every message renders as it would in a request without tools.)
    - an assistant's `tool_calls`: after its content, each as `render_tool_call`, on lines of their own.
    - `tool` messages: as in Qwen 2.5, `<tool_response>\n{content}\n</tool_response>` in a user turn, consecutive
      ones in the same turn (`tool_call_id` is not rendered, as there).
    - `name`: in the turn's header, `<|im_start|>user name=alice\n` (a tool message's in its `<tool_response>` tag).
      Many templates drop it; rendering it is the conservative choice for a proxy's tests.
    - image parts: `image_marker(url)` where the part is, as if the model were multimodal.
    - the `developer` role: rendered as `system`, as llama-server maps it for every template but GPT-OSS's.
    """
    out = []
    if tools:
        out.append("<|im_start|>system\n# Tools\n\n<tools>\n" + "\n".join(to_json(t) for t in tools))
        out.append("\n</tools><|im_end|>\n")
    for i, m in enumerate(messages):
        role, text = m["role"], content_text(m.get("content"))
        role = "system" if role == "developer" else role
        if role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            name = m.get("name")
            tag = f"<tool_response name={name}>" if isinstance(name, str) and name else "<tool_response>"
            out.append(f"\n{tag}\n{text}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
            continue
        calls = m.get("tool_calls")
        if calls is not None and role == "assistant":
            if not isinstance(calls, list):
                raise ValueError("'tool_calls' must be an array")
            text = "\n".join(([text] if text else []) + [render_tool_call(c) for c in calls])
        out.append(f"{_header(m, role)}{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def reply_stream(prompt: Sequence[str]) -> Iterator[str]:
    """The endless deterministic answer to a prompt; callers take as many tokens as they need."""
    digest = hashlib.sha256("\x1f".join(prompt).encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    while True:
        yield rng.choice(WORDS)


def lcp(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
