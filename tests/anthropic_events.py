"""Anthropic's event stream read back into (event name, data) pairs, for the tests that compare streams."""

from __future__ import annotations

from typing import Any

import orjson


def events(raw: bytes) -> list[tuple[str, Any]]:
    """Each `event: NAME\\ndata: JSON` block of an Anthropic SSE stream (as llama-server writes them: one data line
    an event, a blank line after each), in order."""
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        out.append((name.removeprefix(b"event: ").decode(), orjson.loads(data.removeprefix(b"data: "))))
    return out
