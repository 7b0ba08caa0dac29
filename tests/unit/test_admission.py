"""Who gets the next free slot (priority class, then the client holding fewest slots, then arrival) and who is
refused before waiting (QUEUE_MAX, a predicted wait past the deadline), with Retry-After."""

from __future__ import annotations

import asyncio
import math

import pytest

from lpcache.backends.admission import CLASSES, HOLD_TRUSTED, HoldTimes, Ticket, max_wait, priority
from lpcache.backends.placement import Choice, WaitPlan, Want
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Slot
from lpcache.errors import QueueFull, SlotsBusy

HIGH, NORMAL, LOW = range(3)


def test_priority_from_the_header_and_the_key() -> None:
    assert priority(None) == NORMAL and priority("HIGH") == HIGH and priority(" low ") == LOW
    assert priority("urgent") == NORMAL and priority("") == NORMAL          # not a class: the key's (normal)
    assert priority(None, LOW) == LOW                                       # the key's class
    # with client keys a request may lower its class, never raise it above its key's
    assert priority("high", NORMAL, keys_held=True) == NORMAL
    assert priority("low", HIGH, keys_held=True) == LOW
    assert priority("high", HIGH, keys_held=True) == HIGH
    assert priority("high", LOW, keys_held=False) == HIGH                   # no keys: the header is the word
    assert CLASSES == ("high", "normal", "low")


@pytest.mark.parametrize("asked, expected", [
    (None, 300.0), ("12.5", 12.5), ("0", 0.0), ("900", 300.0), ("-3", 300.0), ("soon", 300.0), ("nan", 300.0),
    ("inf", 300.0),
])
def test_max_wait_only_shortens_the_limit(asked: str | None, expected: float) -> None:
    assert max_wait(asked, 300.0) == expected


def test_hold_times_predict_a_wait_only_once_trusted() -> None:
    hold = HoldTimes()
    assert hold.wait(3, 2) is None
    for _ in range(HOLD_TRUSTED - 1):
        hold.add(2.0)
    assert hold.wait(3, 2) is None
    hold.add(2.0)
    hold.add(float("nan"))
    hold.add(-1.0)
    assert hold.seen == HOLD_TRUSTED and hold.wait(3, 2) == pytest.approx(4.0) and hold.wait(0, 2) == 1.0
    assert hold.wait(3, 0) is None
    hold.add(12.0)
    assert 2.0 < (hold.mean or 0) < 12.0   # a running mean: the newest hold counts, not alone


def slots(n: int) -> list[Slot]:
    return [Slot(backend=0, id=i, url="http://a") for i in range(n)]


async def waiting(pool: SlotPool, ticket: Ticket, timeout: float | None = None) -> asyncio.Task[Choice]:
    """A request in line: returns once it is queued (acquire queues it before its first suspension)."""
    started = asyncio.Event()

    async def run() -> Choice:
        started.set()
        return await pool.acquire(Want(ticket=ticket), timeout)

    task = asyncio.create_task(run())
    await started.wait()
    await asyncio.sleep(0)
    return task


async def served_order(pool: SlotPool, tasks: list[asyncio.Task[Choice]], running: list[Choice]) -> list[int]:
    """Release the running slots one at a time, each to the next in line; the indexes of `tasks` in the order
    they got a slot."""
    order: list[int] = []
    while len(order) < len(tasks):
        pool.release(running.pop(0).slot)
        pending = [t for i, t in enumerate(tasks) if i not in order]
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, done
        got = tasks.index(done.pop())
        order.append(got)
        running.append(tasks[got].result())
    for choice in running:
        pool.release(choice.slot)
    return order


async def test_one_client_is_served_in_arrival_order() -> None:
    pool = SlotPool(slots(2))
    running = [await pool.acquire(Want(ticket=Ticket("a"))), await pool.acquire(Want(ticket=Ticket("a")))]
    tasks = [await waiting(pool, Ticket("a")) for _ in range(5)]
    assert await served_order(pool, tasks, running) == [0, 1, 2, 3, 4]


async def test_a_bursting_client_takes_turns_with_the_other() -> None:
    pool = SlotPool(slots(2))
    running = [await pool.acquire(Want(ticket=Ticket("burst"))), await pool.acquire(Want(ticket=Ticket("burst")))]
    burst = [await waiting(pool, Ticket("burst")) for _ in range(6)]
    other = [await waiting(pool, Ticket("other")) for _ in range(2)]
    order = await served_order(pool, burst + other, running)
    # the other client's first request gets the first slot to come free (its client holds none), its second
    # the next slot once its first is running while the burst's hold the other... never behind all six
    assert order.index(6) == 0 and order.index(7) <= 2
    assert [i for i in order if i < 6] == [0, 1, 2, 3, 4, 5]   # the burst keeps its own order


async def test_a_high_priority_request_gets_the_next_free_slot() -> None:
    pool = SlotPool(slots(2))
    running = [await pool.acquire(Want(ticket=Ticket("a"))), await pool.acquire(Want(ticket=Ticket("b")))]
    line = [await waiting(pool, Ticket("a", NORMAL)) for _ in range(3)] + [await waiting(pool, Ticket("c", LOW))]
    urgent = await waiting(pool, Ticket("b", HIGH))
    order = await served_order(pool, line + [urgent], running)
    assert order[0] == 4 and order[-1] == 3   # high first, whatever waited before it; low last
    assert sum(pool.waiting_by_class().values()) == 0 and not any(s.busy for s in pool.slots)


async def test_queue_max_refuses_with_retry_after_before_waiting() -> None:
    pool = SlotPool(slots(1), queue_max=2)
    held = await pool.acquire(Want())
    line = [await waiting(pool, Ticket("a")) for _ in range(2)]
    with pytest.raises(QueueFull) as e:
        await pool.acquire(Want(ticket=Ticket("b")))
    assert e.value.status == 429 and e.value.code == "queue_full" and (e.value.retry_after or 0) >= 1.0
    assert pool.refused["queue_full"] == 1 and pool.waiting == 2
    pool.release(held.slot)
    first = await line[0]
    pool.release(first.slot)
    pool.release((await line[1]).slot)
    assert not any(s.busy for s in pool.slots) and pool.waiting == 0


async def test_a_wait_predicted_past_the_deadline_is_refused_at_once() -> None:
    pool = SlotPool(slots(2), wait_timeout=300.0)
    for _ in range(HOLD_TRUSTED):     # the slots' recent hold times: 10 s each
        pool.hold.add(10.0)
    held = [await pool.acquire(Want(ticket=Ticket("a"))), await pool.acquire(Want(ticket=Ticket("a")))]
    line = [await waiting(pool, Ticket("a")) for _ in range(4)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SlotsBusy) as e:
        await pool.acquire(Want(ticket=Ticket("a")), timeout=20.0)   # 4 ahead on 2 slots: about 25 s
    assert loop.time() - started < 1.0                                # told at once, not after 20 s
    assert e.value.status == 503 and e.value.code == "wait_past_deadline"
    assert e.value.retry_after == pytest.approx(25.0)
    assert pool.refused["past_deadline"] == 1
    # a high-priority request goes before the four: its wait fits
    urgent = await waiting(pool, Ticket("a", HIGH), timeout=20.0)
    assert await served_order(pool, [*line, urgent], held) == [4, 0, 1, 2, 3]
    assert not any(s.busy for s in pool.slots) and pool.waiting == 0


async def test_a_wait_that_runs_out_says_when_to_come_back() -> None:
    pool = SlotPool(slots(1), wait_timeout=0.05)
    held = await pool.acquire(Want())
    with pytest.raises(SlotsBusy) as e:
        await pool.acquire(Want())
    assert e.value.code == "all_slots_busy" and e.value.retry_after == 1.0   # no hold time seen yet
    pool.release(held.slot)
    assert pool.hold.seen == 1 and pool.hold.mean is not None and math.isfinite(pool.hold.mean)


async def test_the_line_reports_waits_by_class() -> None:
    pool = SlotPool(slots(1))
    held = await pool.acquire(Want())
    task = await waiting(pool, Ticket("a", LOW))
    assert pool.line()["low"]["waiting"] == 1 and pool.line()["high"]["waiting"] == 0
    pool.release(held.slot)
    choice = await task
    pool.waited(Want(ticket=Ticket("a", LOW)), 0.5)
    assert pool.line()["low"] == {"waiting": 0, "waits": 1, "wait_p50": 0.5, "wait_max": 0.5}
    pool.release(choice.slot)


async def test_a_request_planning_on_a_busy_slot_is_not_refused_while_another_is_idle() -> None:
    pool = SlotPool(slots(2), queue_max=1)
    for _ in range(HOLD_TRUSTED):
        pool.hold.add(10.0)
    busy = await pool.acquire(Want(ticket=Ticket("a")))
    other = pool.slots[1]
    # a waiter planning on the busy slot only (its own conversation's), while the other slot is idle
    planned = asyncio.create_task(pool._acquire(Want(ticket=Ticket("b")), 5.0, WaitPlan(lambda s: s is busy.slot,
                                                                                         5.0)))
    await asyncio.sleep(0)
    assert pool.waiting == 1 and not other.busy
    # neither the full line (QUEUE_MAX 1) nor the predicted wait refuses a request that can take the idle slot
    got = await pool.acquire(Want(ticket=Ticket("c")), timeout=0.5)
    assert got.slot is other
    pool.release(busy.slot)
    choice, on_plan = await planned
    assert choice.slot is busy.slot and on_plan
    pool.release(choice.slot)
    pool.release(got.slot)
    assert not any(s.busy for s in pool.slots)


async def test_slots_freed_together_are_shared_between_clients() -> None:
    pool = SlotPool(slots(2))
    held = [await pool.acquire(Want(ticket=Ticket("x"))), await pool.acquire(Want(ticket=Ticket("x")))]
    tasks = [await waiting(pool, Ticket(c)) for c in ("a", "a", "b")]
    for slot in pool.slots:   # both come free in one wake, as when a backend comes up
        slot.busy = False
    pool.wake()
    await asyncio.sleep(0)
    await asyncio.wait(tasks[:1] + tasks[2:], timeout=5)
    assert tasks[0].done() and tasks[2].done() and not tasks[1].done()   # one each, not both to client a
    for t in (tasks[0], tasks[2]):
        pool.release(t.result().slot)
    pool.release((await tasks[1]).slot)
    del held


async def test_a_client_finds_its_share_kept_when_it_comes_back() -> None:
    pool = SlotPool(slots(2))
    pool.hold.add(10.0)   # a request keeps its slot 10 s: a share is kept that long
    b = await pool.acquire(Want(ticket=Ticket("b")))
    burst = [await pool.acquire(Want(ticket=Ticket("a")))] + [await waiting(pool, Ticket("a")) for _ in range(3)]
    pool.release(b.slot)
    await asyncio.sleep(0)
    assert not any(t.done() for t in burst[1:])   # the burst holds one slot already: b's stays free
    again = await pool.acquire(Want(ticket=Ticket("b")), timeout=1.0)   # b's next step, at once
    assert again.slot is b.slot and pool.waiting == 3
    pool.release(again.slot)
    pool.release(burst[0].slot)   # the burst holds none now: it takes a slot whatever is kept
    await asyncio.wait(burst[1:], timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert sum(t.done() for t in burst[1:]) == 1


async def test_a_kept_share_runs_out_with_nobody_releasing() -> None:
    pool = SlotPool(slots(2))
    pool.hold.add(0.05)
    b = await pool.acquire(Want(ticket=Ticket("b")))
    held = await pool.acquire(Want(ticket=Ticket("a")))
    later = await waiting(pool, Ticket("a"))
    pool.release(b.slot)
    await asyncio.sleep(0)
    assert not later.done()
    got = await asyncio.wait_for(later, timeout=5)   # b did not come back within one hold time
    assert got.slot is b.slot and "b" in pool.kept
    for choice in (got, held):
        pool.release(choice.slot)


async def test_a_kept_share_holds_back_no_higher_class_and_no_lower_class_before_it() -> None:
    pool = SlotPool(slots(2))
    pool.hold.add(10.0)
    b = await pool.acquire(Want(ticket=Ticket("b", NORMAL)))
    held = await pool.acquire(Want(ticket=Ticket("a")))
    low = await waiting(pool, Ticket("c", LOW))     # holds nothing, but a normal request is held back
    normal = await waiting(pool, Ticket("a", NORMAL))
    pool.release(b.slot)
    await asyncio.sleep(0)
    assert not low.done() and not normal.done()
    urgent = await pool.acquire(Want(ticket=Ticket("a", HIGH)), timeout=1.0)   # a higher class than b's
    assert urgent.slot is b.slot
    for choice in (urgent, held):
        pool.release(choice.slot)
    done, _ = await asyncio.wait([low, normal], timeout=5, return_when=asyncio.ALL_COMPLETED)
    assert len(done) == 2
    for t in (low, normal):
        pool.release(t.result().slot)


def on(backend: int, i: int) -> Slot:
    return Slot(backend=backend, id=i, url=f"http://b{backend}")


async def test_while_a_share_is_kept_queue_max_and_deadlines_still_refuse_at_once() -> None:
    pool = SlotPool([on(0, 0), on(0, 1)], queue_max=2)
    pool.hold.add(10.0)
    b = await pool.acquire(Want(ticket=Ticket("b")))
    a = await pool.acquire(Want(ticket=Ticket("a")))
    pool.release(b.slot)   # b's share is kept: a may not take the last idle slot for 10 s
    line = [await waiting(pool, Ticket("a"), timeout=20.0) for _ in range(2)]
    with pytest.raises(QueueFull):
        await pool.acquire(Want(ticket=Ticket("a")), timeout=20.0)
    assert pool.waiting == 2 and not any(t.done() for t in line)
    for t in line:
        t.cancel()
    await asyncio.gather(*line, return_exceptions=True)
    pool.release(a.slot)


async def test_a_request_whose_deadline_ends_before_the_share_is_not_held_back() -> None:
    pool = SlotPool([on(0, 0), on(0, 1)])
    pool.hold.add(10.0)
    b = await pool.acquire(Want(ticket=Ticket("b")))
    a = await pool.acquire(Want(ticket=Ticket("a")))
    pool.release(b.slot)
    got = await pool.acquire(Want(ticket=Ticket("a")), timeout=1.0)   # waiting out b's share would time it out
    assert got.slot is b.slot
    for choice in (got, a):
        pool.release(choice.slot)


async def test_a_share_holds_back_only_slots_of_its_backend_and_no_class_on_other_backends() -> None:
    x0, x1, y0 = on(0, 0), on(0, 1), on(1, 0)   # backend 0 serves model X, backend 1 model Y
    pool = SlotPool([x0, x1, y0])
    pool.hold.add(10.0)
    b = await pool.acquire(Want(ticket=Ticket("b"), allowed=lambda s: s.backend == 0))
    a = await pool.acquire(Want(ticket=Ticket("a"), allowed=lambda s: s.backend == 0))
    y_busy = await pool.acquire(Want(ticket=Ticket("e"), allowed=lambda s: s.backend == 1))
    pool.release(b.slot)   # b's share: on backend 0
    held = asyncio.create_task(pool.acquire(Want(ticket=Ticket("a", NORMAL), allowed=lambda s: s.backend == 0), 20))
    low = asyncio.create_task(pool.acquire(Want(ticket=Ticket("d", LOW), allowed=lambda s: s.backend == 1), 20))
    await asyncio.sleep(0)
    pool.release(y_busy.slot)   # backend 1's only slot: nobody's share
    got = await asyncio.wait_for(low, timeout=5)
    assert got.slot is y0 and not held.done()
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    for choice in (got, a):
        pool.release(choice.slot)


async def test_shares_on_one_backend_leave_another_backends_idle_slot_free() -> None:
    s = [on(0, 0), on(0, 1), on(0, 2), on(1, 0)]
    pool = SlotPool(s)
    pool.hold.add(10.0)
    b = await pool.acquire(Want(ticket=Ticket("b"), allowed=lambda x: x is s[0]))
    c = await pool.acquire(Want(ticket=Ticket("c"), allowed=lambda x: x is s[1]))
    a = await pool.acquire(Want(ticket=Ticket("a"), allowed=lambda x: x is s[2]))
    pool.release(b.slot)
    pool.release(c.slot)   # shares of b and c, both on backend 0
    d = await pool.acquire(Want(ticket=Ticket("d"), allowed=lambda x: x is s[0]))   # holds none: takes one
    got = await asyncio.wait_for(pool.acquire(Want(ticket=Ticket("a")), timeout=20.0), timeout=5)   # not in 10 s
    assert got.slot is s[3], "backend 1's idle slot is nobody's share"
    for choice in (got, a, d):
        pool.release(choice.slot)
