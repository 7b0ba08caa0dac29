"""Tracing on the real llama-server (b11434, SmolLM2-135M, -np 1 --cache-ram 0), lpcache exporting OTLP/HTTP to a
receiver that decodes what it gets with opentelemetry-proto: a request whose prompt's cache was saved, pushed out
of the only slot and restored has a trace with the wait, restore, prefill, generation and save spans, and their
durations add up to the request's latency (its span: from its arrival until lpcache was done with it, save
included) within 5 %."""

from __future__ import annotations

from pathlib import Path

import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.workloads.harness import LlamaServer, story
from lpcache.workloads.otlp_receiver import OtlpReceiver

from ..conftest import Proxy, figures

pytestmark = pytest.mark.e2e

STEPS = ("slot_wait", "restore", "prefill", "generation", "save")


def test_a_restored_requests_spans_add_up_to_its_latency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver, LlamaServer(str(tmp_path / "slots"), n_slots=1, cache_ram=0,
                                                 ctx=8192) as server:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        proxy = Proxy(Settings(backends=(BackendConfig(server.url, None, server.slot_save_path),),
                               meta_dir=str(tmp_path / "meta"), host="127.0.0.1", big_threshold_words=100))
        try:
            def ask(text: str) -> None:
                r = proxy.client.post("/v1/chat/completions", timeout=600, json={
                    "messages": [{"role": "user", "content": text}], "max_tokens": 48, "min_tokens": 48,
                    "temperature": 0})
                assert r.status_code == 200, r.text
                proxy.settle()

            first = story(11, 700)
            ask(first)
            ask(story(12, 700))                      # the only slot now holds another prompt
            ask(first + "\nWho is in this story?")   # the first prompt's cache comes back from disk
            record = proxy.records[-1]
            assert record.restored and record.cache_n is not None and record.cache_n > 500, record
            [root] = [s for s in receiver.wait_for(3, "POST /v1/chat/completions") if s.trace_id == record.trace_id]
            spans = {s.name: s for s in receiver.wait_for(3 * 6) if s.trace_id == record.trace_id}
            assert set(STEPS) <= set(spans), sorted(spans)
            added = sum(spans[name].ms for name in STEPS)
            figures(f"\ntracing, a restored request on the real server: latency {root.ms:.1f} ms, "
                    + ", ".join(f"{name} {spans[name].ms:.1f}" for name in STEPS)
                    + f" ms: {added:.1f} ms in all ({added / root.ms:.1%})")
            assert abs(added - root.ms) <= 0.05 * root.ms
            assert root.attributes["llama_cpp.cache_n"] == record.cache_n
            assert spans["prefill"].attributes["lpcache.prompt_n"] == record.prompt_n
            assert spans["restore"].attributes["lpcache.ok"] is True
        finally:
            proxy.stop()
