"""Two lpcache replicas sharing one real Redis in front of two real llama-servers (-np 2 --cache-ram 0, separate
slot-save folders). A client sends each request of the story workload (3 users x 3 kinds of work x 4 rounds, each
kind with its X-Session-ID; one thread per user) to a random replica:

- the servers compute at most 1.08x the ideal (the tokens no earlier prompt of the same session shared);
- no two replicas use one slot at once: each replica's use of a slot (from its claim to its release) never overlaps
  another replica's, and every time a server's own GET /slots shows a slot processing, one replica holds it;
- Redis restarted mid-run (losing its data): no error answer, and the next round is back within the bound;
- a replica killed (SIGKILL) mid-request: the client's retry through the other replica is answered.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.workloads.harness import LlamaServer, LpcacheProcess, RedisServer
from lpcache.workloads.story import Turn, ideal, turns

from ..conftest import Proxy, figures

pytestmark = pytest.mark.e2e

# One turn computed on the other server is allowed: a request whose home slots both generate goes elsewhere when the
# answers under way (at the loaded CPU's decode rate) would take longer than the prefill its home spares (issue 21:
# a wait never costs more than the prefill it spares). On two servers, two replicas and Redis on 2 cores, a redraft
# turn did so once in CI (424 tokens computed, 71 ideal: 1.062x), which is the rule working, not sharing lost.
BOUND = 1.08


@pytest.fixture(scope="module")
def workload() -> list[Turn]:
    return turns(users=3, kinds=("generate", "annotate", "redraft"), rounds=4)


@pytest.fixture(scope="module")
def ideal_tokens(workload: list[Turn]) -> list[int]:
    with LlamaServer(None, n_slots=1, cache_ram=0, ctx=4096) as server:
        return ideal(server.url, workload)


@pytest.fixture
def servers(tmp_path: Any) -> Iterator[list[LlamaServer]]:
    started: list[LlamaServer] = []
    try:
        for i in range(2):
            started.append(LlamaServer(str(tmp_path / f"slots{i}"), n_slots=2, cache_ram=0, ctx=8192))
        yield started
    finally:
        for s in started:
            s.stop()


def replica_settings(servers: Sequence[LlamaServer], redis: RedisServer, tmp_path: Any, i: int) -> Settings:
    return Settings(backends=tuple(BackendConfig(s.url, None, s.slot_save_path) for s in servers),
                    meta_dir=str(tmp_path / f"meta{i}"), host="127.0.0.1", big_threshold_words=200,
                    redis_url=redis.url, replica_id=f"replica{i}", slot_lease_ms=5000)


@dataclass
class Run:
    answers: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    computed_by_round: dict[int, int] = field(default_factory=dict)
    computed_by_turn: dict[int, tuple[int, str, str]] = field(default_factory=dict)   # index -> (tokens, via, route)

    @property
    def computed(self) -> int:
        return sum(self.computed_by_round.values())


def send_workload(workload: Sequence[Turn], urls: Callable[[], Sequence[str]], seed: int,
                  between_rounds: Callable[[int], None] | None = None) -> Run:
    """One thread per user, each sending its turns in order, each to a random replica; a round starts when every
    user finished the previous one (`between_rounds` runs then)."""
    run = Run()
    lock = threading.Lock()
    users = sorted({t.user for t in workload})
    rounds = sorted({t.turn for t in workload})

    def user_round(user: int, r: int) -> None:
        rng = random.Random(seed * 1000 + user * 10 + r)
        with httpx.Client(timeout=600) as client:
            for index, t in ((i, t) for i, t in enumerate(workload) if t.user == user and t.turn == r):
                url = rng.choice(list(urls()))
                resp = client.post(f"{url}/v1/chat/completions", headers={"X-Session-ID": t.session}, json={
                    "model": "smollm2", "messages": t.messages, "max_tokens": 8, "temperature": 0})
                with lock:
                    if resp.status_code != 200:
                        run.errors.append(f"{resp.status_code} {resp.text[:200]}")
                        continue
                    body = resp.json()
                    run.answers.append(body)
                    run.computed_by_round[r] = run.computed_by_round.get(r, 0) + body["timings"]["prompt_n"]
                    run.computed_by_turn[index] = (body["timings"]["prompt_n"], url,
                                                   resp.headers.get("x-lpcache-slot", "-"))

    with ThreadPoolExecutor(len(users)) as pool:
        for r in rounds:
            if between_rounds is not None:
                between_rounds(r)
            list(pool.map(user_round, users, [r] * len(users)))
    return run


class SlotWatch:
    """Polls each server's GET /slots while the run goes: (server url, slot id, sent, received) whenever a slot is
    processing."""

    def __init__(self, servers: Sequence[LlamaServer]) -> None:
        self.servers = servers
        self.seen: list[tuple[str, int, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> SlotWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                for s in self.servers:
                    sent = time.time()
                    try:
                        slots = client.get(f"{s.url}/slots").json()
                    except (httpx.HTTPError, ValueError):
                        continue
                    received = time.time()
                    self.seen += [(s.url, int(x["id"]), sent, received) for x in slots if x.get("is_processing")]
                self._stop.wait(0.02)


def holds(trace: Sequence[tuple[str, float, str]]) -> dict[str, list[tuple[float, float]]]:
    """A replica's use of each slot, from its pool's trace: (take, give) intervals."""
    out: dict[str, list[tuple[float, float]]] = {}
    open_at: dict[str, float] = {}
    for name, at, what in trace:
        if what == "take":
            open_at[name] = at
        elif name in open_at:
            out.setdefault(name, []).append((open_at.pop(name), at))
    for name, at in open_at.items():
        out.setdefault(name, []).append((at, float("inf")))
    return out


def speeds_of(proxy: Proxy) -> str:
    """The speeds a replica learnt per backend (what its restore and wait decisions weighed)."""
    return "; ".join(f"{b}: " + ", ".join(f"{k}={v:.2f}" for k, v in s.describe().items() if v is not None)
                     for (b, _), s in proxy.pipeline.speeds.items())


def explain(records: Sequence[Any], session: str) -> str:
    """The session's requests as the replicas recorded them, in order (for the message of a failed bound)."""
    fields = ("backend", "slot", "route", "seeded", "prompt_n", "cache_n", "restore_file", "restore_lost",
              "restore_reused", "restore_skipped", "queue_ms", "swap_saved", "saved", "save_file", "retries")
    mine = sorted((r for r in records if r.session == session), key=lambda r: r.started)
    return "".join("\n    " + ", ".join(f"{f}={getattr(r, f)}" for f in fields) for r in mine)


DECISIONS = ("session_away", "own_slot_still_busy", "restore_skipped", "waited_for_save", "save_deferred",
             "slot_claims_local", "shared_write_failed", "shared_map_gap")


def decisions(caplog: pytest.LogCaptureFixture, replicas: Sequence[Proxy]) -> str:
    """The replicas' logged placement decisions (which replica: its port), for the message of a failed bound."""
    port = {f"uvicorn-{p.url.rsplit(':', 1)[1]}": f"replica{i}" for i, p in enumerate(replicas)}
    return "".join(f"\n    {r.created:.2f} {port.get(r.threadName or '', r.threadName)} {r.getMessage()[:700]}"
                   for r in caplog.records if r.getMessage().startswith(DECISIONS))


def check_one_holder(replicas: Sequence[Proxy], watch: SlotWatch) -> int:
    """No slot used by two replicas at once; every processing slot the servers showed was held by a replica.
    Returns the number of server observations checked."""
    per_replica = [holds(list(p.pipeline.pool.trace or [])) for p in replicas]
    names = set().union(*per_replica)
    for name in names:
        spans = [(a, b, i) for i, h in enumerate(per_replica) for a, b in h.get(name, [])]
        for a1, b1, i1 in spans:
            for a2, b2, i2 in spans:
                assert i1 == i2 or b1 <= a2 or b2 <= a1, f"{name}: replica{i1} used it {a1}-{b1}, replica{i2} {a2}-{b2}"
    checked = 0
    for url, slot_id, sent, received in watch.seen:
        name = f"{url}#{slot_id}"
        holders = {i for i, h in enumerate(per_replica) for a, b in h.get(name, []) if a <= received and b >= sent}
        assert len(holders) == 1, f"{name} processing between {sent} and {received}: held by {holders}"
        checked += 1
    return checked


def test_two_replicas_with_random_assignment_compute_about_the_ideal_and_never_share_a_slot(
        servers: list[LlamaServer], redis_server: RedisServer, workload: list[Turn], ideal_tokens: list[int],
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lpcache")
    replicas = [Proxy(replica_settings(servers, redis_server, tmp_path, i)) for i in range(2)]
    try:
        for p in replicas:
            p.pipeline.pool.trace = []
        started = time.perf_counter()
        with SlotWatch(servers) as watch:
            run = send_workload(workload, lambda: [p.url for p in replicas], seed=1)
        for p in replicas:
            p.settle()
        seconds = time.perf_counter() - started
        assert run.errors == []
        total = sum(ideal_tokens)
        records = [r for p in replicas for r in p.records]
        routes: dict[str, int] = {}
        for r in records:
            routes[r.route or "-"] = routes.get(r.route or "-", 0) + 1
        fleets = [p.pipeline.fleet for p in replicas]
        calls = sum(f.stats.redis_calls for f in fleets if f)
        figures(f"\nscale-out, 2 replicas x 2 servers, random assignment: computed {run.computed}, ideal {total} "
                f"({run.computed / total:.3f}x), {seconds:.0f} s; routes {routes}; Redis calls {calls} "
                f"({calls / len(records):.1f} per request), claims refused "
                f"{sum(f.stats.claims_refused for f in fleets if f)}, Redis errors "
                f"{sum(f.stats.redis_errors for f in fleets if f)}, claims without Redis "
                f"{sum(f.stats.local_claims for f in fleets if f)}; restores skipped (a prefill judged faster) "
                f"{sum(1 for r in records if r.restore_skipped)}; speeds "
                + " | ".join(f"replica{i}: {speeds_of(p)}" for i, p in enumerate(replicas)))
        over = [f"turn {i} ({workload[i].kind} u{workload[i].user} r{workload[i].turn}) via {via} slot {slot}: "
                f"{n} computed, ideal {ideal_tokens[i]}; session's requests:{explain(records, workload[i].session)}"
                for i, (n, via, slot) in sorted(run.computed_by_turn.items()) if n > ideal_tokens[i] + 16]
        assert run.computed <= BOUND * total, "\n".join(over) + "\ndecisions:" + decisions(caplog, replicas)
        checked = check_one_holder(replicas, watch)
        assert checked > 0, "the watch saw slots processing"
        assert {r.backend for r in records} == {s.url for s in servers}, "both servers served"
    finally:
        for p in replicas:
            p.stop()


def test_a_redis_restart_mid_run_costs_no_answer_and_the_next_round_is_back_within_the_bound(
        servers: list[LlamaServer], workload: list[Turn], ideal_tokens: list[int], tmp_path: Any) -> None:
    redis = RedisServer()
    replicas = [Proxy(replica_settings(servers, redis, tmp_path, i)) for i in range(2)]
    try:
        def restart_before_round_two(r: int) -> None:
            if r == 2:
                for p in replicas:
                    p.settle()
                redis.kill()     # gone with its data, then back empty: each replica writes again what it knows
                redis.restart()

        run = send_workload(workload, lambda: [p.url for p in replicas], seed=2,
                            between_rounds=restart_before_round_two)
        assert run.errors == []
        rounds = sorted({t.turn for t in workload})
        ideal_by_round = {r: sum(i for t, i in zip(workload, ideal_tokens, strict=True) if t.turn == r)
                          for r in rounds}
        figures("\nRedis restarted before round 2: computed/ideal by round "
                + ", ".join(f"{r}: {run.computed_by_round[r]}/{ideal_by_round[r]}" for r in rounds))
        over = [f"turn {i} ({workload[i].kind} u{workload[i].user} r{workload[i].turn}) via {via} slot {slot}: "
                f"{n} computed, ideal {ideal_tokens[i]}"
                for i, (n, via, slot) in sorted(run.computed_by_turn.items()) if n > ideal_tokens[i] + 16]
        assert run.computed_by_round[3] <= BOUND * ideal_by_round[3], "the round after the restart's is back:\n" + \
            "\n".join(over)
        assert all(p.pipeline.fleet is not None and p.pipeline.fleet.healthy for p in replicas)
    finally:
        for p in replicas:
            p.stop()
        redis.remove()


def test_a_replica_killed_mid_request_loses_no_request_the_client_retried(
        servers: list[LlamaServer], redis_server: RedisServer, workload: list[Turn], tmp_path: Any) -> None:
    common = {"BACKENDS": json.dumps([{"url": s.url, "slot_save_path": s.slot_save_path} for s in servers]),
              "REDIS_URL": redis_server.url, "SLOT_LEASE_MS": "3000", "BIG_THRESHOLD_WORDS": "200"}
    replicas = [LpcacheProcess({**common, "REPLICA_ID": f"p{i}", "META_DIR": str(tmp_path / f"meta-p{i}")})
                for i in range(2)]
    victim, survivor = replicas
    try:
        answered, retried, sent_to_victim = 0, 0, 0
        rng = random.Random(3)
        with httpx.Client(timeout=600) as client:
            for t in workload[:24]:
                body = {"model": "smollm2", "messages": t.messages, "max_tokens": 8, "temperature": 0}
                headers = {"X-Session-ID": t.session}
                alive = victim.process is not None and victim.process.poll() is None
                first = victim if alive and rng.random() < 0.5 else survivor
                if first is victim:
                    sent_to_victim += 1
                if first is victim and sent_to_victim == 3:
                    # mid-request: its answer streams, and the replica is killed (SIGKILL) at its first chunk
                    try:
                        with client.stream("POST", f"{victim.url}/v1/chat/completions", headers=headers,
                                           json={**body, "stream": True, "max_tokens": 200}) as r:
                            for _ in r.iter_bytes():
                                assert victim.process is not None
                                victim.process.kill()
                                victim.process.wait()
                    except httpx.TransportError:
                        pass   # its replica died under it: the client retries through the other
                    else:
                        pytest.fail("the stream ended although its replica was killed")
                    r = client.post(f"{survivor.url}/v1/chat/completions", headers=headers, json=body)
                    retried += 1
                else:
                    r = client.post(f"{first.url}/v1/chat/completions", headers=headers, json=body)
                assert r.status_code == 200, r.text
                answered += 1
        assert victim.process is not None and victim.process.poll() is not None, "the victim was killed"
        assert answered == 24 and retried == 1
        figures(f"\nreplica killed mid-request: 24 requests answered, {retried} through a retry; the victim served "
                f"{sent_to_victim - 1} before")
        assert "Traceback" not in survivor.log_text()
    finally:
        for p in replicas:
            p.stop()
