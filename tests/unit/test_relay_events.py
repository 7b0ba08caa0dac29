"""What of a backend's SSE events reaches the client: the events as they came, less comment lines (llama-server's
keep-alive `:`), which no SSE reader makes anything of and a strict `data: <json>` reader fails on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from lpcache.flow.relay import SseRelay, _whole_events, _without_comments

DATA = b'data: {"choices":[{"index":0,"delta":{"content":"a: b"}}]}\n\n'


@pytest.mark.parametrize("events", [DATA, DATA + b"data: [DONE]\n\n", DATA.replace(b"\n", b"\r\n"),
                                    b"event: x\ndata: {}\n\n", b""])
def test_events_without_comments_are_passed_as_they_came(events: bytes) -> None:
    assert _without_comments(events) is events


@pytest.mark.parametrize(("events", "kept"), [
    (b":\n\n", b""),                                        # llama-server's keep-alive, alone
    (b":\n\n" + DATA + b":\n\n:\n\n", DATA),               # between events
    (DATA + b": note\r\n\r\n", DATA),                       # CRLF
    (b": note\ndata: {}\n\n", b"data: {}\n\n"),             # a comment line inside an event
    (b"data: {}\r\n:\r\n\r\n", b"data: {}\r\n\r\n"),
    (b":", b""),                                            # the end of a stream, without its blank line
    (DATA + b"data: [DO", DATA + b"data: [DO"),
])
def test_comment_lines_are_left_out(events: bytes, kept: bytes) -> None:
    assert _without_comments(events) == kept


def test_whole_events_end_at_the_last_blank_line() -> None:
    assert _whole_events(DATA + b"data: {") == len(DATA)
    assert _whole_events(b":\r\n\r\ndata") == 5
    assert _whole_events(b"data: {}\n") == 0


def test_events_queued_while_the_last_were_written_go_out_in_one_write() -> None:
    """The reader got ahead (a slow client, a loaded CPU): what waits in the queue goes to the client's socket in
    one write, the end marker still ends the stream, and nothing is lost or reordered."""
    teed: list[bytes] = []
    record = SimpleNamespace(bytes_out=0)
    relay = SseRelay(cast(Any, SimpleNamespace(tee=teed.append)), cast(Any, record), cast(Any, None), 8, 0.0)
    events = [b'data: {"n":%d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]
    end = object()
    bodies: list[bytes] = []

    async def send(message: Any) -> None:
        bodies.append(message["body"])

    async def run() -> object:
        queue: asyncio.Queue[object] = asyncio.Queue()
        for event in events[1:3]:
            queue.put_nowait(event)       # queued while the first was being written

        async def later() -> None:
            await asyncio.sleep(0)
            for item in (events[3], events[4], end):
                queue.put_nowait(item)

        feeder = asyncio.ensure_future(later())
        item = await relay._pump(send, queue, events[0])
        await feeder
        return item

    assert asyncio.run(run()) is end
    assert bodies[0] == b"".join(events[:3])          # one write for the three that were there
    assert b"".join(bodies) == b"".join(events) == b"".join(teed)
    assert record.bytes_out == len(b"".join(events)) and relay._done
