"""The dashboard plugin: params, counters, buckets and pruning, the recent ring, ?since ranges, coarsening, excluded
paths, the self-contained page and both routes."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from lpcache.flow.record import RequestRecord
from lpcache.plugins.base import Observer, PluginError, Routes
from lpcache.plugins.dashboard import KEEP_SECS, MAX_POINTS, Dashboard

T0 = 1_700_000_000.0  # a multiple of every bucket size used here


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(clock: Clock | None = None, **params: Any) -> Dashboard:
    plugin = Dashboard(params)
    plugin.clock = clock or Clock()
    plugin.started_at = plugin.clock()
    return plugin


def rec(started: float = T0, status: int | None = 200, path: str = "/v1/chat/completions", **fields: Any) -> Any:
    return RequestRecord(path=path, status=status, started=started, **fields)


# ---- params ----

def test_defaults() -> None:
    plugin = Dashboard()
    assert isinstance(plugin, Observer) and isinstance(plugin, Routes) and plugin.name == "dashboard"
    assert (plugin.path, plugin.refresh_ms, plugin.window_secs, plugin.bucket_secs, plugin.max_recent) == (
        "/dashboard", 2000, 300, 5, 100)
    assert plugin.excluded_paths() == ["/dashboard", "/dashboard/api/stats"]


@pytest.mark.parametrize(("name", "low", "high"), [
    ("refresh_ms", 100, 3_600_000), ("window_secs", 10, 86400), ("bucket_secs", 1, 3600), ("max_recent", 0, 10000),
])
def test_integer_params_accept_their_range_only(name: str, low: int, high: int) -> None:
    assert getattr(Dashboard({name: low}), name) == low
    assert getattr(Dashboard({name: high}), name) == high
    for bad in (low - 1, high + 1, "5", 5.0, True, None):
        with pytest.raises(PluginError) as info:
            Dashboard({name: bad})
        message = str(info.value)
        assert "'dashboard'" in message and repr(name) in message and f"{low}..={high}" in message


@pytest.mark.parametrize("path", ["/dash", "/a/b/stats-page", "/x_1.y~z"])
def test_good_paths(path: str) -> None:
    plugin = Dashboard({"path": path})
    assert plugin.excluded_paths() == [path, path + "/api/stats"]


@pytest.mark.parametrize("path", ["dashboard", "/", "/dashboard/", "", "//", "/a//b", "/a b", "/{x}", "/a?b", 7])
def test_bad_paths(path: Any) -> None:
    with pytest.raises(PluginError, match=r"'dashboard'.*'path'"):
        Dashboard({"path": path})


def test_unknown_param_is_an_error() -> None:
    with pytest.raises(PluginError, match=r"'dashboard'.*'refresh'"):
        Dashboard({"refresh": 1000})


# ---- counters ----

def test_lifetime_counters() -> None:
    plugin = make()
    plugin.finished(rec(status=200, prompt_tokens=100, cached_tokens=80, prompt_n=20, completion_tokens=7,
                        restored=True, restore_ms=30.0, cache_hit=True, saved=True, save_ms=10.0))
    plugin.finished(rec(status=200, prompt_tokens=50, cache_n=10, prompt_n=40, completion_tokens=3, coalesced=True))
    plugin.finished(rec(status=502, reason="backend_unreachable", restored=False, restore_ms=50.0, saved=False))
    plugin.finished(rec(status=404))
    plugin.finished(rec(status=None, reason="client_disconnected", prompt_tokens=30))  # no prompt_n: all computed
    c = plugin.stats()["lifetime"]
    assert (c["requests"], c["successes"], c["errors"]) == (5, 2, 3)
    # the 404 and the client that left are the clients' doing: the rate counts the 502 only
    assert (c["served"], c["client_errors"], c["server_errors"]) == (2, 2, 1)
    assert c["success_rate"] == pytest.approx(2 / 3) and c["server_error_rate"] == pytest.approx(1 / 3)
    assert c["client_error_rate"] == pytest.approx(0.4)
    assert c["by_status"] == {"2xx": 2, "3xx": 0, "4xx": 1, "5xx": 1, "other": 1}
    assert (c["restored"], c["restore_failed"], c["cache_hits"], c["coalesced"]) == (1, 1, 1, 1)
    assert (c["saves_ok"], c["saves_failed"]) == (1, 1)
    assert (c["prompt_tokens"], c["cached_tokens"], c["computed_tokens"]) == (180, 90, 90)
    assert c["cached_share"] == pytest.approx(0.5)
    assert c["completion_tokens"] == 10
    assert (c["restore_ms_sum"], c["restore_ms_avg"], c["save_ms_sum"], c["save_ms_avg"]) == (80.0, 40.0, 10.0, 10.0)


def test_no_requests_no_rates() -> None:
    c = make().stats()["lifetime"]
    assert c["requests"] == 0 and c["success_rate"] is None and c["cached_share"] is None


# ---- buckets, series, pruning ----

def test_bucket_assignment() -> None:
    plugin = make(Clock(T0 + 10), bucket_secs=5)
    for started in (T0, T0 + 4.99, T0 + 5, T0 - 0.01):
        plugin.finished(rec(started=started, completion_tokens=10))
    assert {t: c.requests for t, c in plugin.buckets.items()} == {T0: 2, T0 + 5: 1, T0 - 5: 1}
    assert plugin.buckets[int(T0)].completion_tokens == 20


def test_window_series_is_zero_filled_and_ends_now() -> None:
    clock = Clock(T0 + 7)
    plugin = make(clock, window_secs=300, bucket_secs=5)
    plugin.finished(rec(started=T0 + 6, completion_tokens=10))
    plugin.finished(rec(started=T0 - 290, status=500))
    plugin.finished(rec(started=T0 - 400))   # before the window: only in the lifetime counters
    series = plugin.stats()["series"]
    assert len(series) == 60
    assert series[-1]["t"] == T0 + 5 and series[0]["t"] == T0 + 5 - 59 * 5
    assert all(b["t"] - a["t"] == 5 for a, b in zip(series, series[1:], strict=False))
    last = series[-1]
    assert (last["requests"], last["completion_tokens"], last["req_per_s"], last["tok_per_s"]) == (1, 10, 0.2, 2.0)
    assert sum(p["requests"] for p in series) == 2 and sum(p["errors"] for p in series) == 1
    assert plugin.stats()["lifetime"]["requests"] == 3


def test_window_not_a_multiple_of_the_bucket() -> None:
    plugin = make(window_secs=10, bucket_secs=3)
    assert len(plugin.stats()["series"]) == 4


def test_buckets_are_pruned_after_a_day() -> None:
    clock = Clock()
    plugin = make(clock, bucket_secs=1)
    plugin.finished(rec(started=T0))
    clock.now = T0 + 100
    plugin.finished(rec(started=T0 + 100))
    clock.now = T0 + KEEP_SECS + 1
    plugin.finished(rec(started=clock.now))
    assert sorted(plugin.buckets) == [T0 + 100, T0 + KEEP_SECS + 1]
    clock.now = T0 + KEEP_SECS + 101
    doc = plugin.stats(since=0)
    assert sorted(plugin.buckets) == [T0 + KEEP_SECS + 1]
    assert len(plugin.blocks) == 1
    assert doc["range"]["counters"]["requests"] == 1
    assert doc["lifetime"]["requests"] == 3        # lifetime counters are never pruned
    plugin.finished(rec(started=T0))               # too old for any bucket
    assert sorted(plugin.buckets) == [T0 + KEEP_SECS + 1]
    assert plugin.stats()["lifetime"]["requests"] == 4


def test_a_clock_that_went_back_puts_nothing_in_the_future() -> None:
    plugin = make(bucket_secs=5)
    plugin.finished(rec(started=T0 + 1000))
    assert list(plugin.buckets) == [T0]


# ---- recent ----

def test_recent_ring_keeps_the_newest_first() -> None:
    plugin = make(max_recent=3)
    for i in range(5):
        plugin.finished(rec(started=T0 - 10 + i, status=200 + i, model="m", stream=True, backend="http://b", slot=1,
                            prompt_tokens=10, cached_tokens=4, completion_tokens=2, elapsed_ms=12.34,
                            ttft_ms=5.56))
    recent = plugin.stats()["recent"]
    assert [r["status"] for r in recent] == [204, 203, 202]
    first = recent[0]
    assert first["time"] == T0 - 6 and first["method"] == "POST" and first["path"] == "/v1/chat/completions"
    assert (first["model"], first["stream"], first["backend"], first["slot"]) == ("m", True, "http://b", 1)
    assert (first["prompt_tokens"], first["cached_tokens"], first["completion_tokens"]) == (10, 4, 2)
    assert (first["ms"], first["ttft_ms"]) == (12.3, 5.6)
    for key in ("restored", "cache_hit", "reason"):
        assert key in first


def test_max_recent_zero_disables_the_ring() -> None:
    plugin = make(max_recent=0)
    plugin.finished(rec())
    doc = plugin.stats()
    assert doc["recent"] == [] and doc["max_recent"] == 0 and doc["lifetime"]["requests"] == 1


# ---- ?since ----

def test_since_scopes_counters_series_and_recent() -> None:
    clock = Clock(T0 + 60)
    plugin = make(clock, bucket_secs=5)
    for started, tokens in ((T0 - 600, 1), (T0, 10), (T0 + 7, 100), (T0 + 58, 1000)):
        plugin.finished(rec(started=started, completion_tokens=tokens, prompt_tokens=tokens, cached_tokens=tokens))
    doc = plugin.stats(since=T0)
    rng = doc["range"]
    assert rng["since"] == T0
    assert rng["counters"]["requests"] == 3 and rng["counters"]["completion_tokens"] == 1110
    assert rng["counters"]["cached_tokens"] == 1110
    assert sum(p["completion_tokens"] for p in rng["series"]) == 1110
    assert rng["series"][0]["t"] == T0 and rng["series"][-1]["t"] == T0 + 60
    assert [r["time"] for r in doc["recent"]] == [T0 + 58, T0 + 7, T0]
    assert doc["lifetime"]["requests"] == 4        # the lifetime counters stay whole
    # Only the buckets that start at or after since.
    later = plugin.stats(since=T0 + 3)["range"]["counters"]
    assert later["requests"] == 2 and later["completion_tokens"] == 1100
    assert plugin.stats(since=0)["range"]["counters"]["requests"] == 4
    assert plugin.stats(since=T0 + 3600)["range"] == {"since": T0 + 3600, "counters": make().stats(0)["range"][
        "counters"], "series": []}


def test_all_time_range_starts_at_the_oldest_bucket() -> None:
    clock = Clock(T0)
    plugin = make(clock, bucket_secs=5, window_secs=60)
    plugin.finished(rec(started=T0 - 1000))
    series = plugin.stats(since=0)["range"]["series"]
    assert series[0]["t"] == T0 - 1000 and series[-1]["t"] == T0 and len(series) == 201
    empty = make(Clock(T0), bucket_secs=5, window_secs=60).stats(since=0)["range"]["series"]
    assert len(empty) == 12 and empty[-1]["t"] == T0     # nothing kept: the trailing window


@pytest.mark.parametrize(("bucket_secs", "span", "since_offset"), [(1, KEEP_SECS, 0.0), (1, 5000, 1234.5),
                                                                    (5, 40000, 7.0), (3, 1085, 0.0), (7, 2600, 11.0)])
def test_long_ranges_are_coarsened_and_keep_totals(bucket_secs: int, span: int, since_offset: float) -> None:
    clock = Clock(T0)
    plugin = make(clock, bucket_secs=bucket_secs)
    for i in range(0, span, 3):
        plugin.finished(rec(started=T0 - i, status=500 if i % 7 == 0 else 200, completion_tokens=i % 11 + 1))
    since = T0 - span + since_offset
    rng = plugin.stats(since=since)["range"]
    series, counters = rng["series"], rng["counters"]
    assert 0 < len(series) <= MAX_POINTS
    expected = [i for i in range(0, span, 3)
                if plugin.bucket_of(T0 - i) >= since and plugin.bucket_of(T0 - i) + bucket_secs > T0 - KEEP_SECS]
    assert counters["requests"] == sum(p["requests"] for p in series) == len(expected)
    assert counters["errors"] == sum(p["errors"] for p in series) == sum(1 for i in expected if i % 7 == 0)
    assert counters["completion_tokens"] == sum(p["completion_tokens"] for p in series) == sum(
        i % 11 + 1 for i in expected)
    # Contiguous points from the first bucket at or after since to the current one.
    assert series[0]["t"] >= since and series[-1]["t"] + series[-1]["secs"] == plugin.bucket_of(T0) + bucket_secs
    assert all(a["t"] + a["secs"] == b["t"] for a, b in zip(series, series[1:], strict=False))
    for p in series:
        assert p["req_per_s"] == pytest.approx(p["requests"] / p["secs"], abs=1e-4)


# ---- excluded paths ----

@pytest.mark.parametrize("path", ["/dashboard", "/a/b/dash"])
def test_the_dashboards_own_requests_are_ignored(path: str) -> None:
    plugin = make(path=path)
    plugin.finished(rec(path=path, method="GET"))
    plugin.finished(rec(path=path + "/api/stats", method="GET"))
    plugin.finished(rec(path=path + "/api/stats?since=12.5", method="GET"))
    assert plugin.stats()["lifetime"]["requests"] == 0 and plugin.buckets == {} and plugin.stats()["recent"] == []
    plugin.finished(rec(path=path + "/other", method="GET"))
    plugin.finished(rec(path="/health", method="GET"))
    assert plugin.stats()["lifetime"]["requests"] == 2


# ---- the page ----

IDS = ["kpi-requests", "kpi-success-rate", "kpi-cached-tokens", "kpi-computed-tokens", "kpi-cached-share",
       "kpi-restores", "kpi-saves", "kpi-completion-tokens", "kpi-disk", "chart-requests", "chart-tokens",
       "backends", "recent", "range", "range-custom", "status"]


def test_the_page_is_self_contained() -> None:
    html = Dashboard({"refresh_ms": 1500}).page().decode()
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert not re.search(r"""(src|href|action|srcset)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(https?:)?//", html, re.I)
    assert not re.search(r"@import", html, re.I)
    assert "<link" not in html.lower() and not re.search(r"<script[^>]*\bsrc\s*=", html, re.I)
    assert not re.search(r"<(img|iframe|object|embed)\b", html, re.I)
    for element_id in IDS:
        assert f'id="{element_id}"' in html, element_id
    assert '<optgroup label="presets">' in html and '<optgroup label="other">' in html
    for label in ("30 seconds", "1 minute", "5 minutes", "15 minutes", "custom time", "all time"):
        assert f">{label}</option>" in html
    assert 'type="datetime-local"' in html
    assert '"refresh_ms":1500' in html


@pytest.mark.parametrize(("path", "relative"), [("/dashboard", "dashboard/api/stats"), ("/a/b/dash", "dash/api/stats")])
def test_the_page_polls_a_relative_stats_url(path: str, relative: str) -> None:
    html = Dashboard({"path": path}).page().decode()
    assert f'"stats":"{relative}"' in html
    assert str(httpx.URL("http://h:1" + path).join(relative)) == f"http://h:1{path}/api/stats"


# ---- routes ----

def client(plugin: Dashboard) -> httpx.AsyncClient:
    app = Starlette(routes=list(plugin.routes()))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_page_route() -> None:
    plugin = make(path="/stats-page")
    async with client(plugin) as http:
        resp = await http.get("/stats-page")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in resp.headers["content-security-policy"]
        assert 'id="kpi-requests"' in resp.text
        assert (await http.get("/dashboard")).status_code == 404


async def test_stats_route() -> None:
    clock = Clock(T0 + 10)
    plugin = make(clock, refresh_ms=1000, window_secs=60, bucket_secs=5)
    plugin.finished(rec(started=T0 - 100, completion_tokens=5))
    plugin.finished(rec(started=T0 + 2, status=500))
    async with client(plugin) as http:
        resp = await http.get("/dashboard/api/stats")
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        assert resp.headers["cache-control"] == "no-store"
        doc = resp.json()
        assert set(doc) >= {"now", "uptime_secs", "proxy", "lifetime", "series", "recent", "refresh_ms",
                            "window_secs", "bucket_secs"}
        assert "range" not in doc and doc["proxy"] == {}
        assert (doc["now"], doc["uptime_secs"], doc["refresh_ms"], doc["window_secs"], doc["bucket_secs"]) == (
            T0 + 10, 0, 1000, 60, 5)
        assert doc["lifetime"]["requests"] == 2 and doc["lifetime"]["errors"] == 1
        assert len(doc["series"]) == 12 and sum(p["requests"] for p in doc["series"]) == 1
        assert [r["status"] for r in doc["recent"]] == [500, 200]

        doc = (await http.get("/dashboard/api/stats", params={"since": str(T0)})).json()
        assert doc["range"]["since"] == T0 and doc["range"]["counters"]["requests"] == 1
        assert [r["status"] for r in doc["recent"]] == [500]
        assert (await http.get("/dashboard/api/stats?since=-5")).json()["range"]["counters"]["requests"] == 2


@pytest.mark.parametrize("since", ["abc", "", "nan", "inf", "1e999", "12,5"])
async def test_bad_since_is_a_400(since: str) -> None:
    async with client(make()) as http:
        resp = await http.get("/dashboard/api/stats", params={"since": since})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and "since" in error["message"]


async def test_proxy_state_is_served() -> None:
    plugin = make()
    state = {"backends": [{"url": "http://b:1", "state": "closed", "failures": 0, "kv_cache": True, "n_slots": 2,
                           "slots": [{"id": 0, "busy": True}, {"id": 1, "busy": False}]}],
             "in_flight": 1, "coalesced_groups": 0, "meta_entries": 3, "cache_disk_bytes": 12345}
    plugin.state = lambda: state
    async with client(plugin) as http:
        assert (await http.get("/dashboard/api/stats")).json()["proxy"] == state

        async def later() -> dict[str, Any]:
            return {"in_flight": 2}

        plugin.state = later  # type: ignore[assignment]
        assert (await http.get("/dashboard/api/stats")).json()["proxy"] == {"in_flight": 2}

        def broken() -> dict[str, Any]:
            raise RuntimeError("boom")

        plugin.state = broken
        resp = await http.get("/dashboard/api/stats")
        assert resp.status_code == 200 and "error" in resp.json()["proxy"]


async def test_the_disk_figure_is_read_off_the_loop_once_per_period() -> None:
    import asyncio
    import threading

    from lpcache.edge.app import DiskFigure

    class Index:
        reads: list[int] = []

        def kv_files(self) -> list[tuple[str, ...]]:
            return [("/nonexistent",)]

        def disk_bytes_of(self, files: list[tuple[str, ...]]) -> int:
            self.reads.append(threading.get_ident())
            return 1234

    index = Index()
    disk = DiskFigure(index)  # type: ignore[arg-type]
    figures = await asyncio.gather(*(disk.get() for _ in range(5)))
    assert figures == [1234] * 5 and await disk.get() == 1234
    assert len(index.reads) == 1 and index.reads[0] != threading.get_ident()   # one read, in a worker thread
    disk.at -= 60   # the period is over
    await disk.get()
    assert len(index.reads) == 2


# ---- percentiles, outcomes and load per bucket ----

def test_percentiles_are_computed_per_bucket_from_its_own_requests() -> None:
    clock = Clock(T0 + 12)
    plugin = make(clock, bucket_secs=5, window_secs=15)
    for i in range(1, 101):      # the first bucket: 1..100 ms, streams
        plugin.finished(rec(started=T0 + i / 100, api="chat", elapsed_ms=float(i) * 10, ttft_ms=float(i)))
    for _ in range(9):           # the second: nine fast JSON answers and one slow one
        plugin.finished(rec(started=T0 + 6, api="chat", elapsed_ms=20.0))
    plugin.finished(rec(started=T0 + 7, api="chat", elapsed_ms=5000.0))
    plugin.finished(rec(started=T0 + 7, api="chat", status=400, elapsed_ms=1.0))   # a client's: not latency
    plugin.finished(rec(started=T0 + 7, api=None, elapsed_ms=9999.0))              # not generation
    series = plugin.stats()["series"]
    assert [p["t"] for p in series] == [T0, T0 + 5, T0 + 10]
    first, second, third = series
    assert first["ttft_n"] == 100 and first["latency_n"] == 100
    assert first["ttft_p50"] == pytest.approx(50, rel=0.1) and first["ttft_p90"] == pytest.approx(90, rel=0.1)
    assert first["ttft_p99"] == pytest.approx(99, rel=0.1) and first["latency_p50"] == pytest.approx(500, rel=0.1)
    assert second["ttft_n"] == 0 and second["ttft_p50"] is None          # no stream there
    assert second["latency_n"] == 10 and second["latency_p50"] == pytest.approx(20, rel=0.1)
    assert second["latency_p90"] == pytest.approx(20, rel=0.19)   # within its bin
    assert second["latency_p99"] == 5000.0                               # the slow one, its bucket's own
    assert third["latency_n"] == 0 and third["latency_p99"] is None
    whole = plugin.stats()["lifetime"]["latency_ms"]
    assert whole["n"] == 110 and whole["max"] == 5000.0 and whole["p50"] == pytest.approx(450, rel=0.15)


def test_series_points_count_client_and_server_errors_apart() -> None:
    clock = Clock(T0 + 4)
    plugin = make(clock, bucket_secs=5, window_secs=10)
    for status in (200, 200, 200, 404, 429, 503):
        plugin.finished(rec(started=T0 + 1, status=status))
    plugin.finished(rec(started=T0 + 1, status=200, reason="backend_unreachable"))   # broken after the 200
    point = plugin.stats()["series"][-1]
    assert (point["requests"], point["served"], point["client_errors"], point["server_errors"]) == (7, 3, 2, 2)
    assert point["errors"] == 3 and point["success_rate"] == pytest.approx(3 / 5)
    recent = plugin.stats()["recent"]
    assert [r["outcome"] for r in recent][:3] == ["server_errors", "server_errors", "client_errors"]


def test_prompt_tokens_from_cache_and_computed_per_point() -> None:
    clock = Clock(T0 + 9)
    plugin = make(clock, bucket_secs=5, window_secs=10)
    plugin.finished(rec(started=T0, prompt_tokens=1000, cached_tokens=900, prompt_n=100))
    plugin.finished(rec(started=T0 + 6, prompt_tokens=400, cached_tokens=0, prompt_n=400))
    first, second = plugin.stats()["series"]
    assert (first["cached_tokens"], first["computed_tokens"], first["cached_per_s"], first["computed_per_s"]) == (
        900, 100, 180.0, 20.0)
    assert (second["cached_tokens"], second["computed_tokens"]) == (0, 400)


def test_backend_load_counts_requests_where_they_start_and_compute_where_it_was_spent() -> None:
    clock = Clock(T0 + 30)
    plugin = make(clock, bucket_secs=5, window_secs=35)
    # started at T0, waited 3 s, computed 12 s (prefill 2 + generation 10): busy from T0 + 3 to T0 + 15
    plugin.finished(rec(started=T0, backend="http://a:1", elapsed_ms=15000.0, prefill_ms=2000.0, gen_ms=10000.0))
    plugin.finished(rec(started=T0 + 20, backend="http://b:2", elapsed_ms=500.0))   # no timings: no compute
    series = {p["t"]: p for p in plugin.stats()["series"]}
    assert series[T0]["backends"] == {"http://a:1": {"requests": 1, "req_per_s": 0.2, "busy": 0.4}}
    assert series[T0 + 5]["backends"]["http://a:1"] == {"requests": 0, "req_per_s": 0.0, "busy": 1.0}
    assert series[T0 + 10]["backends"]["http://a:1"]["busy"] == 1.0
    assert series[T0 + 15]["backends"] == {}
    assert series[T0 + 20]["backends"] == {"http://b:2": {"requests": 1, "req_per_s": 0.2, "busy": 0.0}}
    assert plugin.stats()["lifetime"]["backends"] == {"http://a:1": {"requests": 1, "busy_secs": 12.0},
                                                      "http://b:2": {"requests": 1, "busy_secs": 0.0}}


def test_at_most_max_backends_are_told_apart() -> None:
    from lpcache.plugins.dashboard_stats import MAX_BACKENDS, OTHER

    plugin = make()
    for i in range(MAX_BACKENDS + 8):
        plugin.finished(rec(backend=f"http://10.0.0.{i}:8080"))
    plugin.finished(rec(backend="http://10.0.0.0:8080"))        # a known one stays itself
    backends = plugin.stats()["lifetime"]["backends"]
    assert len(backends) == MAX_BACKENDS + 1 and backends[OTHER]["requests"] == 8
    assert backends["http://10.0.0.0:8080"]["requests"] == 2


def test_a_bucket_stays_small_under_any_traffic() -> None:
    import random

    from lpcache.plugins.dashboard_stats import BINS

    plugin = make(bucket_secs=50)
    rng = random.Random(4)
    for _ in range(20_000):
        plugin.finished(rec(started=T0, api="chat", elapsed_ms=rng.uniform(1, 600_000), ttft_ms=rng.uniform(1, 6e4)))
    bucket = plugin.buckets[int(T0)]
    assert bucket.latency is not None and bucket.ttft is not None
    assert len(bucket.latency.bins) <= BINS and len(bucket.ttft.bins) <= BINS and bucket.latency.n == 20_000


def test_the_dashboard_names_its_browser_paths() -> None:
    assert make(path="/ops/dash").browser_paths() == ["/ops/dash", "/ops/dash/api/stats"]
