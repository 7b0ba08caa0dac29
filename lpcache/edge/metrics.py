"""Prometheus metrics at GET /metrics, read from the one record per request and from the live slot state.

Counters and histograms are fed by `Metrics.observe` (an observer like the others); slot occupancy, breaker state
and cache entries are read when scraped, so they are never stale. GET /v1/models and GET /health, which lpcache
answers without a record, are counted by `Metrics.counted`. Each app has its own registry, exposed without the
`_created` samples prometheus_client adds (`_WithoutCreated`).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from lpcache.apis import BY_PATH
from lpcache.backends.admission import CLASSES
from lpcache.cache import agent_ids
from lpcache.cache.worth import MISSED_KINDS
from lpcache.config.version import __version__
from lpcache.flow.record import RequestRecord
from lpcache.flow.session_seed import SEED_SOURCES
from lpcache.flow.unpinned import PINNING_STATES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BREAKER_STATES = ("closed", "open", "half_open")
# Slot saves and restores: a few ms for a small file, minutes for a file of GiBs on a slow or network disk.
SLOT_FILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
Endpoint = Callable[[Request], Awaitable[Response]]


class _Live(Collector):
    """Gauges computed at scrape time from the pipeline."""

    def __init__(self, pipeline: Callable[[], Any], disk: Callable[[], Any]) -> None:
        self.pipeline = pipeline
        self.disk = disk

    def collect(self) -> Iterable[Metric]:
        p = self.pipeline()
        if p is None:
            return
        busy = GaugeMetricFamily("lpcache_slots_busy", "Slots serving a request", labels=["backend"])
        total = GaugeMetricFamily("lpcache_slots", "Slots lpcache knows", labels=["backend"])
        state = GaugeMetricFamily("lpcache_backend_circuit_state", "1 for the breaker's current state",
                                  labels=["backend", "state"])
        pins = GaugeMetricFamily("lpcache_backend_pinning", "1 for the way requests go to the backend now: pinned to "
                                 "a slot, or unpinned (the server's RAM cache serves every return, lpcache neither "
                                 "saves nor restores: the server queues them itself), or switching",
                                 labels=["backend", "state"])
        for b in p.backends:
            slots = [s for s in p.pool.slots if s.backend == b.index]
            busy.add_metric([b.url], sum(1 for s in slots if s.busy))
            total.add_metric([b.url], len(slots))
            for name in BREAKER_STATES:
                state.add_metric([b.url, name], 1.0 if b.breaker.state == name else 0.0)
            for name in PINNING_STATES:
                pins.add_metric([b.url, name], 1.0 if p.unpinned.state.get(b.index) == name else 0.0)
        yield busy
        yield total
        yield state
        yield pins
        yield CounterMetricFamily("lpcache_unpinned_requests", "Requests sent without a slot pin while the "
                                  "backend's requests went unpinned", value=p.unpinned.sent)
        yield GaugeMetricFamily("lpcache_waiting_requests", "Requests waiting for a slot", value=p.pool.waiting)
        by_class = p.pool.waiting_by_class()
        depth = GaugeMetricFamily("lpcache_queue_depth", "Requests waiting for a slot, by priority class",
                                  labels=["priority"])
        for level in CLASSES:
            depth.add_metric([level], by_class[level])
        yield depth
        refused = CounterMetricFamily("lpcache_queue_refused", "Requests refused before waiting for a slot: "
                                      "queue_full (QUEUE_MAX waiters, 429), past_deadline (the predicted wait "
                                      "passed the request's deadline, 503)", labels=["reason"])
        for reason in ("queue_full", "past_deadline"):
            refused.add_metric([reason], p.pool.refused[reason])
        yield refused
        yield GaugeMetricFamily("lpcache_cache_entries", "Saved KV caches in the meta index", value=len(p.index))
        yield GaugeMetricFamily("lpcache_coalesced_groups", "Running coalesced groups", value=len(p.coalescer))
        yield GaugeMetricFamily("lpcache_sessions", "Sessions (X-Session-ID, one per route) lpcache keeps track of "
                                "now (past a bound the least recently used are forgotten, their files kept)",
                                value=len(p.sessions))
        # X-Session-ID values (`session_ids`): hashed to lpcache's form, or rejected (prefix mode) by reason
        yield CounterMetricFamily("lpcache_session_ids_hashed", "X-Session-ID values other than 32 lower-case hex "
                                  "digits, hashed to a session id", value=p.session_ids.hashed)
        rejected = CounterMetricFamily("lpcache_session_ids_rejected", "X-Session-ID values that cannot be a "
                                       "session (served in prefix mode)", labels=["reason"])
        for reason, count in p.session_ids.rejected.items():
            rejected.add_metric([reason], count)
        yield rejected
        sources = CounterMetricFamily("lpcache_session_requests", "Requests served in session mode, by the header "
                                      "their session came from (X-Session-ID or a coding agent's own)",
                                      labels=["source"])
        for source in agent_ids.SOURCES:
            sources.add_metric([source], p.session_ids.sources[source])
        yield sources
        seeds = CounterMetricFamily("lpcache_session_seeds", "Sessions that started anew (a first turn, a file "
                                    "gone, a prompt that left the file's), by what they started from: a slot "
                                    "holding their prefix, a prefix-mode file, another session's file, the "
                                    "parent's, or nothing", labels=["source"])
        for source in SEED_SOURCES:
            seeds.add_metric([source], p.filler.seeds.seeds[source])
        yield seeds
        idle = CounterMetricFamily("lpcache_background_saves", "Slot saves outside requests (idle, shutdown, "
                                   "a router about to unload a model)", labels=["result"])
        idle.add_metric(["ok"], p.saver.background.saves_ok)
        idle.add_metric(["failed"], p.saver.background.saves_failed)
        yield idle
        yield CounterMetricFamily("lpcache_background_save_bytes", "Bytes those saves wrote",
                                  value=p.saver.background.bytes)
        yield GaugeMetricFamily("lpcache_cache_need_rate", "Share of the prompts seen that a later request continued "
                                "when neither a slot nor the server's RAM cache still held them: how often a saved "
                                "cache is needed (BIG_THRESHOLD_WORDS=auto weighs the prefill a file spares by it)",
                                value=p.saver.worth.watch.rate())
        yield CounterMetricFamily("lpcache_cache_evictions", "Saved caches deleted by META_MAX or META_MAX_GIB",
                                  value=p.index.evicted)
        yield CounterMetricFamily("lpcache_restores_lost", "Restores whose chosen cache's file was gone before they "
                                  "ran", value=p.index.lost)
        yield CounterMetricFamily("lpcache_orphan_files_removed", "Files in the slot-save folders no meta file named "
                                  "(left by crashes), deleted after ORPHAN_GRACE_SECONDS",
                                  value=p.index.orphans_removed)
        yield CounterMetricFamily("lpcache_slot_beliefs_corrected", "Slots found holding something else than "
                                  "lpcache believed (GET /slots)", value=p.truth.corrected)
        yield CounterMetricFamily("lpcache_reuse_verdicts", "Times a backend's model was found not to reuse "
                                  "restored caches", value=p.reuse.turned_off)
        yield GaugeMetricFamily("lpcache_cache_bytes", "Bytes of the saved prefix caches, as the servers reported "
                                "them", value=p.index.total_bytes)
        disk = self.disk()
        if disk is not None and disk.value is not None:
            yield GaugeMetricFamily("lpcache_cache_disk_bytes", "Bytes the saved prefix caches' files take on disk, "
                                    "in the slot-save folders lpcache sees (a few seconds old at most)",
                                    value=disk.value)
        fleet = p.fleet
        if fleet is not None:   # REDIS_URL
            stats = fleet.stats
            yield GaugeMetricFamily("lpcache_redis_up", "1 while the shared map follows Redis, 0 while this replica "
                                    "decides alone (REDIS_URL)", value=1.0 if fleet.healthy else 0.0)
            yield CounterMetricFamily("lpcache_redis_calls", "Round trips to Redis for slot claims, releases and "
                                      "shared writes", value=stats.redis_calls)
            yield CounterMetricFamily("lpcache_redis_errors", "Redis calls that failed (down or too slow)",
                                      value=stats.redis_errors)
            yield CounterMetricFamily("lpcache_redis_claim_seconds", "Time requests spent claiming slot leases "
                                      "(the latency Redis adds on a request's way)", value=stats.claim_seconds)
            claims = CounterMetricFamily("lpcache_slot_claims", "Slot claims by outcome: refused (another replica "
                                         "held it), local (Redis down: taken on this replica's word), handover "
                                         "(taken over from this replica's previous request: no round trip)",
                                         labels=["outcome"])
            claims.add_metric(["refused"], stats.claims_refused)
            claims.add_metric(["local"], stats.local_claims)
            claims.add_metric(["handover"], stats.handovers)
            yield claims
            yield GaugeMetricFamily("lpcache_shared_entries", "Index entries in the shared map's local mirror",
                                    value=fleet.map.count("index"))


class _WithoutCreated(Collector):
    """A registry's metrics without their `_created` samples (a third of the output, that Prometheus stores as
    series of their own). prometheus_client's own switch (`disable_created_metrics()`,
    PROMETHEUS_DISABLE_CREATED_SERIES) is global to the process; this one leaves a host application's metrics be."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self.registry.collect():   # built afresh by each collect: changing it changes nothing else
            created = metric.name + "_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class Metrics:
    """`pipeline` and `disk` give the live pipeline and the disk figure (`app.DiskFigure`), None before start."""

    def __init__(self, pipeline: Callable[[], Any], disk: Callable[[], Any] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.disk = disk
        self._exposed = _WithoutCreated(self.registry)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter("lpcache_requests", "Requests finished, by route and HTTP status", ["route", "status"],
                                registry=r)
        self.outcomes = Counter("lpcache_request_outcomes", "Finished requests by pipeline outcome (reason)",
                                ["reason"], registry=r)
        self.prefilter = Counter("lpcache_prefilter_outcomes", "Requests a prefilter rejected or served",
                                 ["plugin", "outcome"], registry=r)
        self.restores = Counter("lpcache_restores", "Slot restores from disk, by result (ok, failed)", ["result"],
                                registry=r)
        self.not_reused = Counter("lpcache_restores_not_reused", "Restores the server did not reuse (it computed "
                                  "the prompt again: sliding-window model without --swa-full, hybrid model)",
                                  registry=r)
        self.restore_seconds = Histogram("lpcache_restore_seconds", "Seconds a slot restore took (the server "
                                         "reading the file)", buckets=SLOT_FILE_BUCKETS, registry=r)
        self.saves = Counter("lpcache_saves", "Slot saves to disk for requests (after the answer, or of what a slot "
                             "held before a swap), by result (ok, failed)", ["result"], registry=r)
        self.disk_bytes = Counter("lpcache_slot_file_bytes", "Bytes of slot files written (save) and read "
                                  "(restore) by the servers", ["action"], registry=r)
        self.save_seconds = Histogram("lpcache_save_seconds", "Seconds a slot save took (the server writing the "
                                      "file)", buckets=SLOT_FILE_BUCKETS, registry=r)
        self.tokens = Counter("lpcache_prompt_tokens", "Prompt tokens the servers took from their cache (cached) "
                              "or computed (computed)", ["source"], registry=r)
        self.completion_tokens = Counter("lpcache_completion_tokens", "Tokens the servers generated", registry=r)
        self.missed_tokens = Counter("lpcache_prefill_missed_tokens", "Prompt tokens computed again that an earlier "
                                     "request had, which a saved cache would have spared, by why there was none: "
                                     "threshold (BIG_THRESHOLD_WORDS did not save it), limit (META_MAX or "
                                     "META_MAX_GIB deleted its file), not_worth (auto judged a file not worth it)",
                                     ["kind"], registry=r)
        self.missed_seconds = Counter("lpcache_prefill_missed_seconds", "Seconds of prefill those tokens took, at the "
                                      "backend's learnt speed", ["kind"], registry=r)
        self.decisions = Counter("lpcache_save_decisions", "BIG_THRESHOLD_WORDS=auto: answered requests by whether "
                                 "their cache was worth a file (worth, probe: saved to learn a save's cost) or not "
                                 "(not_worth, probe_too_short, no_speed; left_to_ram: worth one, left to the "
                                 "server's RAM cache while requests wait)", ["decision"], registry=r)
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.ttft = Histogram("lpcache_time_to_first_token_seconds", "Seconds from a streamed request's arrival "
                              "to its first chunk", buckets=buckets, registry=r)
        self.duration = Histogram("lpcache_request_duration_seconds", "Seconds from a request's arrival to its "
                                  "end, by route", ["route"], buckets=buckets, registry=r)
        self.queue_wait = Histogram("lpcache_queue_wait_seconds", "Seconds a request waited for its slot, by "
                                    "priority class (high, normal, low: `X-Lpcache-Priority`, CLIENT_PRIORITIES)",
                                    ["priority"], buckets=(0.001,) + buckets, registry=r)
        Info("lpcache_build", "The lpcache version and the Python running it", registry=r).info(
            {"version": __version__, "python": platform.python_version()})
        for metric, values in ((self.restores, ("ok", "failed")), (self.saves, ("ok", "failed")),
                               (self.disk_bytes, ("save", "restore")), (self.tokens, ("cached", "computed")),
                               (self.missed_tokens, MISSED_KINDS), (self.missed_seconds, MISSED_KINDS)):
            for value in values:   # at 0 from the start: a rate over them is 0, not "no data"
                self._child(metric, value)
        r.register(_Live(pipeline, disk))

    def _child(self, metric: Any, *labels: str) -> Any:
        """A labelled child, kept: prometheus_client's `labels()` takes a lock and builds a tuple each time."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe(self, record: RequestRecord) -> None:
        route = _route(record.path)
        self._child(self.requests, route, str(record.status or 0)).inc()
        self._child(self.outcomes, record.reason or "ok").inc()
        if record.prefilter is not None:
            plugin, _, outcome = record.prefilter.rpartition(":")
            self.prefilter.labels(plugin, outcome).inc()
        if record.elapsed_ms is not None:
            self._child(self.duration, route).observe(record.elapsed_ms / 1000.0)
        if record.queue_ms is not None:
            self._child(self.queue_wait, CLASSES[record.ticket.priority]).observe(record.queue_ms / 1000.0)
        if record.restored is not None:
            self._child(self.restores, "ok" if record.restored else "failed").inc()
            if record.restore_ms is not None:
                self.restore_seconds.observe(record.restore_ms / 1000.0)
        if record.restore_reused is False:
            self.not_reused.inc()
        if record.save_bytes:
            self.disk_bytes.labels("save").inc(record.save_bytes)
        if record.restore_bytes:
            self.disk_bytes.labels("restore").inc(record.restore_bytes)
        if record.saved is not None:
            self._child(self.saves, "ok" if record.saved else "failed").inc()
            if record.save_ms is not None:
                self.save_seconds.observe(record.save_ms / 1000.0)
        if record.swap_saved is not None:
            self._child(self.saves, "ok" if record.swap_saved else "failed").inc()
            if record.swap_save_ms is not None:
                self.save_seconds.observe(record.swap_save_ms / 1000.0)
        if record.swap_save_bytes:
            self.disk_bytes.labels("save").inc(record.swap_save_bytes)
        if record.cache_n is not None:
            self._child(self.tokens, "cached").inc(record.cache_n)
        if record.prompt_n is not None:
            self._child(self.tokens, "computed").inc(record.prompt_n)
        if record.completion_tokens:
            self.completion_tokens.inc(record.completion_tokens)
        if record.stream and record.ttft_ms is not None:
            self.ttft.observe(record.ttft_ms / 1000.0)
        if record.missed_kind is not None:
            self._child(self.missed_tokens, record.missed_kind).inc(record.missed_tokens or 0)
            self._child(self.missed_seconds, record.missed_kind).inc(record.missed_seconds or 0.0)
        if record.save_decision is not None:
            self._child(self.decisions, record.save_decision).inc()

    def counted(self, route: str, endpoint: Endpoint) -> Endpoint:
        """`endpoint` (one lpcache answers itself, without a record: GET /v1/models, GET /health), counted in
        lpcache_requests_total and timed in lpcache_request_duration_seconds under `route`."""
        def count(status: int, started: float) -> None:
            self._child(self.requests, route, str(status)).inc()
            self._child(self.duration, route).observe(time.monotonic() - started)

        async def counted(request: Request) -> Response:
            started = time.monotonic()
            try:
                response = await endpoint(request)
            except Exception:
                count(500, started)   # what the app's error handler answers
                raise
            count(response.status_code, started)
            return response

        return counted

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format, as GET /metrics serves them (the disk figure as last read)."""
        return generate_latest(self._exposed)

    async def endpoint(self, request: Request) -> Response:
        disk = self.disk()
        if disk is not None:
            await disk.get()   # stats the files in a worker thread, at most every few seconds (`app.DiskFigure`)
        return Response(self.exposition(), media_type=CONTENT_TYPE)


_ROUTES = frozenset({*BY_PATH, "/v1/models", "/health"})


def _route(path: str) -> str:
    """A bounded label: the generation routes (every API's) and a few others by name, the rest as "other"."""
    path = path.split("?", 1)[0]
    return path if path in _ROUTES else "other"
