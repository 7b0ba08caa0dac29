"""responses_stream: llama-server's Responses events, completed with the indexes OpenAI's SDKs build the response by."""

from __future__ import annotations

import random
from typing import Any

import orjson

from lpcache.apis.responses_stream import ResponsesStream

# llama-server b11434's events for a short answer, as it writes them (no output_index, content_index, sequence)
ITEM = "msg_YRLEhWVSC6c25vxpFL5EadfYIu1zd8S8"
SERVER: list[dict[str, Any]] = [
    {"type": "response.created", "response": {"id": "resp_1", "object": "response", "status": "in_progress"}},
    {"type": "response.in_progress", "response": {"id": "resp_1", "object": "response", "status": "in_progress"}},
    {"type": "response.output_item.added", "item": {"content": [], "id": ITEM, "role": "assistant",
                                                    "status": "in_progress", "type": "message"}},
    {"type": "response.content_part.added", "item_id": ITEM, "part": {"type": "output_text", "text": ""}},
    {"type": "response.output_text.delta", "item_id": ITEM, "delta": "I"},
    {"type": "response.output_text.delta", "item_id": ITEM, "delta": " data: ok"},
    {"type": "response.output_text.done", "item_id": ITEM, "text": "I data: ok"},
    {"type": "response.content_part.done", "item_id": ITEM, "part": {"type": "output_text", "text": "I data: ok"}},
    {"type": "response.output_item.done", "item": {"type": "message", "status": "completed", "id": ITEM,
                                                   "content": [], "role": "assistant"}},
    {"type": "response.output_item.added", "item": {"type": "function_call", "id": "fc_1", "call_id": "c1",
                                                    "name": "f", "arguments": ""}},
    {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": "{}"},
    {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "output": ["kept"]}},
]


def stream(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)


def convert(chunks: list[bytes]) -> bytes:
    s = ResponsesStream()
    return b"".join(s.feed(c) for c in chunks) + s.close()


def parsed(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n", 1)
        doc = orjson.loads(data[len(b"data: "):])
        assert name == b"event: " + doc["type"].encode()
        out.append(doc)
    return out


def test_every_event_gets_the_indexes_openais_sdk_reads() -> None:
    got = parsed(convert([stream(SERVER)]))
    assert [e["sequence_number"] for e in got] == list(range(len(SERVER)))
    assert got[0]["response"]["output"] == [] and got[-1]["response"]["output"] == ["kept"]
    assert [e.get("output_index") for e in got] == [None, None, 0, 0, 0, 0, 0, 0, 0, 1, 1, None]
    assert [e.get("content_index") for e in got[3:9]] == [0, 0, 0, 0, 0, None]
    assert got[5]["delta"] == " data: ok"   # text that looks like an SSE field is the event's text
    for theirs, ours in zip(SERVER, got, strict=True):   # nothing the server sent is changed
        assert all(ours[k] == v for k, v in theirs.items() if k != "response"), (theirs, ours)


def test_in_any_pieces_the_bytes_are_the_same() -> None:
    raw = stream(SERVER)
    whole = convert([raw])
    rng = random.Random(3)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(1, 12)))
        assert convert([raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]) == whole


def test_a_second_content_part_and_what_the_server_sends_itself_are_kept() -> None:
    events = [
        {"type": "response.output_item.added", "item": {"id": "m", "type": "message"}, "output_index": 4,
         "sequence_number": 9},
        {"type": "response.content_part.added", "item_id": "m", "part": {"type": "output_text"}},
        {"type": "response.content_part.added", "item_id": "m", "part": {"type": "output_text"}},
        {"type": "response.output_text.delta", "item_id": "m", "delta": "x"},
    ]
    got = parsed(convert([stream(events)]))
    assert got[0]["output_index"] == 4 and got[0]["sequence_number"] == 9
    assert [e["content_index"] for e in got[1:]] == [0, 1, 1]


def test_what_is_not_a_json_event_passes_on_unchanged() -> None:
    raw = b": ping\n\ndata: [DONE]\n\ndata: {\"error\": {\"message\": \"x\"}}\n\nevent: e\ndata: {not json\n\n"
    assert convert([raw]) == raw
    assert convert([b"data: {\"type\": \"response.created\"}"]) == b"data: {\"type\": \"response.created\"}"


def test_events_framed_with_crlf_go_out_as_they_come() -> None:
    s = ResponsesStream()
    first = stream(SERVER[:1]).replace(b"\n", b"\r\n")
    out = s.feed(first + b"event: response.in_progress\r\n")
    assert out.endswith(b"\r\n\r\n") and parsed(out.replace(b"\r\n", b"\n"))[0]["sequence_number"] == 0
    assert s.close() == b"event: response.in_progress\r\n"
