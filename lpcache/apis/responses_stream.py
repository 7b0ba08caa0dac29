"""A Responses stream as OpenAI's SDKs read it: llama-server's events with the indexes it leaves out.

llama-server (b11434) streams /v1/responses events without `output_index`, `content_index` and
`sequence_number`, and its `response.created` has no `output`. OpenAI's Python SDK builds the response from the
events (`client.responses.stream()`, `ResponseStreamState.accumulate_event`) by those indexes, and fails on the first
text delta ("list indices must be integers or slices, not NoneType"). Each event here gets what it lacks, counted as
OpenAI counts them: an item's place in the response's output, a part's place in its item, the event's place in the
stream. A field the server sends is never changed, and a block that is not a JSON event passes on as it came.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_ITEM_EVENTS = ("response.output_item.added", "response.output_item.done")
_BETWEEN = re.compile(rb"(\r\n\r\n|\n\n)")   # what ends an event (llama-server writes the second)
_PART_ADDED = "response.content_part.added"


class ResponsesStream:
    def __init__(self) -> None:
        self._buffer = b""
        self._sequence = 0
        self._items: dict[str, int] = {}    # item id -> its index in the response's output
        self._parts: dict[str, int] = {}    # item id -> index of its latest content part

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        *parts, self._buffer = _BETWEEN.split(self._buffer)
        return b"".join(self._block(block) + end for block, end in zip(parts[::2], parts[1::2], strict=True))

    def close(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _block(self, block: bytes) -> bytes:
        # its data line: the first that starts with "data: " (a JSON value holds no raw line feed)
        if block.startswith(b"data: "):
            head, data = b"", block[6:]
        else:
            at = block.find(b"\ndata: ")
            if at < 0:
                return block
            head, data = block[:at + 1], block[at + 7:]
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return block
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return block
        self._complete(event)
        return head + b"data: " + orjson.dumps(event)

    def _complete(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        event.setdefault("sequence_number", self._sequence)
        self._sequence += 1
        response = event.get("response")
        if isinstance(response, dict):
            response.setdefault("output", [])
        item = event.get("item")
        item_id = item.get("id") if isinstance(item, dict) else event.get("item_id")
        if not isinstance(item_id, str):
            return
        if kind in _ITEM_EVENTS and item_id not in self._items:
            self._items[item_id] = len(self._items)
        if item_id in self._items:
            event.setdefault("output_index", self._items[item_id])
        if kind == _PART_ADDED:
            self._parts[item_id] = self._parts.get(item_id, -1) + 1
        if "part" in event or kind.startswith(("response.output_text.", "response.refusal.",
                                                "response.reasoning_text.")):
            event.setdefault("content_index", self._parts.get(item_id, 0))
