"""What of a backend's SSE events reaches the client: the events as they came, less comment lines (llama-server's
keep-alive `:`), which no SSE reader makes anything of and a strict `data: <json>` reader fails on."""

from __future__ import annotations

import pytest

from lpcache.flow.relay import _whole_events, _without_comments

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
