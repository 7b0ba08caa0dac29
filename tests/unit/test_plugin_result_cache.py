"""The result cache prefilter."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from lpcache.flow.coalesce import aggregate_sse
from lpcache.plugins.base import Answer, ChatRequest, PluginError, Serve
from lpcache.plugins.result_cache import RemoveAfterServe, ResultCachePrefilter, entry_key

COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def request(*, stream: bool = False, client_key: str | None = None, headers: dict[str, str] | None = None,
            session: str | None = None, **extra: Any) -> ChatRequest:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "capital of France?"}], **extra}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return ChatRequest(body=body, key="prefix-key", model="m", stream=stream, text="capital of France?",
                       headers=headers or {}, client_key=client_key, session=session)


def answer(*, stream: bool = False, status: int = 200, completion: Any = COMPLETION) -> Answer:
    return Answer(status=status, completion=completion, stream=stream)


async def make(tmp_path: Path, **params: Any) -> ResultCachePrefilter:
    plugin = ResultCachePrefilter({"dir": str(tmp_path / "cache"), **params})
    await plugin.start()
    plugin.clock = lambda: 1000.0
    return plugin


def files(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / "cache"))


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


async def test_start_creates_dir(tmp_path: Path) -> None:
    await make(tmp_path)
    assert (tmp_path / "cache").is_dir()


async def test_miss_store_hit(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    assert await plugin.check(request()) is None
    await plugin.answered(request(), answer())
    path = plugin.entry_path(request())
    assert files(tmp_path) == [os.path.basename(path)]
    assert orjson.loads(read(path)) == {"created": 1000.0, "completion": COMPLETION}
    verdict = await plugin.check(request())
    assert isinstance(verdict, Serve)
    assert verdict.status == 200 and verdict.content_type == "application/json" and verdict.cleanup is None
    assert orjson.loads(verdict.body) == COMPLETION


async def test_entry_key_is_not_prefix_key(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    assert os.path.basename(plugin.entry_path(request())) == entry_key(request()) + ".json"
    assert entry_key(request()) != "prefix-key"


async def test_streaming_request_not_served_by_default(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    await plugin.answered(request(), answer())
    assert await plugin.check(request(stream=True)) is None


async def test_streaming_request_served_as_sse_with_cache_streaming(tmp_path: Path) -> None:
    plugin = await make(tmp_path, cache_streaming=True)
    await plugin.answered(request(), answer())
    verdict = await plugin.check(request(stream=True))
    assert isinstance(verdict, Serve)
    assert verdict.content_type == "text/event-stream"
    assert verdict.body.endswith(b"data: [DONE]\n\n")
    again = aggregate_sse(verdict.body)
    assert again["choices"][0]["message"]["content"] == "Paris."
    assert again["choices"][0]["finish_reason"] == "stop"
    assert again["usage"] == COMPLETION["usage"]


async def test_streaming_answer_stored_only_with_cache_streaming(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    await plugin.answered(request(stream=True), answer(stream=True))
    assert files(tmp_path) == []
    plugin = await make(tmp_path, cache_streaming=True)
    await plugin.answered(request(stream=True), answer(stream=True))
    assert len(files(tmp_path)) == 1
    verdict = await plugin.check(request())  # the aggregated stream serves a JSON request too
    assert isinstance(verdict, Serve) and orjson.loads(verdict.body) == COMPLETION


async def test_unsuccessful_answers_not_stored(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    await plugin.answered(request(), answer(status=500))
    await plugin.answered(request(), answer(completion=None))
    await plugin.answered(request(), answer(completion={"object": "chat.completion", "choices": []}))
    assert files(tmp_path) == []


async def test_expiry(tmp_path: Path) -> None:
    plugin = await make(tmp_path, ttl_secs=60)
    await plugin.answered(request(), answer())
    plugin.clock = lambda: 1059.9
    assert isinstance(await plugin.check(request()), Serve)
    plugin.clock = lambda: 1060.0
    assert await plugin.check(request()) is None
    assert files(tmp_path) == []  # the expired entry is deleted


async def test_ttl_zero_never_expires(tmp_path: Path) -> None:
    plugin = await make(tmp_path, ttl_secs=0)
    await plugin.answered(request(), answer())
    plugin.clock = lambda: 1000.0 + 10 * 365 * 86400
    assert isinstance(await plugin.check(request()), Serve)


async def test_cache_control_no_cache_bypass(tmp_path: Path) -> None:
    plugin = await make(tmp_path, cache_control=True)
    await plugin.answered(request(), answer())
    assert await plugin.check(request(headers={"cache-control": "no-cache"})) is None
    assert await plugin.check(request(headers={"cache-control": "max-age=0, No-Cache"})) is None
    assert isinstance(await plugin.check(request(headers={"cache-control": "max-age=0"})), Serve)
    assert isinstance(await plugin.check(request()), Serve)


async def test_no_cache_header_ignored_without_cache_control(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    await plugin.answered(request(), answer())
    assert isinstance(await plugin.check(request(headers={"cache-control": "no-cache"})), Serve)


@pytest.mark.parametrize("content", [b"not json{", b"[1, 2]", b'{"created": 1000}',
                                     b'{"created": "x", "completion": {}}', b'{"completion": {"id": 1}}'])
async def test_corrupt_entry_deleted(tmp_path: Path, content: bytes) -> None:
    plugin = await make(tmp_path)
    path = plugin.entry_path(request())
    write(path, content)
    assert await plugin.check(request()) is None
    assert files(tmp_path) == []
    await plugin.answered(request(), answer())  # the request went on to the backend; its answer heals the entry
    assert isinstance(await plugin.check(request()), Serve)


async def test_remove_after_serve(tmp_path: Path) -> None:
    plugin = await make(tmp_path, remove_after_serve=True)
    await plugin.answered(request(), answer())
    verdict = await plugin.check(request())
    assert isinstance(verdict, Serve) and isinstance(verdict.cleanup, RemoveAfterServe)
    assert len(files(tmp_path)) == 1  # not before the answer was sent
    await verdict.cleanup.run(request())
    assert files(tmp_path) == []
    await verdict.cleanup.run(request())  # once; a missing file is fine
    assert await plugin.check(request()) is None


async def test_remove_after_serve_missing_file_is_fine(tmp_path: Path) -> None:
    await RemoveAfterServe(str(tmp_path / "gone.json")).run(request())


async def test_client_keys_do_not_share(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    await plugin.answered(request(client_key="alice"), answer())
    assert await plugin.check(request(client_key="bob")) is None
    assert await plugin.check(request()) is None
    assert isinstance(await plugin.check(request(client_key="alice")), Serve)


async def test_sessions_do_not_share(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    await plugin.answered(request(session="a" * 32), answer())
    assert await plugin.check(request(session="b" * 32)) is None
    assert await plugin.check(request()) is None
    assert isinstance(await plugin.check(request(session="a" * 32)), Serve)
    # without a session the key is what it was before sessions counted (stored caches stay valid)
    assert entry_key(request()) != entry_key(request(session="a" * 32))


async def test_generation_params_change_the_entry(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    await plugin.answered(request(temperature=0.2), answer())
    assert await plugin.check(request(temperature=0.9)) is None
    assert await plugin.check(request()) is None
    assert isinstance(await plugin.check(request(temperature=0.2)), Serve)


async def test_stream_flag_alone_does_not_change_the_key(tmp_path: Path) -> None:
    assert entry_key(request(stream=True)) == entry_key(request())
    body_order = ChatRequest(body=dict(reversed(list(request().body.items()))), key="x", model="m", stream=False,
                             text="", headers={})
    assert entry_key(body_order) == entry_key(request())


async def test_store_recreates_a_removed_dir(tmp_path: Path) -> None:
    plugin = await make(tmp_path)
    os.rmdir(tmp_path / "cache")
    await plugin.answered(request(), answer())
    assert isinstance(await plugin.check(request()), Serve)


async def test_answered_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    plugin = ResultCachePrefilter({"dir": str(blocker / "cache")})  # cannot be created: a file is in the way
    await plugin.answered(request(), answer())
    assert await plugin.check(request()) is None


async def test_start_fails_on_uncreatable_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PluginError, match="result_cache"):
        await ResultCachePrefilter({"dir": str(blocker / "cache")}).start()


@pytest.mark.parametrize(("params", "name"), [
    ({}, "dir"),
    ({"dir": ""}, "dir"),
    ({"dir": 5}, "dir"),
    ({"dir": "d", "ttl_secs": -1}, "ttl_secs"),
    ({"dir": "d", "ttl_secs": "300"}, "ttl_secs"),
    ({"dir": "d", "ttl_secs": 1.5}, "ttl_secs"),
    ({"dir": "d", "ttl_secs": True}, "ttl_secs"),
    ({"dir": "d", "cache_streaming": "yes"}, "cache_streaming"),
    ({"dir": "d", "cache_control": 1}, "cache_control"),
    ({"dir": "d", "remove_after_serve": "true"}, "remove_after_serve"),
    ({"dir": "d", "sweep_secs": 0}, "sweep_secs"),
    ({"dir": "d", "max_entries": -1}, "max_entries"),
])
def test_bad_params(params: dict[str, Any], name: str) -> None:
    with pytest.raises(PluginError) as err:
        ResultCachePrefilter(params)
    assert "result_cache" in str(err.value) and repr(name) in str(err.value)


def test_defaults(tmp_path: Path) -> None:
    plugin = ResultCachePrefilter({"dir": str(tmp_path)})
    assert (plugin.ttl_secs, plugin.cache_streaming, plugin.cache_control, plugin.remove_after_serve) == (
        300, False, False, False)


def test_wants_only_the_answers_it_can_store(tmp_path: Path) -> None:
    plain = ResultCachePrefilter({"dir": str(tmp_path)})
    assert plain.wants_answer(request()) and not plain.wants_answer(request(stream=True))
    assert ResultCachePrefilter({"dir": str(tmp_path), "cache_streaming": True}).wants_answer(request(stream=True))


def stored(plugin: ResultCachePrefilter, created: float, n: int) -> str:
    """An entry written as `answered` writes it, created at `created`."""
    path = os.path.join(plugin.dir, f"{n:064x}.json")
    write(path, orjson.dumps({"created": created, "completion": COMPLETION}))
    return path


async def test_sweep_deletes_expired_and_corrupt_entries_without_a_repeat_request(tmp_path: Path) -> None:
    plugin = await make(tmp_path, ttl_secs=60)
    stored(plugin, 900.0, 1)
    fresh = stored(plugin, 990.0, 2)
    corrupt = os.path.join(plugin.dir, f"{3:064x}.json")
    write(corrupt, b"{not json")
    other = os.path.join(plugin.dir, "notes.json")           # not an entry name: never touched
    write(other, b"{}")
    assert plugin.sweep() == 2
    assert files(tmp_path) == sorted(os.path.basename(p) for p in (fresh, other))
    plugin.clock = lambda: 1050.0
    assert plugin.sweep() == 1 and files(tmp_path) == ["notes.json"]
    await plugin.stop()


async def test_sweep_keeps_at_most_max_entries_the_newest(tmp_path: Path) -> None:
    plugin = await make(tmp_path, ttl_secs=0, max_entries=2)
    paths = [stored(plugin, 100.0 + n, n) for n in range(5)]
    assert plugin.sweep() == 3
    assert files(tmp_path) == sorted(os.path.basename(p) for p in paths[3:])
    await plugin.stop()


async def test_the_sweep_runs_by_itself(tmp_path: Path) -> None:
    plugin = await make(tmp_path, ttl_secs=60, sweep_secs=0.01)
    await plugin.answered(request(), answer())
    assert len(files(tmp_path)) == 1
    plugin.clock = lambda: 2000.0                              # the entry expires; nobody asks for it again
    deadline = time.monotonic() + 10
    while files(tmp_path):
        assert time.monotonic() < deadline, "the sweep did not run"
        await asyncio.sleep(0.01)
    await plugin.stop()
    assert plugin._sweeper is None


async def test_a_redis_that_fails_is_left_alone_for_a_while(tmp_path: Path) -> None:
    """With redis_url, a failed call is a miss (or a result not stored), and the next calls within REDIS_PAUSE
    seconds are not tried (each would wait for the client's timeout); after it, Redis is tried again."""
    from lpcache.plugins import result_cache

    plugin = ResultCachePrefilter({"dir": str(tmp_path / "cache"), "redis_url": "redis://127.0.0.1:1/0"})
    calls: list[str] = []

    class Down:
        async def get(self, key: str) -> bytes:
            calls.append("get")
            raise ConnectionError("refused")

        async def set(self, key: str, data: bytes, px: int | None = None) -> None:
            calls.append("set")
            raise ConnectionError("refused")

    plugin.redis = Down()
    now = [100.0]
    plugin.clock = lambda: now[0]
    assert await plugin.check(request()) is None
    assert await plugin.check(request()) is None
    await plugin.answered(request(), answer())
    assert calls == ["get"], "one try, then Redis is left alone"
    now[0] += result_cache.REDIS_PAUSE + 0.1
    await plugin.answered(request(), answer())
    assert calls == ["get", "set"]
