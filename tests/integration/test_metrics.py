"""GET /metrics of a running lpcache: every documented route label, the families served, the disk gauge."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lpcache import __version__
from lpcache.edge import app
from lpcache.workloads.harness import RedisServer

from ..conftest import Proxy, user, words
from ..metric_names import families, served

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
REDIS_ONLY = {"lpcache_redis_up", "lpcache_redis_calls_total", "lpcache_redis_errors_total",
              "lpcache_redis_claim_seconds_total", "lpcache_slot_claims_total", "lpcache_shared_entries"}


def documented_routes() -> set[str]:
    """The `route` label values operations.md's metrics table gives for lpcache_requests_total."""
    row = next(line for line in OPERATIONS.read_text().splitlines() if line.startswith("| `lpcache_requests_total` |"))
    labels = row.split(" | ")[1]
    return {v for v in re.findall(r"`([^`]+)`", labels) if v.startswith("/") or v == "other"}


def route_labels(text: str, name: str) -> set[str]:
    return {s.labels["route"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and "route" in s.labels}


def test_every_documented_route_label_appears_when_its_route_is_asked(start_backend: Any, start_proxy: Any) -> None:
    proxy: Proxy = start_proxy(start_backend())
    routes = documented_routes()
    assert {"/v1/chat/completions", "/infill", "/v1/models", "/health", "other"} <= routes
    recorded = 0
    for route in sorted(routes):
        if route == "other":
            assert proxy.client.get("/props").status_code == 200   # passed on to the backend
            recorded += 1
        elif route in ("/v1/models", "/health"):
            assert proxy.client.get(route).status_code == 200
        else:
            assert proxy.client.post(route, json={}).status_code in (200, 400)   # a body its API refuses, or not
            recorded += 1
    proxy.wait_finished(recorded)
    text = proxy.client.get("/metrics").text
    assert route_labels(text, "lpcache_requests_total") == routes
    assert route_labels(text, "lpcache_request_duration_seconds_count") == routes


def test_a_scrape_serves_the_families_the_docs_and_the_dashboard_name(start_backend: Any, start_proxy: Any) -> None:
    proxy: Proxy = start_proxy(start_backend())
    proxy.chat(user(words(1, 60)))
    proxy.wait_finished(1)
    text = proxy.client.get("/metrics").text
    assert "_created" not in text
    found = families(text)
    assert set(found) <= set(served())
    assert set(served()) - set(found) == REDIS_ONLY   # the rest is shown with REDIS_URL only
    build = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "lpcache_build_info"]
    assert [(s.labels["version"], s.value) for s in build] == [(__version__, 1.0)]


def test_with_redis_a_scrape_serves_every_family(start_backend: Any, start_proxy: Any,
                                                 redis_server: RedisServer) -> None:
    proxy: Proxy = start_proxy(start_backend(), redis_url=redis_server.url, replica_id="r0")
    proxy.chat(user(words(1, 60)))
    proxy.wait_finished(1)
    assert set(families(proxy.client.get("/metrics").text)) == set(served())


def disk_gauge(proxy: Proxy) -> float | None:
    found = re.search(r"^lpcache_cache_disk_bytes (\S+)$", proxy.client.get("/metrics").text, re.MULTILINE)
    return None if found is None else float(found.group(1))


def test_the_disk_gauge_is_the_saved_files_read_off_the_loop_at_most_every_few_seconds(
        start_backend: Any, start_proxy: Any, slot_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy: Proxy = start_proxy(start_backend())
    proxy.chat(user(words(1, 60)))
    proxy.chat(user(words(2, 60)))
    proxy.wait_finished(2)
    files = [e for e in os.scandir(slot_dir) if e.is_file() and len(e.name) == 64]
    assert len(files) == 2 and len(proxy.pipeline.index) == 2
    index = proxy.pipeline.index
    reads: list[str] = []
    read = index.disk_bytes_of

    def counted(files: list[tuple[str, ...]]) -> int | None:
        reads.append(threading.current_thread().name)
        return read(files)

    monkeypatch.setattr(index, "disk_bytes_of", counted)
    assert disk_gauge(proxy) == sum(e.stat().st_size for e in files)
    loop_thread = proxy.run(_thread_name())
    assert len(reads) == 1 and reads[0] != loop_thread   # stat-ed in a worker thread
    monkeypatch.setattr(app, "DISK_FIGURE_SECONDS", 3600.0)
    for _ in range(3):
        assert disk_gauge(proxy) is not None
    assert len(reads) == 1   # the figure read once is served until it is DISK_FIGURE_SECONDS old


async def _thread_name() -> str:
    return threading.current_thread().name


def test_no_disk_gauge_when_lpcache_sees_none_of_the_files(start_backend: Any, start_proxy: Any,
                                                           slot_dir: str) -> None:
    proxy: Proxy = start_proxy(start_backend())
    proxy.chat(user(words(1, 60)))
    proxy.wait_finished(1)
    for e in os.scandir(slot_dir):
        os.remove(e.path)   # deleted behind lpcache's back: entries, and no file to stat
    assert len(proxy.pipeline.index) == 1
    assert disk_gauge(proxy) is None

