"""The built-in `dashboard` plugin: a self-contained real-time statistics page and the JSON it polls.

Routes (mounted by lpcache before its catch-all forwarding):

- `GET {path}`: one HTML document with inline CSS and JS, no external asset, talking only to its own origin.
- `GET {path}/api/stats[?since=<unix seconds>]`: the proxy's live state (from `state`, set by lpcache) with the
  plugin's aggregates: lifetime counters, a per-bucket time series of the trailing `window_secs` (with TTFT and
  latency percentiles, tokens from the cache and computed, the load per backend), and the ring of recent requests.
  With `since`, a `range` is added: the counters of the buckets starting at or after `since` and their series
  coarsened to at most `MAX_POINTS` points, and the recent list keeps the requests started since then.

Every finished request reaches `finished()` once with its `RequestRecord`; the page's own requests (its path and the
stats API, see `excluded_paths()`) are left out, so polling never inflates the statistics. Buckets are kept for the
longest range a page can ask for, `KEEP_SECS`; lifetime counters are never pruned. With a history file
(`dashboard_history`), all of it outlives a restart. With client keys, a browser gets in through lpcache's login
form (`lpcache.edge.browser_login`): `browser_paths()` names the page and its data.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lpcache.errors import BadRequest
from lpcache.plugins import dashboard_history
from lpcache.plugins.base import Observer, PluginError, Routes, param
from lpcache.plugins.dashboard_history import COARSE, FINE, History
from lpcache.plugins.dashboard_stats import MAX_BACKENDS, OTHER, Counts, _int, _num, outcome
from lpcache.plugins.dashboard_timeline import BLOCK, KEEP_SECS, MAX_POINTS, Timeline

log = logging.getLogger("lpcache.dashboard")

__all__ = ["BLOCK", "KEEP_SECS", "MAX_POINTS", "Counts", "Dashboard"]

PAGE_RESOURCE = "dashboard_page.html"
HISTORY_FILE = "dashboard-history.json"

_PATH = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)+")
_PARAMS = ("path", "refresh_ms", "window_secs", "bucket_secs", "max_recent", "history_file", "history_secs")


class Dashboard(Observer, Routes):
    """Aggregates finished requests and serves them as a page and a JSON API (see the module doc)."""

    name = "dashboard"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        p = self.params
        unknown = sorted(set(p) - set(_PARAMS))
        if unknown:
            raise PluginError(f"plugin 'dashboard': unknown parameter {unknown[0]!r} (known: {', '.join(_PARAMS)})")
        self.path: str = param(p, "path", str, "/dashboard", plugin=self.name,
                               check=lambda v: _PATH.fullmatch(v) is not None,
                               rule="a URL path that starts with '/' and has no trailing '/' (not '/' itself)")
        self.refresh_ms: int = _ranged(p, "refresh_ms", 2000, 100, 3_600_000)
        self.window_secs: int = _ranged(p, "window_secs", 300, 10, 86400)
        self.bucket_secs: int = _ranged(p, "bucket_secs", 5, 1, 3600)
        self.max_recent: int = _ranged(p, "max_recent", 100, 0, 10000)
        self.history_file: str = param(p, "history_file", str, HISTORY_FILE, plugin=self.name,
                                       check=lambda v: "\x00" not in v,
                                       rule="a file name (in META_DIR), an absolute path, or \"\" for none")
        self.history_secs: int = _ranged(p, "history_secs", 60, 5, 86400)
        self.stats_path = self.path + "/api/stats"
        self.clock = time.time
        self.started_at = self.clock()
        self.since = self.started_at             # when the history began (a restored history's start)
        self.lifetime = Counts()
        self.timeline = Timeline(self.bucket_secs)
        self.recent: deque[dict[str, Any]] = deque(maxlen=self.max_recent)
        self.history_path: str | None = None     # where the history is kept (set at start)
        self.saved_at: float | None = None
        self._lock = threading.Lock()             # finished() may come from another thread than the stats route
        self._changes = 0                         # requests recorded; the history is written when it moved
        self._saved_changes = 0
        self._backend_names: set[str] = set()
        self._saver: asyncio.Task[None] | None = None
        self._page: bytes | None = None

    @property
    def buckets(self) -> dict[int, Counts]:
        return self.timeline.buckets

    @property
    def blocks(self) -> dict[int, Counts]:
        return self.timeline.blocks

    def bucket_of(self, t: float) -> int:
        return self.timeline.bucket_of(t)

    # ---- start and stop: the history file ----

    async def start(self) -> None:
        self.started_at = self.since = self.clock()
        self.history_path = self._history_path()
        if self.history_path is None:
            return
        try:
            history = await asyncio.to_thread(dashboard_history.read, self.history_path)
        except OSError as e:
            log.warning("dashboard_history_off file=%s reason=%s", self.history_path, e)
            self.history_path = None
            return
        if history is not None:
            self.restore(history)
            log.info("dashboard_history_loaded file=%s since=%.0f requests=%d spans=%d", self.history_path,
                     history.since, history.lifetime.requests, len(history.spans))
        self._saver = asyncio.create_task(self._save_periodically())

    async def stop(self) -> None:
        if self._saver is not None:
            self._saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._saver
            self._saver = None
        await self.save()

    def _history_path(self) -> str | None:
        if not self.history_file:
            return None
        if os.path.isabs(self.history_file):
            return self.history_file
        folder = self.data_dir
        return os.path.join(folder, self.history_file) if folder else None

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.history_secs)   # a period, not a wait for some other task
            try:
                await self.save()
            except Exception:                        # a bug: logged, and the next period tries again
                log.exception("dashboard_history_failed file=%s", self.history_path)

    async def save(self) -> bool:
        """Write the history file when something was recorded since the last write; False when nothing was
        written (no file, nothing new, or a write error: logged, tried again next time)."""
        path = self.history_path
        if path is None or self._changes == self._saved_changes:
            return False
        with self._lock:
            doc, changes = self._history_doc(), self._changes
        try:
            await asyncio.to_thread(lambda: dashboard_history.write(path, orjson.dumps(doc)))
        except OSError as e:
            log.warning("dashboard_history_not_saved file=%s reason=%s", path, e)
            return False
        self._saved_changes, self.saved_at = changes, doc["saved_at"]
        return True

    def _history_doc(self) -> dict[str, Any]:
        now = self.clock()
        self.timeline.prune(now)
        return dashboard_history.document(History(
            since=self.since, bucket_secs=self.bucket_secs, lifetime=self.lifetime,
            spans=list(self.timeline.spans(now, FINE, COARSE)), recent=list(self.recent), saved_at=now))

    def restore(self, history: History) -> None:
        """Take a history read from the file in: its sums under what was recorded since the start."""
        with self._lock:
            now = self.clock()
            self.since = min(self.since, history.since)
            self.lifetime.add(history.lifetime)
            self._backend_names.update(list(history.lifetime.backends or {})[:MAX_BACKENDS])
            for start, _secs, counts in history.spans:
                self.timeline.add(self.bucket_of(min(start, now)), counts, now)
            if self.max_recent:
                self.recent = deque([*history.recent[-self.max_recent:], *self.recent], maxlen=self.max_recent)
            self._changes += 1

    # ---- aggregation ----

    def excluded_paths(self) -> Sequence[str]:
        return [self.path, self.stats_path]

    def browser_paths(self) -> Sequence[str]:
        return [self.path, self.stats_path]

    def finished(self, record: Any) -> None:
        path = str(getattr(record, "path", "") or "").split("?", 1)[0]
        if path in (self.path, self.stats_path):
            return
        with self._lock:
            backend = self._backend_name(getattr(record, "backend", None))
            delta = Counts.of(record, backend)
            now = self.clock()
            started = _num(getattr(record, "started", None))
            started = now if started is None else started
            self.lifetime.add(delta)
            # a clock that went back puts nothing in the future
            self.timeline.add(self.bucket_of(min(started, now)), delta, now)
            if backend is not None:
                self._spread_busy(record, backend, started, now)
            self.timeline.prune(now)
            self._changes += 1
            if self.max_recent:
                self.recent.append(_recent_entry(record, started))

    def _backend_name(self, backend: Any) -> str | None:
        if not isinstance(backend, str) or not backend:
            return None
        if backend in self._backend_names:
            return backend
        if len(self._backend_names) < MAX_BACKENDS:
            self._backend_names.add(backend)
            return backend
        return OTHER

    def _spread_busy(self, record: Any, backend: str, started: float, now: float) -> None:
        """The backend's compute time for the request (prefill and generation), put in the buckets it was spent
        in: at the end of the request, where the backend worked."""
        busy_ms = (_num(getattr(record, "prefill_ms", None)) or 0.0) + (_num(getattr(record, "gen_ms", None)) or 0.0)
        if busy_ms <= 0:
            return
        elapsed = _num(getattr(record, "elapsed_ms", None))
        end = min(now, started + elapsed / 1000) if elapsed is not None else now
        t = max(end - busy_ms / 1000, now - KEEP_SECS)
        assert self.lifetime.backends is not None
        self.lifetime.backends[backend][1] += busy_ms
        while t < end:
            start = self.bucket_of(t)
            stop = min(end, start + self.bucket_secs)
            piece = Counts()
            piece.backends = {backend: [0, (stop - t) * 1000]}
            self.timeline.add(start, piece, now)
            t = stop

    # ---- the stats payload ----

    def stats(self, since: float | None = None) -> dict[str, Any]:
        """The stats API's payload without the proxy state (see `payload`)."""
        with self._lock:
            now = self.clock()
            self.timeline.prune(now)
            b = self.bucket_secs
            last = self.bucket_of(now)
            first = last - (math.ceil(self.window_secs / b) - 1) * b
            doc: dict[str, Any] = {
                "now": now,
                "uptime_secs": round(max(0.0, now - self.started_at), 3),
                "lifetime": self.lifetime.to_json(),
                "lifetime_since": self.since,
                "lifetime_secs": round(max(0.0, now - self.since), 3),
                "series": self.series(first, last)[1],
                "recent": [e for e in reversed(self.recent) if since is None or e["time"] >= since],
                "refresh_ms": self.refresh_ms,
                "window_secs": self.window_secs,
                "bucket_secs": b,
                "max_recent": self.max_recent,
                "history": {"file": self.history_path, "since": self.since, "saved_at": self.saved_at},
            }
            if since is not None:
                # The buckets that start at or after since; the series not before the oldest bucket kept (or, with
                # nothing kept, the trailing window).
                oldest = self.timeline.oldest()
                start = max(math.ceil(since / b) * b, min(first, oldest) if oldest is not None else first)
                counters, series = self.series(start, last)
                doc["range"] = {"since": since, "counters": counters.to_json(), "series": series}
            return doc

    def series(self, first: int, last: int) -> tuple[Counts, list[dict[str, Any]]]:
        """See `Timeline.series`."""
        return self.timeline.series(first, last)

    async def payload(self, since: float | None = None) -> dict[str, Any]:
        """The whole stats API answer: `stats()` with the proxy's live state under "proxy"."""
        doc = self.stats(since)
        doc["proxy"] = await self._proxy_state()
        return doc

    async def _proxy_state(self) -> dict[str, Any]:
        if self.state is None:
            return {}
        try:
            state: Any = self.state()
            if inspect.isawaitable(state):
                state = await state
            return dict(state or {})
        except Exception:
            log.exception("dashboard_state_failed")
            return {"error": "the proxy state could not be read"}

    # ---- routes ----

    def routes(self) -> Sequence[Any]:
        return [Route(self.path, self.page_endpoint, methods=["GET"]),
                Route(self.stats_path, self.stats_endpoint, methods=["GET"])]

    def page(self) -> bytes:
        """The HTML page, its settings filled in."""
        if self._page is None:
            template = resources.files(__package__ or "lpcache.plugins").joinpath(PAGE_RESOURCE).read_text("utf-8")
            page = self.path.rsplit("/", 1)[1]    # relative URLs: the page works behind a proxy that moves it
            config = orjson.dumps({"page": page, "stats": page + "/api/stats", "refresh_ms": self.refresh_ms,
                                   "window_secs": self.window_secs, "bucket_secs": self.bucket_secs,
                                   "max_recent": self.max_recent}).decode()
            config = config.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            self._page = template.replace("/*CONFIG*/{}", config, 1).encode()
        return self._page

    async def page_endpoint(self, request: Request) -> Response:
        return Response(self.page(), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    async def stats_endpoint(self, request: Request) -> Response:
        raw = request.query_params.get("since")
        since: float | None = None
        if raw is not None:
            try:
                since = float(raw)
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                err = BadRequest(f"since must be a number of unix seconds, got {raw!r}", code="invalid_since")
                return Response(orjson.dumps(err.body()), status_code=err.status, media_type="application/json",
                                headers=_NO_STORE)
        doc = await self.payload(since)
        return Response(orjson.dumps(doc), media_type="application/json", headers=_NO_STORE)


_NO_STORE = {"cache-control": "no-store"}
_PAGE_HEADERS = {
    **_NO_STORE,
    # The page may talk to its own origin only, and load nothing: a browser enforces what the tests check.
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def _recent_entry(record: Any, started: float) -> dict[str, Any]:
    def g(name: str) -> Any:
        return getattr(record, name, None)

    elapsed, ttft = _num(g("elapsed_ms")), _num(g("ttft_ms"))
    cached = _int(g("cached_tokens"))
    cached = cached if cached is not None else _int(g("cache_n"))
    return {
        "time": started, "method": g("method"), "path": g("path"), "api": g("api"), "status": g("status"),
        "route": g("route"),
        "model": g("model"),
        "stream": g("stream"), "backend": g("backend"), "slot": g("slot"), "restored": g("restored"),
        "cache_hit": g("cache_hit"), "coalesced": g("coalesced"), "saved": g("saved"), "reason": g("reason"),
        "outcome": outcome(_int(g("status")), g("reason")),
        "prompt_tokens": _int(g("prompt_tokens")), "cached_tokens": cached,
        "completion_tokens": _int(g("completion_tokens")),
        "ms": None if elapsed is None else round(elapsed, 1), "ttft_ms": None if ttft is None else round(ttft, 1),
        "trace_id": g("trace_id"), "steps": _steps(g("steps"), g("started")),
    }


def _steps(steps: Any, started: Any) -> list[dict[str, Any]]:
    """A request's steps (`RequestRecord.steps`) for its row's timings: name, start from the request's, length."""
    if not isinstance(steps, list) or not isinstance(started, int | float):
        return []
    origin = started * 1e9
    return [{"name": s.name, "at_ms": round((s.start_ns - origin) / 1e6, 1),
             "ms": round((s.end_ns - s.start_ns) / 1e6, 1)}
            for s in sorted(steps, key=lambda s: (s.start_ns, -s.end_ns))]


def _ranged(params: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value: int = param(params, name, int, default, plugin="dashboard", check=lambda v: low <= v <= high,
                       rule=f"an integer in {low}..={high}")
    return value
