"""The acceptance soak of issue 11: N chat requests (5,000) at concurrency 32 through lpcache, as a process of its own
(`python -m lpcache`), in front of two stand-in llama-servers (processes too) whose faults are re-armed at random all
along: 5xx, error/answer/`/slots`/`/props`/`/health`/save bodies cut or stalled, dropped connections, stalls, hangs,
broken streams, failed saves. Coalescing and the result cache are on, with two client keys: identical bodies go at once
from both keys, and some clients leave (leaders of coalesced groups among them). See `lpcache.workloads.soak`.

Prints: the outcomes, lpcache's own 500s, answers made for one key seen by the other, bad answers, records (request
log lines) against requests, busy slots and waiters at the end (GET /health), and lpcache's resident memory (VmRSS)
after the warm-up (the first tenth) and at the end. Exits 1 when an acceptance figure fails.

Run: python bench/soak.py [--requests 5000] [--concurrency 32] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from lpcache.workloads.harness import LpcacheProcess, MockProcess, remove_tree, scratch_dir
from lpcache.workloads.soak import KEYS, Soak, plan, wait_free

RSS_LIMIT_MB = 20.0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def records(path: Path) -> int:
    """Request-log records: one line per finished request (lines starting with # are headers)."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip() and not line.startswith(b"#"))


async def soak(args: argparse.Namespace, work: Path) -> dict[str, object]:
    slots = work / "slots"
    slots.mkdir()
    mocks = [MockProcess(str(slots), n_slots=4, extra=["--gen-ms-per-token", "1"]) for _ in range(2)]
    log_path = work / "requests.log"
    plugins = [{"name": "result_cache", "params": {"dir": str(work / "results"), "ttl_secs": 60,
                                                   "cache_streaming": True}},
               {"name": "request_log", "params": {"path": str(log_path), "max_bytes": 0}}]
    settings = {"BACKENDS": json.dumps([{"url": m.url, "slot_save_path": str(slots)} for m in mocks]),
                "META_DIR": str(work / "meta"), "LOG_LEVEL": "ERROR", "COALESCE_REQUESTS": "true",
                "LPCACHE_API_KEYS": ",".join(KEYS), "PLUGINS": json.dumps(plugins), "REQUEST_TIMEOUT": "2",
                "BREAKER_COOLDOWN_MS": "100", "BREAKER_MAX_COOLDOWN_MS": "800", "BIG_THRESHOLD_WORDS": "50",
                "WORDS_PER_BLOCK": "10", "SAVE_RETRY_DELAY_MS": "10"}
    try:
        with LpcacheProcess(settings) as proxy:
            assert proxy.process is not None
            pid = proxy.process.pid
            rss: list[float] = [rss_mb(pid)]
            parts = 10

            async def measure(k: int) -> None:
                rss.append(rss_mb(pid))
                print(f"  {(k + 1) * args.requests // parts} requests, {time.monotonic() - started:.0f} s, "
                      f"RSS {rss[-1]:.1f} MB", flush=True)

            started = time.monotonic()
            jobs = plan(args.requests, random.Random(args.seed))
            runner = Soak(proxy.url, [m.url for m in mocks], concurrency=args.concurrency,
                          faults=random.Random(args.seed + 1), timeout=120)
            report = await runner.run(jobs, measure, parts=parts)
            health = await wait_free(proxy.url, timeout=60)
            for _ in range(600):   # polling, 60 s at most: the log is written after each answer
                if records(log_path) >= report.asked:
                    break
                await asyncio.sleep(0.1)
            rss.append(rss_mb(pid))
            lines = records(log_path)
            print(f"lpcache log (errors only), last lines:\n{proxy.log_tail(5)}")
    finally:
        for m in mocks:
            m.stop()
    busy = sum(b.get("busy_slots", 0) for b in health["backends"])
    growth = rss[-1] - rss[1]
    return {
        "requests": report.asked, "concurrency": args.concurrency, "seconds": round(report.seconds, 1),
        "outcomes": dict(sorted(report.outcomes.items())), "faults armed": dict(sorted(report.armed.items())),
        "lpcache's own 500s": report.own_500s(), "cross-key answers": len(report.cross_key()),
        "bad answers": len(report.problems), "first bad answers": report.problems[:5],
        "records": lines, "busy slots at the end": busy, "waiting at the end": health.get("waiting"),
        "RSS MB at start, after warm-up, at the end": [round(rss[0], 1), round(rss[1], 1), round(rss[-1], 1)],
        "RSS growth MB": round(growth, 1),
        "pass": (report.own_500s() == 0 and not report.cross_key() and not report.problems and busy == 0
                 and not health.get("waiting") and lines == report.asked and growth < RSS_LIMIT_MB),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    work = Path(scratch_dir("lpcache-soak-"))
    try:
        result = asyncio.run(soak(args, work))
    finally:
        remove_tree(str(work))
    for name, value in result.items():
        print(f"{name}: {value}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
