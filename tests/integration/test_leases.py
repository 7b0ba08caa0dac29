"""Slot leases against a real Redis: grants, renewals, releases and expiry; fencing tokens that only grow, across
restarts and lost data; Redis down as one quick error; and many replicas' requests at once never holding one slot
together."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from lpcache.errors import SharedStoreDown
from lpcache.fleet.leases import COUNTER, PREFIX, Holder, Lease, Leases, LeaseTaken
from lpcache.workloads.harness import RedisServer

SLOT = "http://127.0.0.1:8080#0"
A, B = Holder("replica-a", "req-1"), Holder("replica-b", "req-2")


def client(url: str) -> Redis:
    """As a replica would make it: short socket timeouts, one immediate reconnect (a restarted Redis), no backoff."""
    return Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 1))


@pytest.fixture
async def leases(redis_server: RedisServer) -> AsyncIterator[Leases]:
    redis = client(redis_server.url)
    yield Leases(redis)
    await redis.aclose()


async def until(condition: Callable[[], Awaitable[bool]], timeout: float = 3.0) -> float:
    """Poll `condition` until it holds; the time it took (fails at the deadline)."""
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout, "condition not met before the deadline"
        await asyncio.sleep(0.005)   # polling interval, not synchronisation
    return time.monotonic() - start


async def test_one_holder_at_a_time_and_only_the_holder_renews_or_releases(leases: Leases) -> None:
    lease = await leases.acquire(SLOT, A, 5000)
    assert lease is not None and lease.valid() and lease.holder == A
    assert await leases.acquire(SLOT, B, 5000) is None
    seen = await leases.holder(SLOT)
    assert seen is not None and (seen.holder, seen.token) == (A, lease.token) and 4000 < seen.ttl_ms <= 5000
    impostors = [Lease(SLOT, B, lease.token, 5000, lease.expires), Lease(SLOT, A, lease.token + 1, 5000, 0.0)]
    for other in impostors:
        assert await leases.renew(other, 60000) is False
        assert await leases.release(other) is False
    assert await leases.redis.pttl(PREFIX + SLOT) <= 5000
    before = lease.expires
    assert await leases.renew(lease, 60000) is True
    assert lease.expires > before and lease.ttl_ms == 60000 and await leases.redis.pttl(PREFIX + SLOT) > 5000
    assert await leases.release(lease) is True and not lease.valid()
    assert await leases.holder(SLOT) is None
    assert await leases.release(lease) is False and await leases.renew(lease) is False
    second = await leases.acquire(SLOT, B, 5000)
    assert second is not None and second.token > lease.token
    assert (await leases.redis.get(PREFIX + SLOT)) == f"{second.token} replica-b req-2".encode()


async def test_a_lease_lapses_after_its_holder_stopped_believing_in_it(leases: Leases) -> None:
    start = time.monotonic()
    lease = await leases.acquire(SLOT, A, 100)
    assert lease is not None and lease.valid()

    async def gone() -> bool:
        valid_before = lease.valid()
        missing = await leases.holder(SLOT) is None
        assert not (missing and valid_before), "Redis forgot a lease its holder still believed valid"
        return missing

    await until(gone)
    assert time.monotonic() - start >= 0.099    # Redis counts the ttl from when the call arrived (1 ms resolution)
    assert not lease.valid() and await leases.renew(lease) is False


async def test_a_late_release_leaves_the_next_holders_lease_alone(leases: Leases) -> None:
    late = await leases.acquire(SLOT, A, 50)
    assert late is not None
    await until(lambda: _is_none(leases.holder(SLOT)))
    current = await leases.acquire(SLOT, B, 5000)
    assert current is not None and current.token > late.token
    assert await leases.renew(late) is False
    assert await leases.release(late) is False
    seen = await leases.holder(SLOT)
    assert seen is not None and (seen.holder, seen.token) == (B, current.token)


async def _is_none(result: Awaitable[object]) -> bool:
    return await result is None


async def test_tokens_grow_with_every_grant_across_slots_and_holders(leases: Leases) -> None:
    tokens = []
    for i in range(30):
        lease = await leases.acquire(f"http://b{i % 3}:8080#{i}", Holder(f"r{i % 4}", f"q{i}"), 1000)
        assert lease is not None
        tokens.append(lease.token)
        if i % 2:
            await leases.release(lease)
    assert all(a < b for a, b in zip(tokens, tokens[1:], strict=False))
    seconds, micros = await leases.redis.time()
    assert tokens[-1] <= seconds * 1_000_000 + micros     # the clock floor: tokens are microseconds, not 1, 2, 3


async def test_a_restarted_redis_keeps_the_counter_and_the_held_leases(leases: Leases,
                                                                       redis_server: RedisServer) -> None:
    before = await leases.acquire("http://b:8080#1", A, 1000)
    assert before is not None
    async with leases.hold(SLOT, B, 5000) as held:
        await asyncio.to_thread(redis_server.restart)
        renewed = held.expires
        await until(lambda: _true(held.expires > renewed), timeout=4)   # the keeper renews it after the restart
        assert held.valid() and not held.lost.is_set()
        assert await leases.acquire(SLOT, A, 1000) is None
    after = await leases.acquire(SLOT, A, 1000)
    assert after is not None and after.token > held.token > before.token


async def _true(value: bool) -> bool:
    return value


async def test_redis_losing_its_data_never_reissues_a_token(leases: Leases, redis_server: RedisServer) -> None:
    """SIGKILL loses what came after the last save: the counter goes back and the newer leases vanish. The clock
    floor keeps the next token above every token granted before."""
    saved = await leases.acquire("http://b:8080#1", A, 60000)
    assert saved is not None
    await asyncio.to_thread(redis_server.restart)          # saved at shutdown
    unsaved = [await leases.acquire(f"http://b:8080#{i}", B, 60000) for i in range(2, 6)]
    highest = max(lease.token for lease in unsaved if lease is not None)
    await asyncio.to_thread(redis_server.kill)
    await asyncio.to_thread(redis_server.restart)
    assert int(await leases.redis.get(COUNTER)) < highest                 # the data really went back
    assert await leases.holder("http://b:8080#2") is None                 # and the newer leases with it
    seen = await leases.holder("http://b:8080#1")
    assert seen is not None and seen.token == saved.token
    again = await leases.acquire("http://b:8080#2", A, 1000)
    assert again is not None and again.token > highest
    assert await leases.renew(unsaved[0]) is False                        # (its holder learns it lost the slot)


async def test_redis_down_is_one_quick_error(leases: Leases, redis_server: RedisServer) -> None:
    held = await leases.acquire(SLOT, A, 5000)
    assert held is not None
    await asyncio.to_thread(redis_server.kill)
    calls = [leases.acquire(SLOT, B, 1000), leases.renew(held), leases.release(held), leases.holder(SLOT)]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(SharedStoreDown, match=r"Redis at 127\.0\.0\.1:\d+ did not answer") as caught:
            await call
        assert time.monotonic() - start < 1.5
        assert isinstance(caught.value.__cause__, RedisError | OSError)


async def test_a_silent_redis_is_cut_off_by_the_timeout() -> None:
    """A Redis that accepts the connection and never answers (a stalled host): the call still ends in time."""
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    redis = Redis(host="127.0.0.1", port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    start = time.monotonic()
    with pytest.raises(SharedStoreDown):
        await Leases(redis, timeout=0.3).acquire(SLOT, A, 1000)
    assert time.monotonic() - start < 1.0
    await redis.aclose()
    server.close()
    await server.wait_closed()


async def test_hold_renews_past_the_ttl_and_releases_on_the_way_out(leases: Leases) -> None:
    async with leases.hold(SLOT, A, 200) as lease:
        with pytest.raises(LeaseTaken):
            async with leases.hold(SLOT, B, 200):
                pass
        end = time.monotonic() + 0.6           # work for three ttls
        while time.monotonic() < end:
            assert lease.valid()
            await asyncio.sleep(0.02)
        seen = await leases.holder(SLOT)
        assert seen is not None and seen.token == lease.token
    assert await leases.holder(SLOT) is None and not lease.valid()

    with pytest.raises(ZeroDivisionError):
        async with leases.hold(SLOT, A, 5000):
            1 / 0  # noqa: B018
    assert await leases.holder(SLOT) is None


async def test_a_cancelled_holder_releases(leases: Leases) -> None:
    inside = asyncio.Event()

    async def request() -> None:
        async with leases.hold(SLOT, A, 5000):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await inside.wait()
    assert await leases.holder(SLOT) is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await leases.holder(SLOT) is None


async def test_the_keeper_reports_a_lease_taken_from_under_it(leases: Leases) -> None:
    async with leases.hold(SLOT, A, 200) as lease:
        await leases.redis.delete(PREFIX + SLOT)          # as if it had lapsed while the replica stalled
        thief = await leases.acquire(SLOT, B, 5000)
        assert thief is not None
        await asyncio.wait_for(lease.lost.wait(), 1.0)
        assert not lease.valid()
    seen = await leases.holder(SLOT)
    assert seen is not None and seen.token == thief.token      # the exit's release left the thief's lease alone


async def test_the_keeper_gives_up_when_redis_is_gone_past_the_ttl(leases: Leases,
                                                                   redis_server: RedisServer) -> None:
    async with leases.hold(SLOT, A, 300) as lease:
        await asyncio.to_thread(redis_server.kill)
        await asyncio.wait_for(lease.lost.wait(), 2.0)
        assert not lease.valid()
    # leaving the block did not raise: the release failed quietly, the lease lapses by itself


class Racing(Leases):
    """The holder leaves while a renewal's answer is on its way back."""

    leaving: Lease

    async def _run(self, what: str, script: Any, name: str, *args: Any, counter: bool = False) -> Any:
        result = await super()._run(what, script, name, *args, counter=counter)
        if what == "renew":
            await self.release(self.leaving)
        return result


async def test_a_renewal_answered_after_the_release_does_not_extend_the_lease(redis_server: RedisServer) -> None:
    redis = client(redis_server.url)
    leases = Racing(redis)
    lease = await leases.acquire(SLOT, A, 5000)
    assert lease is not None
    leases.leaving = lease
    assert await leases.renew(lease, 60000) is False
    assert lease.expires <= time.monotonic() and not lease.valid()
    assert await leases.renew(lease) is False and await leases.holder(SLOT) is None
    await redis.aclose()


class Stubborn(Leases):
    """A renewal that swallows a cancel, as redis-py's socket writes through asyncio.wait_for do on Python 3.11."""

    renewals = 0

    async def renew(self, lease: Lease, ttl_ms: int | None = None) -> bool:
        self.renewals += 1
        try:
            await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            pass
        return await super().renew(lease, ttl_ms)


async def test_leaving_the_block_stops_the_keeper_even_mid_renewal(redis_server: RedisServer) -> None:
    redis = client(redis_server.url)
    leases = Stubborn(redis)
    async with leases.hold(SLOT, A, 90) as lease:
        await until(lambda: _true(leases.renewals > 0))
        left = time.monotonic()
    assert time.monotonic() - left < 0.5
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("lease keeper")]
    assert lease.expires <= left + 0.001 and await leases.holder(SLOT) is None
    await redis.aclose()


async def test_a_cancel_swallowed_inside_redis_py_is_raised_again(leases: Leases) -> None:
    async def swallowing(keys: list[str], args: tuple[Any, ...]) -> int:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass
        return 1

    leases._renew = swallowing
    lease = Lease(SLOT, A, 1, 1000, time.monotonic() + 1)
    task = asyncio.create_task(leases.renew(lease))
    await asyncio.sleep(0)       # let it start (one loop turn)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class SlowAnswer(Leases):
    """Redis grants the lease, and the answer takes a while to come back."""

    granted: asyncio.Event

    async def _run(self, what: str, script: Any, name: str, *args: Any, counter: bool = False) -> Any:
        result = await super()._run(what, script, name, *args, counter=counter)
        if what == "acquire":
            self.granted.set()
            await asyncio.sleep(0.05)
        return result


async def test_a_holder_cancelled_while_acquiring_gives_the_grant_back(redis_server: RedisServer) -> None:
    redis = client(redis_server.url)
    leases = SlowAnswer(redis)
    leases.granted = asyncio.Event()

    async def request() -> None:
        async with leases.hold(SLOT, A, 60000):
            raise AssertionError("the block runs after a cancel")

    task = asyncio.create_task(request())
    await leases.granted.wait()
    assert await leases.holder(SLOT) is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await until(lambda: _is_none(leases.holder(SLOT)), timeout=1) < 1    # not after its 60 s ttl
    await redis.aclose()


# ---- many replicas' requests at once ----

@dataclass
class Slot:
    """A slot that accepts a write only with a token at least the highest it accepted (what fencing asks)."""

    accepted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)

    def write(self, token: int) -> None:
        (self.rejected if self.accepted and token < self.accepted[-1] else self.accepted).append(token)


@dataclass
class Held:
    name: str
    lease: Lease
    start: float          # when the holder learnt it had the lease


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_many_requests_never_share_a_slot(leases: Leases, seed: int) -> None:
    rng = random.Random(seed)
    names = [f"http://backend-{i}:8080#{i % 2}" for i in range(3)]
    slots = {name: Slot() for name in names}
    held: list[Held] = []
    stats = {"expired mid-work": 0, "crashed": 0, "cancelled": 0, "late releases refused": 0, "kept lapsed": 0}

    async def work(lease: Lease, steps: int, step: float) -> bool:
        """Write `steps` times; stop at the first check that finds the lease no longer valid."""
        for _ in range(steps):
            await asyncio.sleep(step)
            if not lease.valid():
                return False
            slots[lease.name].write(lease.token)     # no await between the check and the write
        return True

    async def grab(name: str, holder: Holder, ttl: int) -> Lease:
        while True:                            # a replica polls: the lease lives in another process
            lease = await leases.acquire(name, holder, ttl)
            if lease is not None:
                break
            await asyncio.sleep(rng.uniform(0.005, 0.02))
        held.append(Held(name, lease, time.monotonic()))
        return lease

    async def request(i: int) -> None:
        name, mode = rng.choice(names), rng.choice(["kept", "kept", "bare", "crash", "cancel"])
        holder = Holder(f"replica-{i % 5}", f"req-{i}")
        steps, step = rng.randint(2, 6), rng.uniform(0.01, 0.04)
        await asyncio.sleep(rng.uniform(0, 0.5))
        if mode == "bare":                     # no renewals: a ttl shorter than the work lapses mid-work
            lease = await grab(name, holder, rng.randint(30, 120))
            if not await work(lease, steps, step):
                stats["expired mid-work"] += 1
            if not await leases.release(lease):
                stats["late releases refused"] += 1
        elif mode == "crash":                  # the replica dies: no more writes, no release, no renewals
            lease = await grab(name, holder, rng.randint(30, 200))
            await work(lease, rng.randint(0, 2), step)
            stats["crashed"] += 1
        else:                                  # renewed by the keeper; "cancel": the client leaves mid-work
            ttl = rng.randint(40, 300)
            while True:
                try:
                    async with leases.hold(name, holder, ttl) as lease:
                        held.append(Held(name, lease, time.monotonic()))
                        if mode == "cancel":
                            task = asyncio.current_task()
                            assert task is not None
                            asyncio.get_running_loop().call_later(step * steps / 2, task.cancel)
                        if not await work(lease, steps, step):
                            stats["kept lapsed"] += 1      # a stalled loop missed a renewal: it stopped writing
                    return
                except LeaseTaken:
                    await asyncio.sleep(rng.uniform(0.005, 0.02))
                except asyncio.CancelledError:         # raised through hold's exit, which released the lease
                    stats["cancelled"] += 1
                    return

    start = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(request(i) for i in range(50))), 15)
    assert time.monotonic() - start < 15

    assert len(held) == 50
    assert stats["expired mid-work"] > 0 and stats["crashed"] > 0 and stats["cancelled"] > 0
    tokens = [h.lease.token for h in held]
    assert len(set(tokens)) == len(tokens)
    for name in names:
        mine = sorted((h for h in held if h.name == name), key=lambda h: h.start)
        for earlier, later in zip(mine, mine[1:], strict=False):
            # the earlier holder stopped believing (released, or its local deadline passed) before the later one
            # learnt it held the slot, and the later one presents a larger token
            assert earlier.lease.expires <= later.start, (earlier, later)
            assert earlier.lease.token < later.lease.token
        assert slots[name].rejected == [] and slots[name].accepted == sorted(slots[name].accepted)
        assert slots[name].accepted
    for name in names:
        await until(lambda name=name: _is_none(leases.holder(name)), timeout=2)   # crashed leases lapse
