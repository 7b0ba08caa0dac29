"""Agents as they connect (issue 23): their own session ids, sub-agents that start from their parents' harness, and
many agents of two client keys on few slots. On a real llama-server (build 11434, SmolLM2-135M, `-np 2 --cache-ram
0`, `bench/templates/chatml-tools.jinja`), behind lpcache with its defaults.

Part `sessions`: 4 parent sessions of one coding-agent harness (`lpcache.workloads.agents`: a system prompt and eight
tool schemas, ~2,500 tokens), each starting 2 sub-agents after its first turn, every session a task and 4 tool
exchanges through `POST /v1/messages` (max_tokens 8), 4 requests at a time. Sent without any session header, and
with the headers each client sends: OpenCode (`x-session-id`, a sub-agent's `x-parent-session-id`), Claude Code
(`x-claude-code-session-id`, a sub-agent's `x-claude-code-agent-id`), Codex (`session-id`, a spawned thread's
`thread-id` and `x-codex-parent-thread-id`). The prompt tokens llama-server computed (its `/metrics`) over the ideal
(each request's tokens no earlier request's prompt shared as a token prefix). Target: at most 1.1x the ideal with
every header, and never more than without one.

Part `admission`: two client keys (`LPCACHE_API_KEYS`), 2 slots. Key b's 4 agents (a task and 5 tool exchanges each,
closed loop) alone; then key a's 12 agents sent all at once beside them (a burst), with one request of key a asking
`X-Lpcache-Priority: high` (CLIENT_PRIORITIES lets it; its burst asks for normal, so only the class puts it ahead)
sent once b's agents are done and the burst holds every slot and still waits (sent while b's agents run, it would
take whichever slot came free first, b's too, a turn the run alone has no match for); then `QUEUE_MAX=6` under the
same burst with requests asking `X-Lpcache-Max-Wait: 1`. It reports b's median wait for its answer (sent to
answered) and for a slot (the request log's `lpcache-queue-ms`), alone and beside the burst (target: within 2x), the
high-priority request's wait against the longest time a request held a slot then (target: at most one running
generation), and every status returned (refusals with their `Retry-After`; target: no 500).

Writes a section between the `agent-sessions` markers of docs/benchmarks.md and bench/results/agent_sessions.json.
Run: python bench/agent_sessions.py [--parts sessions,admission] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import llama_machine_text, replace_section, stop_run, table  # noqa: E402
from agents_replay import prompt_tokens  # noqa: E402
from aiperf_scenario import computed_tokens  # noqa: E402
from replay import metric  # noqa: E402

from lpcache.workloads.agents import Session, sessions  # noqa: E402
from lpcache.workloads.harness import REPO, LlamaServer, LpcacheProcess, llama_paths  # noqa: E402

TEMPLATE = REPO / "bench" / "templates" / "chatml-tools.jinja"
DOC = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results" / "agent_sessions.json"
START, END = "<!-- agent-sessions:start -->", "<!-- agent-sessions:end -->"
MODES = ("none", "x-session-id", "claude-code", "codex")
PARENTS, SUBS, STEPS, CONCURRENCY, MAX_TOKENS = 4, 2, 4, 4, 8
ADMISSION_STEPS = 5
KEY_A, KEY_B = "bench-key-a", "bench-key-b"


def headers_of(mode: str, s: Session, parent: int | None) -> dict[str, str]:
    """The session headers a client sends for session `s` (a sub-agent of `parent`), as its sources do."""
    sid = f"sess-{s.index:02d}-7f3a"
    root = f"sess-{parent:02d}-7f3a" if parent is not None else None
    if mode == "x-session-id":
        return {"x-session-id": sid, **({"x-parent-session-id": root} if root else {})}
    if mode == "claude-code":
        return ({"x-claude-code-session-id": sid} if root is None else
                {"x-claude-code-session-id": root, "x-claude-code-agent-id": f"a{s.index}"})
    if mode == "codex":
        return ({"session-id": sid, "thread-id": sid} if root is None else
                {"session-id": root, "thread-id": f"th-{s.index}", "x-codex-parent-thread-id": root})
    return {}


def drive(url: str, starts: Sequence[Session], then: dict[int, Sequence[Session]], concurrency: int,
          headers: Callable[[Session], dict[str, str]], statuses: list[tuple[int, str | None]] | None = None,
          max_tokens: int = MAX_TOKENS, latencies: list[float] | None = None) -> list[tuple[int, int]]:
    """Closed loop: each session's turns in order, `concurrency` requests at a time; a session's sub-agents
    (`then`) start after its first turn. Returns (session, turn) in the order answered; `latencies` gets each
    answered request's seconds from sending to its answer."""
    ready: queue.Queue[tuple[Session, int]] = queue.Queue()
    for s in starts:
        ready.put((s, 0))
    left = [sum(s.turns for s in starts) + sum(x.turns for subs in then.values() for x in subs)]
    order: list[tuple[int, int]] = []
    failed: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(timeout=900) as client:
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                try:
                    s, turn = ready.get(timeout=0.2)
                except queue.Empty:
                    continue
                sent = time.monotonic()
                try:
                    r = client.post(url + "/v1/messages", json=s.body(turn, max_tokens=max_tokens),
                                    headers=headers(s))
                except httpx.HTTPError as e:   # lpcache gone: every worker stops, instead of waiting for turns
                    with lock:
                        failed.append(f"{type(e).__name__}: {e}")
                        left[0] = 0
                    return
                with lock:
                    if latencies is not None and r.status_code == 200:
                        latencies.append(time.monotonic() - sent)
                    if statuses is not None:
                        statuses.append((r.status_code, r.headers.get("retry-after")))
                    order.append((s.index, turn))
                    left[0] -= 1 if r.status_code == 200 else s.turns - turn   # a refused session stops
                if r.status_code != 200:
                    if statuses is None:
                        with lock:
                            failed.append(f"{r.status_code}: {r.text[:300]}")
                            left[0] = 0
                        return
                    continue
                if turn + 1 < s.turns:
                    ready.put((s, turn + 1))
                if turn == 0:
                    for sub in then.get(s.index, ()):
                        ready.put((sub, 0))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(failed[0])
    return order


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n, m = 0, min(len(a), len(b))
    while n < m and a[n] == b[n]:
        n += 1
    return n


def ideal_of(order: Sequence[tuple[int, int]], tokens: dict[tuple[int, int], list[int]]) -> int:
    seen: list[list[int]] = []
    total = 0
    for key in order:
        t = tokens[key]
        total += len(t) - max((lcp(t, u) for u in seen), default=0)
        seen.append(t)
    return total


def server(slots: str) -> LlamaServer:
    return LlamaServer(slots, n_slots=2, ctx=16384 * 2, cache_ram=0,
                       extra=["--metrics", "--chat-template-file", str(TEMPLATE)])


def part_sessions(say: Callable[[str], None]) -> dict[str, Any]:
    everyone = sessions(PARENTS * (1 + SUBS), steps=STEPS, seed=23, apis=("messages",))
    parents = everyone[:PARENTS]
    subs = {p.index: everyone[PARENTS + SUBS * i: PARENTS + SUBS * (i + 1)] for i, p in enumerate(parents)}
    parent_of = {sub.index: p for p, ss in subs.items() for sub in ss}
    with LlamaServer(None, n_slots=1, ctx=16384, cache_ram=0, extra=["--chat-template-file", str(TEMPLATE)]) as s:
        tokens = prompt_tokens(s.url, everyone)
    harness = lcp(tokens[(0, 0)], tokens[(1, 0)])
    rows: dict[str, Any] = {"harness_tokens": harness, "requests": len(tokens), "modes": {}}
    for mode in MODES:
        work = Path(tempfile.mkdtemp(prefix="bench-agent-sessions-"))
        try:
            with server(str(work / "slots")) as llama:
                proxy = LpcacheProcess({"BACKENDS": json.dumps([{"url": llama.url, "slot_save_path":
                                                                 str(work / "slots")}]),
                                        "META_DIR": str(work / "meta"), "LOG_LEVEL": "WARNING"})
                try:
                    before, started = computed_tokens(llama.url), time.monotonic()
                    order = drive(proxy.url, parents, subs, CONCURRENCY,
                                  lambda s, m=mode: headers_of(m, s, parent_of.get(s.index)))
                    took, computed = time.monotonic() - started, computed_tokens(llama.url) - before
                    seeds = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in
                             httpx.get(proxy.url + "/metrics").text.splitlines()
                             if line.startswith("lpcache_session_seeds_total{")}
                finally:
                    proxy.stop()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        ideal = ideal_of(order, tokens)
        rows["modes"][mode] = {"computed": computed, "ideal": ideal, "x_ideal": round(computed / ideal, 3),
                               "seconds": round(took, 1), "seeds": {k: int(v) for k, v in seeds.items() if v}}
        say(f"sessions {mode}: computed {computed} / ideal {ideal} = {computed / ideal:.3f}, {took:.0f} s, "
            f"seeds {rows['modes'][mode]['seeds']}")
    return rows


def waits_of(log: Path, agent: str) -> list[float]:
    """`lpcache-queue-ms` of the answered requests whose User-Agent is `agent` (the request log)."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("#"):
            continue
        ua, status, queue_ms, *_ = line.split()
        if ua == agent and status == "200" and queue_ms != "-":
            out.append(float(queue_ms))
    return out


def burst_holds_all(url: str, key: str) -> bool:
    """Every slot busy and requests waiting in line (lpcache's /metrics, read with a client key)."""
    try:
        r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
    except httpx.HTTPError:
        return False   # not seen: the caller polls again until its deadline
    waiting = metric(r.text, "lpcache_queue_depth", {"priority": "normal"}) or 0.0
    busy, slots = metric(r.text, "lpcache_slots_busy") or 0.0, metric(r.text, "lpcache_slots") or 0.0
    return waiting > 0 and slots > 0 and busy >= slots


def admission_run(label: str, settings: dict[str, str], burst: bool, say: Callable[[str], None],
                  max_wait: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    log = work / "requests.log"
    # 5 tool exchanges: key b's 24 requests make its median steadier than 12 did (2.45x then 1.89x, same code)
    everyone = sessions(16, steps=ADMISSION_STEPS, seed=7, apis=("messages",))
    b_agents, a_agents = everyone[:4], everyone[4:]
    statuses: list[tuple[int, str | None]] = []
    b_latencies: list[float] = []
    urgent: dict[str, Any] = {}
    try:
        with server(str(work / "slots")) as llama:
            proxy = LpcacheProcess({
                "BACKENDS": json.dumps([{"url": llama.url, "slot_save_path": str(work / "slots")}]),
                "META_DIR": str(work / "meta"), "LOG_LEVEL": "WARNING", "LPCACHE_API_KEYS": f"{KEY_A},{KEY_B}",
                "CLIENT_PRIORITIES": f"{KEY_A}=high", "REQUEST_LOG": "true", "REQUEST_LOG_PATH": str(log),
                # the first five are read here; the rest say where a request's time went (kept with BENCH_KEEP)
                "REQUEST_LOG_FIELDS": "cs(User-Agent),sc-status,lpcache-queue-ms,lpcache-priority,cs-time,"
                                      "lpcache-slot,lpcache-route,lpcache-seeded,lpcache-restored,"
                                      "lpcache-prompt-tokens,lpcache-cached-tokens,lpcache-prefill-ms,lpcache-gen-ms,"
                                      "datetime",
                **settings})
            try:
                # warm-up: the harness computed once, and the slots' hold times learnt, for every run alike
                drive(proxy.url, everyone[:1], {}, 1, lambda s: {"Authorization": f"Bearer {KEY_B}",
                                                               "User-Agent": "warm-up"})
                headers_b = lambda s: {"Authorization": f"Bearer {KEY_B}", "User-Agent": "agent-b",  # noqa: E731
                                       "x-session-id": f"b{s.index}"}
                extra = {"X-Lpcache-Max-Wait": max_wait} if max_wait else {}
                headers_a = lambda s: {"Authorization": f"Bearer {KEY_A}", "User-Agent": "agent-a",  # noqa: E731
                                       "x-session-id": f"a{s.index}", "X-Lpcache-Priority": "normal", **extra}
                threads = [threading.Thread(target=drive, args=(proxy.url, b_agents, {}, len(b_agents), headers_b,
                                                                statuses, MAX_TOKENS, b_latencies))]
                if burst:
                    threads.append(threading.Thread(target=drive, args=(proxy.url, a_agents, {}, len(a_agents),
                                                                        headers_a, statuses)))
                for t in threads:
                    t.start()
                if burst and not settings:
                    # the high-priority request is key a's (its burst asks for normal): only its class can put it
                    # ahead of the burst, which holds every slot by then. Sent once b's agents are done (the burst
                    # lasts longer), so it takes no turn of b's share, which the run alone has no match for
                    threads[0].join()
                    answered = len(statuses)
                    deadline = time.monotonic() + 120
                    # b's last slot is kept for it a while (`admission.Reserved`): first until it is seen free or
                    # the burst has had two more answers, then until the burst holds both slots and waits in line
                    while time.monotonic() < deadline and threads[1].is_alive() and len(statuses) < answered + 2 \
                            and burst_holds_all(proxy.url, KEY_B):
                        time.sleep(0.05)
                    held = False
                    while time.monotonic() < deadline and threads[1].is_alive() and \
                            not (held := burst_holds_all(proxy.url, KEY_B)):
                        time.sleep(0.05)
                    started = time.monotonic()
                    r = httpx.post(proxy.url + "/v1/messages", json=everyone[0].body(1, max_tokens=MAX_TOKENS),
                                   headers={"Authorization": f"Bearer {KEY_A}", "User-Agent": "urgent",
                                            "X-Lpcache-Priority": "high"}, timeout=900)
                    urgent = {"status": r.status_code, "seconds": round(time.monotonic() - started, 2),
                              "sent_while_the_burst_held_every_slot": held}
                for t in threads:
                    t.join()
            finally:
                proxy.stop()
        rows = [line.split() for line in log.read_text().splitlines() if not line.startswith("#")]
        holds = [float(r[4]) - float(r[2]) for r in rows if r[1] == "200" and r[2] != "-" and r[4] != "-"]
        if urgent:
            urgent["queue_ms"] = next(float(r[2]) for r in rows if r[0] == "urgent")
            urgent["longest_hold_ms"] = round(max(holds), 1)
        b = waits_of(log, "agent-b")
        result = {"label": label, "b_wait_p50_ms": round(statistics.median(b), 1) if b else None,
                  "b_latency_p50_s": round(statistics.median(b_latencies), 2) if b_latencies else None,
                  "b_latency_mean_s": round(statistics.fmean(b_latencies), 2) if b_latencies else None,
                  "b_turns": ADMISSION_STEPS + 1, "b_requests": len(b), "a_requests": len(waits_of(log, "agent-a")),
                  "urgent": urgent,
                  "statuses": sorted({str(s) for s, _ in statuses}),
                  "status_counts": {str(s): sum(1 for x, _ in statuses if x == s) for s, _ in statuses},
                  "retry_after": sorted({ra for s, ra in statuses if s != 200 and ra is not None}),
                  "refusals_without_retry_after": sum(1 for s, ra in statuses if s in (429, 503) and ra is None)}
        say(f"admission {label}: {result}")
        return result
    finally:
        stop_run(work)


def part_admission(say: Callable[[str], None]) -> dict[str, Any]:
    return {"alone": admission_run("key b alone", {}, False, say),
            "burst": admission_run("key b beside key a's burst", {}, True, say),
            "queue_max": admission_run("QUEUE_MAX=6, X-Lpcache-Max-Wait 1 s", {"QUEUE_MAX": "6"}, True, say,
                                       max_wait="1")}


def urgent_when(urgent: dict[str, Any]) -> str:
    held = urgent.get("sent_while_the_burst_held_every_slot")
    if held is None:
        return "while the burst waited"   # a run of before 2026-12-06: sent as the burst began
    return ("while the burst held every slot with requests waiting" if held else
            "without seeing the burst hold every slot")


def mean_ratio(alone: dict[str, Any], burst: dict[str, Any]) -> str:
    a, b = alone.get("b_latency_mean_s"), burst.get("b_latency_mean_s")
    return f"{b / a:.2f}x" if a and b else "-"


def markdown(report: dict[str, Any]) -> str:
    out = [START, "", "## Agents as they connect: session headers, sub-agents, two client keys "
           "(`bench/agent_sessions.py`)", "", report["machine"], ""]
    s = report.get("sessions")
    if s:
        out += [f"4 parent sessions of one harness ({s['harness_tokens']} tokens), each starting 2 sub-agents "
                f"after its first turn, a task and {STEPS} tool exchanges each ({s['requests']} requests), "
                f"`POST /v1/messages`, {CONCURRENCY} at a time, `-np 2 --cache-ram 0`, lpcache's defaults. "
                "Target: at most 1.1x the ideal, and never more than without a session header."
                + (f" Figures of an earlier run, on {s['kept_from']}." if s.get("kept_from") else ""), "",
                table(["session headers", "computed", "ideal", "x ideal", "time s", "new sessions started from"],
                      [[m, r["computed"], r["ideal"], f"{r['x_ideal']:.3f}", r["seconds"],
                        ", ".join(f"{k} {v}" for k, v in sorted(r["seeds"].items())) or "-"]
                       for m, r in s["modes"].items()]), ""]
    a = report.get("admission")
    if a:
        alone, burst, bounded = a["alone"], a["burst"], a["queue_max"]
        if a.get("kept_from"):
            out += [f"Figures of an earlier run, on {a['kept_from']}:", ""]
        ratio = burst["b_wait_p50_ms"] / alone["b_wait_p50_ms"] if alone["b_wait_p50_ms"] else None
        answer = burst["b_latency_p50_s"] / alone["b_latency_p50_s"] if alone.get("b_latency_p50_s") else None
        out += [f"Two client keys on 2 slots: key b's 4 agents (closed loop, {alone.get('b_turns', 3)} turns "
                "each), alone and beside key a's 12 agents sent "
                "at once; one request of key a with `X-Lpcache-Priority: high` (its burst asks for normal) sent once "
                "b's agents are done, while the burst holds both slots and still waits; then "
                "`QUEUE_MAX=6` under the same burst, key a asking `X-Lpcache-Max-Wait: 1`.", "",
                table(["run", "key b: answer p50 s", "answer mean s", "wait for a slot p50 ms", "requests b / a",
                       "statuses", "Retry-After (s)"],
                      [[r["label"], r.get("b_latency_p50_s"), r.get("b_latency_mean_s"), r["b_wait_p50_ms"],
                        f"{r['b_requests']} / {r['a_requests']}",
                        ", ".join(f"{k}: {v}" for k, v in sorted(r["status_counts"].items())),
                        ", ".join(r["retry_after"]) or "-"] for r in (alone, burst, bounded)]), "",
                f"Key b's median wait for its answer beside the burst: {answer:.2f}x its wait alone (target 2x; "
                f"its mean: {mean_ratio(alone, burst)}); "
                f"its time in line for a slot: {ratio:.2f}x its time in line alone. Each key keeps one of the two "
                "slots while both wait (a free slot goes to the key holding fewer, and a key's next step finds the "
                "slot its last answer freed), "
                "so key b's 4 agents share one slot where alone they shared two: about twice the time to an "
                "answer, and in a closed loop of 4 agents about 3 answers waited for in line instead of 1. Without "
                "fair shares (arrival order) key b's requests queue behind the whole burst of 12."
                if ratio and answer else "",
                f"The high-priority request, sent "
                f"{urgent_when(burst['urgent'])}, waited {burst['urgent'].get('queue_ms')} ms for "
                f"its slot; the longest a request held a slot in that run: {burst['urgent'].get('longest_hold_ms')} "
                "ms (target: at most one running generation)." if burst.get("urgent") else "",
                f"Refusals without Retry-After: {bounded['refusals_without_retry_after']}; 500s: "
                f"{sum(r['status_counts'].get('500', 0) for r in (alone, burst, bounded))}.", ""]
    return "\n".join(out + [END])


def keep_parts_not_run(report: dict[str, Any], results: Path) -> None:
    """A part not run this time keeps its figures of the last run written (`results`), named as such: the docs
    section shows both parts whichever was run."""
    try:
        last = json.loads(results.read_text())
    except (OSError, ValueError):
        return
    for part in ("sessions", "admission"):
        if part not in report and isinstance(last.get(part), dict):
            machine = str(last.get("machine", "")).removeprefix("Machine: ")
            report[part] = {**last[part], "kept_from": last[part].get("kept_from") or machine}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="sessions,admission", help="sessions, admission (default: both)")
    ap.add_argument("--no-docs", action="store_true", help="print only; do not write docs/ and bench/results/")
    args = ap.parse_args(argv)
    started = time.monotonic()
    binary, gguf = llama_paths()
    report: dict[str, Any] = {"machine": llama_machine_text(binary, gguf)}
    parts = args.parts.split(",")
    if "sessions" in parts:
        report["sessions"] = part_sessions(print)
    if "admission" in parts:
        report["admission"] = part_admission(print)
    report["minutes"] = round((time.monotonic() - started) / 60, 1)
    keep_parts_not_run(report, RESULTS)
    text = markdown(report)
    print(text)
    if not args.no_docs:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=1) + "\n")
        replace_section(DOC, START, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
