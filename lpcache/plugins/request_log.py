"""The request log: one W3C Extended Log Format (XLF) record per finished request, appended to a size-rotated file.

Params (the REQUEST_LOG* settings): `path` (default "lpcache-request.log", relative to the CWD at start-up; parent
directories are created), `max_bytes` (rotation threshold, 0 = never rotate), `keep` (rotated generations retained,
0 = keep all) and `fields` (an ordered subset of FIELDS, as a list or a comma-separated string).

Each file, and each fresh file after a rotation, starts with the XLF header; an existing non-empty file is appended
to without a new header. Writes are synchronous (append + flush per record, the file kept open between writes);
every I/O failure is logged and swallowed, so the log never breaks request serving.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from lpcache.backends.admission import CLASSES
from lpcache.config.version import __version__
from lpcache.flow.record import RequestRecord
from lpcache.plugins.base import Observer, PluginError

log = logging.getLogger("lpcache.request_log")

DATE_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
DEFAULT_PATH = "lpcache-request.log"
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_KEEP = 5


def _datetime(record: RequestRecord) -> Any:
    started = record.started
    if not isinstance(started, int | float) or isinstance(started, bool) or not math.isfinite(started):
        return None
    try:
        return datetime.fromtimestamp(started, tz=UTC).strftime(DATE_FORMAT)
    except (OverflowError, OSError, ValueError):
        return None


def _ttft(record: RequestRecord) -> Any:
    return record.ttft_ms if record.stream is True else None


# The known fields, in the default order: W3C fields, then lpcache pipeline fields, then performance fields.
_GETTERS: dict[str, Callable[[RequestRecord], Any]] = {
    "datetime": _datetime,
    "cs-method": lambda r: r.method,
    "cs-uri": lambda r: r.path,
    "c-ip": lambda r: r.client_ip,
    "cs(User-Agent)": lambda r: r.user_agent,
    "cs-bytes": lambda r: r.bytes_in,
    "cs-time": lambda r: r.elapsed_ms,
    "sc-status": lambda r: r.status,
    "sc-bytes": lambda r: r.bytes_out,
    "lpcache-model": lambda r: r.model,
    "lpcache-stream": lambda r: r.stream,
    "lpcache-key": lambda r: r.key,
    "lpcache-n-words": lambda r: r.n_words,
    "lpcache-is-big": lambda r: r.big,
    "lpcache-backend": lambda r: r.backend,
    "lpcache-slot": lambda r: r.slot,
    "lpcache-restored": lambda r: r.restored,
    "lpcache-cache-hit": lambda r: r.cache_hit,
    "lpcache-coalesced": lambda r: r.coalesced,
    "lpcache-reason": lambda r: r.reason,
    "lpcache-prompt-tokens": lambda r: r.prompt_tokens,
    "lpcache-completion-tokens": lambda r: r.completion_tokens,
    "lpcache-cached-tokens": lambda r: r.cached_tokens,
    "lpcache-prefill-ms": lambda r: r.prefill_ms,
    "lpcache-gen-ms": lambda r: r.gen_ms,
    "lpcache-prefill-tps": lambda r: r.prefill_tps,
    "lpcache-gen-tps": lambda r: r.gen_tps,
    "lpcache-ttft-ms": _ttft,
    # Known but not in the default (the default is the Rust lpcache's 28 fields, for the log readers written for
    # it): the API of the request (chat, responses, messages, completions, infill; - for other routes).
    "lpcache-api": lambda r: r.api,
    # ... and why its slot was chosen (resident, restore, session, server_ram, prefill; waited_: after a wait for a
    # busy slot; docs/operations.md "Why a request went where it went").
    "lpcache-route": lambda r: r.route,
    # ... where its session came from (x-session-id, x-claude-code-session-id, session-id, metadata.user_id; -
    # in prefix mode: `agent_ids`) ...
    "lpcache-session-source": lambda r: r.session_source,
    # ... what a new session's first turn started from (resident, file, session, parent: `slot_fill`) ...
    "lpcache-seeded": lambda r: r.seeded,
    # ... its priority class and how long it waited for its slot (`backends.admission`).
    "lpcache-priority": lambda r: CLASSES[r.ticket.priority],
    "lpcache-queue-ms": lambda r: r.queue_ms,
    # ... and the OpenTelemetry trace its spans went to (TRACING; the client's when it sent a traceparent).
    "lpcache-trace-id": lambda r: r.trace_id,
}

_EXTRA = ("lpcache-api", "lpcache-route", "lpcache-session-source", "lpcache-seeded", "lpcache-priority",
          "lpcache-queue-ms", "lpcache-trace-id")
FIELDS: tuple[str, ...] = tuple(name for name in _GETTERS if name not in _EXTRA)
KNOWN: tuple[str, ...] = tuple(_GETTERS)
_BY_LOWER = {name.lower(): name for name in KNOWN}

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def render_value(value: Any) -> str:
    """One XLF field value: `-` when missing, numbers bare, strings quoted and escaped when they need it."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        text = f"{value:.3f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    text = str(value)
    if text == "":
        return "-"
    if text[0] in '-"' or any(c.isspace() or c in '"\\' or _is_control(c) for c in text):
        return '"' + "".join(_escape(c) for c in text) + '"'
    return text


def _is_control(c: str) -> bool:
    return ord(c) < 0x20 or ord(c) == 0x7F


def _escape(c: str) -> str:
    if c in _ESCAPES:
        return _ESCAPES[c]
    return f"\\x{ord(c):02x}" if _is_control(c) else c


def _int_param(params: Mapping[str, Any], name: str, default: int) -> int:
    """A non-negative int; a string of decimal digits is accepted too (the REQUEST_LOG_* environment form)."""
    value = params.get(name, default)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PluginError(f"plugin 'request_log': parameter {name!r} must be an integer >= 0, got {value!r}")
    return value


def _fields_param(params: Mapping[str, Any]) -> tuple[str, ...]:
    value = params.get("fields")
    if value is None:
        return FIELDS
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",") if part.strip()]
        if not names:  # REQUEST_LOG_FIELDS set but empty: the default
            return FIELDS
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        names = [v.strip() for v in value]
    else:
        raise PluginError(f"plugin 'request_log': parameter 'fields' must be a list of field names or a "
                          f"comma-separated string, got {value!r}")
    if not names:
        raise PluginError("plugin 'request_log': parameter 'fields' must name at least one field")
    out = []
    for name in names:
        known = _BY_LOWER.get(name.lower())
        if known is None:
            raise PluginError(f"plugin 'request_log': unknown field {name!r} in 'fields' "
                              f"(known: {', '.join(KNOWN)})")
        out.append(known)
    return tuple(out)


class RequestLog(Observer):
    """Appends one XLF record per finished request to a size-rotated file."""

    name = "request_log"
    PARAMS = ("path", "max_bytes", "keep", "fields")

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        unknown = sorted(set(self.params) - set(self.PARAMS))
        if unknown:
            raise PluginError(f"plugin 'request_log': unknown parameter(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(self.PARAMS)})")
        path = self.params.get("path", DEFAULT_PATH)
        if not isinstance(path, str | os.PathLike) or str(path).strip() == "":
            raise PluginError(f"plugin 'request_log': parameter 'path' must be a non-empty string, got {path!r}")
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.max_bytes = _int_param(self.params, "max_bytes", DEFAULT_MAX_BYTES)
        self.keep = _int_param(self.params, "keep", DEFAULT_KEEP)
        self.fields = _fields_param(self.params)
        self._getters = [_GETTERS[f] for f in self.fields]
        self._file: BinaryIO | None = None
        self._size = 0
        self._has_records = False   # the open file holds more than a fresh header (never rotate a header alone)
        self._failing = False       # the last I/O attempt failed: later failures log at debug until one succeeds
        self._lock = threading.Lock()

    # -- rendering

    def header(self) -> str:
        return (f"#Software: lpcache-plugins/{__version__}\n#Version: 1.0\n#Date-format: {DATE_FORMAT}\n"
                f"#Fields: {' '.join(self.fields)}\n")

    def render(self, record: RequestRecord) -> str:
        """The record's XLF line, without the newline."""
        return " ".join(render_value(get(record)) for get in self._getters)

    # -- hooks

    async def start(self) -> None:
        with self._lock:
            self._guard(self._ensure_open)

    async def stop(self) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._guard(self._close)

    def finished(self, record: Any) -> None:
        try:
            line = (self.render(record) + "\n").encode("utf-8", "backslashreplace")
        except Exception:  # a malformed record must not break serving either
            log.exception("request log: cannot render record")
            return
        with self._lock:
            self._guard(lambda: self._write(line))

    # -- file handling (called with the lock held)

    def _guard(self, action: Callable[[], object]) -> None:
        try:
            action()
        except OSError as exc:
            (log.debug if self._failing else log.warning)("request log %s: I/O failed: %s", self.path, exc)
            self._failing = True
            try:
                self._close()
            except OSError:
                self._file = None
        else:
            if self._failing:
                log.info("request log %s: writing again", self.path)
            self._failing = False

    def _ensure_open(self) -> BinaryIO:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "ab")  # kept open between writes
            try:
                self._size = os.fstat(f.fileno()).st_size
                self._has_records = self._size > 0
                if self._size == 0:
                    self._append(f, self.header().encode("utf-8"))
            except OSError:
                f.close()
                raise
            self._file = f
        return self._file

    def _append(self, f: BinaryIO, data: bytes) -> None:
        f.write(data)
        f.flush()
        self._size += len(data)

    def _write(self, line: bytes) -> None:
        f = self._ensure_open()
        if self.max_bytes > 0 and self._has_records and self._size + len(line) > self.max_bytes:
            self._rotate()
            f = self._ensure_open()
        self._append(f, line)
        self._has_records = True

    def _close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def _generation(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def _rotate(self) -> None:
        """path → path.1, path.1 → path.2, …; generations beyond `keep` are deleted (keep 0: none are)."""
        self._close()
        top = 0
        while self._generation(top + 1).exists():
            top += 1
        if self.keep > 0:
            for n in range(self.keep, top + 1):  # these would end up beyond `keep` after the shift
                self._generation(n).unlink(missing_ok=True)
            top = min(top, self.keep - 1)
        for n in range(top, 0, -1):
            os.replace(self._generation(n), self._generation(n + 1))
        os.replace(self.path, self._generation(1))
        log.debug("request log %s: rotated", self.path)
