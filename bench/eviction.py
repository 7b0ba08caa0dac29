"""Replacement policies for the saved caches, simulated: LRU against `lpcache.cache.eviction`'s predicted next use.

A trace is a sequence of uses of conversations. A use restores the conversation's saved file if it is still kept
(a hit), else it is a miss; then the conversation's new file is saved (the next turn), which supersedes the old
one and takes over its history, and the policy deletes what is over the limit (never the file just saved). Nothing
is written: the policies only see `Usage` records. Columns:
  LRU        `lru_victims`, what lpcache did (META_MAX: least recently used first);
  predicted  `UsageTable.victims`, the rule as the index would run it (ranks a bounded set of candidates);
  exact      `victims`, the same rule ranking every entry (to show the candidates lose nothing here);
  Belady     offline optimum for reference: deletes the file whose conversation comes back furthest in the future
             (it knows the trace; like the others it must keep the file just saved).
The traces (seeded, one use every 10 s on average):
  cyclic N/L      N conversations in round robin, limit L, 20 rounds;
  jitter N/L      the same, each round in a random order, gaps 5 to 15 s;
  hot+cold        3 hot conversations every round plus 12 one-off conversations, random order, limit 10, 20 rounds;
  zipf 50/10      1,000 uses of 50 conversations with Zipf(1) popularity, limit 10;
  sessions        (a check where LRU does well) conversations start every 40 s on average (exponential gaps),
                  last 1 + a geometric number of turns (4 on average) 20 to 120 s apart, limit 10, 1,000 uses;
  bytes 16/4.8GB  16 conversations with files of 20 MB, 300 MB or 1 GB (growing 5% a turn), jittered rounds, a
                  byte budget of half their first sizes' total, no count limit; the byte-hit column is the share
                  of restored bytes (prefill saved, roughly) among all uses' bytes.
Then the time of one `victims` call that deletes one entry, with 100,000 entries (half of them with a known interval).

Run: python bench/eviction.py [--json]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable

import orjson

from lpcache.cache.eviction import UsageTable, lru_victims, victims

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, machine_line, median, percentile, table  # noqa: E402

GAP = 10.0
MB = 1 << 20
Use = tuple[float, str, int]  # time, conversation, size of the file its save writes
Chooser = Callable[[UsageTable, float, int, int, set[str]], list[str]]


def cyclic(n: int, rounds: int = 20) -> list[Use]:
    return [((r * n + c) * GAP, f"c{c:02d}", 0) for r in range(rounds) for c in range(n)]


def jittered(n: int, rounds: int = 20, seed: int = 1) -> list[Use]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(rounds):
        order = list(range(n))
        rng.shuffle(order)
        for c in order:
            t += GAP * rng.uniform(0.5, 1.5)
            out.append((t, f"c{c:02d}", 0))
    return out


def hot_and_cold(hot: int = 3, cold: int = 12, rounds: int = 20, seed: int = 2) -> list[Use]:
    rng = random.Random(seed)
    out, t, fresh = [], 0.0, 0
    for _ in range(rounds):
        names = [f"hot{h}" for h in range(hot)] + [f"one{fresh + i:04d}" for i in range(cold)]
        fresh += cold
        rng.shuffle(names)
        for name in names:
            t += GAP * rng.uniform(0.5, 1.5)
            out.append((t, name, 0))
    return out


def zipf(n: int = 50, uses: int = 1000, s: float = 1.0, seed: int = 3) -> list[Use]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    out, t = [], 0.0
    for c in rng.choices(range(n), weights, k=uses):
        t += GAP * rng.uniform(0.5, 1.5)
        out.append((t, f"z{c:02d}", 0))
    return out


def sessions(uses: int = 1000, arrival: float = 40.0, mean_turns: float = 4.0, seed: int = 7) -> list[Use]:
    rng = random.Random(seed)
    out: list[Use] = []
    t, c = 0.0, 0
    while len(out) < 2 * uses:
        t += rng.expovariate(1.0 / arrival)
        at = t
        while True:
            out.append((at, f"s{c:05d}", 0))
            at += rng.uniform(20.0, 120.0)
            if rng.random() < 1.0 / mean_turns:
                break
        c += 1
    out.sort()
    return out[:uses]


def sized(n: int = 16, rounds: int = 20, seed: int = 4) -> tuple[list[Use], int]:
    rng = random.Random(seed)
    first = {f"s{c:02d}": rng.choice((20 * MB, 300 * MB, 1024 * MB)) for c in range(n)}
    turns = dict.fromkeys(first, 0)
    out, t = [], 0.0
    for _ in range(rounds):
        order = sorted(first)
        rng.shuffle(order)
        for name in order:
            t += GAP * rng.uniform(0.5, 1.5)
            out.append((t, name, int(first[name] * 1.05 ** turns[name])))
            turns[name] += 1
    return out, sum(first.values()) // 2


def belady(trace: list[Use]) -> Chooser:
    """Offline: the file whose conversation's next use is furthest (never = infinity) goes first."""
    next_use: dict[tuple[str, float], float] = {}
    last_seen: dict[str, float] = {}
    for t, name, _ in reversed(trace):
        next_use[(name, t)] = last_seen.get(name, float("inf"))
        last_seen[name] = t
    owner: dict[str, tuple[str, float]] = {}  # file key -> (conversation, time of its save)

    def choose(tbl: UsageTable, now: float, max_count: int, max_bytes: int, keep: set[str]) -> list[str]:
        count, total = len(tbl), tbl.total_bytes
        ranked = sorted((u for u in tbl if u.key not in keep),
                        key=lambda u: (-next_use[owner[u.key]], u.key))
        out = []
        for u in ranked:
            if not ((max_count and count > max_count) or (max_bytes and total > max_bytes)):
                break
            out.append(u.key)
            count -= 1
            total -= u.size
        return out

    choose.owner = owner  # type: ignore[attr-defined]
    return choose


def simulate(trace: list[Use], choose: Chooser, max_count: int, max_bytes: int = 0) -> dict[str, float]:
    tbl = UsageTable()
    current: dict[str, str] = {}
    hits = misses = 0
    hit_bytes = all_bytes = 0
    owner = getattr(choose, "owner", None)
    for turn, (t, name, size) in enumerate(trace):
        old = current.get(name)
        if old is not None and old in tbl:
            hits += 1
            usage = tbl.get(old)
            hit_bytes += usage.size if usage else 0
            tbl.use(old, t)
        else:
            misses += 1
        all_bytes += size
        key = f"{name}/{turn}"
        if owner is not None:
            owner[key] = (name, t)
        tbl.add(key, size, t, supersedes=[old] if old else [])
        current[name] = key
        for victim in choose(tbl, t, max_count, max_bytes, {key}):
            tbl.remove(victim)
        if max_count:
            assert len(tbl) <= max_count
    return {"hits": hits, "misses": misses, "rate": hits / len(trace),
            "byte_rate": hit_bytes / all_bytes if all_bytes else 0.0}


def policies(trace: list[Use]) -> dict[str, Chooser]:
    return {
        "LRU": lambda tbl, now, mc, mb, keep: lru_victims(tbl, now, mc, mb, keep),
        "predicted": lambda tbl, now, mc, mb, keep: tbl.victims(now, mc, mb, keep),
        "exact": lambda tbl, now, mc, mb, keep: victims(tbl, now, mc, mb, keep),
        "Belady": belady(trace),
    }


def run_traces() -> list[dict[str, object]]:
    cases: list[tuple[str, list[Use], int, int]] = []
    for n in (11, 12, 20):
        cases.append((f"cyclic {n}/10", cyclic(n), 10, 0))
    for n in (11, 12, 20):
        cases.append((f"jitter {n}/10", jittered(n), 10, 0))
    cases.append(("hot+cold 3+12/10", hot_and_cold(), 10, 0))
    cases.append(("zipf 50/10", zipf(), 10, 0))
    cases.append(("sessions/10", sessions(), 10, 0))
    trace, budget = sized()
    cases.append((f"bytes 16/{budget / 1024 / MB:.1f}GB", trace, 0, budget))
    results = []
    for name, trace, max_count, max_bytes in cases:
        row: dict[str, object] = {"trace": name, "uses": len(trace)}
        for policy, choose in policies(trace).items():
            row[policy] = simulate(trace, choose, max_count, max_bytes)
        results.append(row)
    return results


def build_table(n: int, seed: int = 5) -> tuple[UsageTable, float]:
    """n entries over a day: half used twice or more (intervals of 10 s to an hour), half once; 20 MB to 2 GB."""
    rng = random.Random(seed)
    tbl = UsageTable()
    t = 0.0
    for i in range(n):
        t += 86400.0 / n
        key = f"{rng.getrandbits(128):032x}"
        tbl.add(key, rng.randrange(20 * MB, 2048 * MB), t - 3600.0 * rng.random())
        if i % 2:
            for _ in range(rng.randrange(1, 4)):
                tbl.use(key, t + rng.uniform(10.0, 3600.0))
    return tbl, t + 3600.0


def time_victims(n: int = 100_000, calls: int = 2000) -> dict[str, dict[str, float]]:
    tbl, now = build_table(n)
    rng = random.Random(6)
    clock = time.perf_counter_ns
    out: dict[str, dict[str, float]] = {}

    def one_save(limit_count: int, limit_bytes: int) -> tuple[float, int]:
        nonlocal now
        now += GAP
        key = f"{rng.getrandbits(128):032x}"
        tbl.add(key, rng.randrange(20 * MB, 2048 * MB), now)
        t0 = clock()
        chosen = tbl.victims(now, limit_count, limit_bytes, {key})
        ns = clock() - t0
        for k in chosen:
            tbl.remove(k)
        return ns / 1000.0, len(chosen)

    for label, by_bytes in (("UsageTable.victims, count limit", False), ("UsageTable.victims, byte limit", True)):
        for _ in range(100):  # warm-up
            one_save(n, tbl.total_bytes if by_bytes else 0)
        us, deleted = [], []
        for _ in range(calls):
            limit_bytes = tbl.total_bytes if by_bytes else 0  # before the save: the save puts it over
            x, k = one_save(0 if by_bytes else n, limit_bytes)
            us.append(x)
            deleted.append(k)
        out[label] = {"median_us": median(us), "p99_us": percentile(us, 99), "max_us": max(us),
                      "deleted_per_call": sum(deleted) / len(deleted)}
    for label, fn in (("victims (ranks all)", victims), ("lru_victims (ranks all)", lru_victims)):
        us = []
        for _ in range(5):
            t0 = clock()
            fn(tbl, now, n - 1, 0, ())
            us.append((clock() - t0) / 1000.0)
        out[label] = {"median_us": median(us), "p99_us": max(us), "max_us": max(us), "deleted_per_call": 1.0}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument("--entries", type=int, default=100_000, help="entries for the timing (default 100000)")
    args = parser.parse_args(argv)
    results = run_traces()
    timing = time_victims(args.entries)
    if args.json:
        print(orjson.dumps({"machine": machine(), "traces": results, "timing": timing},
                           option=orjson.OPT_INDENT_2).decode())
        return 0
    print(machine_line())
    print()
    names = ("LRU", "predicted", "exact", "Belady")
    rows = []
    for row in results:
        cells: list[object] = [row["trace"], row["uses"]]
        for policy in names:
            r = row[policy]
            assert isinstance(r, dict)
            cells.append(f"{r['hits']}/{r['misses']}")
            cells.append(f"{100 * r['rate']:.0f}%")
        pred_row, lru_row = row["predicted"], row["LRU"]
        assert isinstance(pred_row, dict) and isinstance(lru_row, dict)
        sized_trace = lru_row["byte_rate"] or pred_row["byte_rate"]
        cells.append(f"{100 * lru_row['byte_rate']:.0f}% / {100 * pred_row['byte_rate']:.0f}%" if sized_trace else "-")
        rows.append(cells)
    headers = ["trace", "uses"]
    for policy in names:
        headers += [f"{policy} hits/misses", "rate"]
    headers.append("byte hits LRU / pred.")
    print(table(headers, rows))
    print()
    print(f"One save over the limit, {args.entries:,} entries (the victims call only):")
    print(table(["call", "median µs", "p99 µs", "max µs", "deleted per call"],
                [[k, v["median_us"], v["p99_us"], v["max_us"], v["deleted_per_call"]] for k, v in timing.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
