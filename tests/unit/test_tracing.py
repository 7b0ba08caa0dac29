"""OpenTelemetry tracing (`edge.tracing`): when it is on, and the spans a finished request's record becomes."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from lpcache.edge.tracing import Tracing, wanted
from lpcache.flow.record import RequestRecord

MS = 1_000_000


@pytest.mark.parametrize(("setting", "env", "on"), [
    ("auto", {}, False),
    ("auto", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ("auto", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ("auto", {"OTEL_TRACES_EXPORTER": "console"}, True),
    ("auto", {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ("auto", {"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ("auto", {"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ("on", {}, True),
    ("on", {"OTEL_SDK_DISABLED": "true"}, False),
    ("off", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    # an exporter lpcache has not (zipkin) alone: spans for nowhere, so off; with one it has: on
    ("auto", {"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ("on", {"OTEL_TRACES_EXPORTER": "zipkin"}, False),
    ("auto", {"OTEL_TRACES_EXPORTER": "zipkin,console"}, True),
    # the SDK's name of otlp over HTTP is otlp; over gRPC, a transport lpcache has not
    ("on", {"OTEL_TRACES_EXPORTER": "otlp_proto_http"}, True),
    ("on", {"OTEL_TRACES_EXPORTER": "otlp_proto_grpc"}, False),
])
def test_tracing_is_on_only_when_asked(setting: str, env: dict[str, str], on: bool) -> None:
    assert wanted(setting, env) is on


def traced() -> tuple[Tracing, InMemorySpanExporter]:
    tracing = Tracing({"OTEL_TRACES_EXPORTER": "none"})
    exporter = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracing, exporter


def restored_record(traceparent: str | None = None) -> RequestRecord:
    """A chat request that waited 5 ms, had its slot's cache saved and a file restored, was answered and saved."""
    record = RequestRecord(path="/v1/chat/completions?x=1", api="chat", model="smollm2", status=200, started=1000.0,
                           elapsed_ms=1000.0, prompt_tokens=900, completion_tokens=16, cache_n=880, prompt_n=20,
                           route="restore", restored=True, restore_file="ab" * 32, traceparent=traceparent)
    t0 = 1000 * 1000 * MS
    record.step("slot_wait", t0 + 1 * MS, t0 + 6 * MS, route="restore", slot=0, restore_file=None)
    record.step("save_previous", t0 + 7 * MS, t0 + 57 * MS, ok=True, tokens=700)
    record.step("restore", t0 + 57 * MS, t0 + 97 * MS, ok=False, tokens=None)
    record.step("slot_fill", t0 + 6 * MS, t0 + 98 * MS, restored=True)
    record.step("llama_server", t0 + 100 * MS, t0 + 900 * MS, cache_n=880)
    record.step("prefill", t0 + 150 * MS, t0 + 400 * MS)
    record.step("generation", t0 + 400 * MS, t0 + 900 * MS)
    record.step("save", t0 + 905 * MS, t0 + 990 * MS, ok=True)
    return record


def test_a_record_becomes_a_request_span_with_a_span_per_step_nested_as_the_steps_are() -> None:
    tracing, exporter = traced()
    record = restored_record()
    tracing.observe(record)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans.pop("POST /v1/chat/completions")
    assert root.kind is SpanKind.SERVER and root.parent is None
    assert (root.start_time, root.end_time) == (1000 * 1000 * MS, 1001 * 1000 * MS)
    parents = {name: s.parent.span_id if s.parent else None for name, s in spans.items()}
    assert parents == {"slot_wait": root.context.span_id, "slot_fill": root.context.span_id,
                       "save_previous": spans["slot_fill"].context.span_id,
                       "restore": spans["slot_fill"].context.span_id,
                       "llama_server": root.context.span_id, "prefill": spans["llama_server"].context.span_id,
                       "generation": spans["llama_server"].context.span_id, "save": root.context.span_id}
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    assert record.trace_id == format(root.context.trace_id, "032x")
    assert spans["llama_server"].kind is SpanKind.CLIENT
    assert spans["restore"].status.status_code is StatusCode.ERROR
    assert spans["save"].status.status_code is StatusCode.UNSET
    assert (spans["prefill"].end_time - spans["prefill"].start_time) == 250 * MS
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.request.model"] == "smollm2" and attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.usage.input_tokens"] == 900 and attributes["llama_cpp.cache_n"] == 880
    assert attributes["url.path"] == "/v1/chat/completions" and attributes["lpcache.route"] == "restore"
    assert "lpcache.reason" not in attributes   # a missing fact is no attribute
    assert dict(spans["slot_wait"].attributes or {}) == {"lpcache.route": "restore", "lpcache.slot": 0}
    assert dict(spans["restore"].attributes or {}) == {"lpcache.ok": False}


def test_a_request_with_a_traceparent_joins_the_clients_trace() -> None:
    tracing, exporter = traced()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    record = restored_record(f"00-{trace_id}-{parent_id}-01")
    tracing.observe(record)
    root = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert format(root.context.trace_id, "032x") == trace_id and record.trace_id == trace_id
    assert root.parent is not None and format(root.parent.span_id, "016x") == parent_id


def test_a_malformed_traceparent_starts_a_trace_of_its_own() -> None:
    tracing, exporter = traced()
    record = restored_record("00-not-a-trace-01")
    tracing.observe(record)
    root = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert root.parent is None and record.trace_id == format(root.context.trace_id, "032x")


def test_a_server_error_marks_the_request_span_as_failed() -> None:
    tracing, exporter = traced()
    tracing.observe(RequestRecord(path="/v1/chat/completions", status=502, reason="backend_unreachable",
                                  elapsed_ms=3.0))
    [root] = exporter.get_finished_spans()
    assert root.status.status_code is StatusCode.ERROR and root.status.description == "backend_unreachable"


def test_a_step_of_no_length_nests_under_the_step_it_happens_in_not_beside_it() -> None:
    tracing, exporter = traced()
    record = RequestRecord(path="/v1/chat/completions", status=200, started=1000.0, elapsed_ms=100.0)
    t0 = 1000 * 1000 * MS
    record.step("llama_server", t0 + 10 * MS, t0 + 90 * MS)
    record.step("prefill", t0 + 40 * MS, t0 + 40 * MS)       # a prompt the slot held whole
    record.step("generation", t0 + 40 * MS, t0 + 90 * MS)
    record.step("save", t0 + 90 * MS, t0 + 90 * MS)
    tracing.observe(record)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    call, root = spans["llama_server"].context.span_id, spans["POST /v1/chat/completions"].context.span_id
    assert {name: s.parent.span_id for name, s in spans.items() if s.parent} == {
        "llama_server": root, "prefill": call, "generation": call, "save": root}


def test_the_llama_server_span_names_the_servers_host_and_port() -> None:
    tracing, exporter = traced()
    record = restored_record()
    record.backend = "http://gpu-box.internal:8080"
    tracing.observe(record)
    [call] = [s for s in exporter.get_finished_spans() if s.name == "llama_server"]
    assert call.attributes is not None
    assert (call.attributes["server.address"], call.attributes["server.port"]) == ("gpu-box.internal", 8080)


def test_the_resource_attributes_the_user_sets_win_over_lpcaches_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.version=canary-7,deployment.environment=prod")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    tracing = Tracing(os.environ)
    attributes = tracing.provider.resource.attributes
    assert attributes["service.version"] == "canary-7" and attributes["service.name"] == "lpcache"
    assert attributes["deployment.environment"] == "prod"


def test_a_shutdown_does_not_wait_on_a_collector_that_does_not_answer(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A collector that takes the connection and never answers: the last spans are given up after FLUSH_SECONDS,
    said in the log, not after the exporter's own timeout (10 s a batch)."""
    import socket
    import threading

    import lpcache.edge.tracing as tracing_module

    monkeypatch.setattr(tracing_module, "FLUSH_SECONDS", 0.2)
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    port = silent.getsockname()[1]
    tracing = Tracing({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
                       "OTEL_EXPORTER_OTLP_TIMEOUT": "30"})
    tracing.observe(restored_record())
    with caplog.at_level("WARNING", logger="lpcache.tracing"):
        tracing.shutdown()
    assert "tracing_flush_timeout" in caplog.text
    silent.close()
    for conn in held:
        conn.close()


def test_the_sdks_name_of_otlp_over_http_is_lpcaches_otlp_once() -> None:
    from lpcache.edge.tracing import exporter_names

    assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp_proto_http,otlp"}) == (["otlp"], [])
    assert exporter_names({"OTEL_TRACES_EXPORTER": "OTLP_PROTO_GRPC"}) == ([], ["otlp_proto_grpc"])
