"""lpcache.metrics: the exposition (no `_created` series, build info, buckets up to minutes, the disk gauge), the
endpoints counted without a record, and the Grafana dashboard in docs/, whose queries name only served metrics."""

from __future__ import annotations

import asyncio
import json
import platform
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import prometheus_client.metrics
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import Response

from lpcache import __version__
from lpcache.edge.metrics import Metrics
from lpcache.flow.record import RequestRecord

from ..metric_names import served, served_samples

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"\blpcache_[a-z_]+\b")
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by name and labels, read back with prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}


def record(**fields: Any) -> RequestRecord:
    return RequestRecord(path="/v1/chat/completions", status=200, elapsed_ms=12.0, **fields)


# ---- the exposition ----

def test_no_created_series_and_the_process_wide_switch_left_as_it_was() -> None:
    before = prometheus_client.metrics._use_created
    metrics = Metrics(lambda: MagicMock())
    metrics.observe(record(restored=True, restore_ms=20.0, saved=True, save_ms=30.0, cache_n=5, prompt_n=7))
    text = metrics.exposition().decode()
    assert "lpcache_requests_total" in text and "lpcache_save_seconds_bucket" in text
    assert "_created" not in text
    # a host application's own registry keeps prometheus_client's default
    assert prometheus_client.metrics._use_created == before
    host = CollectorRegistry()
    Counter("host_things", "Things", registry=host).inc()
    assert ("host_things_created" in generate_latest(host).decode()) == before


def test_build_info_names_the_version_and_the_python() -> None:
    found = samples(Metrics(lambda: None))
    key = ("lpcache_build_info", (("python", platform.python_version()), ("version", __version__)))
    assert found[key] == 1.0
    assert [k for k in found if k[0] == "lpcache_build_info"] == [key]


def test_save_and_restore_buckets_reach_minutes() -> None:
    metrics = Metrics(lambda: None)
    metrics.observe(record(saved=True, save_ms=200_000.0, restored=True, restore_ms=90_000.0))
    value = metrics.registry.get_sample_value
    assert value("lpcache_save_seconds_bucket", {"le": "120.0"}) == 0
    assert value("lpcache_save_seconds_bucket", {"le": "300.0"}) == 1
    assert value("lpcache_restore_seconds_bucket", {"le": "60.0"}) == 0
    assert value("lpcache_restore_seconds_bucket", {"le": "120.0"}) == 1
    assert value("lpcache_restore_seconds_bucket", {"le": "0.005"}) == 0   # and a small file's few ms


def test_results_are_at_zero_before_the_first_request() -> None:
    found = samples(Metrics(lambda: None))
    for name, label, values in (("lpcache_restores_total", "result", ("ok", "failed")),
                                ("lpcache_saves_total", "result", ("ok", "failed")),
                                ("lpcache_slot_file_bytes_total", "action", ("save", "restore")),
                                ("lpcache_prompt_tokens_total", "source", ("cached", "computed"))):
        for v in values:
            assert found[(name, ((label, v),))] == 0.0


def test_sessions_is_a_gauge_of_the_sessions_kept_now() -> None:
    pipeline = MagicMock()
    pipeline.sessions = [object()] * 3   # SessionBook: its len is the sessions it keeps (bounded)
    [family] = [f for f in text_string_to_metric_families(Metrics(lambda: pipeline).exposition().decode())
                if f.name == "lpcache_sessions"]
    assert family.type == "gauge" and family.samples[0].value == 3


@pytest.mark.parametrize("value, shown", [(None, None), (0, 0.0), (123_456, 123456.0)])
def test_the_disk_gauge_is_the_figure_last_read(value: int | None, shown: float | None) -> None:
    found = samples(Metrics(lambda: MagicMock(), lambda: SimpleNamespace(value=value)))
    assert found.get(("lpcache_cache_disk_bytes", ())) == shown


def test_a_scrape_asks_the_disk_figure_first() -> None:
    class Figure:
        value: int | None = None
        asked = 0

        async def get(self) -> int | None:
            self.asked += 1
            self.value = 4096
            return self.value

    figure = Figure()
    metrics = Metrics(lambda: MagicMock(), lambda: figure)
    response = asyncio.run(metrics.endpoint(MagicMock()))
    assert figure.asked == 1
    assert b"lpcache_cache_disk_bytes 4096.0" in response.body


# ---- endpoints without a record ----

def test_counted_endpoints_are_counted_by_route_and_status() -> None:
    metrics = Metrics(lambda: None)

    async def health(request: Any) -> Response:
        return Response(status_code=503)

    async def broken(request: Any) -> Response:
        raise RuntimeError("bug")

    asyncio.run(metrics.counted("/health", health)(MagicMock()))
    with pytest.raises(RuntimeError):
        asyncio.run(metrics.counted("/v1/models", broken)(MagicMock()))
    value = metrics.registry.get_sample_value
    assert value("lpcache_requests_total", {"route": "/health", "status": "503"}) == 1
    assert value("lpcache_requests_total", {"route": "/v1/models", "status": "500"}) == 1
    assert value("lpcache_request_duration_seconds_count", {"route": "/health"}) == 1
    assert value("lpcache_request_outcomes_total", {"reason": "ok"}) is None   # no record: not an outcome


# ---- the Grafana dashboard ----

def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())   # type: ignore[no-any-return]


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def exprs(doc: dict[str, Any]) -> list[str]:
    """The panels' PromQL expressions."""
    return [t["expr"] for p in panels(doc) for t in p["targets"]]


def queries(doc: dict[str, Any]) -> list[str]:
    """The panels' expressions and the variables' queries."""
    return exprs(doc) + [v["query"]["query"] for v in doc["templating"]["list"] if v["type"] == "query"]


def test_the_dashboard_is_importable() -> None:
    doc = dashboard()
    assert isinstance(doc["schemaVersion"], int) and doc["schemaVersion"] >= 36
    assert doc["title"] and doc["uid"] and doc["id"] is None
    [ds] = doc["__inputs"]
    assert (ds["name"], ds["type"], ds["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels(doc):
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"] and all(t["datasource"] == DATASOURCE and t["expr"] for t in p["targets"]), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        grid = p["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, p["title"]
    for variable in doc["templating"]["list"]:
        assert variable["datasource"] == DATASOURCE


def test_the_dashboard_queries_only_metrics_lpcache_serves() -> None:
    known = served_samples()
    used = set()
    for query in queries(dashboard()):
        names = set(METRIC.findall(query))
        assert names, query
        assert names <= known, (query, names - known)
        used |= names
    # what the dashboard is for: requests, prompt tokens, restores and saves with their durations, slots, the
    # cache's entries, bytes and disk, Redis
    assert {"lpcache_requests_total", "lpcache_prompt_tokens_total", "lpcache_restores_total", "lpcache_saves_total",
            "lpcache_restore_seconds_bucket", "lpcache_save_seconds_bucket", "lpcache_slots_busy",
            "lpcache_cache_entries", "lpcache_cache_bytes", "lpcache_cache_disk_bytes", "lpcache_redis_up"} <= used
    # every family lpcache serves is on it
    assert {name for name in served() if not set(served()[name]).isdisjoint(used)} == set(served())


def test_the_dashboard_queries_are_balanced_and_use_the_instance_variable() -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    for query in exprs(dashboard()):
        stack: list[str] = []
        for ch in re.sub(r'"[^"]*"', '""', query):
            if ch in "([{":
                stack.append(ch)
            elif ch in pairs:
                assert stack and stack.pop() == pairs[ch], query
        assert not stack, query
        for selector in re.findall(r"\blpcache_[a-z_]+(\{[^}]*\})?", query):
            assert 'instance=~"$instance"' in selector, query
