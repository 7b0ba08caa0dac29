"""The `scale` scenario of bench/scenarios.py: lpcache replicas sharing one Redis, in front of two llama-servers.

The workload is the story workload of the other scenarios (`lpcache.workloads.story.turns`), sent `--scale-concurrency`
requests at a time (default 2), round by round (bench/replay.py). The same two llama-servers (build 11434,
SmolLM2-135M, `-np 2 --cache-ram 0`, each its own slot-save folder, `--metrics`) serve every run; between runs they
are restarted on their ports with their folders emptied, so every run starts from nothing:

    one     one lpcache in front of both servers
    two     two lpcache replicas in front of both, sharing a fresh redis-server (REDIS_URL, REPLICA_ID r0 and r1,
            a META_DIR each), each request sent to a random replica (seeded)
    none    no lpcache: the client sends its requests to the two servers in turn (round-robin)

lpcache runs with its default settings (SAVE_POLICY eager). For each run: the prompt tokens the servers computed
(`timings.prompt_n`) over the ideal (the prompt tokens no earlier prompt shared as a token prefix), time to first
token p50/p90 (JSON answers of 8 tokens: the whole answer, as in the other story scenarios), the run's time; with
Redis, the replicas' Redis round trips and the time their requests spent claiming slot leases, per request (their
/metrics, summed over the replicas), and what Redis itself processed (its INFO). The target: two replicas within
1.05x the ideal. A table goes to docs/benchmarks.md between its `scale` markers, the raw figures to
bench/results/scale.json.

Run: python bench/scenarios.py --only scale [--users 3] [--rounds 3] [--scale-kinds generate,annotate,redraft]
     [--scale-concurrency 2] [--scale-seed 1] [--scale-setups one,two,none] [--scale-log-level INFO] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import Servers, redis_commands, shared_cores, table
from replay import metric, replay

from lpcache.workloads.harness import REPO, LpcacheProcess, RedisServer
from lpcache.workloads.story import KINDS, Turn, turns

START, END = "<!-- scale:start -->", "<!-- scale:end -->"
RESULTS = REPO / "bench" / "results" / "scale.json"
N_SERVERS = 2
N_SLOTS = 2
CACHE_RAM = 0
TARGET = 1.05      # two replicas: prompt tokens computed at most this over the ideal
DEFAULT_REQUESTS = 27   # the default workload's size (3 users x 3 kinds x 3 rounds): below it, a short run


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    replicas: int     # 0: no lpcache, the client round-robins over the servers


SETUPS = (
    Setup("one", "1 lpcache in front of both servers", 1),
    Setup("two", "2 lpcache replicas, one Redis, each request to a random replica", 2),
    Setup("none", "no lpcache, the client round-robins over the servers", 0),
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scale-kinds", default="generate,annotate,redraft",
                    help="scale: the kinds of work on each story (conversations: --users x kinds)")
    ap.add_argument("--scale-concurrency", type=int, default=2, help="scale: requests in flight")
    ap.add_argument("--scale-seed", type=int, default=1, help="scale: the seed of the replicas' random choice")
    ap.add_argument("--scale-log-level", default="WARNING",
                    help="scale: lpcache's LOG_LEVEL; at another level than WARNING the replicas' logs are kept")
    ap.add_argument("--scale-setups", default=",".join(s.key for s in SETUPS),
                    help="scale: the runs to make, among one (1 replica), two (2 replicas and Redis), none "
                         "(round-robin, no lpcache)")


def workload(args: argparse.Namespace) -> list[Turn]:
    kinds = [k for k in args.scale_kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise SystemExit(f"unknown scale kinds {sorted(unknown)}; choose among {sorted(KINDS)}")
    return turns(users=args.users, kinds=kinds, rounds=args.rounds, first_words=args.first_words,
                 part_words=args.part_words)


def targets(setup: Setup, fronts: Sequence[str], n: int, seed: int) -> list[str]:
    """Where each request goes: a random replica (seeded), or the servers in turn."""
    if setup.replicas > 1:
        rng = random.Random(seed)
        return [fronts[rng.randrange(len(fronts))] for _ in range(n)]
    return [fronts[i % len(fronts)] for i in range(n)]


def fleet_counts(urls: Sequence[str]) -> dict[str, float | None]:
    """The replicas' Redis figures from their /metrics, summed (None: this lpcache does not expose that one)."""
    names = {"redis_calls": ("lpcache_redis_calls_total", None),
             "claim_seconds": ("lpcache_redis_claim_seconds_total", None),
             "claims_refused": ("lpcache_slot_claims_total", {"outcome": "refused"}),
             "claims_local": ("lpcache_slot_claims_total", {"outcome": "local"}),
             "redis_up": ("lpcache_redis_up", None),
             "redis_errors": ("lpcache_redis_errors_total", None)}
    out: dict[str, float | None] = dict.fromkeys(names)
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for key, (name, labels) in names.items():
            value = metric(text, name, labels)
            if value is not None:
                out[key] = (out[key] or 0.0) + value
    return out


_EXCEPTION = re.compile(r"^[A-Za-z_.]*(Error|Exception)\b")   # the last line of a traceback


def log_problems(proxies: Sequence[LpcacheProcess]) -> list[str]:
    """The warnings and errors the replicas logged, with the exception that ends each traceback."""
    lines = []
    for i, proxy in enumerate(proxies):
        for line in proxy.log_text().splitlines():
            if (" WARNING " in line or " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
                    or _EXCEPTION.match(line)):
                lines.append(f"r{i}: {line[:400]}")
    return lines


def one_run(setup: Setup, servers: Servers, load: Sequence[Turn], args: argparse.Namespace,
            say: Callable[[str], None]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    redis: RedisServer | None = None
    proxies: list[LpcacheProcess] = []
    keep_logs = False
    try:
        backends = json.dumps([{"url": s.url, "slot_save_path": d}
                               for s, d in zip(servers.servers, servers.dirs, strict=True)])
        if setup.replicas == 1:
            proxies = [LpcacheProcess({"BACKENDS": backends, "META_DIR": str(work / "meta"),
                                      "LOG_LEVEL": args.scale_log_level})]
        elif setup.replicas > 1:
            redis = RedisServer()
            proxies = [LpcacheProcess({"BACKENDS": backends, "META_DIR": str(work / f"meta{i}"),
                                       "LOG_LEVEL": args.scale_log_level, "REDIS_URL": redis.url,
                                       "REPLICA_ID": f"r{i}"})
                       for i in range(setup.replicas)]
        fronts = [p.url for p in proxies] or [s.url for s in servers.servers]
        sent_to = targets(setup, fronts, len(load), args.scale_seed)
        say(f"scale: {setup.label}")
        commands_before = redis_commands(redis.url) if redis is not None else {}
        load_before = os.getloadavg()[0]
        report = replay(fronts[0], load, concurrency=args.scale_concurrency, tokenize_url=servers.servers[0].url,
                        slot_dirs=servers.dirs, llama_metrics_urls=[s.url for s in servers.servers],
                        targets=sent_to, progress=lambda m: say("  " + m))
        summary: dict[str, Any] = dict(report.summary)
        requests = summary["requests"]
        summary.update(setup=setup.key, label=setup.label, replicas=setup.replicas,
                       per_front=[sent_to.count(f) for f in fronts],
                       load_1m=[round(load_before, 1), round(os.getloadavg()[0], 1)],
                       commit=_commit(), at=time.strftime("%Y-%m-%d %H:%M"),
                       error_messages=sorted({r.error or f"HTTP {r.status}" for r in report.rows if r.failed})[:10])
        if redis is not None:
            fleet = fleet_counts(fronts)
            summary["fleet"] = fleet
            commands = redis_commands(redis.url)
            summary["redis"] = {k: v - commands_before[k] for k, v in commands.items()}
            summary["redis_calls_per_request"] = (None if fleet["redis_calls"] is None
                                                  else round(fleet["redis_calls"] / requests, 2))
            summary["claim_ms_per_request"] = (None if fleet["claim_seconds"] is None
                                               else round(fleet["claim_seconds"] * 1000 / requests, 3))
            summary["redis_commands_per_request"] = round(summary["redis"]["commands"] / requests, 1)
            summary["redis_scripts_per_request"] = round(summary["redis"]["scripts"] / requests, 2)
        problems = log_problems(proxies)
        summary["log_problems"] = problems[:20]
        summary["log_problem_count"] = len(problems)
        keep_logs = bool(problems) or bool(summary["errors"]) or args.scale_log_level != "WARNING"
        say(f"  computed {summary['computed']} / ideal {summary['ideal']} = {summary['computed_over_ideal']}, ttft "
            f"p50 {summary['ttft_p50']} s p90 {summary['ttft_p90']} s, {summary['elapsed_s']} s, {summary['errors']} "
            f"errors, requests per front {summary['per_front']}")
        if redis is not None:
            f = summary["fleet"]
            say(f"  Redis: {summary['redis_calls_per_request']} round trips a request (lpcache_redis_calls_total), "
                f"{summary['claim_ms_per_request']} ms claiming a request, claims refused {f['claims_refused']}, "
                f"local {f['claims_local']}, lpcache_redis_up {f['redis_up']}; Redis processed "
                f"{summary['redis_commands_per_request']} commands and {summary['redis_scripts_per_request']} script "
                "calls a request")
        if summary["errors"]:
            say(f"  errors: {summary['error_messages']}")
        if problems:
            say(f"  {len(problems)} warnings or errors in the replicas' logs, the first:\n    "
                + "\n    ".join(problems[:5]))
        if keep_logs:
            say("  logs kept: " + ", ".join(str(p.log_path) for p in proxies))
        return summary
    finally:
        for proxy in proxies:
            proxy.stop()
            if not keep_logs:
                proxy.log_path.unlink(missing_ok=True)
        if redis is not None:
            redis.remove()
        shutil.rmtree(work, ignore_errors=True)


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return out.stdout.strip()[:80]


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    """The chosen setups one after the other, on the same two llama-servers, emptied between runs."""
    chosen = args.scale_setups.split(",")
    unknown = set(chosen) - {s.key for s in SETUPS}
    if unknown:
        raise SystemExit(f"unknown scale setups {sorted(unknown)}; choose among {[s.key for s in SETUPS]}")
    load = workload(args)
    kinds = [k for k in args.scale_kinds.split(",") if k]
    described = (f"{args.users} users x {len(kinds)} kinds ({', '.join(kinds)}) x {args.rounds} rounds = "
                 f"{len(load)} requests, stories of {args.first_words} words growing by {args.part_words} a round, "
                 f"{args.scale_concurrency} at a time, 8 tokens generated per answer, temperature 0")
    settings = {"users": args.users, "kinds": kinds, "rounds": args.rounds, "first_words": args.first_words,
                "part_words": args.part_words, "concurrency": args.scale_concurrency, "seed": args.scale_seed,
                "servers": N_SERVERS, "n_slots": N_SLOTS, "cache_ram": CACHE_RAM}
    work = Path(tempfile.mkdtemp(prefix="bench-scale-servers-"))
    servers = None
    runs = []
    try:
        servers = Servers(work, N_SERVERS, N_SLOTS, CACHE_RAM, threads=shared_cores(N_SERVERS, args.scale_concurrency))
        for i, setup in enumerate(s for s in SETUPS if s.key in chosen):
            if i:
                servers.restart(erase=True)
            runs.append(one_run(setup, servers, load, args, say))
    finally:
        if servers is not None:
            servers.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"workload": described, "settings": settings, "runs": runs}


HEADERS = ["setup", "requests", "errors", "computed", "ideal", "x ideal", "ttft p50 s", "ttft p90 s", "time s",
           "Redis round trips / request", "claim ms / request", "claims refused"]


def _message(line: str) -> str:
    """A log line without its replica and time stamp, cut short."""
    text = re.sub(r"^r\d+: (\d{4}-\d\d-\d\d [\d:,]+ )?", "", line)
    return text.replace("`", "'")[:160]


def _or_dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def markdown(report: dict[str, Any], machine: str, minutes: float) -> str:
    runs = report["runs"]
    short = runs and runs[0]["requests"] < DEFAULT_REQUESTS
    lines = [START, "", "## Scale-out: lpcache replicas sharing one Redis (`bench/scenarios.py --only scale`)", "",
             f"{machine}. Workload: {report['workload']}. Whole run: {minutes:.1f} minutes. `make bench` runs it with "
             "the other scenarios; `python bench/scenarios.py --only scale` alone.", ""]
    if short:
        lines += [f"**A short run** ({runs[0]['requests']} requests, below the default workload's "
                  f"{DEFAULT_REQUESTS}): it shows the setups work, not how they compare.", ""]
    lines += [
        f"The same two llama-servers (`-np {N_SLOTS} --cache-ram {CACHE_RAM}`, a slot-save folder each, restarted "
        "with their folders emptied between runs) serve three runs: one lpcache in front of both; two lpcache "
        "replicas sharing a fresh redis-server (`REDIS_URL`, a `META_DIR` each), each request sent to a random "
        "replica (seeded); and no lpcache, the client sending its requests to the two servers in turn. lpcache "
        "with its default settings. `computed` is the prompt tokens the servers computed (`timings.prompt_n`); the "
        "ideal is the prompt tokens no earlier prompt shared as a token prefix; time to first token is the whole "
        "answer's (JSON, 8 tokens), as in the other story scenarios; `time` the run's. Redis round trips "
        "(`lpcache_redis_calls_total`), the time requests spent claiming slot leases "
        "(`lpcache_redis_claim_seconds_total`) and the claims refused because the other replica held the slot "
        "(`lpcache_slot_claims_total{outcome=\"refused\"}`) are summed over the replicas' /metrics.", ""]
    rows = []
    for s in runs:
        f = s.get("fleet") or {}
        rows.append([s["label"], s["requests"], s["errors"], s["computed"], s["ideal"],
                     f"{s['computed_over_ideal']:.3f}", f"{s['ttft_p50']:.2f}", f"{s['ttft_p90']:.2f}",
                     f"{s['elapsed_s']:.1f}", _or_dash(s.get("redis_calls_per_request"), "{:.2f}"),
                     _or_dash(s.get("claim_ms_per_request"), "{:.3f}"), _or_dash(f.get("claims_refused"), "{:.0f}")])
    lines += [table(HEADERS, rows), ""]
    two = next((s for s in runs if s["setup"] == "two"), None)
    if two is not None:
        met = two["computed_over_ideal"] <= TARGET
        lines += [f"Target: two replicas within {TARGET:.2f}x the ideal: {two['computed_over_ideal']:.3f}x, "
                  f"{'met' if met else 'NOT met'}. Redis itself processed {two['redis_commands_per_request']} "
                  f"commands a request ({two['redis_scripts_per_request']} script calls) over the run's "
                  f"{two['elapsed_s']:.0f} s (its INFO: the commands scripts run, the lease renewals of long requests "
                  "and the replicas' background work included). Requests per replica: "
                  f"{', '.join(str(n) for n in two['per_front'])}.", ""]
    logged = [s for s in runs if s.get("log_problem_count")]
    if logged:
        lines += ["Warnings and errors in the replicas' logs: " + "; ".join(
            f"{s['setup']}: {s['log_problem_count']} lines, the first: `{_message(s['log_problems'][0])}`"
            for s in logged) + " (bench/results/scale.json has the first 20 of each run).", ""]
    lines += ["Runs: " + "; ".join(f"{s['setup']}: {s['at']}, commit {s['commit'].split()[0]}, 1-minute load "
                                   f"{s['load_1m'][0]} → {s['load_1m'][1]}" for s in runs) + ".", "", END]
    return "\n".join(lines)
