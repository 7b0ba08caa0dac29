"""An outside tool's view: NVIDIA's aiperf drives multi-turn chats at llama-server alone and through lpcache.

aiperf (PyPI `aiperf`, pinned by scripts/get-aiperf.sh, in a virtualenv of its own under ~/.cache/lpcache) generates
the workload and measures it; nothing of lpcache's own bench code sends a request. The workload: N conversations
(default 8) of T turns (default 4), each request carrying a system prompt shared by every conversation (~1,000
tokens), a user context of the conversation's own (~300 tokens), the earlier turns with the answers the server really
gave, and a new user message (~50 tokens); 8 tokens generated per answer (`ignore_eos`), temperature 0, streamed.
aiperf keeps C conversations (default 4) going at once and sends a conversation's next turn the moment its answer
ends (zero think time) or after a think time (default 5 s), then starts the next conversation when one is done.
The server: llama-server (build 11434, SmolLM2-135M) with 2 slots (`-np 2`), `--cache-ram 0` by default (the
working set is larger than its RAM cache) and `--metrics`; behind lpcache with its default settings otherwise.

Measured for each run: the prompt tokens llama-server computed (the increase of `llamacpp:prompt_tokens_total` on its
own `/metrics`; lpcache's slot saves and restores are not prompt tokens there), all prompt tokens of the requests
(the servers' `usage.prompt_tokens`, summed by aiperf), time to first token p50 and p90 (aiperf's
profile_export_aiperf.json), request count and errors (its per-request records), lpcache's restores, aiperf's
benchmark duration. Each run gets a fresh llama-server, same seed, so the same conversations.

aiperf reaches no model hub here: its tokenizer is built from the GGUF file by bench/gguf_tokenizer.py, laid out in
a local HuggingFace hub cache, and loaded with HF_HUB_OFFLINE=1; it is checked against llama-server's /tokenize
first.

The table goes to docs/benchmarks.md (between its `aiperf` markers) and the raw figures to bench/results/aiperf.json.

Run: python bench/aiperf_scenario.py [--conversations 8] [--turns 4] [--concurrency 4] [--think-ms 5000]
     [--system-tokens 1000] [--context-tokens 300] [--user-tokens 50] [--output-tokens 8] [--cache-ram 0]
     [--quick] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import llama_machine_text, replace_section, stop_run, table  # noqa: E402
from aiperf_records import json_lines  # noqa: E402
from replay import metric  # noqa: E402

from lpcache.workloads.harness import REPO, LlamaServer, LpcacheProcess, llama_paths, script_paths  # noqa: E402

DOC = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results" / "aiperf.json"
GET_AIPERF = REPO / "scripts" / "get-aiperf.sh"
TOKENIZER_SCRIPT = REPO / "bench" / "gguf_tokenizer.py"
START, END = "<!-- aiperf:start -->", "<!-- aiperf:end -->"
LLAMA_COMPUTED = "llamacpp:prompt_tokens_total"
ALONE, PROXY = "llama-server alone", "through lpcache"


def cache_dir() -> Path:
    return Path(os.environ.get("LPCACHE_CACHE") or Path.home() / ".cache" / "lpcache")


def aiperf_paths() -> tuple[str, str]:
    """(aiperf, its Python) from scripts/get-aiperf.sh (or AIPERF_BIN, AIPERF_PYTHON)."""
    binary, python = script_paths(GET_AIPERF, "AIPERF_BIN", "AIPERF_PYTHON")
    return binary, python


def tokenizer_for(python: str, gguf: str) -> tuple[str, str, str]:
    """(folder, hub cache, repo id) of the GGUF's tokenizer, built once by bench/gguf_tokenizer.py in aiperf's
    Python (gguf, tokenizers) and laid out in a hub cache of its own under the lpcache cache folder."""
    stem = re.sub(r"[^a-z0-9._-]+", "-", Path(gguf).stem.lower())
    folder = cache_dir() / "aiperf-tokenizers" / stem
    hub = cache_dir() / "aiperf-hf-hub"
    repo_id = f"local/{stem}"
    subprocess.run([python, str(TOKENIZER_SCRIPT), "build", gguf, str(folder), "--hub-cache", str(hub),
                    "--repo-id", repo_id], check=True, capture_output=True, text=True)
    return str(folder), str(hub), repo_id


def check_tokenizer(python: str, folder: str, url: str, hub: str) -> dict[str, Any]:
    """bench/gguf_tokenizer.py's comparison with llama-server's /tokenize (tokenizers and transformers)."""
    out = subprocess.run([python, str(TOKENIZER_SCRIPT), "check", folder, "--url", url, "--transformers", "--json"],
                         capture_output=True, text=True, env=offline_env(hub))
    try:
        return dict(json.loads(out.stdout))
    except ValueError:
        return {"error": (out.stderr or out.stdout).strip()[-500:]}


def offline_env(hub: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": hub,
            "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1"}


def aiperf_argv(aiperf: str, url: str, tokenizer: str, out: str, args: argparse.Namespace, think_ms: int
                ) -> list[str]:
    """The aiperf command line of one run."""
    return [
        aiperf, "profile", "--model", "smollm2", "--tokenizer", tokenizer, "--url", url,
        "--endpoint-type", "chat", "--streaming",
        "--shared-system-prompt-length", str(args.system_tokens),
        "--user-context-prompt-length", str(args.context_tokens), "--num-dataset-entries", str(args.conversations),
        "--conversation-num", str(args.conversations),
        "--conversation-turn-mean", str(args.turns), "--conversation-turn-stddev", "0",
        "--conversation-turn-delay-mean", str(think_ms), "--conversation-turn-delay-stddev", "0",
        "--isl", str(args.user_tokens), "--isl-stddev", "0", "--osl", str(args.output_tokens),
        "--extra-inputs", "temperature:0", "--extra-inputs", "ignore_eos:true",
        *loop_args(args.concurrency, args.seed), *output_args(out),
    ]


def loop_args(concurrency: int, seed: int) -> list[str]:
    """aiperf's closed loop as the scenarios drive it: at most `concurrency` conversations at once (aiperf's
    `--concurrency` is a count of sessions: a conversation holds its place from its first turn to the end of its
    last, think times included), a turn sent when the previous answer ends (plus the think time)."""
    return [
        # The request rate only paces aiperf's scheduling loop: without one it spins on a CPU core the whole run
        # (its "concurrency burst" mode), stolen from llama-server on a small machine; at 100 a second a turn waits
        # at most 10 ms for the loop's next tick.
        "--concurrency", str(concurrency), "--request-rate", "100", "--arrival-pattern", "constant",
        "--random-seed", str(seed),
        # A new connection per request: with pooled keep-alive connections aiperf sends some requests on one the
        # server has just closed after its 5 s keep-alive timeout (llama-server's and uvicorn's), and counts the
        # "Server disconnected" as a failed request.
        "--connection-reuse-strategy", "never",
        "--workers-max", "1", "--record-processors", "1",
    ]


def output_args(out: str) -> list[str]:
    """Where aiperf writes its exports, and nothing it does not need (no live UI, no metrics scraping)."""
    return ["--artifact-dir", out, "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry"]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def computed_tokens(llama_url: str) -> int:
    value = metric(scrape(llama_url), LLAMA_COMPUTED)
    if value is None:
        raise RuntimeError(f"{llama_url}/metrics has no {LLAMA_COMPUTED}: is llama-server started with --metrics?")
    return int(value)


def lpcache_counts(url: str) -> dict[str, int]:
    """lpcache's restores and saves so far (its own /metrics; names as lpcache/edge/metrics.py has them)."""
    try:
        text = scrape(url)
    except OSError:
        return {}
    counts = {}
    for key, name, labels in (("restores", "lpcache_restores_total", {"result": "ok"}),
                              ("restores_failed", "lpcache_restores_total", None),
                              ("saves", "lpcache_saves_total", {"result": "ok"})):
        value = metric(text, name, labels)
        counts[key] = int(value or 0)
    counts["restores_failed"] -= counts["restores"]
    return counts


def read_aiperf(out: str) -> dict[str, Any]:
    """Figures from aiperf's exports: the summary JSON and the per-request records (JSON lines)."""
    summary = json.loads((Path(out) / "profile_export_aiperf.json").read_text())
    records = json_lines(Path(out) / "profile_export.jsonl")
    errors = [r for r in records if r.get("error")]
    ttft = summary.get("time_to_first_token") or {}
    later = sorted(r["metrics"]["time_to_first_token"]["value"] for r in records
                   if not r.get("error") and r["metadata"].get("turn_index", 0) > 0
                   and "time_to_first_token" in r.get("metrics", {}))

    def stat(key: str, field: str = "avg") -> float | None:
        value = (summary.get(key) or {}).get(field)
        return None if value is None else float(value)

    latency = stat("request_latency", "p50")

    return {
        "requests": len(records),
        "errors": len(errors),
        "error_messages": sorted({str(r["error"].get("message", ""))[:200] for r in errors})[:5],
        "ttft_p50_s": None if ttft.get("p50") is None else ttft["p50"] / 1000,
        "ttft_p90_s": None if ttft.get("p90") is None else ttft["p90"] / 1000,
        "ttft_later_turns_p50_s": later[len(later) // 2] / 1000 if later else None,
        "latency_p50_s": None if latency is None else latency / 1000,
        "prompt_tokens": int(stat("total_usage_prompt_tokens") or 0),
        "isl_tokens": int(stat("total_isl") or 0),
        "duration_s": stat("benchmark_duration"),
    }


def one_run(setup: str, think_ms: int, args: argparse.Namespace, aiperf: str, tokenizer: str, hub: str,
            say: Callable[[str], None]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-aiperf-"))
    server = proxy = None
    try:
        slots = str(work / "slots")
        server = LlamaServer(slots, n_slots=2, cache_ram=args.cache_ram, extra=["--metrics"])
        url = server.url
        if setup == PROXY:
            backends = [{"url": server.url, "slot_save_path": slots}]
            proxy = start_lpcache({"BACKENDS": json.dumps(backends), "META_DIR": str(work / "meta")}, say)
            url = proxy.url
        out = str(work / "aiperf")
        argv = aiperf_argv(aiperf, url, tokenizer, out, args, think_ms)
        load_before = os.getloadavg()[0]
        before = computed_tokens(server.url)
        started = time.perf_counter()
        with open(work / "aiperf.log", "w") as log:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=offline_env(hub),
                                  timeout=args.timeout)
        wall = time.perf_counter() - started
        computed = computed_tokens(server.url) - before
        if not (Path(out) / "profile_export_aiperf.json").is_file():
            tail = "\n".join((work / "aiperf.log").read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"aiperf exited with {proc.returncode} and no results; its log:\n{tail}")
        result: dict[str, Any] = {"setup": setup, "think_ms": think_ms, "computed": computed, **read_aiperf(out),
                                  "aiperf_exit": proc.returncode, "wall_s": round(wall, 1),
                                  "load_1m_before": round(load_before, 2),
                                  "load_1m_after": round(os.getloadavg()[0], 2)}
        if proxy is not None:
            result.update(lpcache_counts(proxy.url))
        result["computed_over_prompt"] = (round(computed / result["prompt_tokens"], 3)
                                          if result["prompt_tokens"] else None)
        return result
    finally:
        stop_run(work, proxy, server)


def start_lpcache(settings: dict[str, str], say: Callable[[str], None], tries: int = 3) -> LpcacheProcess:
    """lpcache as a user starts it; retried a little (its code may be mid-edit in a working checkout)."""
    for attempt in range(1, tries + 1):
        try:
            return LpcacheProcess(settings)
        except RuntimeError as e:
            if attempt == tries:
                raise
            say(f"  lpcache did not start (attempt {attempt}): {str(e).splitlines()[-1]}; retrying in 30 s")
            time.sleep(30)  # waiting for a working tree to settle, not synchronisation
    raise AssertionError("unreachable")


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def rows_of(results: Sequence[dict[str, Any]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in results:
        alone = next((a for a in results if a["setup"] == ALONE and a["think_ms"] == r["think_ms"]), None)
        rows.append([r["setup"], f"{r['think_ms'] / 1000:g} s", r["requests"], r["errors"], r["computed"],
                     r["prompt_tokens"], _f(r["computed_over_prompt"], 3),
                     "-" if alone is None or not alone["computed"] else f"{r['computed'] / alone['computed']:.3f}",
                     _f(r["ttft_p50_s"]), _f(r["ttft_p90_s"]), _f(r["ttft_later_turns_p50_s"]),
                     _f(r["duration_s"], 1), r.get("restores", "-")])
    return rows


HEADERS = ["setup", "think", "requests", "errors", "computed", "prompt", "x prompt", "x alone", "ttft p50 s",
           "ttft p90 s", "ttft p50 turns 2+ s", "duration s", "restores"]


def command_text(args: argparse.Namespace, think_ms: int) -> str:
    argv = aiperf_argv("aiperf", "http://127.0.0.1:PORT", "local/smollm2-135m-instruct.q4_1", "OUT", args, think_ms)
    return shlex.join(argv)


def markdown(results: Sequence[dict[str, Any]], args: argparse.Namespace, check: dict[str, Any], machine: str,
             minutes: float) -> str:
    agree = check.get("agree") or {}
    tok_line = ("Tokenizer check against llama-server's `/tokenize`: " +
                ", ".join(f"{k} {n}/{check['texts']} texts" for k, n in agree.items()) +
                f" ({check.get('tokens', 0)} tokens) agree exactly." if agree else
                f"Tokenizer check failed: {check.get('error', 'no result')}.")
    cache_ram = "`--cache-ram 0`" if args.cache_ram == 0 else (
        "the default `--cache-ram`" if args.cache_ram is None else f"`--cache-ram {args.cache_ram}`")
    loads = ", ".join(f"{r['load_1m_before']:.1f} → {r['load_1m_after']:.1f}" for r in results if "load_1m_before" in r)
    return "\n".join([
        START, "", "## An outside tool: aiperf's multi-turn chats (`bench/aiperf_scenario.py`)", "",
        f"{machine}. Whole run: {minutes:.0f} minutes. NVIDIA aiperf {args.aiperf_version} "
        "(`scripts/get-aiperf.sh`) generates and measures the workload; its tokenizer is made from the GGUF file by "
        "`bench/gguf_tokenizer.py` (no model hub). " + tok_line, "",
        f"Workload: {args.conversations} conversations of {args.turns} turns, {args.concurrency} at a time, each "
        f"request carrying a system prompt shared by all (~{args.system_tokens} tokens), a user context of the "
        f"conversation's own (~{args.context_tokens} tokens), the earlier turns with the server's real answers and "
        f"a new message (~{args.user_tokens} tokens); {args.output_tokens} tokens generated per answer, "
        "temperature 0, streamed. aiperf sends a conversation's next turn the moment the answer ends (think 0 s) "
        f"or after the think time, and starts a new conversation when one ends. One llama-server, `-np 2` and "
        f"{cache_ram}, fresh for every run; lpcache with its default settings. aiperf opens a new connection per "
        "request (pooled keep-alive connections race the servers' 5 s keep-alive timeout) and paces its scheduling "
        "loop at 100 ticks a second (without a request rate it spins on a core, taken from llama-server). "
        f"1-minute load average before → after each run, in the table's order: {loads or '-'} (llama-server takes "
        "about 2; more is other work on the machine, which slows the runs it overlaps; the token counts hardly "
        "depend on it).", "",
        "`computed` is the prompt tokens llama-server computed (`llamacpp:prompt_tokens_total` on its own "
        "`/metrics`, before and after); `prompt` all prompt tokens of the requests (`usage.prompt_tokens`); "
        "`x alone` computed over the server alone's at the same think time; time to first token from aiperf's "
        "export (`turns 2+`: the conversations' later turns only); `duration` aiperf's benchmark duration; "
        "`restores` lpcache's successful slot restores.", "",
        table(HEADERS, rows_of(results)), "",
        "The command (zero think time; the other run adds its delay):", "",
        "```sh", "HF_HUB_OFFLINE=1 HF_HUB_CACHE=~/.cache/lpcache/aiperf-hf-hub " + command_text(args, 0), "```", "",
        END])


def _cache_ram(text: str) -> int | None:
    return None if text == "default" else int(text)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="conversations going at once")
    ap.add_argument("--think-ms", type=int, default=5000, help="think time of the second pair of runs")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--context-tokens", type=int, default=300)
    ap.add_argument("--user-tokens", type=int, default=50)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--cache-ram", type=_cache_ram, default=0, metavar="MIB|default",
                    help="llama-server's --cache-ram (default 0; 'default' leaves llama-server's own)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one aiperf run")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 4 conversations of 2 turns, 2 at a time, 1 s think time, no docs")
    ap.add_argument("--no-docs", action="store_true", help="print only; do not write docs/ and bench/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.concurrency, args.think_ms, args.no_docs = 4, 2, 2, 1000, True
    started = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    aiperf, python = aiperf_paths()
    args.aiperf_version = subprocess.run([python, "-c", "from importlib.metadata import version; "
                                          "print(version('aiperf'))"], capture_output=True, text=True,
                                         check=True).stdout.strip()
    binary, gguf = llama_paths()
    folder, hub, tokenizer = tokenizer_for(python, gguf)
    say(f"aiperf {args.aiperf_version}, tokenizer {tokenizer} ({folder})")
    with LlamaServer(None, n_slots=2, cache_ram=args.cache_ram) as server:
        check = check_tokenizer(python, folder, server.url, hub)
    agree = check.get("agree") or {}
    say("tokenizer vs llama-server /tokenize: " + (", ".join(f"{k} {n}/{check['texts']}" for k, n in agree.items())
                                                   if agree else f"check failed: {check.get('error')}"))
    say("aiperf command: " + command_text(args, 0))
    results: list[dict[str, Any]] = []
    for think_ms in (0, args.think_ms):
        for setup in (ALONE, PROXY):
            say(f"{setup}, think {think_ms} ms")
            r = one_run(setup, think_ms, args, aiperf, tokenizer, hub, say)
            say(f"  {r['requests']} requests, {r['errors']} errors, computed {r['computed']} of {r['prompt_tokens']}"
                f" prompt tokens, ttft p50 {_f(r['ttft_p50_s'])} s p90 {_f(r['ttft_p90_s'])} s, "
                f"{_f(r['duration_s'], 1)} s" + (f", {r['restores']} restores" if "restores" in r else ""))
            results.append(r)
    minutes = (time.perf_counter() - started) / 60
    print(table(HEADERS, rows_of(results)))
    say(f"done in {minutes:.1f} minutes")
    if not args.no_docs:
        section = markdown(results, args, check, llama_machine_text(binary, gguf), minutes)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"aiperf": args.aiperf_version, "command": command_text(args, 0),
                                       "settings": {k: v for k, v in vars(args).items() if k != "aiperf_version"},
                                       "tokenizer_check": check, "minutes": round(minutes, 1),
                                       "results": results}, indent=1, ensure_ascii=False))
        replace_section(DOC, START, END, section)
        print(f"wrote {DOC.relative_to(REPO)}, {RESULTS.relative_to(REPO)}")
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
