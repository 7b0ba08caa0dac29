"""Slot choice and the slot pool: LRU choice, resident prefixes, restores, FIFO waiting, timeouts."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from lpcache.backends.placement import Choice, WaitPlan, Want, choose, wait_plan
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Content, Slot
from lpcache.cache.meta_files import Candidate, MetaEntry
from lpcache.cache.prefix import Prompt
from lpcache.cache.server_cache import (
    PROBE_PAYBACK,
    RAM_BET_GROWTH,
    RAM_BET_SECONDS,
    RAM_RETRY_SECONDS,
    RAM_TRUST,
    RamWatch,
    ServerCaches,
)
from lpcache.errors import ProxyError, SlotsBusy

A, B = "http://a:8000", "http://b:8000"


def text(n: int, start: int = 0, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(start, start + n))


def prompt(content: str, wpb: int = 1) -> Prompt:
    """A prompt whose identity blocks are its word blocks (one per word), so the tests count in words."""
    p = Prompt.of("m", [{"role": "user", "content": content}], wpb)
    return replace(p, exact=p.chain)


def content_of(p: Prompt) -> Content:
    return Content(p.key, p.exact)


def candidate(shared: int, total: int = 10, backend: str | None = A, path: str | None = None) -> Candidate:
    chain = prompt(text(shared)).exact
    entry = MetaEntry("saved", "m", 1, chain, 1.0, shared, backend, path, exact=chain, fingerprint="fp")
    return Candidate(entry, shared, shared / total)


def slot(backend: int = 0, id: int = 0, *, url: str = A, used: bool = False, last_used: float = 0.0,
         content: Content | None = None, path: str | None = None, kv_cache: bool = True) -> Slot:
    return Slot(backend, id, kv_cache=kv_cache, slot_save_path=path, url=url, used=used, last_used=last_used,
                content=content)


# ---- choose: LRU ----

def test_choose_never_used_first() -> None:
    s0 = slot(0, 0, used=True, last_used=1.0)
    s1 = slot(0, 1, used=False)
    s2 = slot(0, 2, used=True, last_used=0.5)
    c = choose([s0, s1, s2], None, None)
    assert c == Choice(s1, None, 0)


def test_choose_least_recently_used() -> None:
    s0 = slot(0, 0, used=True, last_used=3.0)
    s1 = slot(0, 1, used=True, last_used=1.0)
    s2 = slot(1, 0, url=B, used=True, last_used=2.0)
    assert choose([s0, s1, s2], None, None).slot is s1
    assert choose([s0, s2], None, None).slot is s2


def test_choose_tie_goes_to_lowest_backend_then_id() -> None:
    s = [slot(1, 0, url=B), slot(0, 1), slot(0, 0)]
    assert choose(s, None, None).slot is s[2]
    assert choose(s[:2], None, None).slot is s[1]


def test_choose_single_idle_slot() -> None:
    only = slot(0, 3, used=True, last_used=99.0)
    assert choose([only], prompt(text(5)), None) == Choice(only, None, 0)


def test_choose_ignores_content_without_prompt_blocks() -> None:
    p = prompt(text(5))
    holder = slot(0, 0, used=True, last_used=5.0, content=content_of(p))
    cold = slot(0, 1, used=True, last_used=1.0)
    assert choose([holder, cold], None, None).slot is cold
    assert choose([holder, cold], prompt(""), None).slot is cold


# ---- choose: resident prefix ----

def test_choose_slot_holding_the_prefix_without_restore() -> None:
    p = prompt(text(10))
    holder = slot(0, 1, used=True, last_used=9.0, content=content_of(prompt(text(6))))
    fresh = slot(0, 0)
    c = choose([fresh, holder], p, None)
    assert c == Choice(holder, None, 6)


def test_choose_longest_resident_prefix() -> None:
    p = prompt(text(10))
    s3 = slot(0, 0, used=True, last_used=1.0, content=content_of(prompt(text(3) + " x")))
    s7 = slot(0, 1, used=True, last_used=9.0, content=content_of(prompt(text(7) + " y")))
    s0 = slot(0, 2, used=True, last_used=0.5, content=content_of(prompt(text(5, tag="z"))))
    c = choose([s3, s7, s0], p, None)
    assert c.slot is s7 and c.resident == 7 and c.restore is None


def test_choose_resident_tie_goes_to_most_recently_used() -> None:
    p = prompt(text(10))
    older = slot(0, 0, used=True, last_used=1.0, content=content_of(prompt(text(4) + " a")))
    newer = slot(0, 1, used=True, last_used=2.0, content=content_of(prompt(text(4) + " b")))
    assert choose([older, newer], p, None).slot is newer


def test_choose_resident_beats_equal_candidate() -> None:
    p = prompt(text(10))
    holder = slot(0, 1, used=True, last_used=5.0, content=content_of(prompt(text(4))))
    reader = slot(0, 0)
    cand = candidate(4)
    c = choose([reader, holder], p, cand)
    assert c.slot is holder and c.restore is None and c.resident == 4


def test_choose_resident_beats_shorter_candidate() -> None:
    p = prompt(text(10))
    holder = slot(0, 1, used=True, last_used=5.0, content=content_of(prompt(text(4))))
    c = choose([slot(0, 0), holder], p, candidate(2))
    assert c.slot is holder and c.restore is None


# ---- choose: restore ----

def test_choose_restores_longer_candidate_into_coldest_reader() -> None:
    p = prompt(text(10))
    holder = slot(0, 0, used=True, last_used=1.0, content=content_of(prompt(text(3))))
    warm = slot(0, 1, used=True, last_used=5.0)
    cold = slot(0, 2, used=True, last_used=2.0)
    cand = candidate(8)
    c = choose([warm, cold, holder], p, cand)
    assert c.restore is cand and c.resident == 0
    assert c.slot is holder  # the coldest reader: last used at 1.0
    c2 = choose([warm, cold], p, cand)
    assert c2.slot is cold and c2.restore is cand


def test_choose_restore_without_resident_content() -> None:
    cand = candidate(5)
    s0 = slot(0, 0)
    c = choose([s0], prompt(text(10)), cand)
    assert c == Choice(s0, cand, 0)


def test_choose_restore_only_into_slots_reading_the_same_folder() -> None:
    p = prompt(text(10))
    cand = candidate(6, backend=A, path="/kv/shared")
    other_folder = slot(0, 0, url=A, path="/kv/other")
    same_folder = slot(1, 0, url=B, used=True, last_used=9.0, path="/kv/shared")
    c = choose([other_folder, same_folder], p, cand)
    assert c.slot is same_folder and c.restore is cand


def test_choose_restore_by_backend_url_when_paths_unset() -> None:
    p = prompt(text(10))
    cand = candidate(6, backend=B, path=None)
    on_a = slot(0, 0, url=A)
    on_b = slot(1, 0, url=B, used=True, last_used=9.0)
    c = choose([on_a, on_b], p, cand)
    assert c.slot is on_b and c.restore is cand


def test_choose_never_restores_into_kv_cache_disabled_slot() -> None:
    p = prompt(text(10))
    cand = candidate(6, backend=A, path="/kv")
    disabled = slot(0, 0, url=A, path="/kv", kv_cache=False)
    enabled = slot(1, 0, url=B, path="/kv", used=True, last_used=50.0)
    c = choose([disabled, enabled], p, cand)
    assert c.slot is enabled and c.restore is cand
    only_disabled = choose([disabled], p, cand)
    assert only_disabled.slot is disabled and only_disabled.restore is None


def test_choose_no_reader_falls_back_to_resident_then_lru() -> None:
    p = prompt(text(10))
    cand = candidate(8, backend=B, path=None)
    holder = slot(0, 0, url=A, used=True, last_used=5.0, content=content_of(prompt(text(3))))
    cold = slot(0, 1, url=A, used=True, last_used=1.0)
    c = choose([holder, cold], p, cand)
    assert c == Choice(holder, None, 3)
    c2 = choose([cold], p, cand)
    assert c2 == Choice(cold, None, 0)


def test_slot_can_read() -> None:
    cand = candidate(3, backend=A, path="/kv")
    assert slot(url=B, path="/kv").can_read(cand)
    assert not slot(url=A, path="/x").can_read(cand)
    assert slot(url=A).can_read(cand)
    assert not slot(url=A, path="/kv", kv_cache=False).can_read(cand)
    assert not slot().can_read(None)
    assert slot(0, 4, url=A).name == f"{A}#4"


# ---- the pool ----

async def start_waiter(pool: SlotPool, p: Prompt | None = None, cand: Candidate | None = None) -> asyncio.Task:
    """A task blocked in pool.acquire: `started` is set just before it calls acquire, which queues it before its
    first suspension, so once we resume it is in the queue."""
    started = asyncio.Event()

    async def run() -> Choice:
        started.set()
        return await pool.acquire(Want(p, lambda: cand))

    task = asyncio.create_task(run())
    await started.wait()
    return task


async def test_acquire_and_release_marks_busy() -> None:
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    c = await pool.acquire(Want())
    assert c.slot is s0 and s0.busy and s0.used and not s1.busy
    assert pool.idle() == [s1]
    c2 = await pool.acquire(Want())
    assert c2.slot is s1 and s1.busy
    assert pool.idle() == []
    pool.release(s0)
    assert not s0.busy and s0.last_used > 0
    pool.release(s1)
    assert pool.idle() == [s0, s1]
    c3 = await pool.acquire(Want())
    assert c3.slot is s0  # least recently used
    pool.release(s0)
    assert not any(s.busy for s in pool.slots)


async def test_acquire_passes_prompt_and_candidate_to_choose() -> None:
    p = prompt(text(10))
    holder = slot(0, 1, used=True, last_used=1.0, content=content_of(prompt(text(5))))
    pool = SlotPool([slot(0, 0), holder])
    c = await pool.acquire(Want(p, lambda: candidate(3)))
    assert c.slot is holder and c.resident == 5 and c.restore is None
    pool.release(c.slot)
    cand = candidate(9)
    c = await pool.acquire(Want(p, lambda: cand))
    assert c.restore is cand and c.slot is pool.slots[0]
    pool.release(c.slot)
    assert not any(s.busy for s in pool.slots)


async def test_waiters_are_served_fifo() -> None:
    s0 = slot(0, 0)
    pool = SlotPool([s0])
    first = await pool.acquire(Want())
    waiters = [await start_waiter(pool) for _ in range(3)]
    assert pool.waiting == 3
    assert not any(t.done() for t in waiters)

    for i, task in enumerate(waiters):
        holder = first.slot if i == 0 else (await waiters[i - 1]).slot
        pool.release(holder)
        choice = await task
        assert choice.slot is s0 and s0.busy
        assert pool.waiting == 2 - i
        assert all(not t.done() for t in waiters[i + 1:])
    pool.release(s0)
    assert not s0.busy and pool.waiting == 0


async def test_two_waiters_get_both_released_slots() -> None:
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    held = [await pool.acquire(Want()), await pool.acquire(Want())]
    w1, w2 = await start_waiter(pool), await start_waiter(pool)
    assert pool.waiting == 2
    pool.release(held[0].slot)
    pool.release(held[1].slot)
    assert pool.waiting == 0
    c1, c2 = await w1, await w2
    assert {c1.slot, c2.slot} == {s0, s1} and c1.slot is not c2.slot
    assert s0.busy and s1.busy
    pool.release(c1.slot)
    pool.release(c2.slot)
    assert not any(s.busy for s in pool.slots)


async def test_waiter_choice_uses_its_prompt() -> None:
    p = prompt(text(10))
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    h0, h1 = await pool.acquire(Want()), await pool.acquire(Want())
    waiter = await start_waiter(pool, p)
    pool.release(h1.slot, content_of(prompt(text(6))))
    c = await waiter
    assert c.slot is s1 and c.resident == 6
    pool.release(h0.slot)
    pool.release(c.slot)
    assert not any(s.busy for s in pool.slots)


async def test_acquire_timeout_raises_slots_busy() -> None:
    s0 = slot(0, 0)
    pool = SlotPool([s0], wait_timeout=0.05)
    held = await pool.acquire(Want())
    with pytest.raises(SlotsBusy) as info:
        await pool.acquire(Want(prompt(text(3))))
    err = info.value
    assert isinstance(err, ProxyError)
    assert err.status == 503
    assert err.message == "all slots busy"
    assert err.body()["error"]["message"] == "all slots busy"
    assert pool.waiting == 0
    pool.release(held.slot)
    assert not s0.busy
    again = await pool.acquire(Want())
    assert again.slot is s0
    pool.release(s0)
    assert not s0.busy


async def test_cancelled_waiter_leaves_no_slot_busy() -> None:
    s0 = slot(0, 0)
    pool = SlotPool([s0])
    held = await pool.acquire(Want())
    task = await start_waiter(pool)
    assert pool.waiting == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.waiting == 0
    pool.release(held.slot)
    assert not s0.busy
    assert (await pool.acquire(Want())).slot is s0
    pool.release(s0)
    assert not any(s.busy for s in pool.slots)


async def test_cancelled_waiter_does_not_block_the_next_one() -> None:
    s0 = slot(0, 0)
    pool = SlotPool([s0])
    held = await pool.acquire(Want())
    gone = await start_waiter(pool)
    nxt = await start_waiter(pool)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert pool.waiting == 1
    pool.release(held.slot)
    assert (await nxt).slot is s0
    pool.release(s0)
    assert not s0.busy and pool.waiting == 0


async def test_waiter_cancelled_as_the_slot_is_handed_to_it_releases_the_slot() -> None:
    """The slot is handed to the waiter, and the waiter is cancelled before it resumes: acquire must raise
    CancelledError (the caller asked to stop) and give the slot back, not return it to a cancelled caller."""
    s0 = slot(0, 0)
    pool = SlotPool([s0])
    held = await pool.acquire(Want())
    task = await start_waiter(pool)
    pool.release(held.slot)  # hands s0 to the waiter
    task.cancel()            # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not s0.busy
    assert pool.waiting == 0


async def test_release_content_semantics() -> None:
    s0 = slot(0, 0)
    pool = SlotPool([s0])
    first, second = Content("k1", (1, 2)), Content("k2", (3,), saved=True)

    await pool.acquire(Want())
    pool.release(s0, first)
    assert s0.content is first

    await pool.acquire(Want())
    pool.release(s0)  # True: unchanged
    assert s0.content is first

    await pool.acquire(Want())
    pool.release(s0, True)
    assert s0.content is first

    await pool.acquire(Want())
    pool.release(s0, second)
    assert s0.content is second and s0.content.saved

    await pool.acquire(Want())
    pool.release(s0, None)  # unknown
    assert s0.content is None
    assert not s0.busy


async def test_release_of_idle_slot_is_a_no_op() -> None:
    s0 = slot(0, 0, content=Content("k", (1,)))
    pool = SlotPool([s0])
    pool.release(s0, None)
    assert s0.content == Content("k", (1,))
    assert s0.last_used == 0.0 and not s0.busy


async def test_release_updates_last_used_for_lru() -> None:
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    a, b = await pool.acquire(Want()), await pool.acquire(Want())
    assert s0.last_used == 0.0 and s1.last_used == 0.0
    pool.release(b.slot)
    assert s1.last_used > 0.0 and s0.last_used == 0.0
    pool.release(a.slot)
    assert s0.last_used >= s1.last_used > 0.0
    assert not any(s.busy for s in pool.slots)


def never(slot: Slot | None, blocks: int, beside: bool) -> float:
    return 0.0


def seconds_per_block(slot: Slot | None, blocks: int, beside: bool) -> float:
    """A budget of one second per block gained (as if prefilling a block took a second)."""
    return float(blocks)


def long_prompt(n: int) -> Prompt:
    return prompt(" ".join(f"w{i}" for i in range(n)))


def test_wait_plan_for_a_busy_slot_that_will_hold_the_conversation() -> None:
    conv, nxt = long_prompt(40), long_prompt(44)
    busy = Slot(0, 0, busy=True, used=True)
    idle = Slot(0, 1, used=True)
    busy.pending = content_of(conv)
    plan = wait_plan([busy, idle], nxt, None, None, None, frozenset(), seconds_per_block)
    assert plan is not None and plan.wanted(busy) and not plan.wanted(idle) and plan.seconds == 40
    # the cost says no: no wait
    assert wait_plan([busy, idle], nxt, None, None, None, frozenset(), never) is None
    # an idle slot that holds it as well: no reason to wait
    idle.content = content_of(conv)
    assert wait_plan([busy, idle], nxt, None, None, None, frozenset(), seconds_per_block) is None
    # a smaller gain is a shorter wait
    idle.content = Content(conv.key, conv.exact[:30])
    plan = wait_plan([busy, idle], nxt, None, None, None, frozenset(), seconds_per_block)
    assert plan is not None and plan.seconds == 10
    # the filter of the request applies
    idle.content = None
    assert wait_plan([busy, idle], nxt, None, lambda s: s is not busy, None, frozenset(), seconds_per_block) is None


def test_wait_plan_says_when_the_alternative_prefills_beside_the_busy_slot() -> None:
    """`beside`: every idle slot the request may take is on the busy slot's server (a prefill there shares that
    server's compute with the busy slot's); an idle slot on another server is a prefill of its own."""
    harness, mine = long_prompt(40), prompt(" ".join(f"w{i}" for i in range(40)) + " and my own task")
    asked: list[bool] = []

    def budget(slot: Slot | None, blocks: int, beside: bool) -> float:
        asked.append(beside)
        return float(blocks)

    busy = Slot(0, 0, busy=True, used=True, pending=content_of(harness))
    same, other = Slot(0, 1, used=True), Slot(1, 0, used=True)
    assert wait_plan([busy, same], mine, None, None, None, frozenset(), budget) is not None and asked == [True]
    assert wait_plan([busy, same, other], mine, None, None, None, frozenset(), budget) is not None
    assert asked == [True, False]
    # the request may not use the other server (a model it does not serve): beside again
    assert wait_plan([busy, same, other], mine, None, lambda s: s.backend == 0, None, frozenset(), budget)
    assert asked == [True, False, True]
    # no slot idle at all: nothing to prefill on now, so nothing beside (it waits in line for any slot)
    same.busy = other.busy = True
    assert wait_plan([busy, same, other], mine, None, None, None, frozenset(), budget) is not None
    assert asked == [True, False, True, False]
    # a busy slot another request already waits for is not planned on again (only one of them would get it) ...
    same.busy = other.busy = False
    busy.replans.append(lambda: None)
    assert wait_plan([busy, other], mine, None, lambda s: s is not same, None, frozenset(), budget) is None
    # ... unless every idle slot is on its server: a prefill there would share its compute, so the later ones wait
    # too (one then gets the slot, the others restore the file its cache is saved to)
    assert wait_plan([busy, same], mine, None, None, None, frozenset(), budget) is not None


async def test_a_planned_wait_is_decided_again_when_its_slots_request_progresses() -> None:
    """The waiter's deadline follows `recheck` when the target's request gets its first token, never beyond the
    first deadline; the target counts its waiter while it waits."""
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    first = await pool.acquire(Want(allowed=lambda s: s is s0))
    left = [30.0]
    plan = WaitPlan(lambda s: s is s0, 30.0, s0, lambda: left[0])
    task = asyncio.create_task(pool.take(Want(), plan))
    for _ in range(100):             # let it run to its wait (it queues before its first real suspension)
        if s0.replans:
            break
        await asyncio.sleep(0)
    assert len(s0.replans) == 1 and s0.awaited and not task.done()
    left[0] = 0.0                    # the first token came: the wait no longer pays
    pool.progressed(s0)
    choice, planned = await task
    assert choice.slot is s1 and not planned and not s0.awaited and s0.replans == []
    pool.release(choice.slot)
    pool.release(first.slot)
    assert not any(s.busy for s in pool.slots)


def test_wait_plan_for_the_only_slots_that_can_read_the_saved_cache() -> None:
    p = long_prompt(40)
    entry = MetaEntry("k", "m", 2, p.exact, 0.0, backend="http://a:1", slot_save_path="/a", exact=p.exact,
                      fingerprint="fp")
    cand = Candidate(entry, len(p.exact), 1.0)
    a = Slot(0, 0, slot_save_path="/a", url="http://a:1", busy=True, used=True)   # saving the previous request
    b = Slot(1, 0, slot_save_path="/b", url="http://b:1", used=True)             # idle, cannot read the file
    plan = wait_plan([a, b], p, cand, None, None, frozenset(), seconds_per_block)
    assert plan is not None and plan.wanted(a) and not plan.wanted(b)
    a.busy = False                                   # an idle reader: no wait, choose() takes it
    assert wait_plan([a, b], p, cand, None, None, frozenset(), seconds_per_block) is None
    a.busy = True
    b.content = content_of(p)                        # the idle slot holds the prompt already: no wait
    assert wait_plan([a, b], p, cand, None, None, frozenset(), seconds_per_block) is None
    b.content = None
    assert wait_plan([a, b], p, cand, lambda s: s is b, None, frozenset(), seconds_per_block) is None


def test_wait_plan_and_choose_keep_a_session_where_its_file_is() -> None:
    a, b = Slot(0, 0, busy=True, used=True), Slot(1, 0, used=True)
    p = long_prompt(8)
    plan = wait_plan([a, b], p, None, None, "f.bin", frozenset({0}), seconds_per_block)
    assert plan is not None and plan.wanted(a) and not plan.wanted(b)
    assert wait_plan([a, b], p, None, None, "f.bin", frozenset(), seconds_per_block) is None  # no file yet
    a.busy = False
    assert wait_plan([a, b], p, None, None, "f.bin", frozenset({0}), seconds_per_block) is None
    assert choose([b, a], None, None, session="f.bin", homes=frozenset({0})).slot is a


def test_choose_keeps_a_resident_slot_when_the_restore_does_not_pay() -> None:
    """A slot holding 6 blocks and a file holding 7: restoring the whole file into another slot for one block
    would evict that slot's content; the cost hook says no, and the resident slot is taken."""
    p = prompt(text(10))
    holder = slot(0, 1, used=True, last_used=5.0, content=content_of(prompt(text(6))))
    other = slot(0, 0, used=True, last_used=1.0, content=content_of(prompt(text(5, tag="q"))))
    cand = candidate(7)
    asked: list[int] = []

    def pays(target: Slot, c: Candidate, gained: int) -> bool:
        asked.append(gained)
        return gained >= 3

    c = choose([other, holder], p, cand, pays=pays)
    assert c.slot is holder and c.restore is None and c.resident == 6 and c.skipped and asked == [1]
    c = choose([other, holder], p, candidate(9), pays=pays)
    assert c.slot is other and c.restore is not None and asked == [1, 3]


async def test_two_phase_take_waits_for_the_planned_slot_then_any() -> None:
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    first = await pool.acquire(Want())
    plan = WaitPlan(lambda s: s is first.slot, 5.0)
    started = asyncio.Event()

    async def take() -> tuple[Choice, bool]:
        started.set()
        return await pool.take(Want(), plan)

    task = asyncio.create_task(take())
    await started.wait()            # it queued before its first suspension
    assert pool.waiting == 1 and not task.done()   # s1 is idle, but the plan says wait for s0
    pool.release(first.slot)
    choice, planned = await task
    assert choice.slot is first.slot and planned
    pool.release(choice.slot)
    held = await pool.acquire(Want(allowed=lambda s: s is s0))
    choice, planned = await pool.take(Want(), WaitPlan(lambda s: s is s0, 0.01))
    assert choice.slot is s1 and not planned   # the planned wait ran out: any slot
    pool.release(held.slot)
    pool.release(choice.slot)
    assert not any(s.busy for s in pool.slots)


async def test_a_candidate_is_protected_from_choice_until_given_back() -> None:
    protected: list[str] = []
    s0 = slot(0, 0)
    pool = SlotPool([s0], wait_timeout=0.05)
    cand = candidate(5)
    want = Want(prompt(text(10)), lambda: cand, protect=protected.append, unprotect=protected.remove)
    c = await pool.acquire(want)
    assert c.restore is cand and protected == ["saved"]
    want.given_back(c)
    assert protected == []
    pool.release(s0)


def test_choose_sends_a_prompt_no_slot_or_file_holds_to_the_server_whose_ram_likely_does() -> None:
    p = prompt(text(10))
    a_cold = slot(0, 0, used=True, last_used=1.0, content=content_of(prompt(text(4, tag="x"))))
    b_busy_before = slot(1, 0, url=B, used=True, last_used=5.0, content=content_of(prompt(text(3, tag="y"))))
    b_empty = slot(1, 1, url=B)
    # non-empty, on B:
    assert choose([a_cold, b_busy_before, b_empty], p, None, warm=(1, 8, True)).slot is b_busy_before
    assert choose([a_cold, b_empty], p, None, warm=(1, 8, True)).slot is b_empty   # no non-empty slot there: coldest
    # a server not seen serving from RAM may have none: steered to only for a large part of the prompt
    assert choose([a_cold, b_busy_before, b_empty], p, None, warm=(1, 8, False)).slot is b_busy_before
    long_p = prompt(text(100))
    assert choose([a_cold, b_busy_before, b_empty], long_p, None, warm=(1, 8, False)).slot is b_empty
    holder = slot(0, 1, used=True, last_used=9.0, content=content_of(prompt(text(7))))
    assert choose([holder, b_busy_before], p, None, warm=(1, 8, True)).slot is holder   # a resident 7 beats RAM's 8
    assert choose([holder, b_busy_before], p, None, warm=(1, 10, True)).slot is b_busy_before


def test_a_ram_that_likely_holds_no_more_than_a_system_prompt_the_slots_share_is_not_steered_to() -> None:
    system = text(3, tag="sys")
    p = prompt(system + " " + text(40, tag="q"))
    a = slot(0, 0, used=True, last_used=1.0, content=content_of(prompt(system + " " + text(50, tag="x"))))
    b = slot(0, 1, used=True, last_used=2.0, content=content_of(prompt(system + " " + text(50, tag="y"))))
    c = choose([a, b], p, None, warm=(0, 3, True))   # the RAM's deepest: the system prompt, which both slots hold
    assert not c.warm and c.slot is a                 # the coldest, computed as any prompt the RAM does not hold
    c = choose([a, b], p, None, warm=(0, 6, True))   # the RAM holds more: three blocks of this conversation
    assert c.warm and c.warm_blocks == 6
    assert c.resident == 0 and c.uncomputed == 6     # the server loads those: its request computes the rest only


def test_server_caches_remember_the_last_holder_of_the_longest_prefix() -> None:
    from lpcache.cache.server_cache import ServerCaches

    caches = ServerCaches(limit=10)
    a, b = prompt(text(6)), prompt(text(9))
    caches.held(0, a.exact)
    caches.held(1, b.exact)
    assert caches.find(prompt(text(12)).exact) == (1, 9)
    assert caches.find(prompt(text(5, tag="z")).exact) is None
    caches.held(0, b.exact)
    assert caches.find(b.exact) == (0, 9) and len(caches) == 9     # a is a prefix of b
    caches.held(1, prompt(text(5, tag="q")).exact)
    assert len(caches) == 10 and caches.find(a.exact) == (0, 6)   # bounded: the oldest digests go first


def test_server_caches_count_what_a_server_s_ram_kept_after_a_prompt() -> None:
    """What a RAM hit shows the RAM kept beside the prompt: the latest turn of each prompt its slots held after it,
    each no longer than what is counted before it (the RAM had room to store it)."""
    from lpcache.cache.server_cache import ServerCaches

    caches = ServerCaches()
    a, b, c = prompt(text(6)), prompt(text(5, tag="b")), prompt(text(4, tag="c"))
    back = prompt(text(8)).exact                      # a's return
    caches.held(0, a.exact)
    assert caches.since(0, back) == 0
    caches.held(0, b.exact)
    caches.held(1, c.exact)                           # another server's: not beside a in server 0's RAM
    assert caches.since(0, back) == 5
    assert caches.since(1, back) == 0 and caches.since(0, c.exact) == 0   # held elsewhere
    caches.held(0, prompt(text(40, tag="long")).exact)   # longer than all counted: maybe too big to store
    caches.held(0, prompt(text(4, tag="d")).exact)
    assert caches.since(0, back) == 5 + 4
    caches.held(0, prompt(text(6, tag="d")).exact)    # d's next turn: its RAM entry replaces the first
    assert caches.since(0, back) == 5 + 6
    caches.gone(0, b.exact)                           # a restore replaced b before the RAM copied it
    assert caches.since(0, back) == 6
    caches.held(0, back)                              # a's conversation came back: counted from its new turn
    assert caches.since(0, prompt(text(9)).exact) == 0
    caches.forget(0)
    assert caches.since(0, prompt(text(6, tag="d")).exact) == 0 and caches.traffic == {1: len(c.exact)}


def test_caches_a_restore_took_from_the_ram_are_remembered_until_held_again() -> None:
    from lpcache.cache.server_cache import LOST_KEPT, LOST_SECONDS, ServerCaches

    caches = ServerCaches()
    a, b, c = prompt(text(6)), prompt(text(9, tag="b")), prompt(text(4, tag="c"))
    for p_ in (a, b, c):
        caches.held(0, p_.exact)
    caches.gone(0, a.exact, "a.bin")
    caches.gone(0, b.exact, "b.bin")
    caches.gone(0, c.exact)                           # no file holds it: nothing to put back
    assert caches.find(a.exact) is None
    assert [k for k, _ in caches.lost(0)] == ["b.bin", "a.bin"] and caches.lost(1) == []   # newest first
    caches.held(0, prompt(text(12)).exact)            # a's conversation came back: a is held again
    assert [k for k, _ in caches.lost(0)] == ["b.bin"]
    caches.found_again(0, "b.bin", b.exact)
    assert caches.lost(0) == [] and caches.find(b.exact) == (0, 9)
    caches.gone(0, c.exact, "c.bin", now=100.0)
    caches.gone(0, b.exact, "b.bin", now=100.0)
    caches.drop(0, "b.bin")                           # its file is gone: not put back
    assert [k for k, _ in caches.lost(0, now=100.0 + LOST_SECONDS)] == ["c.bin"]
    assert caches.lost(0, now=101.0 + LOST_SECONDS) == []   # quiet too long: not worth a restore at a switch
    for i in range(LOST_KEPT + 3):
        caches.gone(0, prompt(text(3, tag=f"n{i}")).exact, f"n{i}.bin")
    assert len(caches.lost(0)) == LOST_KEPT and caches.lost(0)[0][0] == f"n{LOST_KEPT + 2}.bin"   # bounded
    caches.forget(0)
    assert caches.lost(0) == []


def test_a_server_seen_serving_from_ram_is_trusted_over_a_disk_restore() -> None:
    p = prompt(text(10))
    cand = candidate(8)
    a_reader = slot(0, 0, used=True, last_used=1.0, content=content_of(prompt(text(4, tag="x"))))
    b_other = slot(1, 0, url=B, used=True, last_used=5.0, content=content_of(prompt(text(3, tag="y"))))
    assert choose([a_reader, b_other], p, cand, warm=(1, 9, False)).restore is cand     # RAM not seen: restore
    c = choose([a_reader, b_other], p, cand, warm=(1, 9, True))
    assert c.slot is b_other and c.restore is None                                      # RAM seen: left to it
    assert choose([a_reader, b_other], p, cand, warm=(1, 7, True)).restore is cand      # the file holds more


def test_a_restore_goes_into_a_slot_whose_cache_is_on_disk_first() -> None:
    p = prompt(text(10))
    cand = candidate(8)
    lost_if_replaced = slot(0, 0, used=True, last_used=1.0, content=Content("gone", prompt(text(3, tag="x")).exact))
    on_disk = slot(0, 1, used=True, last_used=5.0, content=Content("kept", prompt(text(3, tag="y")).exact))
    c = choose([lost_if_replaced, on_disk], p, cand, kept=lambda key: key == "kept")
    assert c.slot is on_disk and c.restore is cand
    assert choose([lost_if_replaced], p, cand, kept=lambda key: key == "kept").slot is lost_if_replaced


def test_a_slot_sharing_only_a_common_system_prompt_is_not_taken_for_it() -> None:
    """Two conversations with one system prompt: the second goes to a free slot, not over the first for a few
    blocks (under a tenth of its prompt)."""
    system = text(2, tag="sys")
    first = slot(0, 0, used=True, last_used=5.0, content=content_of(prompt(system + " " + text(30, tag="a"))))
    free = slot(0, 1)
    c = choose([first, free], prompt(system + " " + text(30, tag="b")), None)
    assert c.slot is free and c.resident == 0
    c = choose([first, free], prompt(system + " " + text(30, tag="a") + " more"), None)
    assert c.slot is first and c.resident == 32


async def _until(condition: object, rounds: int = 100) -> None:
    """Let the event loop run until `condition()` holds (a bounded number of turns, no clock)."""
    for _ in range(rounds):
        if condition():   # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_a_request_whose_planned_wait_runs_out_keeps_its_turn_in_line() -> None:
    """Both slots busy; W1 waits for s0 (its conversation's slot), W2 for any. s1 frees: W2 takes it (W1 waits only
    for s0, and holds nobody up). W1's plan runs out, then W3 arrives. When s1 frees again, it goes to W1, which came
    before W3: a request whose wait for its own slot did not pay is not sent to the back of the line."""
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    held0 = await pool.acquire(Want(allowed=lambda s: s is s0))
    held1 = await pool.acquire(Want(allowed=lambda s: s is s1))
    left = [60.0]
    w1 = asyncio.create_task(pool.take(Want(), WaitPlan(lambda s: s is s0, 60.0, s0, lambda: left[0])))
    await _until(lambda: pool.waiting == 1)
    w2 = asyncio.create_task(pool.take(Want(), None))
    await _until(lambda: pool.waiting == 2)
    pool.release(held1.slot)
    got2, _ = await w2
    assert got2.slot is s1 and not w1.done()
    left[0] = 0.0
    pool.progressed(s0)                         # the plan runs out: W1 now waits for any slot, where it stood
    w3 = asyncio.create_task(pool.take(Want(), None))
    await _until(lambda: pool.waiting == 2)
    pool.release(got2.slot)
    await _until(lambda: w1.done() or w3.done())
    assert w1.done() and not w3.done(), "the slot went to the request that came later"
    got1, planned = await w1
    assert got1.slot is s1 and not planned
    pool.release(held0.slot)
    got3, _ = await w3
    assert got3.slot is s0
    pool.release(got1.slot)
    pool.release(got3.slot)
    assert not any(s.busy for s in pool.slots) and pool.waiting == 0


async def test_a_wait_for_a_slot_ends_once_the_request_ahead_that_got_it_saved_what_it_held() -> None:
    """Both slots busy; W1 (any slot) came first, then W2 planned 60 s on s0 (its session's slot, saving its last
    turn). s0 frees and goes to W1, the first in line: s0 will hold W1's conversation, so W2 stops waiting for it
    once W1 saved what s0 held (`handed_over`: W2's file is on disk then), not when its 60 s plan runs out, and not
    before (it would look for a file not written yet). It then takes s1, free meanwhile."""
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    held0 = await pool.acquire(Want(allowed=lambda s: s is s0))
    held1 = await pool.acquire(Want(allowed=lambda s: s is s1))
    w1 = asyncio.create_task(pool.take(Want(), None))
    await _until(lambda: pool.waiting == 1)
    w2 = asyncio.create_task(pool.take(Want(), WaitPlan(lambda s: s is s0, 60.0, s0)))
    await _until(lambda: pool.waiting == 2)
    pool.release(held0.slot)
    got1, _ = await w1
    assert got1.slot is s0 and s0.filling is not None and not s0.filling.is_set()
    pool.release(held1.slot)
    assert not w2.done() and not s1.busy and pool.waiting == 1   # s0's old cache is not on disk yet
    filling = s0.filling
    pool.handed_over(s0)
    assert filling.is_set() and s0.filling is None
    got2, planned = await w2                     # at once: no clock runs out first
    assert got2.slot is s1 and not planned
    pool.release(got1.slot)
    pool.release(got2.slot)
    assert not any(s.busy for s in pool.slots) and pool.waiting == 0 and s0.on_handover == s1.on_handover == []


async def test_a_wait_for_a_slot_gets_it_when_nobody_is_ahead() -> None:
    """The same plan with nobody ahead in line: s0 frees and goes to the request that waited for it."""
    s0, s1 = slot(0, 0), slot(0, 1)
    pool = SlotPool([s0, s1])
    held0 = await pool.acquire(Want(allowed=lambda s: s is s0))
    held1 = await pool.acquire(Want(allowed=lambda s: s is s1))
    w = asyncio.create_task(pool.take(Want(), WaitPlan(lambda s: s is s0, 60.0, s0)))
    await _until(lambda: pool.waiting == 1)
    pool.release(held0.slot)
    got, planned = await w
    assert got.slot is s0 and planned and s0.on_handover == []
    pool.release(got.slot)
    pool.release(held1.slot)


# ---- the server's RAM prompt cache: relied on over a file while it serves ----

def test_a_server_s_ram_is_relied_on_while_its_expected_misses_cost_less_than_a_restore() -> None:
    ram = RamWatch()
    # never seen: a miss as likely as a hit; 2 s of prefill at one half against a 0.05 s restore: the file
    assert not any(ram.rely(2.0, 0.05, now=float(t)) for t in range(100))
    assert ram.rely(2.0, 1.5, now=100.0)           # ... but a restore that waits 1.5 s for a busy server: the RAM
    assert not ram.rely(None, None, now=100.0)     # nothing to weigh and nothing seen
    for t in range(101, 117):
        ram.seen(True, now=float(t), tokens=100)               # 16 prompts found in the RAM
    assert ram.rely(0.5, 0.05, now=117.0) and ram.served and ram.rely(None, None, now=117.0)
    assert not ram.rely(2.0, 0.05, now=117.0)      # 1/18 of 2 s is still more than 0.05 s: a long prompt's file
    ram.seen(False, now=118.0, tokens=100)                     # a miss
    assert not ram.rely(0.5, 0.05, now=119.0) and not ram.rely(None, None, now=119.0)
    assert ram.rely(0.2, 0.05, now=119.0)          # a short prefill is worth the risk


def test_a_server_without_a_ram_cache_is_left_to_only_where_a_miss_costs_about_a_restore() -> None:
    ram = RamWatch()
    for t in range(5, 10):
        ram.seen(False, now=float(t), tokens=100)              # --cache-ram 0: prompts with no file were computed
    assert not ram.served
    assert not ram.rely(2.0, 1.5, now=10.0)        # 6/7 of 2 s > 1.5 s
    assert ram.rely(2.0, 1.9, now=10.0)            # (the restore would not pay either)
    assert ram.rely(2.0, 1.5, now=10.0 + RAM_RETRY_SECONDS)   # the misses are forgotten: tried again


def test_a_ram_never_seen_is_probed_once_the_files_spared_enough_and_on_every_prompt_while_it_serves() -> None:
    ram = RamWatch()
    assert not ram.probe(2.0, now=1.0)              # nothing spared yet: a miss would cost more than the files gave
    ram.restored(PROBE_PAYBACK * 2.0 - 0.5)
    assert not ram.probe(2.0, now=2.0)
    ram.restored(0.5)                               # the restores have spared PROBE_PAYBACK x 2 s of prefill
    assert not ram.probe(2.5, now=3.0)              # a longer prompt's miss needs more spared first
    assert ram.probe(2.0, now=4.0) and not ram.probe(2.0, now=5.0)   # tried, and paid for again from zero
    ram.seen(True, now=11.0, tokens=100)                        # the probe's prompt came from the RAM
    assert ram.probe(2.0, now=12.0) and ram.probe(2.0, now=13.0) and ram.probes == 3
    assert ram.miss_rate(now=13.0) == 1.0           # too few outcomes to spare a file yet
    for t in range(14, 14 + RAM_TRUST):
        ram.seen(True, now=float(t), tokens=100)
    assert ram.miss_rate(now=30.0) == 0.0           # it served every prompt left to it: no file is needed
    ram.seen(False, now=31.0, tokens=100)
    assert ram.miss_rate(now=32.0) == pytest.approx(1 / (RAM_TRUST + 2))
    ram.restored(1000.0)
    assert not any(ram.probe(2.0, now=float(t)) for t in range(32, 100))   # after a miss: no probe ...
    assert ram.probe(2.0, now=31.0 + RAM_RETRY_SECONDS + 1.0)     # ... until it is forgotten (a restart, a refill)


def test_a_server_without_a_ram_cache_loses_at_most_a_twentieth_of_what_the_files_spare() -> None:
    ram = RamWatch()
    probes, spared, lost = [], 0.0, 0.0
    for t in range(1, 2 * int(RAM_RETRY_SECONDS)):   # a return every second for 20 minutes, each 1 s of prefill
        if ram.probe(1.0, now=float(t)):
            probes.append(t)
            lost += 1.0
            ram.seen(False, now=float(t), tokens=100)         # --cache-ram 0: the probe's prompt was computed
        else:
            ram.restored(1.0)                     # restored from its file instead
            spared += 1.0
    assert len(probes) == 2 and probes[1] - probes[0] > RAM_RETRY_SECONDS
    assert lost <= spared / PROBE_PAYBACK and ram.miss_rate(now=float(probes[-1])) == 1.0



def test_a_server_that_said_it_has_a_ram_cache_is_relied_on_at_once_and_one_that_said_none_never() -> None:
    ram = RamWatch()
    assert not ram.rely(2.0, 0.05, now=1.0)         # not asked: an even bet, and the file's restore is cheaper
    ram.present = True                              # `backends.ram_check` saw the RAM give a prompt back
    assert ram.rely(2.0, 0.05, now=1.0) and ram.rely(None, None, now=1.0)   # no PROBE_PAYBACK to wait for
    ram.seen(True, now=2.0, tokens=100)
    assert ram.rely(2.0, 0.05, now=3.0)
    ram.seen(False, now=4.0, tokens=100)                        # a miss: weighed again, the outcomes with the prior
    assert not ram.rely(2.0, 0.05, now=5.0) and not ram.probe(2.0, now=5.0)
    none = RamWatch()
    none.present = False                            # --cache-ram 0: the check's prompt was not given back
    none.restored(1000.0)
    assert not any(none.probe(0.1, now=float(t)) for t in range(1, 2 * int(RAM_RETRY_SECONDS)))
    assert not none.rely(2.0, 1.9, now=5.0) and not none.rely(0.001, 10.0, now=5.0)
    none.seen(True, now=6.0, tokens=100)                        # ... yet it served one: the returns decide from now on
    assert none.present is None and none.rely(None, None, now=7.0)


def test_a_ram_that_missed_nothing_is_bet_on_only_for_prompts_near_the_longest_it_served() -> None:
    """A RAM of a fifth of the working set serves the first short returns and has dropped a long one: the bet
    grows with what it served (RAM_BET_GROWTH), from a miss costing at most RAM_BET_SECONDS."""
    ram = RamWatch()
    ram.present = True                              # the check found a RAM: how much it holds, nothing says
    cheap, long_ = RAM_BET_SECONDS, RAM_BET_SECONDS * 4.5   # prefill seconds (3.4 ms a token: 294 and 1,324 tokens)
    assert ram.rely(cheap, 0.05, now=1.0, tokens=294)          # a miss costs little: bet on
    assert not ram.rely(long_, 0.05, now=1.0, tokens=1_312)    # a long return before any hit: its file
    ram.seen(True, now=2.0, tokens=300)             # the RAM served 300 tokens
    assert ram.rely(long_, 0.05, now=3.0, tokens=RAM_BET_GROWTH * 300)
    assert not ram.rely(long_, 0.05, now=3.0, tokens=RAM_BET_GROWTH * 300 + 1)
    assert not ram.probe(long_, now=3.0, tokens=1_312)   # nor tried "while it serves them"
    ram.seen(True, now=4.0, tokens=700)             # a RAM that holds it all serves longer ones turn by turn
    assert ram.rely(long_, 0.05, now=5.0, tokens=1_312) and ram.rely(long_, 0.05, now=5.0)   # (None: not weighed)
    assert not ram.rely(long_, 30.0, now=5.0, tokens=3_000)   # nor weighed past it: a slow restore says nothing
    assert not ram.probe(long_, now=5.0, tokens=3_000)        # of what a RAM keeps
    assert not ram.rely(long_, 0.05, now=4.0 + RAM_RETRY_SECONDS + 1, tokens=1_312)   # forgotten with its hits
    ram.forget()
    assert not ram.kept_shown


def test_a_ram_that_kept_other_prompts_beside_the_one_it_served_is_bet_on_for_that_much() -> None:
    """A short return served after the server held 2,000 tokens of other chats: its RAM (oldest out first) kept
    them all, so a long return fits it too. With only short returns, a RAM that holds everything was otherwise
    never bet on for a long one."""
    ram = RamWatch()
    ram.present = True
    long_ = RAM_BET_SECONDS * 4.5
    ram.seen(True, now=2.0, tokens=86, beside=90)   # a fifth of the working set: little kept beside it
    assert not ram.rely(long_, 0.05, now=3.0, tokens=1_312)
    ram.seen(True, now=4.0, tokens=86, beside=2_000)
    assert ram.rely(long_, 0.05, now=5.0, tokens=1_312) and ram.rely(long_, 0.05, now=5.0, tokens=2_086)
    assert not ram.rely(long_, 0.05, now=5.0, tokens=2_087)


def test_a_ram_that_said_it_exists_is_tried_once_on_a_long_prompt_before_anything_came_back() -> None:
    """A workload of long prompts only (an agent's harness) would never learn what the RAM keeps: one return is
    risked whatever its size, and its outcome bounds the rest."""
    ram = RamWatch()
    ram.present = True
    assert not ram.rely(60.0, 0.05, now=1.0, tokens=15_000)
    assert ram.probe(60.0, now=1.0, tokens=15_000) and ram.probes == 1
    assert not ram.probe(60.0, now=1.5, tokens=15_000)        # once: the next waits for its outcome
    ram.seen(True, now=2.0, tokens=15_000)
    assert ram.rely(62.0, 0.05, now=3.0, tokens=15_500)       # it kept 15,000 tokens: bet on up to twice that
    unasked = RamWatch()                                      # never asked: no such try (the probes' payback rules)
    assert not unasked.probe(60.0, now=1.0, tokens=15_000)


def test_a_restart_forgets_what_the_ram_did_and_whether_it_has_one() -> None:
    ram = RamWatch()
    ram.present = True
    for t in range(RAM_TRUST):
        ram.seen(True, now=float(t), tokens=100)
    ram.forget()
    assert ram.present is None and not ram.outcomes and ram.miss_rate(now=10.0) == 1.0
    caches = ServerCaches()
    caches.held(0, [1, 2, 3])
    caches.held(1, [1, 2])
    caches.forget(0)
    assert caches.find([1, 2, 3]) == (1, 2)

class _Claims:
    """Leases across replicas as `fleet.Fleet` grants them: a claim of `stale` tells what it really holds."""

    def __init__(self, stale: Slot, holds: Content) -> None:
        self.stale, self.holds = stale, holds
        self.claimed: list[str] = []
        self.given_back: list[str] = []

    async def claim(self, slot: Slot, want: Want | None = None, restore: str | None = None,
                    writes: Content | None = None) -> bool:
        self.claimed.append(slot.name)
        if slot is self.stale:
            slot.content = self.holds
        return True

    def released(self, slot: Slot) -> None:
        self.given_back.append(slot.name)

    def valid(self, slot: Slot) -> bool:
        return True

    def saving(self, slot: Slot) -> None:
        pass


async def test_a_slot_claimed_for_a_cache_it_does_not_hold_is_given_back_for_a_slot_that_can_restore_it() -> None:
    """With REDIS_URL: this replica believed server B's slot holds the prompt (it missed another replica's use of
    it); the claim tells otherwise, and B cannot read the prompt's file. The slot goes back, and server A's, which
    can restore the file, is taken instead of computing the whole prompt on B."""
    p = prompt(text(10))
    cand = candidate(8, backend=A)
    reader = slot(0, 0, url=A)
    believed = slot(1, 0, url=B, content=content_of(p))
    pool = SlotPool([reader, believed])
    claims = _Claims(believed, content_of(prompt(text(10, tag="other"))))
    pool.claims = claims
    choice = await pool.acquire(Want(p, lambda: cand))
    assert choice.slot is reader and choice.restore is cand
    assert claims.claimed == [believed.name, reader.name] and claims.given_back == [believed.name]
    assert not believed.busy and believed.content == content_of(prompt(text(10, tag="other")))


async def test_a_claim_that_corrects_a_slot_to_an_equal_use_keeps_it() -> None:
    """The claim's truth changes nothing the request gains (it holds another prompt, as believed of the other
    slot too): the slot is kept, with one claim."""
    p = prompt(text(10))
    only = slot(0, 0, url=A, content=content_of(prompt(text(10, tag="x"))))
    pool = SlotPool([only])
    claims = _Claims(only, content_of(prompt(text(10, tag="y"))))
    pool.claims = claims
    choice = await pool.acquire(Want(p, lambda: None))
    assert choice.slot is only and claims.claimed == [only.name] and claims.given_back == []
