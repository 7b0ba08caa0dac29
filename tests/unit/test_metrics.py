"""lpcache.metrics: the exposition (no `_created` series, build info, buckets up to minutes, the disk gauge), and
the endpoints counted without a record."""

from __future__ import annotations

import asyncio
import platform
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import prometheus_client.metrics
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import Response

from lpcache import __version__
from lpcache.metrics import Metrics
from lpcache.record import RequestRecord


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

