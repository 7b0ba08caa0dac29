"""The pinned / unpinned switches (`flow.unpinned`): when a backend's requests go unpinned, and that the two kinds
never overlap: no slot is handed out while a switch waits for the other kind to end."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from lpcache.backends.backend import Backend
from lpcache.backends.placement import Want
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Content
from lpcache.cache.prefix import Prompt
from lpcache.cache.server_cache import RAM_BET_SECONDS, RAM_TRUST, ServerCaches
from lpcache.cache.speeds import SpeedBook
from lpcache.config import BackendConfig, Settings
from lpcache.errors import ProxyError
from lpcache.flow.record import RequestRecord
from lpcache.flow.unpinned import QUIET_REQUESTS, SWITCH_SECONDS, UnpinnedMode


class _Client:
    """GET /slots as told: busy for the first `busy_polls` calls, each answer `delay` seconds late."""

    def __init__(self, busy_polls: int = 0, delay: float = 0.0) -> None:
        self.busy_polls = busy_polls
        self.delay = delay
        self.polls = 0

    async def slots(self, model: str | None = None) -> list[dict[str, Any]]:
        self.polls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return [{"id": i, "is_processing": self.polls <= self.busy_polls} for i in range(2)]


def _setup(threshold: int | None = None, backends: int = 1, busy_polls: int = 0) -> tuple[UnpinnedMode, Backend,
                                                                                         SlotPool, list[Any]]:
    configs = tuple(BackendConfig(f"http://b{i}", None, "/tmp") for i in range(backends))
    bs = [Backend(i, c, _Client(busy_polls), 2) for i, c in enumerate(configs)]  # type: ignore[arg-type]
    pool = SlotPool([s for b in bs for s in b.slots()])
    spawned: list[Any] = []
    saver = SimpleNamespace(server_caches=ServerCaches(), observe=None)
    mode = UnpinnedMode(Settings(backends=configs, big_threshold_words=threshold), bs, pool, SpeedBook(),
                        saver, lambda coro: spawned.append(asyncio.ensure_future(coro)))  # type: ignore[arg-type]
    assert saver.observe == mode.observe
    return mode, bs[0], pool, spawned


def _trusted(backend: Backend, hits: int = RAM_TRUST) -> None:
    for _ in range(hits):
        backend.ram.seen(True, time.monotonic(), 8192)


def _quiet(mode: UnpinnedMode, backend: Backend, n: int = QUIET_REQUESTS) -> None:
    for _ in range(n):
        mode.observe(backend, RequestRecord())


def _unpinned_now(busy_polls: int = 0) -> tuple[UnpinnedMode, Backend, SlotPool, list[Any]]:
    """One backend whose RAM the check trusts, after enough quiet pinned requests: its requests go unpinned."""
    mode, backend, pool, spawned = _setup(busy_polls=busy_polls)
    _trusted(backend)
    _quiet(mode, backend)
    assert mode.state[0] == "unpinned"
    return mode, backend, pool, spawned


LONG_TURN = {"role": "user", "content": "A long conversation, déjà vu. " * 60}


def _held(mode: UnpinnedMode, *before: dict[str, str]) -> Prompt:
    """A long prompt (after `before`'s messages) that a slot of backend 0 held: its server copies it to its RAM."""
    prompt = Prompt.of("m", [*before, LONG_TURN], 10)
    mode.server_caches.held(0, prompt.exact)
    return prompt


def _answer(mode: UnpinnedMode, backend: Backend, prompt: Prompt, record: RequestRecord) -> None:
    """One unpinned request, sent and answered with `record`'s cache_n."""
    mode.began(0)
    mode.judge(backend, prompt, record)
    mode.ended(0)


def test_quiet_requests_behind_a_trusted_ram_switch_once_the_pinned_ones_are_over() -> None:
    async def run() -> None:
        mode, backend, pool, _ = _setup()
        _quiet(mode, backend)
        assert mode.state[0] == "pinned"   # the RAM never seen: pinned
        mode.observe(backend, RequestRecord(saved=True))   # a save: the count starts again
        _trusted(backend)
        _quiet(mode, backend, QUIET_REQUESTS - 1)
        assert mode.state[0] == "pinned"
        busy = (await pool.acquire(Want())).slot           # a pinned request still under way
        busy.content = Content("k", (1, 2))
        _quiet(mode, backend, 1)
        assert mode.state[0] == "to_unpinned" and mode.closed(0) and not mode.unpinned(0)
        assert pool.idle() == []                           # nothing handed out meanwhile: the pinned one runs
        waiter = asyncio.ensure_future(pool.acquire(Want()))
        await asyncio.sleep(0)
        assert not waiter.done()
        pool.release(busy)
        choice = await waiter
        assert mode.state[0] == "unpinned" and mode.unpinned(0)
        assert all(s.content is None for s in pool.slots)  # the server chooses the slots from now on
        assert not await pool.take_idle(pool.slots[1])    # no slot action of lpcache's own meanwhile
        pool.release(choice.slot)

    asyncio.run(run())


def test_a_save_made_only_so_that_a_restore_keeps_the_ram_s_reach_is_quiet_and_any_other_is_not() -> None:
    async def run() -> None:
        mode, backend, _, _ = _setup()
        _trusted(backend)
        _quiet(mode, backend, QUIET_REQUESTS - 1)
        mode.observe(backend, RequestRecord(swap_saved=True))   # what the slot held, saved as a file worth keeping
        assert mode.state[0] == "pinned" and mode.quiet[0] == 0
        _quiet(mode, backend, QUIET_REQUESTS - 1)
        mode.observe(backend, RequestRecord(saved=True, swap_saved=True, saved_for_ram=True))   # its own, saved
        assert mode.state[0] == "pinned" and mode.quiet[0] == 0
        _quiet(mode, backend, QUIET_REQUESTS - 1)
        # saved only because the restore before it would have taken it out of the server's RAM reach: unpinned,
        # the RAM would have kept it and served the restored prompt, so the count goes on
        mode.observe(backend, RequestRecord(swap_saved=True, saved_for_ram=True))
        assert mode.state[0] == "unpinned"

    asyncio.run(run())


def test_caches_not_worth_a_file_on_a_server_whose_ram_the_check_found_go_unpinned_before_the_ram_is_trusted() -> None:
    def unworthy(mode: UnpinnedMode, backend: Backend, n: int, **fields: Any) -> None:
        for _ in range(n):
            mode.observe(backend, RequestRecord(save_decision="not_worth", **fields))

    async def run() -> None:
        mode, backend, _, _ = _setup()
        backend.ram.present = True                          # the check found a RAM cache
        unworthy(mode, backend, QUIET_REQUESTS - 1)
        mode.observe(backend, RequestRecord(save_decision="probe_too_short"))   # nothing said of what a file is worth
        unworthy(mode, backend, QUIET_REQUESTS - 1)
        mode.observe(backend, RequestRecord(save_decision="not_worth", restored=True))   # a file spared a prefill
        unworthy(mode, backend, QUIET_REQUESTS - 1)
        mode.observe(backend, RequestRecord(save_decision="left_to_ram"))   # worth a file: files do pay here
        unworthy(mode, backend, QUIET_REQUESTS - 1)
        assert mode.state[0] == "pinned" and mode.quiet[0] >= QUIET_REQUESTS
        backend.ram.seen(False, time.monotonic(), 0)        # the RAM missed a return lately
        unworthy(mode, backend, 1)
        assert mode.state[0] == "pinned" and mode.unworthy[0] == QUIET_REQUESTS
        backend.ram.outcomes.clear()
        for present in (None, False):                       # not asked whether it has a RAM, or it has none
            backend.ram.present = present
            unworthy(mode, backend, 1)
            assert mode.state[0] == "pinned"
        backend.ram.present = True                          # found by the check, no outcome yet: enough
        unworthy(mode, backend, 1)
        assert mode.state[0] == "unpinned" and mode.unworthy[0] == 0

    asyncio.run(run())


def test_a_miss_pins_again_only_after_every_unpinned_request_and_the_server_s_slots() -> None:
    async def run() -> None:
        mode, backend, pool, spawned = _unpinned_now(busy_polls=2)
        prompt = _held(mode)
        first = (await pool.acquire(Want())).slot
        mode.began(0)
        pool.release(first, None)                          # at its first token: its place goes to the next
        second = (await pool.acquire(Want())).slot
        mode.began(0)
        mode.judge(backend, prompt, RequestRecord(cache_n=3, prompt_tokens=700))   # the server lost it
        assert mode.state[0] == "to_pinned" and pool.idle() == []
        mode.ended(0)                                      # one over, one still under way
        pool.release(second, None)
        assert mode.state[0] == "to_pinned" and pool.idle() == []
        mode.ended(0)
        assert mode.state[0] == "draining" and pool.idle() == []   # the server says its slots are busy, still
        await asyncio.gather(*spawned)
        assert mode.state[0] == "pinned" and len(pool.idle()) == 2 and backend.suspect
        assert backend.client.polls >= 2 + 2               # type: ignore[attr-defined]   # idle twice in a row
        _quiet(mode, backend)
        assert mode.state[0] == "pinned"                   # the miss is remembered: no switch back yet

    asyncio.run(run())


def test_a_return_the_server_held_keeps_requests_unpinned() -> None:
    async def run() -> None:
        mode, backend, _, _ = _unpinned_now()
        prompt = _held(mode)
        record = RequestRecord(cache_n=690, prompt_tokens=700)
        _answer(mode, backend, prompt, record)
        assert mode.state[0] == "unpinned" and record.ram_expected and all(backend.ram.recent(time.monotonic()))

    asyncio.run(run())


def test_only_a_miss_seen_unpinned_pins_again() -> None:
    """A pinned request still under way as requests went unpinned may miss for pinning's own reason (its previous
    turn, answered in the other slot, not yet copied to the RAM when its slot looked there): its outcome, recorded
    as the switch ends, does not pin again; a miss of an unpinned request does."""
    async def run() -> None:
        mode, backend, _, _ = _unpinned_now()
        backend.ram.seen(False, time.monotonic(), 27)      # the last pinned request's outcome
        prompt = _held(mode, {"role": "system", "content": "Tu es un assistant. 🙂"})
        _answer(mode, backend, prompt, RequestRecord(cache_n=690, prompt_tokens=700))
        assert mode.state[0] == "unpinned" and not all(backend.ram.recent(time.monotonic()))
        _answer(mode, backend, prompt, RequestRecord(cache_n=3, prompt_tokens=700))   # the server lost it
        assert mode.state[0] in ("to_pinned", "draining")

    asyncio.run(run())


def test_a_miss_seen_before_a_restart_does_not_pin_again() -> None:
    async def run() -> None:
        mode, backend, _, _ = _unpinned_now()
        prompt = _held(mode)
        mode.pinned_after[0] = time.monotonic() + 60.0     # a switch back called off lately: not yet
        _answer(mode, backend, prompt, RequestRecord(cache_n=3, prompt_tokens=700))
        assert mode.state[0] == "unpinned"
        backend.ram.forget()                                # the server restarted: its RAM holds nothing of before
        mode.pinned_after[0] = 0.0
        mode.server_caches.held(0, prompt.exact)
        _answer(mode, backend, prompt, RequestRecord(cache_n=690, prompt_tokens=700))
        assert mode.state[0] == "unpinned"

    asyncio.run(run())


def test_a_miss_cheaper_than_the_ram_s_bet_keeps_requests_unpinned_and_a_dear_one_does_not() -> None:
    """A short chat turn's RAM entry that another chat's first prompt took (llama-server's own choice, which the
    server alone loses the same way) costs less than pinning every request again for RAM_RETRY_SECONDS (ShareGPT at
    the default RAM: a 111-token miss pinned the rest of the run)."""
    async def run() -> None:
        mode, backend, _, _ = _unpinned_now()
        short = Prompt.of("m", [{"role": "user", "content": "Short turn, ça va? 🙂 " * 12}], 10)
        long_ = Prompt.of("m", [LONG_TURN], 10)
        speeds = mode.speeds.of(0, RouterModels.served(backend, "m"))
        speeds.prefill.ms_per_token = 4.0                  # a CPU: 250 tokens a second
        for prompt in (short, long_):
            mode.server_caches.held(0, prompt.exact)
        expected_short = speeds.tokens_of(len(short.exact))
        assert expected_short * 4.0 / 1000 <= RAM_BET_SECONDS < speeds.tokens_of(len(long_.exact)) * 4.0 / 1000
        record = RequestRecord(cache_n=3, prompt_tokens=round(expected_short) + 10)
        _answer(mode, backend, short, record)              # missed, but cheaply
        assert mode.state[0] == "unpinned" and all(backend.ram.recent(time.monotonic())) and record.ram_expected
        _answer(mode, backend, long_, RequestRecord(cache_n=3, prompt_tokens=700))   # missed, dearly
        assert mode.state[0] in ("to_pinned", "draining") and not all(backend.ram.recent(time.monotonic()))

    asyncio.run(run())


def test_small_misses_that_add_up_to_more_than_the_bet_pin_again() -> None:
    """A RAM that keeps dropping short turns: each miss is small, together they are not."""
    async def run() -> None:
        mode, backend, _, _ = _unpinned_now()
        short = Prompt.of("m", [{"role": "user", "content": "Short turn, ça va? 🙂 " * 12}], 10)
        speeds = mode.speeds.of(0, RouterModels.served(backend, "m"))
        speeds.prefill.ms_per_token = 4.0
        mode.server_caches.held(0, short.exact)
        lost = speeds.prefill.seconds(speeds.tokens_of(len(short.exact)) - 3)
        assert lost is not None and 0 < lost <= RAM_BET_SECONDS
        misses = 0
        while mode.state[0] == "unpinned":
            misses += 1
            _answer(mode, backend, short, RequestRecord(cache_n=3, prompt_tokens=120))
            assert misses <= RAM_BET_SECONDS / lost + 1, misses
        assert misses == int(RAM_BET_SECONDS / lost) + 1 and not all(backend.ram.recent(time.monotonic()))

    asyncio.run(run())


def test_fixed_thresholds_and_several_backends_stay_pinned() -> None:
    for threshold, backends in ((500, 1), (None, 2)):
        mode, backend, _, _ = _setup(threshold, backends)
        _trusted(backend)
        _quiet(mode, backend, 3 * QUIET_REQUESTS)
        assert mode.state[0] == "pinned", (threshold, backends)


def test_a_switch_that_waits_too_long_is_called_off_and_hand_outs_open_again() -> None:
    async def run() -> None:
        mode, backend, pool, _ = _setup()
        _trusted(backend)
        busy = (await pool.acquire(Want())).slot           # a long pinned answer under way
        _quiet(mode, backend)
        assert mode.state[0] == "to_unpinned" and 0 in mode.timers
        mode._call_off(0, "to_unpinned")                   # what its timer does after SWITCH_SECONDS
        assert mode.state[0] == "pinned" and len(pool.idle()) == 1
        _quiet(mode, backend, 2 * QUIET_REQUESTS - 1)      # tried again after twice as many quiet requests
        assert mode.state[0] == "pinned"
        _quiet(mode, backend, 1)
        assert mode.state[0] == "to_unpinned"
        pool.release(busy)
        assert mode.state[0] == "unpinned" and 0 not in mode.timers

    asyncio.run(run())


def test_a_switch_waits_for_a_pinned_request_whose_prefill_would_outlast_it() -> None:
    async def run() -> None:
        mode, backend, pool, _ = _setup()
        _trusted(backend)
        mode.speeds.of(0, "").prefill.add(5000.0, 1000)     # 5 ms a token, learnt
        busy = (await pool.acquire(Want())).slot           # a pinned request computing a long prompt
        busy.phase, busy.sent_at, busy.computing = "generate", time.monotonic(), 4000
        assert mode.speeds.of(0, "").prefill.seconds(mode.speeds.of(0, "").tokens_of(4000)) > 2 * SWITCH_SECONDS
        _quiet(mode, backend, 3 * QUIET_REQUESTS)
        assert mode.state[0] == "pinned" and 0 not in mode.timers   # not tried: nothing called off
        assert len(pool.idle()) == 1                       # the other slot still handed out meanwhile
        busy.first_token_at = time.monotonic()             # its prefill is over: its answer may end any time
        _quiet(mode, backend, 1)                           # the next pinned request's end tries it, at the first count
        assert mode.state[0] == "to_unpinned" and mode.called_off[0] == 0
        pool.release(busy)
        assert mode.state[0] == "unpinned"

    asyncio.run(run())


def test_a_pinned_prefill_short_of_the_switch_s_bound_does_not_put_it_off() -> None:
    async def run() -> None:
        mode, backend, pool, _ = _setup()
        _trusted(backend)
        speeds = mode.speeds.of(0, "")
        speeds.prefill.add(5000.0, 1000)
        busy = (await pool.acquire(Want())).slot
        blocks = int(0.5 * SWITCH_SECONDS / speeds.prefill.seconds(speeds.tokens_of(1)))   # half the bound
        busy.phase, busy.sent_at, busy.computing = "generate", time.monotonic(), blocks
        _quiet(mode, backend)
        assert mode.state[0] == "to_unpinned"

    asyncio.run(run())


class _NoSlots(_Client):
    async def slots(self, model: str | None = None) -> list[dict[str, Any]]:
        raise ProxyError("GET /slots: 501", status=502)


def test_a_server_that_does_not_say_its_slots_are_idle_keeps_requests_unpinned() -> None:
    async def run() -> None:
        mode, backend, pool, spawned = _setup()
        backend.client = _NoSlots()  # type: ignore[assignment]
        _trusted(backend)
        _quiet(mode, backend)
        prompt = Prompt.of("m", [{"role": "user", "content": "Ein langes Gespräch über Caches. " * 60}], 10)
        mode.server_caches.held(0, prompt.exact)
        _answer(mode, backend, prompt, RequestRecord(cache_n=3, prompt_tokens=700))
        await asyncio.gather(*spawned)
        assert mode.state[0] == "unpinned" and len(pool.idle()) == 2   # never left closed, never pinned unchecked
        _answer(mode, backend, prompt, RequestRecord(cache_n=3, prompt_tokens=700))
        assert mode.state[0] == "unpinned"                 # not tried again before the back-off is over

    asyncio.run(run())


def test_a_file_the_ram_lacks_pins_again_when_its_prefill_beats_the_switch() -> None:
    """A conversation restored over while requests were pinned is in a file only: sent unpinned, the server would
    compute it all again. Worth pinning for when that prefill beats a switch there and back (2 x SWITCH_SECONDS on
    each of the 2 slots: 20 s); a short one is left to the server."""
    async def run() -> None:
        mode, backend, pool, spawned = _unpinned_now()
        prompt = Prompt.of("m", [{"role": "user", "content": "Une longue conversation, déjà vue. " * 400}], 10)
        blocks = len(prompt.exact)
        speeds = mode.speeds.of(0, "")
        tokens = speeds.tokens_of(blocks)
        assert not mode.pins_for_file(backend, prompt, blocks)        # no prefill measured yet: nothing to weigh
        speeds.prefill.ms_per_token = 25_000.0 / tokens               # the whole file spares 25 s
        assert not mode.pins_for_file(backend, prompt, blocks // 5)   # 5 s: less than the switch
        half = blocks // 2
        mode.server_caches.held(0, prompt.exact[:half])               # the RAM holds half: 12.5 s left to spare
        assert not mode.pins_for_file(backend, prompt, blocks)
        assert mode.state[0] == "unpinned"
        mode.server_caches = ServerCaches()                            # the RAM holds none of it
        mode.server_caches.held(0, Prompt.of("m", [{"role": "user", "content": "Something else."}], 10).exact)
        other = (await pool.acquire(Want())).slot                     # another request, handed a slot meanwhile
        mode.began(0)
        assert mode.pins_for_file(backend, prompt, blocks)
        assert mode.state[0] == "to_pinned" and pool.idle() == [] and mode.closed(0)
        assert mode.pins_for_file(backend, prompt, blocks)             # one handed a slot with it: waits as well
        assert not mode.pins_for_file(backend, prompt, blocks // 5)   # a short one goes on, unpinned
        pool.release(other, None)
        mode.ended(0)
        assert mode.state[0] == "draining" and pool.idle() == []      # no hand-out until pinned
        await asyncio.gather(*spawned)
        assert mode.state[0] == "pinned" and len(pool.idle()) == 2
        assert not mode.pins_for_file(backend, prompt, blocks)        # pinned already: the restore is placement's

    asyncio.run(run())


def test_a_slow_slots_answer_does_not_keep_the_switch_back_closed_past_its_bound(monkeypatch: Any) -> None:
    """Draining waits for GET /slots to say twice that every slot is idle, at most SWITCH_SECONDS: also when each
    answer is slow (a loaded CPU), where the bound used to be checked only between two answers (each bounded by the
    client's 10 s), keeping every slot closed for two of them. Past it, requests stay unpinned."""
    from lpcache.flow import unpinned

    monkeypatch.setattr(unpinned, "SWITCH_SECONDS", 0.3)

    async def run() -> None:
        mode, backend, pool, spawned = _unpinned_now()
        backend.client = _Client(delay=0.25)   # type: ignore[assignment]
        mode._switch(0, "to_pinned")
        assert mode.state[0] == "draining" and mode.closed(0)
        started = time.monotonic()
        await asyncio.gather(*spawned)
        assert time.monotonic() - started < 0.6   # two answers and the poll between them: 0.75 s
        assert mode.state[0] == "unpinned" and not mode.closed(0)

    asyncio.run(run())
