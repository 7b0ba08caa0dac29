"""Soak: 2,000 chat requests at concurrency 32 through lpcache in front of two stand-ins whose faults are re-armed at
random all along (5xx, dropped connections, stalls, hangs, broken streams, failed saves).

Every request gets either a correct answer or an OpenAI-shaped error (a stream that broke after its first bytes may
end with a `data: {"error": ...}` event instead of `[DONE]`). Afterwards nothing is left busy or waiting, every meta
file is whole, no temporary file is left, and lpcache's memory did not grow from the first quarter to the last.
"""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from ..conftest import Proxy, user, words

N_REQUESTS = 2000
CONCURRENCY = 32
TIME_LIMIT = 240.0          # seconds for the whole run
MEMORY_LIMIT = 20 * 2**20   # bytes of growth from the end of the first quarter to the end of the last


@dataclass(frozen=True)
class Spec:
    i: int
    stream: bool
    text: str
    max_tokens: int


def specs(rng: random.Random) -> list[Spec]:
    """Small prompts (under big_threshold_words=50) and big ones (60-200 words, saved); big ones come in 30
    families sharing their first words, so later ones can restore what earlier ones saved."""
    out = []
    for i in range(N_REQUESTS):
        if rng.random() < 0.35:
            text = words(100_000 + rng.randrange(30), rng.randint(60, 200))
        else:
            text = words(i, rng.randint(3, 40))
        out.append(Spec(i, rng.random() < 0.5, text, rng.randint(1, 24)))
    return out


class FaultArmer(threading.Thread):
    """Re-arms faults on a random backend every 50-250 ms, from a seeded generator, until stopped."""

    def __init__(self, backends: list[Any], rng: random.Random) -> None:
        super().__init__(daemon=True, name="soak-faults")
        self.backends, self.rng = backends, rng
        self.stop = threading.Event()
        self.armed: Counter[str] = Counter()
        self.stall_until = [0.0] * len(backends)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=10) as client:
                while not self.stop.wait(self.rng.uniform(0.05, 0.25)):
                    self.tick(client)
        except BaseException as e:  # reported by the test
            self.error = e

    def tick(self, client: httpx.Client) -> None:
        rng, now = self.rng, time.monotonic()
        for n, until in enumerate(self.stall_until):   # a stall lasts a while, then ends
            if until and now >= until:
                client.post(f"{self.backends[n].url}/mock/faults", json={"latency_ms": 0}).raise_for_status()
                self.stall_until[n] = 0.0
        n = rng.randrange(len(self.backends))
        url = f"{self.backends[n].url}/mock/faults"
        kind = rng.choices(["status", "drop", "stall", "hang", "break", "save", "calm"],
                           weights=[20, 20, 12, 4, 25, 10, 9])[0]
        if kind == "calm":
            client.delete(url).raise_for_status()
            self.stall_until[n] = 0.0
            self.armed[kind] += 1
            return
        faults: dict[str, Any] = {
            "status": lambda: {"status": rng.choice([500, 500, 503]), "status_count": rng.randint(1, 3)},
            "drop": lambda: {"drop": rng.randint(1, 3)},
            "stall": lambda: {"latency_ms": rng.uniform(50, 200)},
            "hang": lambda: {"hang": 1},
            "break": lambda: {"stream_break_after": rng.randint(0, 6), "stream_break_count": rng.randint(1, 3)},
            "save": lambda: {"save_status": 500, "save_fail_count": rng.randint(1, 2)},
        }[kind]()
        if kind == "stall":
            self.stall_until[n] = now + rng.uniform(0.3, 1.5)
        client.post(url, json=faults).raise_for_status()
        self.armed[kind] += 1


def openai_error(raw: bytes) -> bool:
    try:
        doc = json.loads(raw)
    except ValueError:
        return False
    err = doc.get("error") if isinstance(doc, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "code" in err)


def judge(spec: Spec, status: int, raw: bytes) -> tuple[str, str | None]:
    """(outcome for the histogram, problem or None)."""
    if status != 200:
        ok = status >= 400 and openai_error(raw)
        return str(status), None if ok else f"error status without an OpenAI error body: {raw[:300]!r}"
    if not spec.stream:
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return "200", f"not a chat completion: {raw[:300]!r}"
        return "200", None if isinstance(content, str) and content else f"empty answer: {raw[:300]!r}"
    if raw.endswith(b"data: [DONE]\n\n"):
        pieces = []
        for event in raw.split(b"\n\n")[:-2]:
            if not event.startswith(b"data: "):
                return "200 stream", f"not an SSE data event: {event[:200]!r}"
            for choice in json.loads(event[6:]).get("choices") or []:
                pieces.append((choice.get("delta") or {}).get("content") or "")
        return "200 stream", None if "".join(pieces) else f"stream without content: {raw[:300]!r}"
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    if raw.endswith(b"\n\n") and last.startswith(b"data: ") and openai_error(last[6:]):
        return "200 stream broke", None
    return "200 stream", f"stream ends neither with [DONE] nor an error event: {raw[-300:]!r}"


def test_soak_with_random_faults(start_backend: Any, start_proxy: Any) -> None:
    backends = [start_backend(slots=4, gen_ms_per_token=1) for _ in range(2)]
    proxy: Proxy = start_proxy(*backends, request_timeout=2, breaker_cooldown_ms=100, breaker_max_cooldown_ms=800)
    plan = specs(random.Random(5678))
    armer = FaultArmer(backends, random.Random(1234))
    client = httpx.Client(base_url=proxy.url, timeout=60,
                          limits=httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY))
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    lock = threading.Lock()
    started = time.monotonic()
    deadline = started + TIME_LIMIT

    def one(spec: Spec) -> None:
        if time.monotonic() > deadline:
            with lock:
                outcomes["not run (time limit)"] += 1
            return
        body = {"messages": user(spec.text), "max_tokens": spec.max_tokens, "stream": spec.stream}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                raw = r.read()
        except httpx.HTTPError as e:
            outcome, problem = "transport error", f"{type(e).__name__}: {e}"
        else:
            outcome, problem = judge(spec, r.status_code, raw)
        with lock:
            outcomes[outcome] += 1
            if problem:
                problems.append(f"#{spec.i} stream={spec.stream}: {problem}")

    def memory() -> int:
        proxy.settle()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    quarter = N_REQUESTS // 4
    mem: list[int] = []
    tracemalloc.start()
    armer.start()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for q in range(4):
                list(pool.map(one, plan[q * quarter:(q + 1) * quarter]))
                mem.append(memory())
    finally:
        armer.stop.set()
        armer.join(10)
        tracemalloc.stop()
        client.close()
    seconds = time.monotonic() - started
    records = proxy.records
    print(f"\nsoak: {N_REQUESTS} requests at concurrency {CONCURRENCY} in {seconds:.1f}s")
    print(f"soak: outcomes {dict(sorted(outcomes.items()))}")
    print(f"soak: faults armed {dict(sorted(armer.armed.items()))}")
    print(f"soak: retries {sum(r.retries for r in records)}, "
          f"over 2 s (a hang timed out) {sum(1 for r in records if (r.elapsed_ms or 0) >= 2000)}, "
          f"saved {sum(1 for r in records if r.saved)}, "
          f"restored {sum(1 for r in records if r.restored)}, reasons "
          f"{dict(Counter(r.reason for r in records if r.reason))}")
    # Traced memory is the whole test process; it includes the harness's own list of every RequestRecord (~2 KB each).
    print("soak: traced memory at the end of each quarter (MB): " + ", ".join(f"{m / 2**20:.1f}" for m in mem)
          + f"; growth Q1->Q4 {(mem[-1] - mem[0]) / 2**20:+.1f} MB")

    assert armer.error is None, f"arming faults failed: {armer.error!r}"
    assert seconds < TIME_LIMIT and not outcomes["not run (time limit)"], f"the run took {seconds:.0f}s"
    assert not problems, f"{len(problems)} bad answers, the first ones:\n" + "\n".join(problems[:10])
    assert sum(outcomes.values()) == N_REQUESTS

    for b in backends:
        httpx.delete(f"{b.url}/mock/faults").raise_for_status()
    proxy.wait_finished(N_REQUESTS)
    assert len(records) == N_REQUESTS, "each request tells the observers exactly once"
    assert proxy.busy_slots() == []
    assert proxy.pipeline.pool.waiting == 0
    for b in backends:   # lpcache closed every upstream it gave up on: no stand-in slot is still generating
        idle = httpx.get(f"{b.url}/mock/wait-idle", params={"timeout": 10}, timeout=20)
        assert idle.status_code == 200, idle.text

    meta_dir = proxy.settings.meta_dir
    metas = [name for name in os.listdir(meta_dir) if name.endswith(".meta.json")]
    assert metas, "no big prompt was saved"
    for name in metas:
        with open(os.path.join(meta_dir, name), "rb") as f:
            doc = json.loads(f.read())
        assert isinstance(doc, dict) and isinstance(doc.get("blocks"), list), name
    folders = [meta_dir, *{b.app_state.config.slot_save_path for b in backends}]
    leftovers = [name for folder in folders for name in os.listdir(folder) if ".tmp-" in name]
    assert leftovers == []

    for i in range(4):   # faults cleared: lpcache serves normally again
        assert proxy.chat(user(words(900_000 + i, 20)), max_tokens=3).status_code == 200
    assert mem[-1] - mem[0] < MEMORY_LIMIT, f"memory grew by {(mem[-1] - mem[0]) / 2**20:.1f} MB"
