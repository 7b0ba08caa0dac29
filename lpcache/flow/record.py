"""The one record each request leaves: the pipeline fills it, observers (log, dashboard, metrics) read it.

None of the observers collects facts of its own, so they never disagree about a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lpcache.backends.admission import Ticket

log = logging.getLogger("lpcache.request")


@dataclass(slots=True)
class Step:
    """One step lpcache took for a request (waiting for its slot, a save, a restore, the call to llama-server), as
    wall-clock nanoseconds: the dashboard shows them and, with tracing on, each becomes a span (`edge.tracing`)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


def now_ns() -> int:
    return time.time_ns()


@dataclass
class RequestRecord:
    method: str = "POST"
    path: str = ""
    client_ip: str | None = None
    user_agent: str | None = None
    bytes_in: int | None = None
    started: float = field(default_factory=time.time)
    elapsed_ms: float | None = None
    status: int | None = None
    bytes_out: int = 0
    api: str | None = None             # chat, responses, messages, completions, infill (lpcache.apis); None: other
    model: str | None = None
    stream: bool | None = None
    key: str | None = None
    n_words: int | None = None
    big: bool | None = None
    backend: str | None = None
    slot: int | None = None
    restored: bool | None = None
    cache_hit: bool | None = None      # the slot already held a prefix of the prompt, or a restore brought one
    coalesced: bool | None = None
    reason: str | None = None          # None on success, else a short outcome (backend_error, slot_timeout...)
    prefilter: str | None = None       # "<plugin>:reject" or "<plugin>:serve" when a prefilter decided
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_n: int | None = None        # tokens the backend computed for the prompt (timings.prompt_n)
    cache_n: int | None = None         # tokens it took from the slot (timings.cache_n)
    prefill_ms: float | None = None
    gen_ms: float | None = None
    prefill_tps: float | None = None
    gen_tps: float | None = None
    ttft_ms: float | None = None
    restore_ms: float | None = None
    restore_bytes: int | None = None   # read by the server from the slot file
    restored_tokens: int | None = None # tokens the restore put in the slot
    restore_share: float | None = None # share of the prompt's blocks the restored cache held
    restore_reused: bool | None = None # False: the server re-computed the prompt anyway (see Pipeline.check_reuse)
    route: str | None = None           # why this slot: resident, restore, session, server_ram, prefill (`slot_fill`)
    restore_skipped: bool | None = None  # True: a prefill was faster at this backend's speeds (lpcache.cache.speeds)
    restore_exact: bool | None = None  # the restored file's content matched the prompt exactly (not a word guess)
    restore_expected: float | None = None  # tokens the restore should have brought (judged against cache_n)
    restore_lost: bool | None = None   # True: the chosen cache's file was gone before its restore (eviction)
    restore_file: str | None = None    # the file restored (prefix mode)
    saved: bool | None = None
    save_file: str | None = None       # the file the slot was saved to
    save_ms: float | None = None
    save_bytes: int | None = None      # written by the server to the slot file
    retries: int = 0                   # failovers to another backend or slot
    session: str | None = None         # its session, when it names a valid one (session mode)
    session_source: str | None = None  # where that session came from (`agent_ids.SOURCES`: a header's name)
    seeded: str | None = None          # a new session's first turn started from: resident, file, session, parent
    ticket: Ticket = field(default_factory=Ticket)   # its client and priority class in the line (`admission`)
    max_wait: float | None = None      # the longest it may wait for a slot, when it asked (else SLOT_WAIT_TIMEOUT)
    queue_ms: float | None = None      # how long it waited for its slot
    swap_saved: bool | None = None     # the slot's previous cache was saved before this request used the slot
    swap_save_ms: float | None = None
    swap_save_bytes: int | None = None
    saved_for_ram: bool = False        # ... only because a restore would take it out of the server's RAM reach
    ram_expected: float | None = None  # tokens lpcache left to the server's RAM prompt cache (no file restored)
    save_decision: str | None = None   # BIG_THRESHOLD_WORDS=auto: why its cache was saved or not (`worth.DECISIONS`)
    missed_kind: str | None = None     # it computed again what an earlier request had (`worth.Worth.came_back`):
    missed_tokens: int | None = None   # ... why no file spared it (threshold, limit, not_worth), how many tokens,
    missed_seconds: float | None = None  # ... and their prefill's seconds at the backend's speed
    steps: list[Step] = field(default_factory=list)   # what lpcache did for it, and when (`step`)
    traceparent: str | None = None     # the client's W3C trace context, when it sent one (`edge.tracing`) ...
    tracestate: str | None = None
    trace_id: str | None = None        # ... and the trace its spans went to (32 hex), once exported

    def step(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
        """Note a step of the request, from `start_ns` until `end_ns` (now when None)."""
        self.steps.append(Step(name, start_ns, time.time_ns() if end_ns is None else end_ns, attributes))

    def take_usage(self, doc: dict[str, Any]) -> None:
        """Copy the backend's `usage` and `timings` from a completion (or the last SSE chunk). A Responses answer
        has its usage under `response` in a stream, and names it `input_tokens` (cached ones included); its JSON
        has no `timings`: the cached and computed parts come from the usage then."""
        response = doc.get("response")
        usage = response.get("usage") if isinstance(response, dict) else doc.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _int(usage.get("prompt_tokens", usage.get("input_tokens")), self.prompt_tokens)
            self.completion_tokens = _int(usage.get("completion_tokens", usage.get("output_tokens")),
                                          self.completion_tokens)
            details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
            if isinstance(details, dict):
                self.cached_tokens = _int(details.get("cached_tokens"), self.cached_tokens)
            if not isinstance(doc.get("timings"), dict) and self.cached_tokens is not None:
                self.cache_n = self.cached_tokens
                if self.prompt_tokens is not None:
                    self.prompt_n = self.prompt_tokens - self.cached_tokens
        timings = doc.get("timings")
        if isinstance(timings, dict):
            self.cache_n = _int(timings.get("cache_n"), self.cache_n)
            self.prompt_n = _int(timings.get("prompt_n"), self.prompt_n)
            self.prefill_ms = _num(timings.get("prompt_ms"), self.prefill_ms)
            self.gen_ms = _num(timings.get("predicted_ms"), self.gen_ms)
            self.prefill_tps = _num(timings.get("prompt_per_second"), self.prefill_tps)
            self.gen_tps = _num(timings.get("predicted_per_second"), self.gen_tps)
            if self.completion_tokens is None:
                self.completion_tokens = _int(timings.get("predicted_n"), None)
            if self.prompt_tokens is None and self.prompt_n is not None and self.cache_n is not None:
                self.prompt_tokens = self.prompt_n + self.cache_n
            if self.cached_tokens is None:
                self.cached_tokens = self.cache_n


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _num(value: Any, default: float | None) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


Observer = Callable[[RequestRecord], None]


def log_record(record: RequestRecord) -> None:
    """The built-in observer: one line per chat request."""
    if record.key is None and record.reason is None:
        return
    log.info(
        "request_done status=%s stream=%s words=%s big=%s slot=%s restored=%s cache_n=%s prompt_n=%s ttft_ms=%s "
        "saved=%s reason=%s ms=%.1f key=%s route=%s session=%s%s",
        record.status, record.stream, record.n_words, record.big,
        None if record.slot is None else f"{record.backend}#{record.slot}", record.restored, record.cache_n,
        record.prompt_n, None if record.ttft_ms is None else round(record.ttft_ms, 1), record.saved,
        record.reason or "-", record.elapsed_ms or 0.0, (record.key or "-")[:16], record.route or "-",
        (record.session or "-")[:24], f" trace={record.trace_id}" if record.trace_id else "",
    )
