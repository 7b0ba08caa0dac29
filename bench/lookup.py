"""Restore-candidate lookup time (`MetaIndex.find`) with 10, 1,000 and 100,000 meta entries, and the index's memory.

The index is filled in memory (`MetaIndex._insert`, the call `load()` makes for each file), no file is written.
Entries look like real saves with WORDS_PER_BLOCK=100, as lpcache writes them (an exact identity chain and the
model's fingerprint; here the exact chain is the word chain, which costs the same to look up): 10 to 40 blocks each;
every entry starts with one of 5 shared "system prompts" (2 to 6 blocks); entries come in conversations of 3 that
share a few more blocks after the system prompt, then diverge. Block hashes are SHA-256 hex digests and chains are
computed by `lpcache.cache.prefix.chain`, as for real prompts.

Lookups are timed one by one (`time.perf_counter_ns`) for prompts that
  hit:    extend an entry (its whole chain, then 2 new blocks): the deepest level holds one entry;
  system: share only a system prompt (then 15 new blocks): the deepest level is shared by a fifth of all entries;
  none:   share nothing (20 new blocks): the first block misses.
The `usable` filter is the pipeline's (`MetaEntry.readable_by` one backend) and the threshold LCP_TH's default, 0.1.
Memory is what tracemalloc counts as still allocated after building the index (entries, chains, keys, the prefix
tables). For context, `Prompt.of` (hashing a request) is timed for a 2,000-word chat.

Run: python bench/lookup.py [--sizes 10,1000,100000] [--queries 3000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Callable

import orjson

from lpcache.cache.index import MetaIndex
from lpcache.cache.meta_files import Candidate, MetaEntry
from lpcache.cache.prefix import Prompt, block_hashes, cache_key, chain, raw_prefix, words
from lpcache.workloads.harness import story

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, machine_line, median, percentile, table  # noqa: E402

MODEL = "llama.cpp"
FINGERPRINT = "fp-smollm2"   # the model identity (`/props`) the entries were saved with
WPB = 100
URL = "http://127.0.0.1:8080"
SAVE_PATH = "/var/lib/llama/slots"
N_SYSTEM = 5
LCP_TH = 0.1
TARGET_US = 1000.0  # find() at 100,000 entries


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


SYSTEM_PROMPTS = [[digest(f"system {s} block {j}") for j in range(2 + s)] for s in range(N_SYSTEM)]


def entry_blocks(i: int) -> list[str]:
    """Entry i: system prompt i % 5, then the shared opening of its conversation (i // 3), then its own blocks;
    10 to 40 blocks in all (a fixed pseudo-random length per i)."""
    system = SYSTEM_PROMPTS[i % N_SYSTEM]
    conversation = i // 3
    total = 10 + (i * 2654435761 >> 7) % 31
    shared = min(3 + conversation % 4, total - len(system) - 1)
    blocks = list(system)
    blocks += [digest(f"conversation {conversation} system {i % N_SYSTEM} block {j}") for j in range(shared)]
    blocks += [digest(f"entry {i} block {j}") for j in range(total - len(blocks))]
    return blocks


def build(n: int) -> MetaIndex:
    """An index of n entries, filled as `load()` fills it (oldest first), without files."""
    index = MetaIndex("/nonexistent-meta-dir", WPB, meta_max=0, slot_save_paths=(SAVE_PATH,))
    for i in range(n):
        blocks = entry_blocks(i)
        index._insert(MetaEntry(key=digest(f"key {i}"), model=MODEL, wpb=WPB, chain=chain(blocks),
                                timestamp=1_700_000_000.0 + i, n_words=len(blocks) * WPB + 37,
                                backend=URL, slot_save_path=SAVE_PATH, exact=chain(blocks), fingerprint=FINGERPRINT))
    return index


def prompt_of(blocks: list[str]) -> Prompt:
    linked = chain(blocks)
    return Prompt(MODEL, digest("|".join(blocks)), len(blocks) * WPB, tuple(blocks), linked, exact=linked)


def queries(n: int, count: int, seed: int = 2) -> dict[str, list[tuple[Prompt, int]]]:
    """Per case, `count` prompts and the number of whole blocks find() must report shared."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[Prompt, int]]] = {"hit": [], "system": [], "none": []}
    for q in range(count):
        blocks = entry_blocks(rng.randrange(n))
        out["hit"].append((prompt_of(blocks + [digest(f"next {q} {j}") for j in range(2)]), len(blocks)))
        system = SYSTEM_PROMPTS[q % N_SYSTEM]
        out["system"].append((prompt_of(system + [digest(f"new {q} {j}") for j in range(15)]), len(system)))
        out["none"].append((prompt_of([digest(f"other {q} {j}") for j in range(20)]), 0))
    return out


def time_finds(index: MetaIndex, cases: dict[str, list[tuple[Prompt, int]]]) -> dict[str, dict[str, float]]:
    def usable(e: MetaEntry) -> bool:
        return e.readable_by(URL, SAVE_PATH)

    find: Callable[..., Candidate | None] = index.find
    clock = time.perf_counter_ns
    out = {}
    for case, prompts in cases.items():
        for prompt, _ in prompts[:200]:  # warm-up
            find(prompt, (FINGERPRINT,), usable, LCP_TH)
        ns = []
        for prompt, expected in prompts:
            t0 = clock()
            candidate = find(prompt, (FINGERPRINT,), usable, LCP_TH)
            ns.append(clock() - t0)
            shared = candidate.shared if candidate is not None else 0
            if shared != expected:
                raise AssertionError(f"{case}: find() shared {shared} blocks, expected {expected}")
        us = [x / 1000.0 for x in ns]
        out[case] = {"median_us": median(us), "p99_us": percentile(us, 99), "max_us": max(us)}
    return out


def time_prompt_of(runs: int = 1000) -> dict[str, float]:
    """Prompt.of for a 2,000-word chat (a 300-word system prompt, a 1,700-word user message), and its parts."""
    messages = [{"role": "system", "content": story(11, 300)}, {"role": "user", "content": story(12, 1700)}]
    raw = raw_prefix(messages)
    word_list = words(raw)
    assert len(word_list) == 2000, len(word_list)
    blocks = block_hashes(word_list, WPB)
    parts: dict[str, Callable[[], object]] = {
        "Prompt.of": lambda: Prompt.of(MODEL, messages, WPB),
        "words()": lambda: words(raw),
        "block_hashes()": lambda: block_hashes(word_list, WPB),
        "chain()": lambda: chain(blocks),
        "cache_key()": lambda: cache_key(MODEL, raw),
    }
    out = {}
    for name, fn in parts.items():
        for _ in range(20):
            fn()
        us = []
        for _ in range(runs):
            t0 = time.perf_counter_ns()
            fn()
            us.append((time.perf_counter_ns() - t0) / 1000.0)
        out[name] = {"median_us": median(us), "p99_us": percentile(us, 99)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1000,100000", help="entry counts (default 10,1000,100000)")
    parser.add_argument("--queries", type=int, default=3000, help="timed lookups per case and size (default 3000)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.monotonic()
    info = machine()

    hashing = time_prompt_of()  # first, on a small heap
    results = []
    for n in sizes:
        gc.collect()
        tracemalloc.start()
        t0 = time.perf_counter()
        index = build(n)
        build_s = time.perf_counter() - t0
        gc.collect()
        memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        cases = queries(n, args.queries)
        timed = time_finds(index, cases)
        digests = sum(len(t) for t in index._exact.values()) + sum(len(t) for t in index._words.values())
        results.append({"entries": n, "chain_digests": digests, "memory_bytes": memory,
                        "bytes_per_entry": memory / n, "build_s_traced": build_s, "find": timed})
        del index, cases

    largest = results[-1]
    worst = max(c["p99_us"] for c in largest["find"].values())
    target = {"entries": largest["entries"], "target_us": TARGET_US, "worst_p99_us": worst,
              "met": worst <= TARGET_US if largest["entries"] >= 100_000 else None}
    doc = {"benchmark": "lookup", "queries": args.queries, "machine": info, "results": results,
           "prompt_of_2000_words": hashing, "target": target, "seconds": round(time.monotonic() - started, 1)}
    if args.json:
        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"MetaIndex.find: {args.queries} lookups per case and size ({machine_line()})\n")
    rows = []
    for r in results:
        f = r["find"]
        rows.append([f"{r['entries']:,}", f"{r['chain_digests']:,}", f"{r['memory_bytes'] / 2**20:.2f}",
                     f"{r['bytes_per_entry']:.0f}", f["hit"]["median_us"], f["hit"]["p99_us"],
                     f["system"]["median_us"], f["system"]["p99_us"], f["none"]["median_us"], f["none"]["p99_us"]])
    print(table(["entries", "chain digests", "memory MiB", "bytes/entry", "hit med µs", "hit p99 µs",
                 "system med µs", "system p99 µs", "none med µs", "none p99 µs"], rows))
    if target["met"] is not None:
        print(f"\ntarget: find() <= {TARGET_US:g} µs at {largest['entries']:,} entries: worst p99 {worst:.1f} µs "
              f"-> {'met' if target['met'] else 'NOT met'}")
    print("\nPrompt.of, 2,000-word chat (µs):")
    print(table(["step", "median µs", "p99 µs"],
                [[name, v["median_us"], v["p99_us"]] for name, v in hashing.items()]))
    print(f"\ntook {doc['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
