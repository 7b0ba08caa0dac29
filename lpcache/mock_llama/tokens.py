"""The toy tokenizer, chat template and answer generator of the stand-in server.

Everything here is a pure function: the same text always gives the same tokens, ids
and answer, in every process, so tests can predict cache hits exactly.
"""

from __future__ import annotations

import hashlib
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


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the concatenated text parts of an array."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    raise ValueError("message content must be a string or an array of parts")


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """Render messages with a ChatML template and open the assistant's turn."""
    out = [f"<|im_start|>{m['role']}\n{content_text(m.get('content'))}<|im_end|>\n" for m in messages]
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
