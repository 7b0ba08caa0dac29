"""An OTLP/HTTP trace receiver for tests: what lpcache's exporter sends to `/v1/traces`, decoded with
opentelemetry-proto as a collector decodes it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status: int = 0              # 0 unset, 1 ok, 2 error
    service: str | None = None

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    receiver.take(body)
                self.send_response(200 if ok else 400)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource in request.resource_spans:
            service = next((_value(a.value) for a in resource.resource.attributes if a.key == "service.name"), None)
            for scope in resource.scope_spans:
                for s in scope.spans:
                    spans.append(ReceivedSpan(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                              s.start_time_unix_nano, s.end_time_unix_nano,
                                              {a.key: _value(a.value) for a in s.attributes}, s.status.code,
                                              service))
        with self.changed:
            self.spans.extend(spans)
            self.requests += 1
            self.changed.notify_all()

    def wait_for(self, count: int, name: str | None = None, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans received (named `name`, when given) once there are at least `count` of them."""
        def found() -> list[ReceivedSpan]:
            return [s for s in self.spans if name is None or s.name == name]

        end = time.monotonic() + timeout
        with self.changed:
            while len(found()) < count:
                left = end - time.monotonic()
                assert left > 0, f"{len(found())} spans named {name} received, {count} expected: " \
                                 f"{[s.name for s in self.spans]}"
                self.changed.wait(left)
            return found()

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
