"""Prefix hashing: pure functions from a chat request to the words, blocks and keys the cache is organised by.

The raw prefix is the message contents joined by newlines, roles left out, text parts of content arrays taken in
order. Its `\\w+` words, lower-cased, are cut into blocks of `words_per_block` words; each whole block is hashed
with SHA-256 (a trailing partial block is not: it would never match the same prompt with a few more words).

For lookups, each block list also gets a *chain*: chain[i] is a 64-bit digest of blocks[0..i], so two prompts share
their first n blocks exactly when their chains agree at n-1. An index keyed by chain digests finds the longest
shared prefix with one dict lookup per block, whatever the number of entries.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lpcache.cache.identity import canonical_text, chain_of

# \w plus the combining marks, as Rust's Unicode \w has them: "cafe\u0301" stays one word.
_WORD = re.compile(r"[\w\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]+")


def content_text(content: Any) -> str:
    """The text of one message's content: a string, or the text parts of an array of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"] for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def raw_prefix(messages: Sequence[Any]) -> str:
    """The message contents joined by newlines, roles stripped."""
    return "\n".join(content_text(m.get("content")) for m in messages if isinstance(m, dict))


# For ASCII text, \w+ is "runs of letters, digits and _": a translate and a split find them 3-4x faster.
_ASCII_NON_WORD = {i: " " for i in range(128) if not (chr(i).isalnum() or chr(i) == "_")}


# A long text is read in pieces of about this many characters, cut at whitespace (no word and no final sigma spans a
# cut): one regex call over megabytes holds the interpreter lock for a third of a second, and a big body is parsed
# in a worker thread so that the event loop runs meanwhile; between pieces, it does.
PIECE_CHARS = 1 << 16
_SPACE = re.compile(r"\s")


def words(text: str) -> list[str]:
    """The `\\w+` words of the text, lower-cased."""
    if len(text) <= PIECE_CHARS:
        return _piece_words(text)
    out: list[str] = []
    start, n = 0, len(text)
    while start < n:
        cut = _SPACE.search(text, start + PIECE_CHARS) if start + PIECE_CHARS < n else None
        end = n if cut is None else cut.end()
        out += _piece_words(text[start:end])
        start = end
    return out


def _piece_words(text: str) -> list[str]:
    lower = text.lower()
    if lower.isascii():
        return lower.translate(_ASCII_NON_WORD).split()
    return _WORD.findall(lower)


def block_hashes(word_list: Sequence[str], words_per_block: int) -> list[str]:
    """SHA-256 (hex) of each whole block of `words_per_block` words, joined by single spaces."""
    full = len(word_list) - len(word_list) % words_per_block
    return [
        hashlib.sha256(" ".join(word_list[i:i + words_per_block]).encode()).hexdigest()
        for i in range(0, full, words_per_block)
    ]


def cache_key(model_id: str, raw: str) -> str:
    """sha256(model_id + "\\n" + text): the request's key (lpcache keys by its canonical text, `identity`)."""
    return hashlib.sha256(f"{model_id}\n{raw}".encode()).hexdigest()


def chain(blocks: Sequence[str]) -> tuple[int, ...]:
    """chain[i] = 64-bit digest of blocks[0..i]: equal chains at i mean equal first i+1 blocks."""
    out = []
    prev = b""
    for block in blocks:
        prev = hashlib.blake2b(prev + bytes.fromhex(block), digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return tuple(out)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (of block hashes or chain digests)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tool_text(messages: Sequence[Any], template: Mapping[str, Any] | None = None) -> str:
    """What the model reads besides the message contents: tool calls' names and arguments, and the tool
    definitions. It counts towards a request's words (an agent's prompt is mostly there), not its blocks."""
    parts = []
    for m in messages:
        if isinstance(m, dict) and m.get("type") in ("function_call", "function_call_output"):
            parts += [str(m.get(k)) for k in ("name", "arguments", "output") if isinstance(m.get(k), str)]
            continue   # a Responses input item: a tool call or its result
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    parts += [str(fn.get("name", "")), str(fn.get("arguments", ""))]
    tools = template.get("tools") if template else None
    if isinstance(tools, list):
        parts.append(str(tools))
    return "\n".join(parts)


@dataclass(frozen=True)
class Prompt:
    """What the cache knows of one chat request: its key, word count, word blocks and their chain (the lookup), and
    its exact identity chain (`exact`, see `identity`: what decides)."""

    model: str
    key: str
    n_words: int
    blocks: tuple[str, ...]
    chain: tuple[int, ...]
    exact: tuple[int, ...] = ()
    chars: int = 0

    @classmethod
    def of(cls, model: str, messages: Sequence[Any], words_per_block: int,
           template: Mapping[str, Any] | None = None, text: str | None = None) -> Prompt:
        """`template`: the request's fields that shape its rendered prompt (`identity.template_fields`); `text`:
        the words' text when it is not the messages' contents (a prompt of token ids)."""
        raw = raw_prefix(messages) if text is None else text
        word_list = words(raw)
        extra = tool_text(messages, template)
        n_words = len(word_list) + (len(words(extra)) if extra else 0)
        blocks = block_hashes(word_list, words_per_block)
        text = canonical_text(messages, template)
        return cls(model, cache_key(model, text), n_words, tuple(blocks), chain(blocks), chain_of(text), len(text))
