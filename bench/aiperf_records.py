"""What aiperf sent and what came back, request by request, from its raw export (`--export-level raw`), and the
ideal of those requests: what a cache that remembered every earlier prompt and answer would compute.

aiperf 0.13.0 writes `profile_export_raw.jsonl` (or shards under `raw_records/`): per request its metadata
(conversation, turn, start and end in ns), the body as sent (`payload`: the messages, earlier answers included) and
the stream as received (`responses`: SSE messages, each a list of fields). It parses those events itself for its
metrics, but an event that is not JSON is dropped without a word; here every one is kept and counted.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lpcache.workloads.story import prompt_tokens, shared


@dataclass
class Sent:
    """One request as aiperf's raw export has it."""

    conversation: str
    turn: int
    start_ns: int
    end_ns: int
    messages: list[dict[str, Any]]
    answer: str = ""
    status: int | None = None
    error: str | None = None                 # aiperf's error record
    not_json: list[str] = field(default_factory=list)       # streamed data lines that are not JSON
    error_events: list[str] = field(default_factory=list)   # JSON events carrying an error
    other_fields: list[str] = field(default_factory=list)   # SSE fields other than data
    usage_prompt: int | None = None
    prompt_n: int | None = None
    cache_n: int | None = None


def read_raw(out: Path) -> list[Sent]:
    """Every request of aiperf's raw export (`--export-level raw`), in the order sent."""
    files = [out / "profile_export_raw.jsonl"] if (out / "profile_export_raw.jsonl").is_file() else sorted(
        (out / "raw_records").glob("*.jsonl"))
    sent = [parse_record(record) for path in files for record in json_lines(path)]
    sent.sort(key=lambda s: s.start_ns)
    return sent


def json_lines(path: Path) -> list[Any]:
    """The documents of a JSON-lines file. Split at "\n" only: aiperf writes the text it sent unescaped, and
    `str.splitlines` also splits at the line and paragraph separators (U+2028, U+2029) and U+0085 that real chats
    hold inside a JSON string, which cut a record in two."""
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def parse_record(record: dict[str, Any]) -> Sent:
    """A raw record: the messages as sent, and the streamed answer, read event by event (aiperf itself skips an
    event that is not JSON without a word: here it is kept and counted)."""
    meta = record.get("metadata") or {}
    payload = record.get("payload") or {}
    err = record.get("error")
    error = None if not err else f"{err.get('type') or ''} {err.get('code') or ''}: {err.get('message')}".strip()
    s = Sent(str(meta.get("conversation_id")), int(meta.get("turn_index") or 0),
             int(meta.get("request_start_ns") or 0), int(meta.get("request_end_ns") or 0),
             list(payload.get("messages") or []), status=record.get("status"), error=error)
    parts = []
    for response in record.get("responses") or []:
        packets = response.get("packets")
        if packets is None:   # a body that is not a stream (an error's JSON, say)
            text = str(response.get("text") or "")
            events = [text] if text else []
        else:
            events = []
            for p in packets:
                if p.get("name") == "data":
                    events.append(p.get("value") or "")
                else:
                    s.other_fields.append(f"{p.get('name')}: {str(p.get('value'))[:120]}")
        for data in events:
            if data.strip() == "[DONE]":
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                s.not_json.append(data[:200])
                continue
            if not isinstance(obj, dict):
                s.not_json.append(data[:200])
                continue
            if "error" in obj:
                s.error_events.append(json.dumps(obj["error"], ensure_ascii=False)[:200])
            for choice in obj.get("choices") or []:
                piece = (choice.get("delta") or choice.get("message") or {}).get("content")
                if isinstance(piece, str):
                    parts.append(piece)
            usage, timings = obj.get("usage"), obj.get("timings")
            if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
                s.usage_prompt = int(usage["prompt_tokens"])
            if isinstance(timings, dict):
                s.prompt_n, s.cache_n = timings.get("prompt_n"), timings.get("cache_n")
    s.answer = "".join(parts)
    return s


def fed_back(sent: Sequence[Sent]) -> tuple[int, int]:
    """(later turns checked, those whose messages are exactly the previous turn's messages, its answer as the
    assistant's message, and the new human turn): aiperf feeding the server's own answers back."""
    by = {(s.conversation, s.turn): s for s in sent}
    checked = same = 0
    for s in sent:
        prev = by.get((s.conversation, s.turn - 1))
        if s.turn == 0 or prev is None:
            continue
        checked += 1
        want = prev.messages + ([{"role": "assistant", "content": prev.answer}] if prev.answer else [])
        same += s.messages[:-1] == want and s.messages[-1].get("role") == "user"
    return checked, same


def in_flight_max(sent: Sequence[Sent]) -> int:
    """The most requests aiperf had in flight at once."""
    events = sorted([(s.start_ns, 1) for s in sent] + [(s.end_ns, -1) for s in sent])
    now = top = 0
    for _, step in events:
        now += step
        top = max(top, now)
    return top


def ideal_of_run(url: str, sent: Sequence[Sent]) -> dict[str, Any]:
    """The run's prompts and answers as llama-server tokenizes them, and the ideal."""
    with httpx.Client(timeout=60) as client:
        prompts = [prompt_tokens(url, s.messages, client) for s in sent]
        answers = []
        for s in sent:
            r = client.post(f"{url}/tokenize", json={"content": s.answer, "add_special": False})
            r.raise_for_status()
            answers.append([int(t) for t in r.json()["tokens"]])
    ideal = ideal_counts(prompts, answers)
    return {"ideal": sum(ideal), "tokenized_prompt": sum(map(len, prompts)), "answer_tokens": sum(map(len, answers)),
            "usage_mismatches": sum(1 for s, p in zip(sent, prompts, strict=True)
                                    if s.usage_prompt is not None and s.usage_prompt != len(p)),
            "last_prompts": sum(len(p) + len(a) for s, p, a in zip(sent, prompts, answers, strict=True)
                                if not any(o.conversation == s.conversation and o.turn > s.turn for o in sent))}


def ideal_counts(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> list[int]:
    """For each request (in the order sent), its prompt tokens that a cache remembering every earlier request's
    prompt followed by its answer would still compute: the prompt's length minus the longest prefix it shares with
    one of those. The earlier sequences are kept sorted: the longest prefix one shares with a new prompt is the one
    its neighbours in that order share, so each request costs a binary search, not a pass over all."""
    earlier: list[tuple[int, ...]] = []
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        key = tuple(prompt)
        at = bisect.bisect_left(earlier, key)
        best = max((shared(key, earlier[j]) for j in (at - 1, at) if 0 <= j < len(earlier)), default=0)
        out.append(len(key) - best)
        seen = key + tuple(answer)
        bisect.insort(earlier, seen)
    return out


def log_problems(out_dir: Path) -> dict[str, int]:
    """aiperf's own ERROR and WARNING lines (its log file, `logs/aiperf.log` in its artifact folder), counted by
    text (time stamps left out)."""
    out: Counter[str] = Counter()
    path = out_dir / "logs" / "aiperf.log"
    text = path.read_text(errors="replace") if path.is_file() else ""
    for line in text.splitlines():
        for level in (" - ERROR - ", " - WARNING - ", " - CRITICAL - "):
            if level in line:
                text = line.split(level, 1)[1].strip()
                if "Event loop for" in text and "taking too long" in text:
                    text = "Event loop ... is taking too long to run"
                out[level.strip(" -") + ": " + text[:200]] += 1
    return dict(out)
