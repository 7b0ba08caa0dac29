"""The built-in `dashboard` plugin: a self-contained real-time statistics page and the JSON it polls.

Routes (mounted by lpcache before its catch-all forwarding):

- `GET {path}`: one HTML document with inline CSS and JS, no external asset, talking only to its own origin.
- `GET {path}/api/stats[?since=<unix seconds>]`: the proxy's live state (from `state`, set by lpcache) with the
  plugin's aggregates: lifetime counters, a per-bucket time series of the trailing `window_secs`, and the ring of
  recent requests. With `since`, a `range` is added: the counters of the buckets starting at or after `since` and
  their series coarsened to at most `MAX_POINTS` points, and the recent list keeps the requests started since then.

Every finished request reaches `finished()` once with its `RequestRecord`; the page's own requests (its path and the
stats API, see `excluded_paths()`) are left out, so polling never inflates the statistics. Buckets are kept for the
longest range a page can ask for, `KEEP_SECS`; lifetime counters are never pruned.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import logging
import math
import operator
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import BadRequest
from .base import Observer, PluginError, Routes, param

log = logging.getLogger("lpcache.dashboard")

MAX_POINTS = 360          # at most this many points in a range's series
KEEP_SECS = 86400         # buckets older than this are dropped (the longest range the page asks for)
PAGE_RESOURCE = "dashboard_page.html"

_PATH = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)+")
_PARAMS = ("path", "refresh_ms", "window_secs", "bucket_secs", "max_recent")

# Per-request counters, summed over the lifetime, each bucket and a range.
_FIELDS = ("requests", "successes", "errors", "s2xx", "s3xx", "s4xx", "s5xx", "sother", "restored",
           "restore_failed", "cache_hits", "coalesced", "saves_ok", "saves_failed", "prompt_tokens", "cached_tokens",
           "computed_tokens", "completion_tokens", "restore_ms_sum", "restore_ms_n", "save_ms_sum", "save_ms_n",
           "restore_bytes", "save_bytes")
_INDEX = {name: i for i, name in enumerate(_FIELDS)}
# The ones a series point carries.
_SERIES = ("requests", "errors", "completion_tokens", "prompt_tokens", "cached_tokens", "computed_tokens")
_SERIES_INDEX = [_INDEX[name] for name in _SERIES]
# Buckets are also summed in blocks of this many, so that a long range costs blocks, not buckets.
BLOCK = 16


class Counts:
    """Sums of the per-request counters (read them as attributes: `c.requests`); `add` merges another set (a
    request's own, a bucket's). A plain list inside, so that merging is cheap."""

    __slots__ = ("v",)

    def __init__(self, values: list[float] | None = None) -> None:
        self.v: list[float] = values if values is not None else [0] * len(_FIELDS)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.v[_INDEX[name]]
        except KeyError:
            raise AttributeError(name) from None

    def add(self, other: Counts) -> None:
        self.v[:] = map(operator.add, self.v, other.v)

    def sub(self, other: Counts) -> None:
        self.v[:] = map(operator.sub, self.v, other.v)

    @classmethod
    def of(cls, record: Any) -> Counts:
        """One request's contribution."""
        c: dict[str, float] = {"requests": 1}
        status = _int(getattr(record, "status", None))
        c["successes" if status is not None and status < 400 else "errors"] = 1
        c[f"s{status // 100}xx" if status is not None and 200 <= status < 600 else "sother"] = 1
        restored = getattr(record, "restored", None)
        c["restored"], c["restore_failed"] = int(restored is True), int(restored is False)
        c["cache_hits"] = int(getattr(record, "cache_hit", None) is True)
        c["coalesced"] = int(getattr(record, "coalesced", None) is True)
        saved = getattr(record, "saved", None)
        c["saves_ok"], c["saves_failed"] = int(saved is True), int(saved is False)
        prompt = _int(getattr(record, "prompt_tokens", None))
        cached = _int(getattr(record, "cached_tokens", None))
        if cached is None:
            cached = _int(getattr(record, "cache_n", None))
        computed = _int(getattr(record, "prompt_n", None))   # what the backend prefilled
        if computed is None and prompt is not None:
            computed = max(0, prompt - (cached or 0))
        c["prompt_tokens"], c["cached_tokens"], c["computed_tokens"] = prompt or 0, cached or 0, computed or 0
        c["completion_tokens"] = _int(getattr(record, "completion_tokens", None)) or 0
        restore_ms, save_ms = _num(getattr(record, "restore_ms", None)), _num(getattr(record, "save_ms", None))
        if restore_ms is not None:
            c["restore_ms_sum"], c["restore_ms_n"] = restore_ms, 1
        if save_ms is not None:
            c["save_ms_sum"], c["save_ms_n"] = save_ms, 1
        c["restore_bytes"] = _int(getattr(record, "restore_bytes", None)) or 0
        c["save_bytes"] = _int(getattr(record, "save_bytes", None)) or 0
        return cls([c.get(name, 0) for name in _FIELDS])

    def to_json(self) -> dict[str, Any]:
        share = self.cached_tokens + self.computed_tokens
        return {
            "requests": self.requests,
            "successes": self.successes,
            "errors": self.errors,
            "success_rate": _ratio(self.successes, self.requests),
            "by_status": {"2xx": self.s2xx, "3xx": self.s3xx, "4xx": self.s4xx, "5xx": self.s5xx,
                          "other": self.sother},
            "restored": self.restored,
            "restore_failed": self.restore_failed,
            "cache_hits": self.cache_hits,
            "coalesced": self.coalesced,
            "saves_ok": self.saves_ok,
            "saves_failed": self.saves_failed,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "cached_share": _ratio(self.cached_tokens, share),
            "completion_tokens": self.completion_tokens,
            "restore_ms_sum": round(self.restore_ms_sum, 3),
            "restore_ms_avg": _avg(self.restore_ms_sum, self.restore_ms_n),
            "save_ms_sum": round(self.save_ms_sum, 3),
            "save_ms_avg": _avg(self.save_ms_sum, self.save_ms_n),
            "restore_bytes": self.restore_bytes,
            "save_bytes": self.save_bytes,
        }


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
        self.stats_path = self.path + "/api/stats"
        self.block_secs = BLOCK * self.bucket_secs
        self.clock = time.time
        self.started_at = self.clock()
        self.lifetime = Counts()
        self.buckets: dict[int, Counts] = {}      # bucket start (unix seconds) -> its counters
        self.blocks: dict[int, Counts] = {}       # block start -> the sum of its buckets
        self._block_n: dict[int, int] = {}        # block start -> how many buckets it has
        self._starts: list[int] = []              # heap of the keys of `buckets`, oldest first
        self.recent: deque[dict[str, Any]] = deque(maxlen=self.max_recent)
        self._lock = threading.Lock()             # finished() may come from another thread than the stats route
        self._page: bytes | None = None

    async def start(self) -> None:
        self.started_at = self.clock()

    # ---- aggregation ----

    def excluded_paths(self) -> Sequence[str]:
        return [self.path, self.stats_path]

    def finished(self, record: Any) -> None:
        path = str(getattr(record, "path", "") or "").split("?", 1)[0]
        if path in (self.path, self.stats_path):
            return
        delta = Counts.of(record)
        with self._lock:
            now = self.clock()
            started = _num(getattr(record, "started", None))
            started = now if started is None else started
            self.lifetime.add(delta)
            start = self.bucket_of(min(started, now))    # a clock that went back puts nothing in the future
            if start + self.bucket_secs > now - KEEP_SECS:
                bucket = self.buckets.get(start)
                if bucket is None:
                    bucket = self.buckets[start] = Counts()
                    heapq.heappush(self._starts, start)
                    block_start = start - start % self.block_secs
                    self._block_n[block_start] = self._block_n.get(block_start, 0) + 1
                    self.blocks.setdefault(block_start, Counts())
                bucket.add(delta)
                self.blocks[start - start % self.block_secs].add(delta)
            self._prune(now)
            if self.max_recent:
                self.recent.append(_recent_entry(record, started))

    def bucket_of(self, t: float) -> int:
        return int(math.floor(t / self.bucket_secs)) * self.bucket_secs

    def _prune(self, now: float) -> None:
        horizon = now - KEEP_SECS
        while self._starts and self._starts[0] + self.bucket_secs <= horizon:
            start = heapq.heappop(self._starts)
            gone = self.buckets.pop(start)
            block_start = start - start % self.block_secs
            left = self._block_n.pop(block_start) - 1
            if left:
                self._block_n[block_start] = left
                self.blocks[block_start].sub(gone)
            else:
                del self.blocks[block_start]

    # ---- the stats payload ----

    def stats(self, since: float | None = None) -> dict[str, Any]:
        """The stats API's payload without the proxy state (see `payload`)."""
        with self._lock:
            now = self.clock()
            self._prune(now)
            b = self.bucket_secs
            last = self.bucket_of(now)
            first = last - (math.ceil(self.window_secs / b) - 1) * b
            doc: dict[str, Any] = {
                "now": now,
                "uptime_secs": round(max(0.0, now - self.started_at), 3),
                "lifetime": self.lifetime.to_json(),
                "series": self.series(first, last)[1],
                "recent": [e for e in reversed(self.recent) if since is None or e["time"] >= since],
                "refresh_ms": self.refresh_ms,
                "window_secs": self.window_secs,
                "bucket_secs": b,
                "max_recent": self.max_recent,
            }
            if since is not None:
                # The buckets that start at or after since; the series not before the oldest bucket kept (or, with
                # nothing kept, the trailing window).
                start = max(math.ceil(since / b) * b, min(first, self._starts[0]) if self._starts else first)
                counters, series = self.series(start, last)
                doc["range"] = {"since": since, "counters": counters.to_json(), "series": series}
            return doc

    def series(self, first: int, last: int) -> tuple[Counts, list[dict[str, Any]]]:
        """The buckets from `first` to `last` (bucket starts, both included) as at most MAX_POINTS points, each
        merging adjacent buckets (zeros where nothing happened), and their summed counters. Points are aligned to
        multiples of their width: beyond BLOCK buckets a point is made of whole blocks but for the first and last."""
        b = self.bucket_secs
        total = Counts()
        if last < first:
            return total, []
        n = (last - first) // b + 1
        per = math.ceil(n / MAX_POINTS)
        if per > BLOCK:
            per = math.ceil(per / BLOCK) * BLOCK
        while last // (per * b) - first // (per * b) + 1 > MAX_POINTS:
            per += BLOCK if per >= BLOCK else 1
        width = per * b
        out = []
        for g in range(first // width, last // width + 1):
            lo, hi = max(first, g * width), min(last, g * width + width - b)
            c = self._sum(lo, hi)
            total.add(c)
            secs = hi + b - lo
            point: dict[str, Any] = {"t": lo, "secs": secs}
            point.update(zip(_SERIES, [c.v[i] for i in _SERIES_INDEX], strict=True))
            point["req_per_s"] = round(point["requests"] / secs, 4)
            point["tok_per_s"] = round(point["completion_tokens"] / secs, 4)
            out.append(point)
        return total, out

    def _sum(self, lo: int, hi: int) -> Counts:
        """The counters of the buckets that start from `lo` to `hi` (both multiples of bucket_secs)."""
        b, size = self.bucket_secs, self.block_secs
        total = Counts()
        whole_lo = -(-lo // size) * size           # the whole blocks in [lo, hi + b)
        whole_hi = (hi + b) // size * size
        if whole_hi > whole_lo:
            for block_start in range(whole_lo, whole_hi, size):
                if (c := self.blocks.get(block_start)) is not None:
                    total.add(c)
            starts: Iterable[int] = itertools.chain(range(lo, whole_lo, b), range(whole_hi, hi + 1, b))
        else:
            starts = range(lo, hi + 1, b)
        for start in starts:
            if (c := self.buckets.get(start)) is not None:
                total.add(c)
        return total

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
            config = orjson.dumps({"stats": self.path.rsplit("/", 1)[1] + "/api/stats", "refresh_ms": self.refresh_ms,
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
        "prompt_tokens": _int(g("prompt_tokens")), "cached_tokens": cached,
        "completion_tokens": _int(g("completion_tokens")),
        "ms": None if elapsed is None else round(elapsed, 1), "ttft_ms": None if ttft is None else round(ttft, 1),
    }


def _ranged(params: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value: int = param(params, name, int, default, plugin="dashboard", check=lambda v: low <= v <= high,
                       rule=f"an integer in {low}..={high}")
    return value


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 6) if whole else None


def _avg(total: float, n: int) -> float | None:
    return round(total / n, 3) if n else None
