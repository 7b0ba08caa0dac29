"""The dashboard's history file: written at stop and read at start (figures, series, recent requests and their
start survive a restart), bounded in size, written atomically; a corrupt or foreign file, or a path that is no
file, is never fatal."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from lpcache.flow.record import RequestRecord
from lpcache.plugins import dashboard_history
from lpcache.plugins.dashboard import Dashboard
from lpcache.plugins.dashboard_history import COARSE, FINE, MAX_BYTES

T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(folder: Path | None, clock: Clock, **params: Any) -> Dashboard:
    plugin = Dashboard(params)
    plugin.clock = clock
    plugin.data_dir = None if folder is None else str(folder)
    return plugin


def rec(started: float, status: int = 200, **fields: Any) -> RequestRecord:
    return RequestRecord(path="/v1/chat/completions", api="chat", status=status, started=started, **fields)


def feed(plugin: Dashboard, start: float, n: int, step: float) -> None:
    for i in range(n):
        plugin.finished(rec(started=start + i * step, status=[200, 200, 200, 404, 502][i % 5],
                            elapsed_ms=50.0 + i % 700, ttft_ms=10.0 + i % 90 if i % 2 else None,
                            prompt_tokens=500, cached_tokens=i % 500, prompt_n=500 - i % 500,
                            completion_tokens=i % 40, backend=f"http://b{i % 2}:8080", prefill_ms=30.0,
                            gen_ms=200.0, model="m"))


def size(path: Path) -> int:
    return os.path.getsize(path)


def listing(folder: Path) -> list[Path]:
    return list(folder.iterdir())


def sparse_file(path: Path, n: int) -> None:
    with open(path, "wb") as f:
        f.truncate(n)


async def test_a_restart_keeps_the_figures(tmp_path: Path) -> None:
    clock = Clock(T0)
    first = make(tmp_path, clock, max_recent=50)
    await first.start()
    clock.now = T0 + 600
    feed(first, T0, 300, 2.0)
    before = first.stats(since=0)
    await first.stop()
    path = tmp_path / "dashboard-history.json"
    assert path.is_file() and not (tmp_path / ".dashboard-history.json.tmp").exists()

    clock.now = T0 + 700                    # down for a while, then started again
    second = make(tmp_path, clock, max_recent=50)
    await second.start()
    after = second.stats(since=0)
    assert after["lifetime"] == before["lifetime"] and after["lifetime"]["requests"] == 300
    assert after["lifetime_since"] == T0 and second.since == T0 and second.started_at == T0 + 700
    assert after["recent"] == before["recent"] and len(after["recent"]) == 50
    assert after["range"]["counters"] == before["range"]["counters"]
    kept = [p for p in after["range"]["series"] if p["t"] < T0 + 600]
    assert kept == [p for p in before["range"]["series"] if p["t"] < T0 + 600]
    assert after["history"]["file"] == str(path)
    # and the requests after the restart add to it
    second.finished(rec(started=T0 + 700))
    assert second.stats()["lifetime"]["requests"] == 301
    await second.stop()


async def test_an_unchanged_history_is_not_written_again(tmp_path: Path) -> None:
    clock = Clock(T0)
    plugin = make(tmp_path, clock)
    await plugin.start()
    assert await plugin.save() is False and not (tmp_path / "dashboard-history.json").exists()
    plugin.finished(rec(started=T0))
    assert await plugin.save() is True and await plugin.save() is False
    plugin.finished(rec(started=T0))
    assert await plugin.save() is True
    await plugin.stop()


async def test_a_day_of_history_is_written_in_bounded_spans(tmp_path: Path) -> None:
    clock = Clock(T0 + 86400)
    plugin = make(tmp_path, clock, bucket_secs=1)
    await plugin.start()
    feed(plugin, T0 + 1, 86400 // 3, 3.0)           # a request every 3 s for a day, in 1-second buckets
    before = plugin.stats(since=0)
    await plugin.stop()
    doc = orjson.loads((tmp_path / "dashboard-history.json").read_bytes())
    assert len(doc["spans"]) <= FINE + COARSE + 1 < len(plugin.buckets)
    assert sum(s[2]["c"].get("requests", 0) for s in doc["spans"]) == 86400 // 3
    assert size(tmp_path / "dashboard-history.json") < 4 * 1024 * 1024

    again = make(tmp_path, clock, bucket_secs=1)
    await again.start()
    after = again.stats(since=0)
    assert after["lifetime"] == before["lifetime"]
    assert after["range"]["counters"]["requests"] == before["range"]["counters"]["requests"] == 86400 // 3
    last_hour = T0 + 86400 - FINE + 1
    assert again.stats(since=last_hour)["range"]["counters"] == plugin.stats(since=last_hour)["range"]["counters"]


async def test_a_history_of_another_bucket_size_is_taken_in(tmp_path: Path) -> None:
    clock = Clock(T0 + 100)
    first = make(tmp_path, clock, bucket_secs=5)
    await first.start()
    feed(first, T0, 40, 2.0)
    await first.stop()
    second = make(tmp_path, clock, bucket_secs=20)
    await second.start()
    rng = second.stats(since=0)["range"]
    assert rng["counters"]["requests"] == sum(p["requests"] for p in rng["series"]) == 40
    assert all(p["t"] % 20 == 0 for p in rng["series"])


@pytest.mark.parametrize("content", [
    b"", b"\x00\xff garbage", b'{"format": "lpcache-dashboard-history", "version": 1, "since": ',   # truncated
    b'{"hello": "world"}', b"[1, 2, 3]", b'"a string"',                                            # foreign
    b'{"format": "lpcache-dashboard-history", "version": 99}',                                     # a newer one
    b'{"format": "lpcache-dashboard-history", "version": 1, "since": 1, "bucket_secs": 5, "lifetime": {"c": {}},'
    b' "spans": [[1, 5, {"c": {"requests": "many"}}]], "recent": []}',                            # a bad sum
    b'{"format": "lpcache-dashboard-history", "version": 1, "since": 1, "bucket_secs": 0, "lifetime": {"c": {}},'
    b' "spans": [], "recent": []}',
    b'{"format": "lpcache-dashboard-history", "version": 1, "since": 1, "bucket_secs": 5, "lifetime": {"c": {}},'
    b' "spans": [], "recent": [{"no": "time"}]}',
])
async def test_a_corrupt_or_foreign_file_is_set_aside(tmp_path: Path, content: bytes,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "dashboard-history.json"
    path.write_bytes(content)
    clock = Clock(T0)
    plugin = make(tmp_path, clock)
    with caplog.at_level(logging.WARNING, logger="lpcache.dashboard"):
        await plugin.start()
    assert any("dashboard_history_ignored" in r.getMessage() for r in caplog.records)
    assert plugin.stats()["lifetime"]["requests"] == 0 and plugin.since == T0
    assert (tmp_path / "dashboard-history.json.bad").read_bytes() == content   # nothing lost
    plugin.finished(rec(started=T0))
    await plugin.stop()
    assert orjson.loads(path.read_bytes())["lifetime"]["c"]["requests"] == 1   # and the next save is a good one


async def test_a_file_too_large_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "dashboard-history.json"
    sparse_file(path, MAX_BYTES + 1)
    plugin = make(tmp_path, Clock())
    with caplog.at_level(logging.WARNING, logger="lpcache.dashboard"):
        await plugin.start()
    assert any("larger than" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "dashboard-history.json.bad").stat().st_size == MAX_BYTES + 1
    await plugin.stop()


async def test_a_path_that_is_no_file_turns_the_history_off(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "dashboard-history.json").mkdir()
    plugin = make(tmp_path, Clock())
    with caplog.at_level(logging.WARNING, logger="lpcache.dashboard"):
        await plugin.start()
    assert any("dashboard_history_off" in r.getMessage() for r in caplog.records)
    plugin.finished(rec(started=T0))
    await plugin.stop()
    assert (tmp_path / "dashboard-history.json").is_dir() and plugin.stats()["history"]["file"] is None


async def test_a_failed_write_is_logged_and_tried_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "meta"
    folder.mkdir()
    plugin = make(folder, Clock())
    await plugin.start()
    plugin.finished(rec(started=T0))
    folder.rmdir()                                 # META_DIR gone under lpcache's feet
    with caplog.at_level(logging.WARNING, logger="lpcache.dashboard"):
        assert await plugin.save() is False
    assert any("dashboard_history_not_saved" in r.getMessage() for r in caplog.records)
    folder.mkdir()
    assert await plugin.save() is True and (folder / "dashboard-history.json").is_file()
    await plugin.stop()


async def test_where_the_history_goes(tmp_path: Path) -> None:
    assert make(None, Clock())._history_path() is None                     # no META_DIR given: none
    assert make(tmp_path, Clock(), history_file="")._history_path() is None
    assert make(tmp_path, Clock(), history_file="dash.json")._history_path() == str(tmp_path / "dash.json")
    absolute = str(tmp_path / "elsewhere" / "h.json")
    assert make(None, Clock(), history_file=absolute)._history_path() == absolute
    plugin = make(tmp_path, Clock(), history_file="")
    await plugin.start()
    plugin.finished(rec(started=T0))
    await plugin.stop()
    assert listing(tmp_path) == []


def test_history_params_are_checked() -> None:
    from lpcache.plugins.base import PluginError

    for bad in ({"history_secs": 4}, {"history_secs": 86401}, {"history_file": 3}, {"history_file": "a\x00b"}):
        with pytest.raises(PluginError):
            Dashboard(bad)
    assert Dashboard({"history_secs": 5, "history_file": "x.json"}).history_secs == 5


def test_parse_names_what_is_wrong() -> None:
    with pytest.raises(dashboard_history.HistoryError, match="not an lpcache dashboard history"):
        dashboard_history.parse(b'{"format": "something else"}')
    with pytest.raises(dashboard_history.HistoryError, match="version 2"):
        dashboard_history.parse(b'{"format": "lpcache-dashboard-history", "version": 2}')
