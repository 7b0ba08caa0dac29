"""The dashboard's figures: what one request adds (`Counts.of`), and the sums of requests over a time bucket, a
block of buckets, a range or the whole history (`Counts`), with the latency percentiles of each (`Histogram`).

Everything is bounded: a `Counts` is a fixed list of counters, two histograms of at most `BINS` bins each and at
most `MAX_BACKENDS` + 1 rows of per-backend load, whatever the traffic.

Outcomes: each request is exactly one of *served* (a status below 400, its answer not broken by the server),
*client error* (a 4xx, 499 included: the client's request, key or patience; or a client that left before any
status) and *server error* (a 5xx, a 401 or 403 of a backend refusing lpcache's LLAMA_API_KEY, a stream a backend
broke after its 200, a request that got no status for another reason). The success rate is served / (served +
server errors): client errors are counted apart.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

# Per-request counters, summed over buckets, blocks, ranges and the lifetime.
FIELDS = ("requests", "successes", "errors", "s2xx", "s3xx", "s4xx", "s5xx", "sother", "restored",
          "restore_failed", "cache_hits", "coalesced", "saves_ok", "saves_failed", "prompt_tokens", "cached_tokens",
          "computed_tokens", "completion_tokens", "restore_ms_sum", "restore_ms_n", "save_ms_sum", "save_ms_n",
          "restore_bytes", "save_bytes", "served", "client_errors", "server_errors",
          # prefill computed again that a saved cache would have spared (`worth`), in tokens by why there was no
          # file, and the milliseconds of the first two: what the settings cost
          "missed_threshold", "missed_limit", "missed_not_worth", "missed_ms")
INDEX = {name: i for i, name in enumerate(FIELDS)}

# Reasons that say the server broke an answer whose status (200) had already gone out.
BROKEN = frozenset({"backend_unreachable", "backend_error", "provider_bad_answer", "provider_non_object",
                    "coalesce_leader_failed", "internal_error"})
CLIENT_GONE = "client_disconnected"
BACKEND_REFUSED = frozenset({"provider_http_401", "provider_http_403"})

SUB = 4                 # histogram bins per doubling of the value: a bin is 19 % wide
LOW = -4                # from 2**-4 ms (62 µs)
BINS = SUB * 28         # to 2**24 ms (4.7 hours); values outside go to the first or the last bin
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
_QS = [q for _, q in QUANTILES]

MAX_BACKENDS = 32       # backends told apart; the load of any further one is summed under OTHER
OTHER = "other"


def outcome(status: int | None, reason: str | None) -> str:
    """served, client_errors or server_errors (see the module doc)."""
    if status is None:
        return "client_errors" if reason == CLIENT_GONE else "server_errors"
    if 400 <= status < 500:
        # a backend refusing lpcache's own key is lpcache's configuration (LLAMA_API_KEY), not the client's
        return "server_errors" if reason in BACKEND_REFUSED else "client_errors"
    if status >= 500 or status < 100:
        return "server_errors"
    return "server_errors" if reason in BROKEN else "served"


class Histogram:
    """Values in milliseconds counted in log-spaced bins (`SUB` per doubling), with the lowest and highest seen:
    a quantile is read within its bin (log-linear) and kept between the two, so it is exact for one value and
    within a bin's width (19 %) otherwise. Merging two is adding their bins; only the bins that count something
    are kept (most buckets see a few requests)."""

    __slots__ = ("bins", "n", "lo", "hi")

    def __init__(self) -> None:
        self.bins: dict[int, int] = {}
        self.n = 0
        self.lo = math.inf
        self.hi = -math.inf

    def record(self, ms: float) -> None:
        i = 0 if ms <= 2 ** LOW else min(BINS - 1, int((math.log2(ms) - LOW) * SUB))
        self.bins[i] = self.bins.get(i, 0) + 1
        self.n += 1
        self.lo, self.hi = min(self.lo, float(ms)), max(self.hi, float(ms))

    def add(self, other: Histogram) -> None:
        bins = self.bins
        for i, c in other.bins.items():
            bins[i] = bins.get(i, 0) + c
        self.n += other.n
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)

    def sub(self, other: Histogram) -> None:
        """Take `other`'s values out (a bucket leaving its block); lo and hi stay as bounds."""
        for i, c in other.bins.items():
            left = self.bins.get(i, 0) - c
            if left > 0:
                self.bins[i] = left
            else:
                self.bins.pop(i, None)
        self.n = sum(self.bins.values())

    def quantile(self, q: float) -> float | None:
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        """The values at the quantiles `qs` (ascending), in one pass over the bins."""
        if self.n <= 0:
            return [None] * len(qs)
        out: list[float | None] = []
        targets = [max(1, math.ceil(q * self.n - 1e-9)) for q in qs]   # the ranks asked for (nearest rank)
        seen, k = 0, 0
        for i, c in sorted(self.bins.items()):
            while k < len(targets) and seen + c >= targets[k]:
                # the bin's c values taken as evenly spread over it (in log scale): the k-th sits at (k - 0.5) / c
                value = 2 ** ((i + (targets[k] - seen - 0.5) / c) / SUB + LOW)
                out.append(round(min(self.hi, max(self.lo, value)), 1))
                k += 1
            if k == len(targets):
                return out
            seen += c
        return out + [round(self.hi, 1)] * (len(targets) - k)

    def summary(self) -> dict[str, Any]:
        values = self.quantiles(_QS)
        return {"n": self.n, **{name: v for (name, _), v in zip(QUANTILES, values, strict=True)},
                "max": round(self.hi, 1) if self.n else None}

    def to_doc(self) -> list[Any]:
        """For the history file: [n, lo, hi, [[bin, count], ...]]."""
        return [self.n, self.lo, self.hi, [[i, c] for i, c in sorted(self.bins.items())]]

    @classmethod
    def from_doc(cls, doc: Any) -> Histogram:
        """From `to_doc`'s shape; ValueError for anything else."""
        if not (isinstance(doc, list) and len(doc) == 4 and isinstance(doc[3], list)):
            raise ValueError("a histogram is [n, lo, hi, bins]")
        h = cls()
        for pair in doc[3]:
            if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(x) for x in pair)
                    and 0 <= pair[0] < BINS and pair[1] > 0):
                raise ValueError("a histogram bin is [index, count]")
            h.bins[pair[0]] = h.bins.get(pair[0], 0) + pair[1]
        h.n = sum(h.bins.values())
        lo, hi = _num(doc[1]), _num(doc[2])
        if h.n:
            if lo is None or hi is None or lo > hi:
                raise ValueError("a histogram's lo and hi are numbers, lo <= hi")
            h.lo, h.hi = lo, hi
        return h


class Counts:
    """Sums of the per-request counters (read them as attributes: `c.requests`), the TTFT and latency histograms
    and the load per backend (url -> [requests, busy ms]); `add` merges another set (a request's own, a bucket's).
    The counters are a plain list, so that merging is cheap; the rest is made only when there is something."""

    __slots__ = ("v", "ttft", "latency", "backends")

    def __init__(self, values: list[float] | None = None) -> None:
        self.v: list[float] = values if values is not None else [0] * len(FIELDS)
        self.ttft: Histogram | None = None
        self.latency: Histogram | None = None
        self.backends: dict[str, list[float]] | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return self.v[INDEX[name]]
        except KeyError:
            raise AttributeError(name) from None

    def add(self, other: Counts) -> None:
        self.v[:] = map(operator.add, self.v, other.v)
        if other.ttft is not None:
            if self.ttft is None:
                self.ttft = Histogram()
            self.ttft.add(other.ttft)
        if other.latency is not None:
            if self.latency is None:
                self.latency = Histogram()
            self.latency.add(other.latency)
        if other.backends:
            if self.backends is None:
                self.backends = {}
            for name, (n, busy) in other.backends.items():
                row = self.backends.setdefault(name, [0, 0.0])
                row[0] += n
                row[1] += busy

    def sub(self, other: Counts) -> None:
        self.v[:] = map(operator.sub, self.v, other.v)
        if other.ttft is not None and self.ttft is not None:
            self.ttft.sub(other.ttft)
        if other.latency is not None and self.latency is not None:
            self.latency.sub(other.latency)
        if other.backends and self.backends:
            for name, (n, busy) in other.backends.items():
                row = self.backends.get(name)
                if row is not None:
                    row[0] -= n
                    row[1] -= busy
                    if row[0] <= 0 and row[1] <= 1e-6:
                        del self.backends[name]

    @classmethod
    def of(cls, record: Any, backend: str | None = None) -> Counts:
        """One request's contribution. `backend`: the name its load counts under (None: the record's own)."""
        c: dict[str, float] = {"requests": 1}
        status = _int(getattr(record, "status", None))
        reason = getattr(record, "reason", None)
        c["successes" if status is not None and status < 400 else "errors"] = 1
        c[f"s{status // 100}xx" if status is not None and 200 <= status < 600 else "sother"] = 1
        kind = outcome(status, reason)
        c[kind] = 1
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
        missed = getattr(record, "missed_kind", None)
        if missed in ("threshold", "limit", "not_worth"):
            c[f"missed_{missed}"] = _int(getattr(record, "missed_tokens", None)) or 0
            if missed != "not_worth":
                c["missed_ms"] = (_num(getattr(record, "missed_seconds", None)) or 0.0) * 1000.0
        c["restore_bytes"] = _int(getattr(record, "restore_bytes", None)) or 0
        c["save_bytes"] = _int(getattr(record, "save_bytes", None)) or 0
        counts = cls([c.get(name, 0) for name in FIELDS])
        # Latency and TTFT of the generation requests a client did not cause to fail (a 4xx says nothing of them).
        if getattr(record, "api", None) is not None and kind != "client_errors":
            elapsed, ttft = _num(getattr(record, "elapsed_ms", None)), _num(getattr(record, "ttft_ms", None))
            if elapsed is not None and elapsed >= 0:
                counts.latency = Histogram()
                counts.latency.record(elapsed)
            if ttft is not None and ttft >= 0:
                counts.ttft = Histogram()
                counts.ttft.record(ttft)
        name = backend if backend is not None else getattr(record, "backend", None)
        if isinstance(name, str) and name:
            counts.backends = {name: [1, 0.0]}
        return counts

    def to_json(self) -> dict[str, Any]:
        share = self.cached_tokens + self.computed_tokens
        judged = self.served + self.server_errors
        return {
            "requests": self.requests,
            "successes": self.successes,
            "errors": self.errors,
            "served": self.served,
            "client_errors": self.client_errors,
            "server_errors": self.server_errors,
            "success_rate": ratio(self.served, judged),
            "server_error_rate": ratio(self.server_errors, judged),
            "client_error_rate": ratio(self.client_errors, self.requests),
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
            "cached_share": ratio(self.cached_tokens, share),
            "completion_tokens": self.completion_tokens,
            "restore_ms_sum": round(self.restore_ms_sum, 3),
            "restore_ms_avg": _avg(self.restore_ms_sum, self.restore_ms_n),
            "save_ms_sum": round(self.save_ms_sum, 3),
            "save_ms_avg": _avg(self.save_ms_sum, self.save_ms_n),
            "restore_bytes": self.restore_bytes,
            "save_bytes": self.save_bytes,
            "missed_tokens": {"threshold": self.missed_threshold, "limit": self.missed_limit,
                              "not_worth": self.missed_not_worth},
            "missed_secs": round(self.missed_ms / 1000.0, 3),
            "ttft_ms": (self.ttft or Histogram()).summary(),
            "latency_ms": (self.latency or Histogram()).summary(),
            "backends": {name: {"requests": n, "busy_secs": round(busy / 1000, 3)}
                         for name, (n, busy) in sorted((self.backends or {}).items())},
        }

    def point(self, t: int, secs: int) -> dict[str, Any]:
        """This sum as one point of a series: from `t`, lasting `secs` seconds."""
        p: dict[str, Any] = {"t": t, "secs": secs}
        for name in ("requests", "errors", "served", "client_errors", "server_errors", "completion_tokens",
                     "prompt_tokens", "cached_tokens", "computed_tokens"):
            p[name] = self.v[INDEX[name]]
        p["req_per_s"] = round(p["requests"] / secs, 4)
        p["tok_per_s"] = round(p["completion_tokens"] / secs, 4)
        p["cached_per_s"] = round(p["cached_tokens"] / secs, 4)
        p["computed_per_s"] = round(p["computed_tokens"] / secs, 4)
        p["success_rate"] = ratio(self.served, self.served + self.server_errors)
        for prefix, h in (("ttft", self.ttft), ("latency", self.latency)):
            p[f"{prefix}_n"] = h.n if h is not None else 0
            values = h.quantiles(_QS) if h is not None else [None] * len(_QS)
            for (name, _), v in zip(QUANTILES, values, strict=True):
                p[f"{prefix}_{name}"] = v
        # Average busy slots: the backend's compute time (prefill and generation) over the point's length.
        p["backends"] = {name: {"requests": n, "req_per_s": round(n / secs, 4), "busy": round(busy / 1000 / secs, 4)}
                         for name, (n, busy) in sorted((self.backends or {}).items()) if n > 0 or busy > 0}
        return p

    def to_doc(self) -> dict[str, Any]:
        """For the history file: the counters by name (zeros left out), histograms, per-backend load."""
        doc: dict[str, Any] = {"c": {name: v for name, v in zip(FIELDS, self.v, strict=True) if v}}
        if self.ttft is not None and self.ttft.n:
            doc["ttft"] = self.ttft.to_doc()
        if self.latency is not None and self.latency.n:
            doc["latency"] = self.latency.to_doc()
        if self.backends:
            doc["backends"] = {name: [n, round(busy, 3)] for name, (n, busy) in self.backends.items()}
        return doc

    @classmethod
    def from_doc(cls, doc: Any) -> Counts:
        """From `to_doc`'s shape; ValueError for anything else. Counter names this version does not know are left
        out (a newer lpcache's), missing ones are zero."""
        if not isinstance(doc, dict) or not isinstance(doc.get("c"), dict):
            raise ValueError("a sum is an object with counters under 'c'")
        values = [0.0] * len(FIELDS)
        for name, v in doc["c"].items():
            if _num(v) is None or v < 0:
                raise ValueError(f"counter {name!r} is not a number >= 0")
            if name in INDEX:
                values[INDEX[name]] = v
        counts = cls(values)
        if "ttft" in doc:
            counts.ttft = Histogram.from_doc(doc["ttft"])
        if "latency" in doc:
            counts.latency = Histogram.from_doc(doc["latency"])
        backends = doc.get("backends")
        if backends is not None:
            if not isinstance(backends, dict):
                raise ValueError("backends is an object")
            counts.backends = {}
            for name, row in backends.items():
                if not (isinstance(row, list) and len(row) == 2 and all(_num(x) is not None and x >= 0 for x in row)):
                    raise ValueError("a backend's load is [requests, busy ms]")
                counts.backends[name] = [row[0], float(row[1])]
        return counts


def ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 6) if whole else None


def _avg(total: float, n: int) -> float | None:
    return round(total / n, 3) if n else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any) -> int | None:
    return value if _is_int(value) else None


def _num(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
