"""Tracing through the whole proxy, against the stand-in: the standard OTEL_* variables turn it on, the spans reach
an OTLP/HTTP receiver (decoded as a collector decodes them), a client's traceparent is joined, and the request log
and the dashboard show the trace and the steps. The real server's test is tests/e2e/test_tracing_real.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lpcache.workloads.otlp_receiver import OtlpReceiver

from ..conftest import user, words

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Any:
    with OtlpReceiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", r.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")   # ms: batches sent at once, for the test
        yield r


def test_spans_of_a_restored_request_reach_the_collector_in_the_clients_trace(
        start_backend: Any, start_proxy: Any, receiver: OtlpReceiver, tmp_path: Path) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=0.5, gen_ms_per_token=2.0)
    log_path = tmp_path / "requests.log"
    proxy = start_proxy(backend, plugins=({"name": "dashboard", "params": {"path": "/dash"}},
                                          {"name": "request_log", "params": {
                                              "path": str(log_path), "fields": ["sc-status", "lpcache-trace-id"]}}))
    first, other = words(1, 300), words(2, 300)
    assert proxy.push(user(first)).status_code == 200
    assert proxy.push(user(other)).status_code == 200   # takes the only slot: the first prompt's cache is on disk
    r = proxy.push(user(first + " and more"), {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200 and r.headers["x-lpcache-restored"] == "true"
    proxy.wait_finished(3)

    roots = receiver.wait_for(3, "POST /v1/chat/completions")
    [root] = [s for s in roots if s.trace_id == TRACE_ID]
    assert root.parent_id == PARENT_ID and root.service == "lpcache"
    assert root.attributes["lpcache.restored"] is True and root.attributes["http.response.status_code"] == 200
    spans = [s for s in receiver.wait_for(3 + 8) if s.trace_id == TRACE_ID]
    by_name = {s.name: s for s in spans}
    assert {"slot_wait", "slot_fill", "restore", "llama_server", "prefill", "generation", "save"} <= set(by_name)
    assert by_name["restore"].parent_id == by_name["slot_fill"].span_id
    assert by_name["prefill"].parent_id == by_name["llama_server"].span_id
    assert by_name["restore"].attributes["lpcache.ok"] is True
    for span in spans:
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns, span
    # the other two requests started traces of their own
    assert len({s.trace_id for s in roots}) == 3

    lines = [line for line in log_path.read_text().splitlines() if not line.startswith("#")]
    assert [line.split() for line in lines][-1] == ["200", TRACE_ID]
    stats = proxy.client.get("/dash/api/stats", params={"since": 0}).json()
    newest = stats["recent"][0]
    assert newest["trace_id"] == TRACE_ID
    assert [s["name"] for s in newest["steps"]][:2] == ["slot_wait", "slot_fill"]
    assert {s["name"] for s in newest["steps"]} == set(by_name) - {root.name}


def test_without_the_variables_nothing_is_traced_but_the_steps_are_shown(
        start_backend: Any, start_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    proxy = start_proxy(start_backend(), plugins=({"name": "dashboard", "params": {"path": "/dash"}},))
    assert proxy.push(user(words(3, 300))).status_code == 200
    proxy.wait_finished(1)
    assert proxy.records[0].trace_id is None
    newest = proxy.client.get("/dash/api/stats", params={"since": 0}).json()["recent"][0]
    assert newest["trace_id"] is None and "llama_server" in {s["name"] for s in newest["steps"]}


def test_a_coalesced_request_shows_its_wait_for_the_first_ones_answer(
        start_backend: Any, start_proxy: Any, receiver: OtlpReceiver) -> None:
    from concurrent.futures import ThreadPoolExecutor

    proxy = start_proxy(start_backend(gen_ms_per_token=20.0), coalesce_requests=True)
    body = {"messages": user(words(4, 100)), "max_tokens": 20, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: proxy.client.post("/v1/chat/completions", json=body), range(2)))
    assert [a.status_code for a in answers] == [200, 200]
    proxy.wait_finished(2)
    [follower] = [r for r in proxy.records if r.coalesced]
    [step] = [s for s in follower.steps if s.name == "coalesced"]
    assert step.attributes == {"leader_failed": False}
    [span] = [s for s in receiver.wait_for(1, "coalesced") if s.trace_id == follower.trace_id]
    assert follower.elapsed_ms is not None and 0.5 * follower.elapsed_ms <= span.ms <= follower.elapsed_ms


def test_a_failed_call_and_a_failed_save_have_spans_of_their_own_marked_failed(
        start_backend: Any, start_proxy: Any, receiver: OtlpReceiver) -> None:
    """Backend 0 drops every connection: the try on it is a failed `llama_server` span, the try on backend 1 an
    ordinary one; backend 1 refuses the save (500, no retry left): a failed `save` span."""
    import httpx

    a, b = start_backend(slots=1), start_backend(slots=1)
    proxy = start_proxy(a, b, save_retries=0)
    httpx.post(f"{a.url}/mock/faults", json={"drop": 100}).raise_for_status()
    httpx.post(f"{b.url}/mock/faults", json={"save_status": 500, "save_fail_count": 1}).raise_for_status()
    r = proxy.push(user(words(1, 300)), {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200 and r.headers["x-lpcache-slot"].startswith("1:")
    proxy.wait_finished(1)
    receiver.wait_for(1, "POST /v1/chat/completions")
    spans = [s for s in receiver.wait_for(1 + 8) if s.trace_id == TRACE_ID]
    calls = sorted((s for s in spans if s.name == "llama_server"), key=lambda s: s.start_ns)
    assert [c.status for c in calls] == [2, 0], calls
    assert calls[0].attributes["lpcache.ok"] is False and calls[0].attributes["lpcache.backend"].endswith(a.url[-5:])
    [save] = [s for s in spans if s.name == "save"]
    assert save.status == 2 and save.attributes["lpcache.status"] == 500, save
