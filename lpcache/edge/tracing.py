"""OpenTelemetry traces: one span per request, and within it a span for each step lpcache took for it.

The steps are the record's (`RequestRecord.steps`: the wait for a slot, the save of what it held, the restore, the
call to llama-server with its prefill and generation as the server timed them, the save after the answer, the
prefilters), so a trace says what the dashboard and the request log say. The spans are made once the request is
over, from those times, and exported in batches by the SDK's own thread, off the event loop. A request that came
with a W3C `traceparent` joins the client's trace; the trace's id goes to the record (`lpcache-trace-id` in the
request log).

Off unless `TRACING=on`, or `TRACING=auto` (the default) and the standard OpenTelemetry variables ask for traces
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER` naming an exporter);
`OTEL_SDK_DISABLED=true`, or an `OTEL_TRACES_EXPORTER` that names none lpcache has (`none`, `zipkin`), keeps it
off. Off, lpcache does not import the SDK. The exporter
is OTLP over HTTP (protobuf), configured by the usual `OTEL_EXPORTER_OTLP_*` variables, or `console`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from lpcache.backends.admission import CLASSES
from lpcache.config.version import __version__
from lpcache.flow.record import RequestRecord, Step

log = logging.getLogger("lpcache.tracing")

ASKING = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER")
CONTAINERS = ("slot_fill", "llama_server")   # the steps others happen within (the rest are the request's own)
OPERATIONS = {"chat": "chat", "responses": "chat", "messages": "chat", "completions": "text_completion",
              "infill": "text_completion"}


EXPORTERS = ("otlp", "console")   # the exporters lpcache has
OTLP_NAMES = ("otlp_proto_http",)   # the SDK's own name of otlp over HTTP, the transport lpcache sends with
FLUSH_SECONDS = 3.0               # the most a shutdown waits for the last spans to go (a collector gone: dropped)


def exporter_names(env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the exporters OTEL_TRACES_EXPORTER names that lpcache has, those it has not); `otlp` when unset."""
    names = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()] or ["otlp"]
    names = list(dict.fromkeys("otlp" if n in OTLP_NAMES else n for n in names))
    return [n for n in names if n in EXPORTERS], [n for n in names if n not in EXPORTERS and n != "none"]


def wanted(setting: str, env: Mapping[str, str]) -> bool:
    """Whether traces are on: `TRACING` (on, off, auto) and the standard variables (see the module's docstring).
    Off too when OTEL_TRACES_EXPORTER names no exporter lpcache has (`none`, or only `zipkin`: spans made for
    nowhere would cost for nothing)."""
    if setting == "off" or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    known, unknown = exporter_names(env)
    if not known:
        if unknown:
            log.warning("tracing_off exporters=%s: not ones lpcache has (otlp, console); no traces", ",".join(unknown))
        return False
    return setting == "on" or any(env.get(name, "").strip() for name in ASKING)


class Tracing:
    """The tracer provider of this process (its own: lpcache sets no global one) and the observer that turns a
    finished request's record into spans."""

    def __init__(self, env: Mapping[str, str]) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # lpcache's defaults; the OTEL_* variables' own values win (Resource.create lets these override them)
        given = {part.split("=", 1)[0].strip() for part in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")}
        attributes: dict[str, Any] = {} if "service.version" in given else {"service.version": __version__}
        if not env.get("OTEL_SERVICE_NAME") and "service.name" not in given:
            attributes["service.name"] = "lpcache"
        self.provider = TracerProvider(resource=Resource.create(attributes))
        names, unknown = exporter_names(env)
        if unknown:
            log.warning("tracing_exporter exporters=%s: not ones lpcache has (otlp, console); ignored",
                        ",".join(unknown))
        exporters: list[SpanExporter] = []
        for name in names:
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", ""))
                if protocol and protocol != "http/protobuf":
                    log.warning("tracing_protocol protocol=%s: lpcache exports OTLP over HTTP (http/protobuf) only; "
                                "point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's HTTP port (4318)", protocol)
                exporters.append(OTLPSpanExporter())
            else:
                exporters.append(ConsoleSpanExporter())
        for exporter in exporters:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("lpcache", __version__)
        self.propagator = TraceContextTextMapPropagator()
        log.info("tracing_on exporters=%s", ",".join(names))

    def observe(self, record: RequestRecord) -> None:
        """Export the request's spans (an observer: called once the request is over, saves included)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = None
        if record.traceparent:
            carrier = {"traceparent": record.traceparent}
            if record.tracestate:
                carrier["tracestate"] = record.tracestate
            parent = self.propagator.extract(carrier)
        start = round(record.started * 1e9)
        end = start + round((record.elapsed_ms or 0.0) * 1e6)
        root = self.tracer.start_span(f"{record.method} {record.path.split('?', 1)[0]}", context=parent,
                                      kind=SpanKind.SERVER, start_time=start,
                                      attributes=_attributes(request_attributes(record)))
        if record.status is not None and record.status >= 500:
            root.set_status(Status(StatusCode.ERROR, record.reason or f"HTTP {record.status}"))
        open_spans: list[tuple[Step, Any]] = []   # the steps that hold others (CONTAINERS), latest last
        for step in sorted(record.steps, key=lambda s: (s.start_ns, s.name not in CONTAINERS, -s.end_ns)):
            while open_spans and not (open_spans[-1][0].start_ns <= step.start_ns < open_spans[-1][0].end_ns
                                      and step.end_ns <= open_spans[-1][0].end_ns):
                open_spans.pop()
            within = open_spans[-1][1] if open_spans and step.name not in CONTAINERS else root
            span = self.tracer.start_span(step.name, context=trace.set_span_in_context(within),
                                          kind=SpanKind.CLIENT if step.name == "llama_server" else SpanKind.INTERNAL,
                                          start_time=step.start_ns,
                                          attributes=_attributes(step_attributes(step, record)))
            if step.attributes.get("ok") is False:
                span.set_status(Status(StatusCode.ERROR, f"{step.name} failed"))
            span.end(end_time=step.end_ns)
            if step.name in CONTAINERS:
                open_spans.append((step, span))
        root.end(end_time=max(end, start))
        record.trace_id = format(root.get_span_context().trace_id, "032x")

    def shutdown(self) -> None:
        """Export what is left (at shutdown), for FLUSH_SECONDS at most: a collector that is gone does not hold
        the shutdown for the exporter's timeout (10 s by default, each batch)."""
        flush = threading.Thread(target=self.provider.shutdown, name="lpcache-tracing-flush", daemon=True)
        flush.start()
        flush.join(FLUSH_SECONDS)
        if flush.is_alive():
            log.warning("tracing_flush_timeout seconds=%g: the last spans were not all exported", FLUSH_SECONDS)


def request_attributes(record: RequestRecord) -> dict[str, Any]:
    """The request span's attributes: HTTP and GenAI semantic conventions, then lpcache's decision and outcome."""
    operation = OPERATIONS.get(record.api or "")
    return {
        "http.request.method": record.method, "url.path": record.path.split("?", 1)[0],
        "http.response.status_code": record.status, "client.address": record.client_ip,
        "user_agent.original": record.user_agent,
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "llama.cpp" if operation else None,
        "gen_ai.request.model": record.model,
        "gen_ai.usage.input_tokens": record.prompt_tokens, "gen_ai.usage.output_tokens": record.completion_tokens,
        "lpcache.api": record.api, "lpcache.stream": record.stream, "lpcache.route": record.route,
        "lpcache.backend": record.backend, "lpcache.slot": record.slot, "lpcache.restored": record.restored,
        "lpcache.cache_hit": record.cache_hit, "lpcache.coalesced": record.coalesced, "lpcache.reason": record.reason,
        "lpcache.prefilter": record.prefilter, "lpcache.key": record.key, "lpcache.session": record.session,
        "lpcache.session_source": record.session_source, "lpcache.seeded": record.seeded,
        "lpcache.priority": CLASSES[record.ticket.priority], "lpcache.queue_ms": record.queue_ms,
        "lpcache.restore_file": record.restore_file, "lpcache.restore_skipped": record.restore_skipped,
        "lpcache.restored_tokens": record.restored_tokens, "lpcache.saved": record.saved,
        "lpcache.save_file": record.save_file, "lpcache.save_decision": record.save_decision,
        "lpcache.retries": record.retries or None,
        "llama_cpp.cache_n": record.cache_n, "llama_cpp.prompt_n": record.prompt_n,
    }


def step_attributes(step: Step, record: RequestRecord) -> dict[str, Any]:
    attributes = {f"lpcache.{k}": v for k, v in step.attributes.items()}
    if step.name == "llama_server":
        attributes.update({"gen_ai.operation.name": OPERATIONS.get(record.api or ""),
                           "gen_ai.provider.name": "llama.cpp", "gen_ai.request.model": record.model,
                           "gen_ai.usage.input_tokens": record.prompt_tokens,
                           "gen_ai.usage.output_tokens": record.completion_tokens,
                           **_server(record.backend)})
    return attributes


def _server(url: str | None) -> dict[str, Any]:
    """`server.address` (the host) and `server.port` of a backend's URL."""
    if not url:
        return {}
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return {"server.address": parts.hostname, "server.port": port or (443 if parts.scheme == "https" else 80)}


def _attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    """Only what OpenTelemetry can carry: no None (a missing fact is no attribute)."""
    return {k: v for k, v in values.items() if v is not None and isinstance(v, str | bool | int | float)}


def from_settings(setting: str) -> Tracing | None:
    """The process's tracing, or None when off."""
    if not wanted(setting, os.environ):
        return None
    try:
        return Tracing(os.environ)
    except ImportError as e:   # the SDK is a dependency: only a broken install lacks it
        raise RuntimeError(f"TRACING is on but OpenTelemetry's SDK cannot be imported ({e}): install "
                           "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http") from e
