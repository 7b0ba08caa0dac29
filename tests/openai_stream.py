"""A streamed chat answer read the way strict OpenAI-style clients read it (vLLM's multi-turn benchmark: each line
stripped, empty ones skipped, `data: ` removed, `[DONE]` the end, everything else `json.loads` and its
`choices[0]["delta"]` read). An SSE comment, an `event:` line, `data:` without its space, a JSON object without
`choices`, two events on one line or a line cut in two fail such a reader; so does anything after `[DONE]`.

The one exception: a stream that truly broke after bytes went out ends with lpcache's error event,
`data: {"error": {"message", "type", "code"}}` (the shape llama-server ends a failed stream with), its last line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Stream:
    content: str            # the deltas' content, joined
    done: bool              # it ended with data: [DONE]
    error: dict[str, Any] | None   # lpcache's error event, when the stream broke


def read_strictly(raw: bytes, broken_ok: bool = False) -> Stream:
    """The answer in `raw`; AssertionError naming the first line a strict reader could not take. `broken_ok`: the
    last line may be the error event of a stream that broke."""
    lines = [line.strip() for line in raw.split(b"\n")]
    lines = [line for line in lines if line]
    parts: list[str] = []
    for n, line in enumerate(lines):
        assert line.startswith(b"data: "), f"line {n} is not 'data: ...': {line[:200]!r}\n{raw[:3000]!r}"
        payload = line[6:].decode("utf-8")
        if payload == "[DONE]":
            assert n == len(lines) - 1, f"line {n}: something follows [DONE]: {lines[n + 1][:200]!r}"
            return Stream("".join(parts), True, None)
        doc = json.loads(payload)
        assert isinstance(doc, dict), f"line {n} is not a JSON object: {line[:200]!r}"
        if "choices" not in doc and broken_ok and n == len(lines) - 1 and isinstance(doc.get("error"), dict):
            assert set(doc["error"]) >= {"message", "type", "code"}, doc
            return Stream("".join(parts), False, doc["error"])
        delta = doc["choices"][0]["delta"]
        assert isinstance(delta, dict), f"line {n}: delta is not an object: {line[:200]!r}"
        parts.append(delta.get("content") or "")
    raise AssertionError(f"the stream ended without [DONE]: {raw[-500:]!r}")
