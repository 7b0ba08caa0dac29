"""Coalescing: the key, the shared answer (subscribers, conversions, failures), SSE aggregation, the registry."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from lpcache.flow.coalesce import Coalescer, Group, aggregate_sse, coalesce_key, completion_to_sse

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2}


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
            "system_fingerprint": "b1", "choices": choices, **extra}


def delta(d: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
    return [{"index": 0, "delta": d, "finish_reason": finish}]


USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
TIMINGS = {"cache_n": 3, "prompt_n": 4, "predicted_n": 5, "prompt_ms": 1.0, "predicted_ms": 2.0}
WORDS = ["Hel", "lo", ", wor", "ld", "!"]


def llama_stream() -> bytes:
    """Shaped like llama-server's: role chunk, content chunks, finish chunk, usage chunk, timings on the last."""
    events = [chunk(delta({"role": "assistant", "content": None}))]
    events += [chunk(delta({"content": w})) for w in WORDS]
    events += [chunk(delta({}, "stop")), chunk([], usage=USAGE, timings=TIMINGS)]
    return b"".join(event(e) for e in events) + b"data: [DONE]\n\n"


def split(raw: bytes, sizes: tuple[int, ...] = (1, 7, 13, 40, 3)) -> list[bytes]:
    """Cut bytes at odd places, cycling through sizes."""
    out, i, n = [], 0, 0
    while i < len(raw):
        out.append(raw[i:i + sizes[n % len(sizes)]])
        i += sizes[n % len(sizes)]
        n += 1
    return out


def completion(content: str | None = "Hello, world!", **message: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-9", "object": "chat.completion", "created": 1700000001, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, **message},
                         "finish_reason": "stop"}], "usage": USAGE, "timings": TIMINGS}


async def collect(it: Any) -> list[bytes]:
    return [c async for c in it]


# ---- coalesce_key ----

def test_key_ignores_key_order() -> None:
    reordered = {"temperature": 0.2, "messages": [{"content": "hi", "role": "user"}], "model": "m"}
    assert coalesce_key(BODY) == coalesce_key(reordered)


def test_key_ignores_stream_and_stream_options() -> None:
    assert coalesce_key(BODY) == coalesce_key(BODY | {"stream": True, "stream_options": {"include_usage": True}})


def test_key_changes_with_content_parameters() -> None:
    base = coalesce_key(BODY)
    assert coalesce_key(BODY | {"temperature": 0.3}) != base
    assert coalesce_key(BODY | {"model": "other"}) != base
    assert coalesce_key(BODY | {"messages": [{"role": "user", "content": "ho"}]}) != base
    assert coalesce_key(BODY | {"max_tokens": 5}) != base
    assert len(base) == 64


def test_key_holds_who_asks_and_the_session() -> None:
    base = coalesce_key(BODY)
    keys = {base, coalesce_key(BODY, client="a"), coalesce_key(BODY, client="b"),
            coalesce_key(BODY, session="s1"), coalesce_key(BODY, session="s2"), coalesce_key(BODY, "a", "s1")}
    assert len(keys) == 6
    assert coalesce_key(BODY, "a", "s1") == coalesce_key(dict(reversed(BODY.items())), "a", "s1")


def test_key_of_a_body_nested_deeper_than_orjson_writes_is_none() -> None:
    deep: Any = []
    for _ in range(300):     # orjson reads 1024 levels but writes 254: such a request is not coalesced
        deep = [deep]
    assert coalesce_key(BODY | {"x": deep}) is None
    assert coalesce_key(BODY | {"x": deep}, "a", "s") is None


# ---- Group: subscribers ----

async def test_late_subscriber_gets_every_chunk_from_the_first() -> None:
    group = Group("k", stream=True)
    seen: dict[str, list[bytes]] = {"early": [], "late": []}
    reached = {"early": asyncio.Event(), "late": asyncio.Event()}

    async def read(name: str, signal_at: int) -> None:
        async for c in group.chunks():
            seen[name].append(c)
            if len(seen[name]) == signal_at:
                reached[name].set()

    early = asyncio.ensure_future(read("early", 1))
    group.feed(b"a")
    await reached["early"].wait()  # the early reader is live, waiting for more
    group.feed(b"b")
    group.feed(b"c")
    late = asyncio.ensure_future(read("late", 3))
    await reached["late"].wait()  # the late one caught up on the three fed before it came
    group.feed(b"d")
    group.finish(200)
    await asyncio.gather(early, late)
    assert seen["early"] == seen["late"] == [b"a", b"b", b"c", b"d"]


async def test_slow_and_fast_readers_each_at_their_pace() -> None:
    group = Group("k", stream=True)
    fast_seen: list[bytes] = []
    release_slow = asyncio.Event()
    progressed = asyncio.Event()

    async def fast() -> None:
        async for c in group.chunks():
            fast_seen.append(c)
            if len(fast_seen) == 3:
                progressed.set()

    async def slow() -> list[bytes]:
        out = []
        async for c in group.chunks():
            out.append(c)
            if len(out) == 1:
                await release_slow.wait()  # stuck after the first chunk while the others keep coming
        return out

    tasks = asyncio.gather(fast(), slow())
    for c in (b"1", b"2", b"3"):
        group.feed(c)
    await progressed.wait()
    assert fast_seen == [b"1", b"2", b"3"]
    group.feed(b"4")
    group.finish(200)
    release_slow.set()
    _, slow_seen = await tasks
    assert fast_seen == slow_seen == [b"1", b"2", b"3", b"4"]


async def test_finish_wakes_every_waiter() -> None:
    group = Group("k", stream=False)
    waiters = asyncio.gather(*(group.wait() for _ in range(5)), collect(group.chunks()))
    group.feed(b"{}")
    group.finish(200, [(b"content-type", b"application/json")])
    results = await waiters
    assert results[-1] == [b"{}"]
    assert group.done and group.status == 200 and group.error is None
    assert group.headers == [(b"content-type", b"application/json")]


async def test_finish_and_fail_after_done_are_no_ops_and_feed_raises() -> None:
    group = Group("k", stream=True)
    group.finish(200)
    group.fail({"error": {"message": "late", "type": "x", "code": 500}})
    assert group.status == 200 and group.error is None
    try:
        group.feed(b"x")
    except RuntimeError:
        pass
    else:
        raise AssertionError("feed after finish must raise")


# ---- Group: failures ----

ERROR = {"error": {"message": "backend went away", "type": "backend_unreachable", "code": 503}}


async def test_fail_as_stream_is_one_error_event() -> None:
    group = Group("k", stream=True)
    reader = asyncio.ensure_future(collect(group.as_stream()))
    group.fail(ERROR)
    assert await reader == [event(ERROR)]
    json_leader = Group("k", stream=False)
    json_leader.fail(ERROR)
    assert await collect(json_leader.as_stream()) == [event(ERROR)]


async def test_fail_as_json_uses_the_http_code_else_502() -> None:
    group = Group("k", stream=False)
    group.fail(ERROR)
    assert await group.as_json() == (503, orjson.dumps(ERROR))
    other = Group("k", stream=True)
    string_code = {"error": {"message": "m", "type": "t", "code": "backend_unreachable"}}
    other.fail(string_code)
    assert await other.as_json() == (502, orjson.dumps(string_code))


async def test_fail_mid_stream_ends_the_stream_with_the_error() -> None:
    group = Group("k", stream=True)
    group.feed(b"data: {}\n\n")
    group.fail(ERROR)
    assert await collect(group.as_stream()) == [b"data: {}\n\n", event(ERROR)]


async def test_non_200_answer() -> None:
    body = orjson.dumps({"error": {"code": 400, "message": "context too long", "type": "invalid_request_error"}})
    for stream in (True, False):
        group = Group("k", stream=stream)
        group.feed(body)
        group.finish(400)
        assert await group.as_json() == (400, body)
        events = await collect(group.as_stream())
        assert len(events) == 1
        doc = orjson.loads(events[0].removeprefix(b"data: "))
        assert doc["error"]["message"] == "context too long" and doc["error"]["code"] == 400


async def test_json_leader_non_object_body_is_502() -> None:
    group = Group("k", stream=False)
    group.feed(b"[1, 2]")
    group.finish(200)
    status, body = await group.as_json()
    assert status == 502 and orjson.loads(body)["error"]["code"] == 502
    assert b'"error"' in (await collect(group.as_stream()))[0]


# ---- Group: conversions ----

async def test_as_json_on_a_streaming_leader_aggregates() -> None:
    group = Group("k", stream=True)
    reader = asyncio.ensure_future(group.as_json())
    for piece in split(llama_stream()):
        group.feed(piece)
    group.finish(200)
    status, body = await reader
    doc = orjson.loads(body)
    assert status == 200 and doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["content"] == "Hello, world!"
    assert doc["usage"] == USAGE and doc["timings"] == TIMINGS


async def test_as_stream_on_a_streaming_leader_is_the_raw_bytes() -> None:
    group = Group("k", stream=True)
    reader = asyncio.ensure_future(collect(group.as_stream()))
    pieces = split(llama_stream())
    for piece in pieces:
        group.feed(piece)
    group.finish(200)
    assert await reader == pieces


async def test_as_json_on_a_json_leader_is_its_body() -> None:
    group = Group("k", stream=False)
    body = orjson.dumps(completion())
    group.feed(body[:10])
    group.feed(body[10:])
    group.finish(200)
    assert await group.as_json() == (200, body)
    assert group.body() == body


async def test_as_stream_on_a_json_leader_round_trips() -> None:
    doc = completion(reasoning_content="think",
                     tool_calls=[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
    doc["system_fingerprint"] = "b1"
    group = Group("k", stream=False)
    reader = asyncio.ensure_future(collect(group.as_stream()))
    group.feed(orjson.dumps(doc))
    group.finish(200)
    raw = b"".join(await reader)
    assert raw.endswith(b"data: [DONE]\n\n")
    for line in raw.split(b"\n\n")[:-2]:
        c = orjson.loads(line.removeprefix(b"data: "))
        assert c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-9" and c["model"] == "m"
    back = aggregate_sse(raw)
    assert back == doc


def test_completion_to_sse_shape() -> None:
    raw = completion_to_sse(completion())
    docs = [orjson.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n")[:-2]]
    assert [d["choices"][0]["delta"] for d in docs] == [{"role": "assistant", "content": None},
                                                        {"content": "Hello, world!"}, {}]
    assert docs[-1]["choices"][0]["finish_reason"] == "stop"
    assert docs[-1]["usage"] == USAGE and docs[-1]["timings"] == TIMINGS
    assert "usage" not in docs[0] and "usage" not in docs[1]


def test_completion_to_sse_without_content() -> None:
    assert aggregate_sse(completion_to_sse(completion(None)))["choices"][0]["message"]["content"] is None


# ---- aggregate_sse ----

def test_aggregate_llama_stream_with_odd_splits_and_crlf() -> None:
    raw = llama_stream().replace(b"\n", b"\r\n")
    raw = b": keep-alive comment\r\n\r\n" + raw + b"data: not json\r\n\r\n"
    doc = aggregate_sse(b"".join(split(raw)))
    assert doc == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "system_fingerprint": "b1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello, world!"},
                     "finish_reason": "stop"}],
        "usage": USAGE, "timings": TIMINGS,
    }


def test_aggregate_takes_timings_from_the_last_chunk_and_content_null_when_none() -> None:
    raw = event(chunk(delta({"role": "assistant", "content": None}), timings={"n": 1}))
    raw += event(chunk(delta({}, "length"), timings={"n": 2})) + b"data: [DONE]\n\n"
    doc = aggregate_sse(raw)
    assert doc["timings"] == {"n": 2} and "usage" not in doc
    assert doc["choices"][0]["message"]["content"] is None and doc["choices"][0]["finish_reason"] == "length"


def test_aggregate_merges_tool_calls_and_reasoning() -> None:
    parts = [
        delta({"role": "assistant", "content": None}),
        delta({"reasoning_content": "let me "}),
        delta({"reasoning_content": "see"}),
        delta({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        delta({"tool_calls": [{"index": 1, "id": "c2", "type": "function",
                               "function": {"name": "get_time", "arguments": "{}"}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}),
        delta({}, "tool_calls"),
    ]
    message = aggregate_sse(b"".join(event(chunk(p)) for p in parts))["choices"][0]["message"]
    assert message == {
        "role": "assistant", "content": None, "reasoning_content": "let me see",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }


def test_aggregate_several_choices() -> None:
    raw = event(chunk([{"index": 1, "delta": {"content": "b"}, "finish_reason": None},
                       {"index": 0, "delta": {"content": "a"}, "finish_reason": None}]))
    raw += event(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"},
                        {"index": 1, "delta": {}, "finish_reason": "stop"}]))
    choices = aggregate_sse(raw)["choices"]
    assert [(c["index"], c["message"]["content"]) for c in choices] == [(0, "a"), (1, "b")]


# ---- Coalescer ----

def test_join_leader_then_followers() -> None:
    co = Coalescer()
    group, leader = co.join("k", stream=True)
    assert leader and group.stream and group.followers == 0
    for n in (1, 2):
        again, leader = co.join("k", stream=False)
        assert again is group and not leader and group.followers == n
    other, leader = co.join("k2", stream=False)
    assert leader and other is not group and not other.stream
    assert len(co) == 2 and sorted(co.active()) == [("k", 2), ("k2", 0)]


def test_after_close_a_new_leader() -> None:
    co = Coalescer()
    group, _ = co.join("k", stream=False)
    group.finish(200)
    co.close(group)
    assert len(co) == 0
    fresh, leader = co.join("k", stream=False)
    assert leader and fresh is not group


def test_a_done_group_is_not_joined_even_before_close() -> None:
    co = Coalescer()
    group, _ = co.join("k", stream=False)
    group.fail(ERROR)
    fresh, leader = co.join("k", stream=True)
    assert leader and fresh is not group


def test_closing_an_old_group_keeps_the_newer_one() -> None:
    co = Coalescer()
    old, _ = co.join("k", stream=False)
    old.finish(200)
    new, leader = co.join("k", stream=False)
    assert leader
    co.close(old)
    assert len(co) == 1
    assert co.join("k", stream=False) == (new, False)
    co.close(new)
    assert len(co) == 0


def test_followers_leave_and_the_last_one_out_calls_on_alone() -> None:
    co = Coalescer()
    group, _ = co.join("k", stream=True)
    calls: list[int] = []
    group.on_alone = lambda: calls.append(group.followers)
    for _ in range(2):
        co.join("k", stream=False)
    group.leave()
    assert group.followers == 1 and calls == [] and co.active() == [("k", 1)]
    group.leave()
    assert group.followers == 0 and calls == [0]


def test_leaving_a_done_group_does_not_call_on_alone() -> None:
    co = Coalescer()
    group, _ = co.join("k", stream=True)
    co.join("k", stream=False)
    group.on_alone = lambda: pytest.fail("on_alone after the answer was complete")
    group.finish(200)
    group.leave()
    group.leave()            # never below zero
    assert group.followers == 0


async def test_a_stream_whose_head_went_out_ends_as_a_stream_for_streaming_followers() -> None:
    """The leader's client got a 200 stream's head, then the backend broke before a whole event: a streaming
    follower gets the same (a 200 stream ending with the error event), not a JSON 502."""
    group = Group("k", stream=True)
    group.start()
    group.fail({"error": {"message": "backend stream broke", "type": "backend_unreachable", "code": 502}})
    assert await group.failed_before_start() is False
    events = [chunk async for chunk in group.as_stream()]
    assert len(events) == 1 and b"backend stream broke" in events[0] and events[0].startswith(b"data: ")
    before = Group("k", stream=True)
    before.fail({"error": {"message": "x", "type": "backend_unreachable", "code": 502}})
    assert await before.failed_before_start() is True
