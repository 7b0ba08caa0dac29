"""Where lpcache saves prefill: every scenario against llama-server alone and behind lpcache, on a real llama-server.

The workload is `lpcache.workloads.story.turns`: users each writing one growing story, each story getting several kinds
of work (generation, annotation, redraft), round by round, as `bench/replay.py` sends and measures it. Each scenario
starts its own llama-server(s) (build 11434, SmolLM2-135M, `--metrics`) and, for the lpcache runs, lpcache as a user
starts it (`python -m lpcache` with its settings in the environment), then replays the same workload:

    fits        -np 2, the default --cache-ram (8 GiB): the working set fits the server's RAM cache
    ram0        -np 2 --cache-ram 0: the working set is larger than the RAM cache
    restart     -np 2, default --cache-ram, llama-server restarted between rounds
    two         two llama-servers (-np 1 --cache-ram 0 each) behind lpcache, against one (-np 2 --cache-ram 0) alone
    sessions    -np 1 --cache-ram 0, requests with X-Session-ID (session mode)
    ram0-c4     as ram0, four requests at a time
    two-12      two llama-servers behind lpcache (half the cores each), 12 conversations two at a time, against one
                alone
    agents      coding-agent sessions through the Responses and Messages APIs (bench/agents_scenario.py: its own
                workload, setups, table and markers)
    scale       two llama-servers behind one lpcache, behind two lpcache replicas sharing one Redis (each request to
                a random replica), and round-robin without lpcache (bench/scale_scenario.py: its own table and
                markers, bench/results/scale.json)

Each lpcache run is made with SAVE_POLICY eager and evict. The tables and a plot go to docs/benchmarks.md (between
its `scenarios` markers) and docs/bench-scenarios.png; the raw figures to bench/results/scenarios.json.

Run: python bench/scenarios.py [--only fits,ram0,agents] [--users 3] [--rounds 3] [--first-words 500] [--no-docs]
     [--agent-sessions 4] [--agent-steps 8] [--agent-concurrency 2] [--agent-setups ram0,ram,lpcache]
     [--agent-routes responses,messages] [--scale-kinds generate,annotate,redraft] [--scale-concurrency 2]
     [--scale-seed 1] [--scale-setups one,two,none]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import agents_scenario  # noqa: E402
import scale_scenario  # noqa: E402
from _common import Servers, llama_machine_text, replace_section, shared_cores, table  # noqa: E402
from replay import replay  # noqa: E402

from lpcache.workloads.harness import REPO, LpcacheProcess, llama_paths  # noqa: E402
from lpcache.workloads.story import Turn, turns  # noqa: E402

DOC = REPO / "docs" / "benchmarks.md"
PLOT = REPO / "docs" / "bench-scenarios.png"
RESULTS = REPO / "bench" / "results" / "scenarios.json"
START, END = "<!-- scenarios:start -->", "<!-- scenarios:end -->"
POLICIES = ("eager", "evict")
AGENTS = "agents"
SCALE = "scale"
KINDS = ("generate", "annotate", "redraft")


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    n_slots: int = 2
    cache_ram: int | None = None     # None: llama-server's default (8 GiB)
    servers: int = 1                 # behind lpcache; alone always runs one server
    alone_slots: int | None = None   # -np of the server alone, when it differs
    restart: bool = False
    session: bool = False
    concurrency: int = 1
    alone_as: str | None = None      # the server alone is run as in this other scenario (same figures)
    repeat: int = 1                  # runs of each setup, interleaved; the one with the median time is reported
    users: int | None = None         # its own number of users (conversations: users x kinds), else --users


SCENARIOS = (
    Scenario("fits", "The working set fits llama-server's RAM cache (-np 2, default --cache-ram)", repeat=3),
    Scenario("ram0", "The working set is larger than the RAM cache (-np 2 --cache-ram 0)", cache_ram=0),
    Scenario("restart", "llama-server restarted between rounds (-np 2, default --cache-ram)", restart=True),
    Scenario("two", "Two llama-servers (-np 1 --cache-ram 0 each) behind lpcache, one (-np 2) alone", n_slots=1,
             cache_ram=0, servers=2, alone_slots=2, alone_as="ram0"),
    Scenario("sessions", "Sessions on one slot (-np 1 --cache-ram 0), X-Session-ID sent", n_slots=1, cache_ram=0,
             session=True),
    Scenario("ram0-c4", "As ram0, four requests at a time", cache_ram=0, concurrency=4),
    Scenario("two-12", "Two llama-servers (-np 2, default --cache-ram, half the cores each) behind lpcache, 12 "
             "conversations (4 users x 3 kinds) two at a time; one llama-server (-np 2, default --cache-ram) alone",
             servers=2, concurrency=2, users=4),
)


@dataclass
class Result:
    scenario: str
    setup: str          # "llama-server alone" or "lpcache, SAVE_POLICY=..."
    summary: dict[str, Any] = field(default_factory=dict)


def one_run(scenario: Scenario, workload: Sequence[Turn], policy: str | None, say: Callable[[str], None]) -> Result:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{scenario.name}-"))
    n = scenario.servers if policy else 1
    slots = scenario.n_slots if policy or scenario.alone_slots is None else scenario.alone_slots
    servers = Servers(work, n, slots, scenario.cache_ram, threads=shared_cores(n, scenario.concurrency))
    proxy = None
    try:
        url = servers.servers[0].url
        if policy:
            backends = [{"url": s.url, "slot_save_path": d} for s, d in zip(servers.servers, servers.dirs,
                                                                           strict=True)]
            proxy = LpcacheProcess({"BACKENDS": json.dumps(backends), "META_DIR": str(work / "meta"),
                                    "SAVE_POLICY": policy, "LOG_LEVEL": "WARNING"})
            url = proxy.url
        label = f"lpcache, SAVE_POLICY={policy}" if policy else "llama-server alone"
        say(f"{scenario.name}: {label}")
        report = replay(url, workload, concurrency=scenario.concurrency, session_header=scenario.session,
                        between=servers.restart if scenario.restart else None,
                        tokenize_url=servers.servers[0].url, slot_dirs=servers.dirs,
                        llama_metrics_urls=[s.url for s in servers.servers], progress=lambda m: say("  " + m))
        summary = dict(report.summary)
        summary["request_s"] = round(summary["elapsed_s"] - summary.get("between_s", 0.0), 3)
        say(f"  computed {summary['computed']} / ideal {summary['ideal']} = {summary['computed_over_ideal']}, "
            f"{summary['request_s']} s, written {summary['bytes_written']:,} B")
        return Result(scenario.name, label, summary)
    finally:
        if proxy is not None:
            proxy.stop()
        servers.stop()
        shutil.rmtree(work, ignore_errors=True)


def markdown(results: Sequence[Result], machine: str, workload: str, minutes: float) -> str:
    by = {(r.scenario, r.setup): r.summary for r in results}
    out = [START, "", "## Prefill saved, scenario by scenario (`bench/scenarios.py`)", "",
           f"{machine}. Workload: {workload}. Whole run: {minutes:.0f} minutes. `computed` is the prompt tokens the "
           "server(s) computed (`timings.prompt_n`); the ideal is the prompt tokens no earlier prompt shared as a "
           "token prefix; `time` is the time spent in requests (restarts excluded; for a scenario run several times, "
           "interleaved, the run with the median time, all times listed below its table); `written` is what "
           "lpcache's saves wrote to the slot-save folders.", ""]
    for s in SCENARIOS:
        rows = []
        alone = by.get((s.name, "llama-server alone"))
        for setup in ["llama-server alone", *(f"lpcache, SAVE_POLICY={p}" for p in POLICIES)]:
            r = by.get((s.name, setup))
            if r is None:
                continue
            rows.append([setup, r["computed"], r["ideal"], f"{r['computed_over_ideal']:.3f}",
                         f"{r['ttft_p50']:.2f}", f"{r['ttft_p90']:.2f}", f"{r['request_s']:.1f}",
                         "-" if alone is None else f"{r['request_s'] / alone['request_s']:.3f}",
                         f"{r['bytes_written'] / 1e6:.0f} MB", f"{r['folder_bytes'] / 1e6:.0f} MB",
                         r["errors"]])
        if rows:
            out += [f"### {s.name}: {s.title}", "", table(
                ["setup", "computed", "ideal", "x ideal", "ttft p50 s", "ttft p90 s", "time s", "x alone",
                 "written", "folder", "errors"], rows), ""]
            if s.repeat > 1:
                times = "; ".join(f"{setup}: {', '.join(f'{t:.1f}' for t in by[(s.name, setup)]['runs_request_s'])}"
                                  for setup in ["llama-server alone", *(f"lpcache, SAVE_POLICY={p}" for p in POLICIES)]
                                  if (s.name, setup) in by)
                out += [f"Times of the {s.repeat} runs (s): {times}.", ""]
    out += ["![tokens computed over the ideal, and time to first token](bench-scenarios.png)", "", END]
    return "\n".join(out)


def plot(results: Sequence[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in SCENARIOS if any(r.scenario == s.name for r in results)]
    setups = ["llama-server alone", *(f"lpcache, SAVE_POLICY={p}" for p in POLICIES)]
    by = {(r.scenario, r.setup): r.summary for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(setups)
    for k, setup in enumerate(setups):
        xs = [i + (k - (len(setups) - 1) / 2) * width for i in range(len(names))]
        ratio = [by.get((n, setup), {}).get("computed_over_ideal") or 0 for n in names]
        ttft = [by.get((n, setup), {}).get("ttft_p50") or 0 for n in names]
        axes[0].bar(xs, ratio, width, label=setup)
        axes[1].bar(xs, ttft, width, label=setup)
    for ax, title in zip(axes, ("prompt tokens computed / ideal", "time to first token, median (s)"), strict=True):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated scenario names (default: all)")
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--first-words", type=int, default=500)
    ap.add_argument("--part-words", type=int, default=40)
    ap.add_argument("--no-docs", action="store_true", help="print only; do not write docs/ and bench/results/")
    agents_scenario.add_arguments(ap)
    scale_scenario.add_arguments(ap)
    args = ap.parse_args(argv)
    only = args.only.split(",") if args.only else None
    chosen = [s for s in SCENARIOS if only is None or s.name in only]
    agents = only is None or AGENTS in only
    scale = only is None or SCALE in only
    if not chosen and not agents and not scale:
        ap.error(f"no such scenario; choose among {', '.join([*(s.name for s in SCENARIOS), AGENTS, SCALE])}")
    workload = turns(users=args.users, kinds=KINDS, rounds=args.rounds, first_words=args.first_words,
                     part_words=args.part_words)
    described = (f"{args.users} users x {len(KINDS)} kinds ({', '.join(KINDS)}) x {args.rounds} rounds = "
                 f"{len(workload)} requests, stories of {args.first_words} words growing by {args.part_words} a "
                 "round, 8 tokens generated per answer, temperature 0")
    started = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    if chosen:
        run_stories(chosen, workload, described, args, say, started)
    if agents:
        agents_started = time.perf_counter()
        report = agents_scenario.run(args, say)
        section = agents_scenario.markdown(report, llama_machine_text(*llama_paths()),
                                           (time.perf_counter() - agents_started) / 60)
        print(section)
        if not args.no_docs:
            agents_scenario.RESULTS.parent.mkdir(parents=True, exist_ok=True)
            agents_scenario.RESULTS.write_text(json.dumps(report, indent=1, ensure_ascii=False))
            replace_section(DOC, agents_scenario.START, agents_scenario.END, section)
            print(f"wrote {DOC.relative_to(REPO)}, {agents_scenario.RESULTS.relative_to(REPO)}")
    if scale:
        scale_started = time.perf_counter()
        scale_report = scale_scenario.run(args, say)
        section = scale_scenario.markdown(scale_report, llama_machine_text(*llama_paths()),
                                          (time.perf_counter() - scale_started) / 60)
        print(section)
        if not args.no_docs:
            scale_scenario.RESULTS.parent.mkdir(parents=True, exist_ok=True)
            scale_scenario.RESULTS.write_text(json.dumps(scale_report, indent=1, ensure_ascii=False))
            replace_section(DOC, scale_scenario.START, scale_scenario.END, section)
            print(f"wrote {DOC.relative_to(REPO)}, {scale_scenario.RESULTS.relative_to(REPO)}")
    return 0


def run_stories(chosen: Sequence[Scenario], workload: Sequence[Turn], described: str, args: argparse.Namespace,
                say: Callable[[str], None], started: float) -> None:
    results: list[Result] = []
    for scenario in chosen:
        load = workload if scenario.users is None else turns(
            users=scenario.users, kinds=KINDS, rounds=args.rounds, first_words=args.first_words,
            part_words=args.part_words)
        runs: dict[str | None, list[Result]] = {}
        for _ in range(scenario.repeat):   # interleaved, so a slow spell of the machine hits every setup alike
            for policy in (None, *POLICIES):
                same = next((r for r in results if r.scenario == scenario.alone_as and r.setup ==
                             "llama-server alone"), None) if policy is None else None
                run = Result(scenario.name, same.setup, same.summary) if same else one_run(scenario, load,
                                                                                           policy, say)
                runs.setdefault(policy, []).append(run)
        for policy in (None, *POLICIES):
            ordered = sorted(runs[policy], key=lambda r: r.summary["request_s"])
            chosen_run = ordered[len(ordered) // 2]
            chosen_run.summary["runs_request_s"] = [r.summary["request_s"] for r in runs[policy]]
            results.append(chosen_run)
    minutes = (time.perf_counter() - started) / 60
    section = markdown(results, llama_machine_text(*llama_paths()), described, minutes)
    print(section)
    if not args.no_docs:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"workload": described, "results": [r.__dict__ for r in results]}, indent=1))
        plot(results, PLOT)
        replace_section(DOC, START, END, section)
        print(f"wrote {DOC.relative_to(REPO)}, {PLOT.relative_to(REPO)}, {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    sys.exit(main())
