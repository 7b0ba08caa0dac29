"""The `agents` scenario of bench/scenarios.py: coding-agent sessions through the Responses and Messages APIs.

The workload is `lpcache.workloads.agents.sessions`: N sessions (default 4) on one harness (a system prompt and eight
tool schemas), each a task and S tool exchanges (default 8), so S + 1 requests, `concurrency` requests at a time
(default 2), the sessions taking turns (bench/agents_replay.py). It runs once per route (`--agent-routes`): all sessions
through `POST /v1/responses` (Codex-style), then all through `POST /v1/messages` (Claude-Code-style), as one agent
program speaks one API; `mixed` sends the even sessions through Responses and the odd ones through Messages (one harness
reaching the server through both APIs). One llama-server (build 11434, SmolLM2-135M, `-np 2`, a context that holds the
longest prompt in each slot, `--slot-save-path`, `--metrics`), fresh for every run:

    llama-server alone, --cache-ram 0
    llama-server alone, its default --cache-ram (8 GiB)
    lpcache (its default settings) in front of it, --cache-ram 0, as in the other scenarios

SmolLM2's own chat template drops the tools and the assistant's tool calls from the prompt, which would leave the
harness a system prompt only; llama-server is given bench/templates/chatml-tools.jinja instead, ChatML rendering
them as Qwen2.5 does (the tools as JSON in the system turn, calls in <tool_call>, results in <tool_response>).

A table per route goes to docs/benchmarks.md between its `agents` markers, the raw figures to
bench/results/agents.json. `--agent-setups lpcache` runs one setup again and keeps the others' last figures (of the
same route and settings) from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import stop_run, table
from agents_replay import prompt_tokens, rows_json, run_sessions, summarise
from aiperf_scenario import computed_tokens, lpcache_counts

from lpcache.workloads.agents import APIS, Session, sessions
from lpcache.workloads.harness import REPO, LlamaServer, LpcacheProcess
from lpcache.workloads.story import shared

START, END = "<!-- agents:start -->", "<!-- agents:end -->"
RESULTS = REPO / "bench" / "results" / "agents.json"
TEMPLATE = REPO / "bench" / "templates" / "chatml-tools.jinja"
N_SLOTS = 2
ROUTES = {"responses": ("responses",), "messages": ("messages",), "mixed": APIS}
ROUTE_TITLES = {"responses": "every session through `POST /v1/responses`",
                "messages": "every session through `POST /v1/messages`",
                "mixed": "half the sessions through `POST /v1/responses`, half through `POST /v1/messages`"}


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    cache_ram: int | None    # None: llama-server's default
    proxy: bool


SETUPS = (
    Setup("ram0", "llama-server alone, --cache-ram 0", 0, False),
    Setup("ram", "llama-server alone, default --cache-ram", None, False),
    Setup("lpcache", "lpcache, its backend --cache-ram 0", 0, True),
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--agent-sessions", type=int, default=4, help="agents: sessions of a run")
    ap.add_argument("--agent-routes", default="responses,messages",
                    help="agents: one run per route: responses, messages, mixed (half and half)")
    ap.add_argument("--agent-steps", type=int, default=8, help="agents: tool exchanges per session")
    ap.add_argument("--agent-concurrency", type=int, default=2, help="agents: requests in flight")
    ap.add_argument("--agent-max-tokens", type=int, default=12, help="agents: tokens generated per answer")
    ap.add_argument("--agent-seed", type=int, default=1)
    ap.add_argument("--agent-setups", default=",".join(s.key for s in SETUPS),
                    help="agents: the setups to run (ram0,ram,lpcache); the others keep their figures from "
                         "bench/results/agents.json")


def _server(slots: str, cache_ram: int | None, ctx: int) -> LlamaServer:
    return LlamaServer(slots, n_slots=N_SLOTS, ctx=ctx, cache_ram=cache_ram,
                       extra=["--metrics", "--chat-template-file", str(TEMPLATE)])


def one_run(setup: Setup, load: Sequence[Session], tokens: dict[tuple[int, int], list[int]], ctx: int,
            args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    server = proxy = None
    try:
        slots = str(work / "slots")
        server = _server(slots, setup.cache_ram, ctx)
        url = server.url
        if setup.proxy:
            proxy = LpcacheProcess({"BACKENDS": json.dumps([{"url": server.url, "slot_save_path": slots}]),
                                    "META_DIR": str(work / "meta"), "LOG_LEVEL": "WARNING"})
            url = proxy.url
        say(f"agents: {setup.label}")
        before = computed_tokens(server.url)
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        rows = run_sessions(url, load, concurrency=args.agent_concurrency, max_tokens=args.agent_max_tokens,
                            progress=lambda m: say("  " + m))
        summary = summarise(rows, tokens, time.perf_counter() - started)
        summary["server_computed"] = computed_tokens(server.url) - before
        summary["load_1m"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
        if proxy is not None:
            summary.update(lpcache_counts(proxy.url))
        summary.update(setup=setup.key, label=setup.label, commit=_commit(), at=time.strftime("%Y-%m-%d %H:%M"))
        say(f"  computed {summary['computed']} (server /metrics {summary['server_computed']}) / ideal "
            f"{summary['ideal']} = {summary['computed_over_ideal']}, ttft p50 {summary['ttft_p50']} s p90 "
            f"{summary['ttft_p90']} s, {summary['elapsed_s']} s, {summary['errors']} errors"
            + (f", {summary.get('restores')} restores" if proxy is not None else ""))
        if summary["errors"]:
            say(f"  errors: {summary['error_messages']}")
        return {"summary": summary, "rows": rows_json(rows)}
    finally:
        stop_run(work, proxy, server)


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return out.stdout.strip()[:80]


def workload(args: argparse.Namespace, route: str) -> list[Session]:
    return sessions(args.agent_sessions, steps=args.agent_steps, seed=args.agent_seed, apis=ROUTES[route])


def measure(load: Sequence[Session]) -> tuple[dict[tuple[int, int], list[int]], dict[str, int]]:
    """Every request's prompt tokens (checked against the APIs' own counts), and the workload's sizes: the harness
    is the prefix all first requests share."""
    with LlamaServer(None, n_slots=1, ctx=4096, cache_ram=0, extra=["--chat-template-file", str(TEMPLATE)]) as s:
        tokens = prompt_tokens(s.url, load)
    firsts = [tokens[(s.index, 0)] for s in load]
    harness = min(shared(firsts[0], f) for f in firsts[1:]) if len(firsts) > 1 else len(firsts[0])
    steps = sum(s.turns - 1 for s in load)
    last = [len(tokens[(s.index, s.turns - 1)]) for s in load]
    return tokens, {"harness": harness, "longest": max(last),
                    "task": round(sum(len(f) - harness for f in firsts) / len(firsts)),
                    "exchange": round(sum(b - len(a) for a, b in zip(firsts, last, strict=True)) / max(1, steps))}


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    """Each chosen route's run; the figures of the setups and routes not chosen from the last results file."""
    routes = args.agent_routes.split(",")
    unknown = set(routes) - set(ROUTES)
    if unknown:
        raise SystemExit(f"unknown agent routes {sorted(unknown)}; choose among {sorted(ROUTES)}")
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    before = {part.get("settings", {}).get("route"): part for part in old.get("routes", [])}
    parts = []
    for route in ROUTES:   # the routes not run keep their last figures
        if route in routes:
            parts.append(run_route(route, args, say, before.get(route)))
        elif route in before:
            parts.append(before[route])
    return {"routes": parts}


def run_route(route: str, args: argparse.Namespace, say: Callable[[str], None],
              old: dict[str, Any] | None) -> dict[str, Any]:
    """The chosen setups on one route's workload, one after the other."""
    load = workload(args, route)
    tokens, sizes = measure(load)
    ctx = N_SLOTS * (-(-(sizes["longest"] + args.agent_max_tokens + 64) // 256) * 256)
    say(f"agents ({route}): {len(load)} sessions x {load[0].turns} requests, harness {sizes['harness']} tokens, an "
        f"exchange {sizes['exchange']} on average, longest prompt {sizes['longest']}; -c {ctx}")
    settings = {"route": route, "sessions": len(load), "steps": args.agent_steps,
                "concurrency": args.agent_concurrency, "max_tokens": args.agent_max_tokens, "seed": args.agent_seed,
                "ctx": ctx, **sizes}
    chosen = args.agent_setups.split(",")
    unknown = set(chosen) - {s.key for s in SETUPS}
    if unknown:
        raise SystemExit(f"unknown agent setups {sorted(unknown)}; choose among {[s.key for s in SETUPS]}")
    kept: dict[str, Any] = {}
    if len(chosen) < len(SETUPS) and old is not None:
        if old.get("settings") == settings:
            kept = {r["summary"]["setup"]: r for r in old["results"]}
        else:
            say(f"agents ({route}): bench/results/agents.json has other settings; its figures are not kept")
    results = []
    for setup in SETUPS:
        if setup.key in chosen:
            results.append(one_run(setup, load, tokens, ctx, args, lambda m: say(f"[{route}] {m}")))
        elif setup.key in kept:
            results.append(kept[setup.key])
    return {"settings": settings, "results": results}


HEADERS = ["setup", "requests", "errors", "computed", "ideal", "x ideal", "server /metrics", "ttft p50 s",
           "ttft p90 s", "time s", "x time alone (ram 0)", "restores"]


def markdown(report: dict[str, Any], machine: str, minutes: float) -> str:
    parts = report["routes"]
    st = parts[0]["settings"]
    requests = st["sessions"] * (st["steps"] + 1)
    lines = [
        START, "", "## Agent sessions through the Responses and Messages APIs (`bench/scenarios.py --only agents`)",
        "", f"{machine}. Whole run: {minutes:.0f} minutes.", "",
        f"Workload (`workloads.agents`): {st['sessions']} coding-agent sessions sharing one harness, a system prompt "
        f"and eight tool schemas (read_file, write_file, apply_patch, run_shell, search_code, list_dir, glob_files, "
        f"todo_write). Each session is a task and {st['steps']} tool exchanges, so {st['steps'] + 1} requests, "
        f"{requests} in all: each request is the previous one plus a scripted tool call and its result (numbered "
        "source lines, pytest, git, tsc and cargo output, search hits, directory trees, with Unicode); the model's "
        "own answers are not used, as an agent replays its own tool loop. One run per route, as one agent program "
        f"speaks one API (Codex-style clients Responses, Claude-Code-style clients Messages); {st['concurrency']} "
        "requests in flight, the sessions taking turns, so a session's next request usually finds its slot holding "
        f"another session; {st['max_tokens']} tokens generated per answer, temperature 0, streamed. One "
        f"llama-server, `-np {N_SLOTS}` with a context that holds the longest prompt in each slot, fresh for every "
        "run; lpcache with its default settings, its backend with `--cache-ram 0` as in the other scenarios. "
        "SmolLM2's own chat template leaves out the tools and the tool calls, so llama-server renders the prompts "
        "with `bench/templates/chatml-tools.jinja` (ChatML with tools, as Qwen2.5 renders them).", "",
        "`computed` is the prompt tokens the answers' usage says were computed (Responses: `input_tokens` − "
        "`cached_tokens`; Messages: `input_tokens`); `server /metrics` the same from llama-server's "
        "`llamacpp:prompt_tokens_total`; the ideal is the harness once, then each request's tokens that no earlier "
        "request shared as a prefix (counted with llama-server's `/apply-template` and `/tokenize`, checked against "
        "its `/v1/responses/input_tokens` and `/v1/messages/count_tokens`); time to first token is to the first "
        "content event of the stream; `time` the whole run; `restores` lpcache's slot restores.", ""]
    loaded = False
    for part in parts:
        st = part["settings"]
        summaries = [r["summary"] for r in part["results"]]
        loaded = loaded or any("load_1m" in s for s in summaries)
        base = next((s for s in summaries if s["setup"] == "ram0"), None)
        rows = [[s["label"], s["requests"], s["errors"], s["computed"], s["ideal"], f"{s['computed_over_ideal']:.3f}",
                 s["server_computed"], f"{s['ttft_p50']:.2f}", f"{s['ttft_p90']:.2f}", f"{s['elapsed_s']:.1f}",
                 "-" if base is None else f"{s['elapsed_s'] / base['elapsed_s']:.3f}", s.get("restores", "-")]
                for s in summaries]
        runs = "; ".join(f"{s['label']}: {s['at']}, commit {s['commit'].split()[0]}"
                         + (f", 1-minute load {s['load_1m'][0]} → {s['load_1m'][1]}" if "load_1m" in s else "")
                         for s in summaries)
        lines += [f"### {ROUTE_TITLES[st['route']]}", "",
                  f"Harness {st['harness']:,} tokens as rendered, a task ~{st['task']} tokens, ~{st['exchange']} "
                  f"tokens an exchange, the longest prompt {st['longest']:,} (`-c {st['ctx']}`).", "",
                  table(HEADERS, rows), ""]
        by = {s["setup"]: s for s in summaries}
        if {"ram0", "ram", "lpcache"} <= set(by):
            mine = by["lpcache"]
            lines += [f"lpcache computed {mine['computed_over_ideal']:.2f}x the ideal, llama-server alone "
                      f"{by['ram0']['computed_over_ideal']:.2f}x (`--cache-ram 0`) and "
                      f"{by['ram']['computed_over_ideal']:.2f}x (its default RAM cache); its median time to first "
                      f"token is {by['ram0']['ttft_p50'] / mine['ttft_p50']:.1f}x and "
                      f"{by['ram']['ttft_p50'] / mine['ttft_p50']:.1f}x lower.", ""]
        if st["route"] == "mixed":
            per_api = "; ".join(f"{s['label']}: {s.get('computed_responses')} + {s.get('computed_messages')} "
                                f"tokens, {s.get('ttft_p50_responses')} s and {s.get('ttft_p50_messages')} s"
                                for s in summaries)
            lines += [f"By API (computed through Responses + through Messages, ttft p50 of each): {per_api}. "
                      "A Responses and a Messages request share their identity where the server renders the "
                      "same prompt (both are keyed by the chat request they become), so the harness is one prefix "
                      "across the two APIs.", ""]
        lines += [f"Runs: {runs}.", ""]
    if loaded:
        lines += ["llama-server takes about 2 of the 1-minute load; more is other work on the machine, which slows "
                  "the run it overlaps: the times vary with it, the token counts do not.", ""]
    return "\n".join([*lines, END])
