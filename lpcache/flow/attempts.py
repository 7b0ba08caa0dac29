"""One chat request's way to a backend: take a slot, restore into it if that pays, send; and when the backend
cannot be reached, or drops the connection before any byte went to the client, try another one.

The failed backend is left out of the next try (the failed slot, when there is only one backend), its breaker
opens, and the tries stop at REQUEST_TIMEOUT or when no slot is left to try. The relay asks for a retry through
`retry` when an answer breaks before its first byte reached the client; once bytes went out, it cannot.

A try holds its slot as a `Lease`: whatever is raised while the slot is filled and the request sent (a cancellation
included), the slot goes back; once the answer is open, the lease goes with it to `finish`, and from there to the
save (`Saver.after`), which gives it back. An answer whose body breaks, even an error answer's, is an unreachable
backend (failover); a backend's own error answer is passed on as it came.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from lpcache.backends.backend import Backend
from lpcache.backends.llama import CHAT_PATH, Upstream, unpin
from lpcache.backends.placement import Choice
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import Lease, SlotPool
from lpcache.backends.slot_truth import SlotTruth
from lpcache.backends.slots import Content, Slot
from lpcache.cache.prefix import Prompt, common_prefix
from lpcache.cache.reuse import REUSE_MIN_TOKENS
from lpcache.cache.sessions import route_name
from lpcache.errors import BackendError, BackendUnreachable, ProxyError
from lpcache.flow.coalesce import Coalescer, Group, aggregate_sse
from lpcache.flow.plugin_api import MAX_ANSWER_BYTES, Answer, ChatRequest, Prefilter
from lpcache.flow.record import RequestRecord, now_ns
from lpcache.flow.relay import Headers, session_header
from lpcache.flow.saving import Saver
from lpcache.flow.slot_fill import SlotFiller
from lpcache.flow.unpinned import UnpinnedMode

log = logging.getLogger("lpcache.attempts")
RETRY_MIN_SECONDS = 1.0   # the least time left worth another backend's try (less with a short REQUEST_TIMEOUT)


def answer_tokens(body: dict[str, Any]) -> int | None:
    """The most tokens the request's answer may have, when it says (a short answer frees its slot soon: worth
    waiting for, `slot_fill.SlotFiller.budget`)."""
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class Crew:
    """What one request's tries work with, handed in by the pipeline."""

    backends: list[Backend]
    pool: SlotPool
    filler: SlotFiller
    saver: Saver
    routers: RouterModels
    truth: SlotTruth
    coalescer: Coalescer
    request_timeout: float
    answered: Callable[[ChatRequest, Answer, Sequence[Prefilter]], None]
    notify: Callable[[RequestRecord], None]
    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    unpinned: UnpinnedMode


class Attempts:
    """The tries of one request. `upstream` is the open answer of the current try."""

    def __init__(self, crew: Crew, body: dict[str, Any], prompt: Prompt, big: bool, record: RequestRecord,
                 client_auth: Mapping[str, str] | None, view: ChatRequest | None = None,
                 want: Content | None = None) -> None:
        self.view = view                    # when a prefilter wants the answer (`listeners`): it is kept for them
        self.listeners: Sequence[Prefilter] = ()
        self.collected: bytearray | None = bytearray() if view is not None else None
        self.p = crew
        self.body, self.prompt, self.big, self.record, self.client_auth = body, prompt, big, record, client_auth
        self.want = want                    # session mode: the session's cache the slot must hold
        self.excluded: set[int] = set()    # backends that failed this request
        self.failed: set[Slot] = set()      # slots that failed this request
        self.asked_to_pin = False           # it asked for requests to be pinned again (`_pins_for_file`)
        self.deadline = time.monotonic() + crew.request_timeout
        self.choice: Choice | None = None
        self.backend: Backend | None = None
        self.lease: Lease | None = None     # the current try's slot, until given back or handed to the save
        self.upstream: Upstream | None = None
        self.sent = False                   # the current try's request went to the backend
        self.sent_ns = 0                    # ... when (wall clock, ns), and when its answer was read whole
        self.answered_ns: int | None = None
        self.group: Group | None = None     # when coalescing: the followers waiting for this answer
        self.tail: bytes | None = None      # how a broken stream ended for the client (`ended_with`)
        self.path = CHAT_PATH               # llama-server's route for the request (`apis.Call.upstream_path`)
        self.unpinned: int | None = None    # the backend this try went to unpinned (`flow.unpinned`), until over
        self.early = False                  # ... and gave its slot back at its first token

    # ---- what the relay uses ----

    async def start(self) -> Upstream:
        """Send the request, failing over while backends cannot be reached. Raises ProxyError."""
        while True:
            try:
                self.upstream = await self._once()
                return self.upstream
            except BackendUnreachable as e:
                self._failed(e)

    async def retry(self, error: BaseException) -> Upstream:
        """The answer broke before the client got a byte of it: try again elsewhere. Raises ProxyError."""
        if self.upstream is not None:
            self.upstream.close()
        self._failed(error if isinstance(error, BackendUnreachable) else BackendUnreachable(
            f"backend dropped the answer: {type(error).__name__}: {error}", code="backend_unreachable"))
        return await self.start()

    def headers(self) -> Headers:
        assert self.choice is not None and self.backend is not None
        slot = self.choice.slot.id if self.unpinned is None else -1   # -1: the server chose it (llama-server's "any")
        return [(b"x-lpcache-slot", f"{self.backend.index}:{slot}".encode()),
                (b"x-lpcache-restored", b"true" if self.record.restored else b"false"),
                (b"x-lpcache-cache-hit", b"true" if self.record.cache_hit else b"false"),
                *session_header(self.want.session if self.want is not None else None)]

    def tee(self, chunk: bytes) -> None:
        """A piece of the answer, as it goes to the client: the followers get it too."""
        if self.group is not None:
            self.group.feed(chunk)
        if self.collected is not None:
            if len(self.collected) + len(chunk) > MAX_ANSWER_BYTES:
                self.collected = None   # too big to keep: streamed on, not told to the prefilters
            else:
                self.collected += chunk

    def ended_with(self, tail: bytes) -> None:
        """The stream broke after bytes went out and ended with `tail` (its error event, in the client's format):
        streaming followers end theirs with the same bytes."""
        self.tail = tail

    def streaming(self) -> None:
        """The client got the head of a 200 stream, sent with its first token: coalesced followers that stream get
        the same, even if it ends with an error event before any whole event; the server's prefill of it is over,
        so a request waiting for this slot decides again how long (`SlotPool.progressed`)."""
        if self.group is not None:
            self.group.start()
        if self.choice is not None:
            self.choice.slot.first_token_at = time.monotonic()
            self.p.pool.progressed(self.choice.slot)
        if self.unpinned is not None and self.lease is not None and not self.lease.returned:
            # unpinned: the server queues the next request itself, so it is sent now, while this one generates
            # (still its client's: `generating`; not a hold time, nor a share kept, as a whole request's would be)
            self.lease.give_back(None, hold=False)
            self.p.unpinned.generating(self.record.ticket.client, 1)
            self.early = True

    def end_group(self, error: dict[str, Any] | None, status: int | None = None) -> None:
        """Tell the followers the answer is complete (error None) or failed, and let a new group start."""
        if self.group is None:
            return
        if error is None:
            self.group.finish(200)
        else:
            self.record.reason = self.record.reason or "coalesce_leader_failed"
            self.group.fail(error, status, self.tail)
        self.p.coalescer.close(self.group)
        self.group = None

    def generated(self) -> None:
        """The backend's answer is read whole: what is left of the slot's use is bookkeeping (a save), soon done,
        so a request that wants this slot may wait for it."""
        if self.choice is not None and self.unpinned is None and self.lease is not None and not self.lease.returned:
            self.choice.slot.phase = "save"
        self.answered_ns = now_ns()

    def finish(self, delivered: bool, complete: bool | None = None) -> None:
        """The answer is over (delivered whole, or the client left, or it broke): save, release, tell observers.
        `complete`: the backend's answer was read whole (for coalesced followers), even if the client left."""
        complete = delivered if complete is None else complete
        if self.unpinned is not None:   # whatever is raised here, the try is counted as over
            try:
                self._finished(complete)
            finally:
                self._unpinned_over(True)
            return
        self._finished(complete)
        lease, backend = self.lease, self.backend
        if lease is None or lease.returned or backend is None:
            self.p.notify(self.record)
            return
        choice, self.lease, self.choice = lease.choice, None, None
        choice.slot.phase = "save"
        # The prompt was read to its end when the answer (or its first token) came: only then does the slot hold it.
        prefilled = delivered or self.record.ttft_ms is not None or self.record.cache_n is not None
        held = self.held_blocks(choice)
        try:
            self.p.filler.judge(choice, backend, self.prompt, self.record)
            route = route_name(self.prompt.model)
            if backend.router and route in backend.slots_guessed:   # the request loaded the model: count its slots
                self.p.spawn(self.p.routers.recount_slots(backend, route))
        finally:   # the save gives the slot back, whatever happened above
            self.p.spawn(self.p.saver.after(lease, backend, self.prompt, self.big, self.record, self.want,
                                            prefilled, held))

    def _finished(self, complete: bool) -> None:
        """What every answer's end does first: the call's steps, the followers told, the prefilters' answer."""
        if self.sent:
            self.note_call()
        self.end_group(None if complete else {"error": {
            "message": f"the shared answer did not complete ({self.record.reason or 'failed'})",
            "type": "backend_error", "code": 502}})
        if complete and self.view is not None and self.collected is not None:
            self.p.answered(self.view, _answer(bytes(self.collected), self.view.stream), self.listeners)
        self.collected = None

    def note_call(self) -> None:
        """The call to llama-server as steps: the call, and within it the prefill and the generation as the server
        timed them (`timings`), laid end to end up to the moment the answer was read whole (what comes before the
        prefill is the server's own queue, a RAM cache's load, the request's way)."""
        record, start = self.record, self.sent_ns
        end = self.answered_ns or now_ns()
        record.step("llama_server", start, end, backend=record.backend, slot=record.slot, cache_n=record.cache_n,
                    prompt_n=record.prompt_n, completion_tokens=record.completion_tokens)
        generated = max(end - round((record.gen_ms or 0.0) * 1e6), start)
        if record.prefill_ms is not None:
            record.step("prefill", max(generated - round(record.prefill_ms * 1e6), start), generated,
                        cache_n=record.cache_n, prompt_n=record.prompt_n)
        if record.gen_ms is not None:
            record.step("generation", generated, end, completion_tokens=record.completion_tokens)

    def note_failed_call(self, error: ProxyError) -> None:
        """A call to llama-server that failed (no answer, an error answer, an answer broken before the client got
        a byte): a step of its own, marked failed, so a trace shows each try."""
        if self.sent:
            self.record.step("llama_server", self.sent_ns, ok=False, backend=self.record.backend,
                             slot=self.record.slot, status=error.status, error=error.message[:200])

    def held_blocks(self, choice: Choice) -> int:
        """Identity blocks of the prompt the slot held before the request was sent."""
        if self.record.restored and self.record.restore_exact and choice.restore is not None:
            return choice.restore.shared
        return choice.resident

    def cancelled(self) -> None:
        """The request was cancelled (the client left) before its answer started."""
        if self.unpinned is not None:   # the server lets go of it itself (a pinned request waits for that)
            self._unpinned_over(False)
            self.p.notify(self.record)
            return
        if self.lease is not None and not self.lease.returned and self.sent:
            # The backend was computing: the save waits until the server lets go of the slot, then gives it back;
            # what the slot held before is still there (nothing partial is saved).
            self.finish(False)
            return
        self._release(None)
        self.p.notify(self.record)

    # ---- one try ----

    def allowed(self) -> Callable[[Slot], bool]:
        """Slots this request may take: not failed for it, on a backend whose breaker lets requests through (or,
        when no untried backend does, on any untried backend: trying beats refusing)."""
        backends = self.p.backends
        route = route_name(self.prompt.model)

        def ok(slot: Slot) -> bool:
            if slot in self.failed or slot.backend in self.excluded:
                return False
            if slot.model is not None and slot.model != route:
                return False   # a router's slot of another model
            if backends[slot.backend].available():
                return True
            return not any(b.available() for b in backends if b.index not in self.excluded)

        return ok

    def _file_blocks(self, choice: Choice, backend: Backend) -> int:
        """How much of the prompt a saved file would bring once pinned: the one placement chose to restore (prefix
        mode, a new session's seed), or a session's own file (kept: a session whose file is gone starts anew, and
        is seeded as placement decides)."""
        if choice.restore is not None:
            return choice.restore.shared
        if self.want is None or choice.seed or not self.p.filler.enabled(backend, self.prompt.model):
            return 0
        info = self.p.filler.sessions.get(self.want.key)
        return common_prefix(info.saved_chain, self.prompt.exact) if info is not None and info.saved_chain else 0

    def _pins_for_file(self, choice: Choice, backend: Backend) -> bool:
        """Whether this request, handed a slot of a backend whose requests go unpinned, waits for them to be
        pinned again instead, to restore a file the server's RAM lacks (`UnpinnedMode.pins_for_file`): asked once
        a request, so a switch called off, or undone before its turn came, does not make it ask again."""
        unpinned = self.p.unpinned
        if self.asked_to_pin or not unpinned.unpinned(backend.index):
            return False
        self.asked_to_pin = unpinned.pins_for_file(backend, self.prompt, self._file_blocks(choice, backend))
        return self.asked_to_pin

    async def _once(self) -> Upstream:
        self.sent = False
        waited_from = now_ns()   # checking what the slots hold is part of the way to one (`slot_wait`)
        await self.p.routers.model_slots(self.prompt.model)
        await self.p.truth.check()
        while True:
            choice = await self.p.filler.take_slot(self.prompt, self.record, self.allowed(), self.want,
                                                   answer_tokens(self.body))
            self.record.step("slot_wait", waited_from, route=self.record.route, backend=self.record.backend,
                             slot=choice.slot.id, shared_blocks=choice.reused,
                             restore_file=choice.restore.entry.key if choice.restore is not None else None,
                             restore_skipped=choice.skipped, prompt_blocks=len(self.prompt.exact))
            waited_from = now_ns()
            backend = self.p.backends[choice.slot.backend]
            # Claimed before anything awaits: when the backend is half-open, this try is its one probe, and no
            # other passes `allowed` meanwhile.
            probe = backend.breaker.claim(time.monotonic())
            if probe or self.allowed()(choice.slot):
                if not self._pins_for_file(choice, backend):
                    break
                if probe:   # requests are pinned again first: this one waits for it, and chooses again
                    backend.breaker.unclaim()
            # another try took the backend's one probe while this one waited for the slot: choose again (in its
            # place in line, `RequestRecord.ticket`; no hold counted: it served nothing)
            self.p.filler.release_choice(choice)
            choice.slot.taken_at = 0.0
            self.p.pool.release(choice.slot, True, used=False)
        # Whatever is raised below gives the slot back; what it then holds: unknown, unless said otherwise.
        lease = Lease(self.p.pool, choice)
        self.lease, self.choice, self.backend = lease, choice, backend
        if self.p.unpinned.unpinned(backend.index):
            self.unpinned = backend.index
            self.p.unpinned.began(backend.index)
        async with lease:
            try:
                filled_from = now_ns()
                if self.unpinned is None:
                    await self.p.filler.prepare(choice, backend, self.prompt, self.want, self.record)
                else:   # the server chooses the slot, and finds what it holds of the prompt itself
                    self.p.filler.release_choice(choice)
                    self.p.pool.handed_over(choice.slot)
                    # no restore tried, none skipped: none counted
                    self.record.route, self.record.slot, self.record.restore_skipped = "unpinned", -1, None
                    unpin(self.body)
                self.record.step("slot_fill", filled_from, restored=self.record.restored,
                                 saved_previous=self.record.swap_saved)
                if self.want is None and not self.record.restored:
                    self.record.cache_hit = choice.resident > 0
                self.sent, self.sent_ns, self.answered_ns = True, now_ns(), None
                sent_at = time.monotonic()
                choice.slot.phase, choice.slot.sent_at = "generate", sent_at
                upstream = await backend.client.chat(self.body, choice.slot.id if self.unpinned is None else None,
                                                     self.path, self.client_auth)
                # its answer began: the server launched it, and copied every slot idle when it did (`ram_reach.holds`)
                # to its RAM. Not at the send: the server tokenizes first, and a restore sent meanwhile by another
                # request may reach its queue before this launch, replacing a slot's cache it had not copied yet.
                backend.launched_at = max(backend.launched_at, sent_at)
            except BackendUnreachable:
                raise   # `start` fails over (`_failed`)
            except asyncio.CancelledError:
                if probe:
                    backend.breaker.unclaim()
                if self.sent:
                    lease.keep()   # the server is computing: `cancelled` gives the slot back once it let go
                else:
                    self._unpinned_over(False)
                raise
            except BackendError as e:
                self.note_failed_call(e)
                if self.sent:   # the backend's own error answer: passed on, not retried
                    if e.status >= 500 and e.status != 501:
                        backend.failed(f"HTTP {e.status}: {e.message}", down=False)
                    else:
                        backend.succeeded()
                elif probe:
                    backend.breaker.unclaim()
                self.record.reason = _reason(e)
                lease.give_back(True)   # it holds what `prepare` left in it (slot.content is kept true)
                self._unpinned_over(False)
                raise
            except BaseException as e:
                if probe:
                    backend.breaker.unclaim()
                self.record.reason = _reason(e)
                lease.give_back(True)
                self._unpinned_over(False)
                raise
        backend.succeeded()
        return upstream

    def _failed(self, error: BackendUnreachable) -> None:
        """This try's backend could not be reached: mark it, free the slot, and give up when nothing is left."""
        if self.choice is None or self.backend is None:   # it failed before a slot was taken
            self.record.reason = "backend_unreachable"
            raise error
        backend, slot = self.backend, self.choice.slot
        self.note_failed_call(error)
        backend.failed(error.message)
        self._release(None)
        self.failed.add(slot)
        if len(self.p.backends) > 1:
            self.excluded.add(backend.index)
        self.record.retries += 1
        ok = self.allowed()
        # a try needs time to be worth it: a tenth of REQUEST_TIMEOUT, at most a second (a backend that hung for
        # the whole timeout leaves none, whatever the timers' jitter; one refused at once leaves nearly all)
        spare = min(RETRY_MIN_SECONDS, 0.1 * self.p.request_timeout)
        if time.monotonic() >= self.deadline - spare or not any(ok(s) for s in self.p.pool.slots):
            self.record.reason = "backend_unreachable"
            raise error
        log.warning("failover from=%s#%d reason=%s try=%d", backend.url, slot.id, error.message,
                    self.record.retries + 1)

    def _release(self, content: Content | None | bool) -> None:
        if self.lease is not None:
            self.lease.give_back(content)
        self.lease = self.choice = None
        self._unpinned_over(False)

    def _unpinned_over(self, answered: bool) -> None:
        """An unpinned try is over: its slot back (content unknown: the server chose where it ran), counted once
        as ended; when `answered` (its answer over, delivered or not), the speeds learnt, `cache_n` judged and the
        observers told."""
        backend_index, self.unpinned = self.unpinned, None
        if backend_index is None:
            return
        backend = self.p.backends[backend_index]
        if self.lease is not None:
            self.lease.give_back(None)
        self.lease = self.choice = None
        if self.early:
            self.p.unpinned.generating(self.record.ticket.client, -1)
            self.early = False
        try:
            if answered and self.record.cache_n is not None:
                self.record.cache_hit = self.record.cache_n >= REUSE_MIN_TOKENS   # the server found it itself
                self.p.saver.learn(backend, self.prompt, self.record)
                self.p.unpinned.judge(backend, self.prompt, self.record)
        finally:
            self.p.unpinned.ended(backend_index)
            if answered:
                self.p.notify(self.record)


def _reason(e: BaseException) -> str:
    if isinstance(e, BackendError):
        return f"provider_http_{e.status}"
    if isinstance(e, ProxyError):
        return {502: "backend_unreachable", 503: "slot_timeout"}.get(e.status, "backend_error")
    return "internal_error"


def _answer(raw: bytes, stream: bool) -> Answer:
    """The answer as prefilters get it: a chat.completion (for a stream, built from its events)."""
    try:
        completion = aggregate_sse(raw) if stream else orjson.loads(raw)
    except (ValueError, TypeError, KeyError):
        completion = None
    return Answer(200, completion if isinstance(completion, dict) else None, stream, raw)
