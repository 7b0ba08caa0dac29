"""A soak under faults: many clients with two client keys, identical bodies sent at once (coalescing), clients that
leave, and faults re-armed on the stand-ins all along. Shared by the soak and property tests (lpcache in a thread)
and `bench/soak.py` (lpcache as a process, RSS measured).

Every answer is judged against what the stand-in answers that very prompt (its answers are a pure function of the
prompt), and every completion id a client saw is kept per client key: the stand-in draws a fresh id for each
generation, so an answer produced for one key and handed to the other (coalescing, the result cache) shows up as an
id both keys saw. An error answer must be in OpenAI's shape; a 500 is the backend's own only when it carries the
stand-in's injected-fault message, otherwise it is lpcache's own and a failure.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import aiohttp
import orjson

from lpcache.mock_llama.faults import INFERENCE_PATHS
from lpcache.mock_llama.tokens import render_chat, reply_stream, tokenize

KEYS = ("soak-key-a", "soak-key-b")
INJECTED = "mock fault: injected status"   # the stand-in's message in a 5xx it was told to answer
INFO_PATHS = ["/slots", "/props", "/health", "/v1/models"]
SAVE_PATHS = [f"/slots/{n}" for n in range(8)]   # POST /slots/{id}?action=save|restore
BIG_WORDS = (60, 200)   # above big_threshold_words=50: saved after the answer
LEAVES = ("early", "mid")


@dataclass(frozen=True)
class Ask:
    """One client request. The asks of one job send identical bodies at once; `leave` makes the client go away:
    "early" `leave_ms` after its request was sent (when not answered by then), "mid" after the answer's first bytes."""

    i: int
    key: int
    text: str
    stream: bool
    max_tokens: int
    leave: str | None = None
    leave_ms: float = 0.0

    def body(self) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": self.text}], "max_tokens": self.max_tokens,
                "stream": self.stream}

    def expected(self) -> str:
        """The stand-in's answer to this prompt."""
        prompt = tokenize(render_chat(self.body()["messages"]))
        return " ".join(islice(reply_stream(prompt), self.max_tokens))


Job = list[Ask]   # sent at once


def words(seed: int, n: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n))


def plan(n: int, rng: random.Random, *, twins: float = 0.3, leave: float = 0.06, families: int = 30) -> list[Job]:
    """About `n` asks in jobs: a single request (a random key), or 2-4 asks of one body from both keys at once
    (`twins` of the jobs), some of whose clients leave (the first, who likely leads the coalesced group, too).
    Prompts are small, or big (saved) in `families` sharing their first words so later ones restore."""
    jobs: list[Job] = []
    i = 0
    while i < n:
        if rng.random() < 0.35:
            text = words(100_000 + rng.randrange(families), rng.randint(*BIG_WORDS)) + f" q{i}"
        else:
            text = words(i, rng.randint(3, 40))
        if rng.random() < 0.2:   # a body asked before: a result-cache hit for its key, if it was answered whole
            text = words(200_000 + rng.randrange(20), 12)
        stream, max_tokens = rng.random() < 0.5, rng.randint(1, 24)
        size = rng.randint(2, min(4, n - i)) if n - i >= 2 and rng.random() < twins else 1
        keys = [rng.randrange(2)] if size == 1 else [k % 2 for k in range(size)]
        rng.shuffle(keys)
        job = []
        for key in keys:
            gone = rng.choice(LEAVES) if rng.random() < leave else None
            job.append(Ask(i, key, text, stream, max_tokens, gone, rng.uniform(0, 60)))
            i += 1
        jobs.append(job)
    return jobs


# ---- faults ----

def fault_kinds(rng: random.Random) -> dict[str, Callable[[], dict[str, Any] | None]]:
    """Every fault of the stand-in, each as a fresh arming (None: disarm all)."""
    inference = list(INFERENCE_PATHS)

    def broken() -> str:
        return rng.choice(["body_cut", "body_stall"])

    return {
        "status": lambda: {"paths": inference, "status": rng.choice([500, 503]), "status_count": rng.randint(1, 3)},
        "error body": lambda: {"paths": inference, "status": rng.choice([500, 503, 429]), "status_count": 1,
                               broken(): 1},
        "drop": lambda: {"paths": inference, "drop": rng.randint(1, 3)},
        "stall": lambda: {"paths": inference, "latency_ms": rng.uniform(50, 200)},
        "hang": lambda: {"paths": inference, "hang": 1},
        "break": lambda: {"paths": inference, "stream_break_after": rng.randint(0, 6),
                          "stream_break_count": rng.randint(1, 3)},
        "answer body": lambda: {"paths": inference, broken(): 1},
        "info body": lambda: {"paths": INFO_PATHS, broken(): rng.randint(1, 3)},
        "save": lambda: {"save_status": 500, "save_fail_count": rng.randint(1, 2)},
        "save body": lambda: {"paths": SAVE_PATHS, broken(): rng.randint(1, 2)},
        "calm": lambda: None,
    }


WEIGHTS = {"status": 14, "error body": 12, "drop": 14, "stall": 8, "hang": 3, "break": 18, "answer body": 4,
           "info body": 8, "save": 8, "save body": 6, "calm": 10}


async def arm(http: aiohttp.ClientSession, backend: str, faults: dict[str, Any] | None) -> None:
    url = f"{backend}/mock/faults"
    async with (http.delete(url) if faults is None else http.post(url, json=faults)) as r:
        r.raise_for_status()


class FaultArmer:
    """Re-arms a random fault on a random stand-in every 50-250 ms; a stall ends after a while."""

    def __init__(self, backends: Sequence[str], rng: random.Random) -> None:
        self.backends, self.rng = list(backends), rng
        self.kinds = fault_kinds(rng)
        self.armed: Counter[str] = Counter()
        self.stall_until = [0.0] * len(backends)

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.rng.uniform(0.05, 0.25))
            except TimeoutError:
                await self.tick(http)

    async def tick(self, http: aiohttp.ClientSession) -> None:
        now = time.monotonic()
        for n, until in enumerate(self.stall_until):
            if until and now >= until:
                await arm(http, self.backends[n], {"latency_ms": 0})
                self.stall_until[n] = 0.0
        n = self.rng.randrange(len(self.backends))
        kind = self.rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        await arm(http, self.backends[n], self.kinds[kind]())
        self.stall_until[n] = now + self.rng.uniform(0.3, 1.5) if kind == "stall" else 0.0
        self.armed[kind] += 1


async def calm(http: aiohttp.ClientSession, backends: Sequence[str]) -> None:
    for b in backends:
        await arm(http, b, None)


# ---- judging ----

def openai_error(raw: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    if (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "code" in err):
        return err
    return None


@dataclass
class Verdict:
    outcome: str
    problem: str | None = None
    ids: set[str] = field(default_factory=set)


def judge(ask: Ask, status: int, raw: bytes) -> Verdict:
    """What the client got: an OpenAI error (never lpcache's own 500), or this prompt's very answer."""
    if status != 200:
        err = openai_error(raw)
        if status < 400 or err is None:
            return Verdict(str(status), f"{status} without an OpenAI error body: {raw[:300]!r}")
        if status == 500 and err["message"] != INJECTED:
            return Verdict("500 lpcache", f"lpcache's own 500: {raw[:300]!r}")
        return Verdict(str(status))
    expected = ask.expected()
    if not ask.stream:
        try:
            doc = orjson.loads(raw)
            content, cid = doc["choices"][0]["message"]["content"], doc["id"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return Verdict("200", f"not a chat completion: {raw[:300]!r}")
        problem = None if content == expected else f"answer {content[:80]!r} is not {expected[:80]!r}"
        return Verdict("200", problem, {cid})
    ids, pieces, done, error = set(), [], False, None
    if not raw.endswith(b"\n\n"):
        return Verdict("200 stream", f"stream does not end with a whole event: {raw[-300:]!r}")
    for event in raw[:-2].split(b"\n\n"):
        if done or error is not None or not event.startswith(b"data: "):
            return Verdict("200 stream", f"bad event {event[:200]!r} (after [DONE]/error: {done or error})")
        if event == b"data: [DONE]":
            done = True
            continue
        try:
            doc = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return Verdict("200 stream", f"event not JSON: {event[:200]!r}")
        if "error" in doc:
            error = openai_error(event[6:]) or "malformed"
            if error == "malformed":
                return Verdict("200 stream", f"error event not in OpenAI's shape: {event[:200]!r}")
            continue
        ids.add(doc.get("id"))
        for choice in doc.get("choices") or []:
            pieces.append((choice.get("delta") or {}).get("content") or "")
    content = "".join(pieces)
    if done:
        problem = None if content == expected else f"stream {content[:80]!r} is not {expected[:80]!r}"
        return Verdict("200 stream", problem, ids)
    if error is None:
        return Verdict("200 stream", f"stream ends neither with [DONE] nor an error event: {raw[-300:]!r}")
    problem = None if expected.startswith(content) else f"broken stream {content[:80]!r} not a start of the answer"
    return Verdict("200 stream broke", problem, ids)


# ---- running ----

@dataclass
class Report:
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    ids: tuple[dict[str, int], dict[str, int]] = field(default_factory=lambda: ({}, {}))
    armed: Counter[str] = field(default_factory=Counter)
    asked: int = 0
    seconds: float = 0.0

    def cross_key(self) -> list[str]:
        """Completion ids both keys saw: an answer produced for one key went to the other."""
        return sorted(set(self.ids[0]) & set(self.ids[1]))

    def own_500s(self) -> int:
        return self.outcomes["500 lpcache"]

    def summary(self) -> str:
        return (f"{self.asked} requests in {self.seconds:.1f}s; outcomes {dict(sorted(self.outcomes.items()))}; "
                f"faults armed {dict(sorted(self.armed.items()))}; lpcache's own 500s {self.own_500s()}, "
                f"cross-key answers {len(self.cross_key())}, bad answers {len(self.problems)}")


class Soak:
    """Sends jobs to lpcache at `url` at most `concurrency` asks at a time; `backends` (stand-in URLs) get faults
    when `faults` is given."""

    def __init__(self, url: str, backends: Sequence[str], *, concurrency: int = 32,
                 faults: random.Random | None = None, timeout: float = 60.0) -> None:
        self.url, self.backends, self.concurrency = url, list(backends), concurrency
        self.armer = FaultArmer(backends, faults) if faults is not None else None
        self.timeout = timeout
        self.report = Report()

    async def run(self, jobs: Sequence[Job], between: Callable[[int], Awaitable[None]] | None = None,
                  parts: int = 1) -> Report:
        """Send every job; `between(k)` is awaited after each of `parts` equal parts (faults keep coming)."""
        started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        traces = aiohttp.TraceConfig()
        traces.on_request_chunk_sent.append(_sent)
        async with aiohttp.ClientSession(connector=connector, trace_configs=[traces],
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as http:
            stop = asyncio.Event()
            armer = asyncio.ensure_future(self.armer.run(http, stop)) if self.armer else None
            try:
                free = asyncio.Semaphore(self.concurrency)
                gate = asyncio.Lock()
                size = -(-len(jobs) // parts)
                for k in range(parts):
                    await asyncio.gather(*(self.job(http, job, free, gate) for job in jobs[k * size:(k + 1) * size]))
                    if between is not None:
                        await between(k)
            finally:
                stop.set()
                if armer is not None:
                    await armer
                    await calm(http, self.backends)
        if self.armer:
            self.report.armed = self.armer.armed
        self.report.seconds = time.monotonic() - started
        return self.report

    async def job(self, http: aiohttp.ClientSession, job: Job, free: asyncio.Semaphore, gate: asyncio.Lock) -> None:
        async with gate:   # a job's asks go together: take all their places at once
            for _ in job:
                await free.acquire()
        try:
            first, *rest = job
            tasks = [asyncio.ensure_future(self.ask(http, first))]
            if rest:
                await asyncio.sleep(0.005)   # the first one likely leads the coalesced group
                tasks += [asyncio.ensure_future(self.ask(http, a)) for a in rest]
            await asyncio.gather(*tasks)
        finally:
            for _ in job:
                free.release()

    async def ask(self, http: aiohttp.ClientSession, ask: Ask) -> None:
        report = self.report
        report.asked += 1
        left, sent = asyncio.Event(), asyncio.Event()

        async def call() -> tuple[int, bytes] | None:
            headers = {"Authorization": f"Bearer {KEYS[ask.key]}", "Content-Type": "application/json"}
            async with http.post(f"{self.url}/v1/chat/completions", data=orjson.dumps(ask.body()), headers=headers,
                                 trace_request_ctx={"sent": sent}) as r:
                if ask.leave == "mid":
                    await r.content.readany()
                    r.close()   # the connection goes with it
                    return None
                return r.status, await r.read()

        task = asyncio.ensure_future(call())
        try:
            if ask.leave == "early":
                # From the end of the request: a client gone before lpcache got it would leave no record to count.
                waiter = asyncio.ensure_future(sent.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                done, _ = await asyncio.wait({task}, timeout=ask.leave_ms / 1000)
                if not done:
                    left.set()
                    task.cancel()
            got = await task
        except asyncio.CancelledError:
            if not left.is_set():
                raise
            report.outcomes["left"] += 1
            return
        except (aiohttp.ClientError, TimeoutError) as e:
            report.outcomes["transport error"] += 1
            report.problems.append(f"#{ask.i}: {type(e).__name__}: {e}")
            return
        if got is None:
            report.outcomes["left"] += 1
            return
        verdict = judge(ask, *got)
        report.outcomes[verdict.outcome] += 1
        if verdict.problem:
            report.problems.append(f"#{ask.i} key={ask.key} stream={ask.stream}: {verdict.problem}")
        seen = report.ids[ask.key]
        for cid in verdict.ids:
            seen[cid] = ask.i


async def _sent(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    """A request's body went out (aiohttp's trace hook)."""
    sent = (context.trace_request_ctx or {}).get("sent")
    if sent is not None:
        sent.set()


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/health") as r:
        return await r.json()  # type: ignore[no-any-return]


async def wait_free(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """Poll lpcache's /health until no slot is busy and nobody waits (or the deadline); returns the last answer."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while True:
            doc = await health(http, url)
            if (not any(b.get("busy_slots") for b in doc["backends"]) and not doc.get("waiting")) \
                    or time.monotonic() > deadline:
                return doc
            await asyncio.sleep(0.05)   # polling with a deadline
