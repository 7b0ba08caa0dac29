"""The chaos scenario (issue 24): two lpcache replicas in front of two real llama-servers through one Redis while a
schedule breaks things; what it measures and how is in docs/benchmarks.md ("Chaos").

Two llama-servers (SmolLM2-135M, `-np 2 --cache-ram 0`, a slot folder each, server 0's on a tmpfs) behind two replicas
(`REDIS_URL`, a `META_DIR` each, a short `ORPHAN_GRACE_SECONDS`). Round by round, two at a time, each request to a
random replica (a connection error is retried on the other): a turn of every story conversation (chat completions) and
of two agent lanes (Responses, Messages). From `--first-fault` on, a fault every `--spacing` rounds, each process back
on its own port: kill-server-restore / -save (SIGKILL a llama-server while a file of its slot folder is open for
reading / writing), kill-replica-save, redis-empty, disk-full (a ballast file on the tmpfs), model-swap (server 1
restarted with Gemma 3 270M). Reported: answered, refused, 500s, connection errors retried, wrong answers (against a
clean server of the model, its slot cut where the live cache was), tokens computed over the ideal before and after
each fault, files no index names after the grace period, and the same for a fault-free baseline.

Run (as root for the tmpfs; without it the disk-full fault makes the folder read-only, and says so):
    python bench/chaos_scenario.py [--no-docs] [--faults kill-server-restore,...] [--baseline-rounds 4] ... (--help)
Figures: bench/results/chaos.json and docs/benchmarks.md's `chaos` markers (not with --no-docs). With BENCH_KEEP set,
the replicas' logs are kept (they always are when the acceptance fails).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import llama_machine_text, replace_section, table  # noqa: E402
from replay import metric  # noqa: E402

from lpcache.cache.orphans import SWEEP_MIN_SECONDS  # noqa: E402
from lpcache.workloads.agents import API_PATHS, sessions  # noqa: E402
from lpcache.workloads.harness import REPO, LlamaServer, LpcacheProcess, RedisServer, gemma_path, llama_paths  # noqa: E402
from lpcache.workloads.story import ideal_of, shared, turns  # noqa: E402

DOC, RESULTS = REPO / "docs" / "benchmarks.md", REPO / "bench" / "results" / "chaos.json"
LIMITS = {"META_MAX": "32", "META_MAX_GIB": "1.5"}   # room for the working set (the auto budget: 1/4 of the tmpfs)
TEMPLATE = REPO / "bench" / "templates" / "chatml-tools.jinja"
START, END = "<!-- chaos:start -->", "<!-- chaos:end -->"
FAULTS = {"kill-server-restore": "a llama-server SIGKILLed mid-restore", "kill-server-save": "one SIGKILLed mid-save",
          "kill-replica-save": "a replica SIGKILLed mid-save", "redis-empty": "Redis restarted empty",
          "disk-full": "server 0's slot disk full", "model-swap": "server 1 restarted with another model file"}
CTX, MAX_TOKENS, BALLAST, TARGET, NEAR = 16384, 8, "ballast.fill", 1.1, 0.5
PATHS = {"chat": "/v1/chat/completions", **API_PATHS}


@dataclass
class Row:
    """One request of the workload as the client saw it (its last attempt), and what the checks made of it."""

    round: int
    lane: str
    api: str
    body: dict[str, Any] = field(repr=False)
    chat: dict[str, Any] = field(repr=False)   # its chat-completions form: tokens and the reference
    status: int = 0
    conn_errors: list[str] = field(default_factory=list)
    error: str | None = None
    clear: bool = False           # a refusal whose body is a JSON error with a message
    model: str = ""
    cache_n: int = 0
    prompt_n: int = 0
    restored: bool = False
    answer: str = ""
    tokens: list[int] = field(default_factory=list, repr=False)
    ideal: int = 0
    split: str = ""               # exact / restored / approx / missed (the reference's cache_n was not the live one)
    ref_answer: str = ""
    verdict: str = ""             # same / near tie / unexplained
    parted_at: int | None = None  # the answer token where live and reference part
    margin: float | None = None   # the reference's logprob of its token there minus that of the live one
    answered: bool = False        # 200, its answer read


def workload(args: argparse.Namespace, rounds: int) -> list[list[Row]]:
    """Rounds of requests: the first agent lane's next request, every story conversation's turn, the other lanes'."""
    story = turns(users=args.users, kinds=args.kinds, rounds=rounds, first_words=args.first_words,
                  part_words=args.part_words, seed=args.seed)
    per = args.agent_steps + 1
    agents = sessions(args.agents * (rounds // per + 1), steps=args.agent_steps, seed=args.seed)
    out = []
    for r in range(rounds):
        lanes = [Row(r, f"agent{k}", s.api, s.body(r % per, max_tokens=MAX_TOKENS), s.chat(r % per))
                 for k, s in enumerate(agents[args.agents * (r // per):args.agents * (r // per + 1)])]
        bodies = [(t, {"model": "smollm2", "messages": t.messages, "max_tokens": MAX_TOKENS, "temperature": 0})
                  for t in story if t.turn == r]
        out.append(lanes[:1] + [Row(r, f"{t.kind}{t.user}", "chat", b, b) for t, b in bodies] + lanes[1:])
    return out


def read_answer(api: str, doc: dict[str, Any]) -> tuple[str, int, int]:
    """(answer text with its tool calls, cache_n, prompt_n) of an answer in its API's shape."""
    u = doc.get("usage") or {}
    if api == "chat":
        msg = doc["choices"][0]["message"]
        parts = [("text", msg.get("content") or "")] + [(c["function"]["name"], c["function"]["arguments"])
                                                       for c in msg.get("tool_calls") or []]
        cached, computed = int(doc["timings"]["cache_n"]), int(doc["timings"]["prompt_n"])
    elif api == "responses":
        parts = [("text", p.get("text") or "") for i in doc["output"] if i["type"] == "message" for p in i["content"]]
        parts += [(i["name"], i["arguments"]) for i in doc["output"] if i["type"] == "function_call"]
        cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        computed = int(u["input_tokens"]) - cached
    else:
        parts = [("text", b["text"]) if b["type"] == "text" else (b["name"], b["input"])
                 for b in doc["content"] if b["type"] in ("text", "tool_use")]
        cached, computed = int(u.get("cache_read_input_tokens") or 0), int(u["input_tokens"])

    def call(name: str, args: Any) -> str:   # the arguments as canonical JSON
        with contextlib.suppress(ValueError):
            args = json.loads(args) if isinstance(args, str) else args
        return f"\n<call {name} {json.dumps(args, sort_keys=True, separators=(',', ':'))}>"
    return "".join(a if n == "text" else call(n, a) for n, a in parts), cached, computed


def llama(folder: str, model: str, n_slots: int = 2, ctx: int = CTX, port: int | None = None) -> LlamaServer:
    gemma = ["-m", gemma_path(), "--swa-full"] if model == "gemma" else []
    return LlamaServer(folder, n_slots=n_slots, ctx=ctx, cache_ram=0, port=port,
                       extra=["--chat-template-file", str(TEMPLATE), *gemma])


class Rig:
    """The two llama-servers, Redis and the two replicas, what breaks them, and the requests sent through them."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.dirs, self.metas = [str(work / f"slots{i}") for i in (0, 1)], [str(work / f"meta{i}") for i in (0, 1)]
        self.servers: list[LlamaServer] = []
        self.replicas: list[LpcacheProcess] = []
        self.logs: list[Path] = []
        self.redis: RedisServer | None = None
        self.tmpfs = self.stopped = self.force_r0 = False
        self.models, self.swapped_at = ["smollm2", "smollm2"], float("inf")
        self.pending: list[threading.Thread] = []
        self.fired: dict[str, Any] | None = None
        self.armed: tuple[bool, Callable[[int, str], None]] | None = None   # (a write, what to do when seen)

    def start(self) -> None:
        for d in self.dirs + self.metas:
            os.makedirs(d)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={self.args.tmpfs_mib}M", "tmpfs", self.dirs[0]]
        self.tmpfs = subprocess.run(mount, capture_output=True).returncode == 0
        self.redis = RedisServer()
        self.servers = [llama(d, "smollm2") for d in self.dirs]
        backends = json.dumps([{"url": s.url, "slot_save_path": d} for s, d in zip(self.servers, self.dirs,
                                                                                     strict=True)])
        self.settings = [{"BACKENDS": backends, "META_DIR": self.metas[i], "REDIS_URL": self.redis.url,
                          "REPLICA_ID": f"r{i}", "ORPHAN_GRACE_SECONDS": str(self.args.grace), **LIMITS,
                          "BIG_THRESHOLD_WORDS": str(self.args.big_words), "LOG_LEVEL": "INFO"} for i in (0, 1)]
        for s in self.settings:
            self.replicas.append(LpcacheProcess(s))
            self.logs.append(self.replicas[-1].log_path)
        threading.Thread(target=self._watch, daemon=True, name="chaos-watch").start()

    def close(self) -> None:
        self.stopped, self.armed = True, None
        for t in self.pending:
            t.join()
        for p in [*self.replicas, *self.servers]:
            p.stop()
        if self.redis is not None:
            self.redis.remove()
        if self.tmpfs:
            subprocess.run(["umount", self.dirs[0]], capture_output=True)

    # ---- faults ----

    def _watch(self) -> None:
        """Polls the servers' open files of their slot folder (read: a restore, written: a save) for the armed kind."""
        while not self.stopped:
            if (armed := self.armed) is not None:
                for i, server in enumerate(list(self.servers)):
                    if (name := _open_file(server, self.dirs[i], armed[0])) is not None and self.armed is armed:
                        self.armed = None
                        armed[1](i, name)
                        break
            time.sleep(0.001)   # the polling period

    def spawn(self, work: Callable[[], Any]) -> None:
        self.pending.append(threading.Thread(target=work, daemon=True))
        self.pending[-1].start()

    def kill(self, i: int, name: str) -> None:
        """SIGKILL server i (or replica r0 with `force_r0`: during its save to server i), then start it again."""
        replica = self.force_r0
        victim: LlamaServer | LpcacheProcess = self.replicas[0] if replica else self.servers[i]
        assert victim.process is not None
        victim.process.kill()
        self.fired = {"at": time.time(), "detail": f"{'r0, saving' if replica else 'file'} {name[:12]} on server {i}"}
        victim.process.wait()
        self.force_r0 = False

        def again() -> None:
            if replica:
                self.replicas[0] = LpcacheProcess(self.settings[0], port=victim.port)
                self.logs.append(self.replicas[0].log_path)
            else:
                self.servers[i] = llama(self.dirs[i], self.models[i], port=victim.port)
        self.spawn(again)

    def begin(self, fault: str) -> None:
        """Start (or arm) `fault` at the start of a round."""
        self.fired = None
        if fault.startswith("kill-"):
            self.force_r0, self.armed = fault == "kill-replica-save", (fault.endswith("save"), self.kill)
        elif fault == "disk-full":
            self.fired = {"at": time.time(), "detail": self.fill(True)}
        elif fault == "redis-empty":
            def restart() -> None:
                time.sleep(2.0)   # into the round, requests in flight
                assert self.redis is not None
                self.redis.restart()
                self.fired = {"at": time.time(), "detail": "2 s into the round"}
            self.spawn(restart)
        elif fault == "model-swap":
            def swap() -> None:
                server = self.servers[1]
                server.stop()
                self.models[1], self.swapped_at = "gemma", time.time()   # any later answer of server 1 is Gemma's
                self.servers[1] = llama(self.dirs[1], "gemma", port=server.port)
                self.fired = {"at": self.swapped_at, "detail": "Gemma 3 270M, --swa-full"}
            self.spawn(swap)

    def end(self, fault: str, began: float) -> bool:
        """After the round (its saves included): wait for restarts, free the disk; whether the fault happened."""
        self.settle()
        self.armed, self.force_r0 = None, False
        while self.pending:
            self.pending.pop().join()
        if fault == "disk-full" and self.fired is not None:
            time.sleep(max(0.0, began + self.args.disk_full_s - time.time()))
            self.fired["detail"] += f", held {time.time() - began:.0f} s"
            self.fill(False)
        self.settle()
        return self.fired is not None

    def fill(self, full: bool) -> str:
        """Server 0's slot folder full (a ballast file leaving 256 KiB on its tmpfs), or back to normal. Without the
        tmpfs the folder is made read-only instead (saves fail with EACCES, not ENOSPC; not as root)."""
        if not self.tmpfs:
            os.chmod(self.dirs[0], 0o555 if full else 0o755)
            return "NO tmpfs (mount not permitted): the folder made read-only"
        path, st = os.path.join(self.dirs[0], BALLAST), os.statvfs(self.dirs[0])
        if full:
            with open(path, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, size := st.f_bavail * st.f_frsize - 256 * 1024)
            return f"a {size / 2**20:.0f} MiB ballast on a {self.args.tmpfs_mib} MiB tmpfs"
        os.unlink(path)
        return ""

    def settle(self, timeout: float = 180.0) -> None:
        """Until every replica answers /metrics with no busy slot and no waiting request (saves included)."""
        deadline = time.monotonic() + timeout
        for i in (0, 1):
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):   # a replica starting again
                    text = httpx.get(f"{self.replicas[i].url}/metrics", timeout=10).text
                    if not metric(text, "lpcache_slots_busy") and not metric(text, "lpcache_waiting_requests"):
                        break
                time.sleep(0.1)

    def send(self, row: Row, target: int) -> None:
        target = 0 if self.force_r0 else target
        for attempt in range(6):
            try:
                r = httpx.post(self.replicas[target].url + PATHS[row.api], json=row.body, timeout=600)
            except httpx.TransportError as e:   # the replica is gone: the balancer tries the other one
                row.conn_errors.append(f"r{target}: {type(e).__name__}")
                target = 1 - target
                time.sleep(0.2 * attempt)
                continue
            row.status, done = r.status_code, time.time()
            doc = None
            with contextlib.suppress(ValueError):
                doc = r.json()
            if r.status_code != 200 or not isinstance(doc, dict):
                err = doc.get("error") if isinstance(doc, dict) else None
                row.clear = r.status_code != 500 and isinstance(err, dict) and bool(err.get("message"))
                row.error = r.text[:300]
                return
            row.restored = r.headers.get("x-lpcache-restored") == "true"
            model, backend = str(doc.get("model")), r.headers.get("x-lpcache-slot", "").split(":")[0]
            row.model = ("gemma" if "gemma" in model else "smollm2") if model.endswith(".gguf") else (
                "gemma" if backend == "1" and done > self.swapped_at else "smollm2")
            try:
                row.answer, row.cache_n, row.prompt_n = read_answer(row.api, doc)
                row.answered = True
            except (KeyError, IndexError, TypeError, ValueError) as e:
                row.error = f"unreadable answer: {e!r}"
            return
        row.error = "no replica answered"


def _open_file(server: LlamaServer, folder: str, write: bool) -> str | None:
    """The name of a file of `folder` the server has open for writing (or reading), if any."""
    base = f"/proc/{server.process.pid if server.process else 0}"
    with contextlib.suppress(OSError):   # not running
        for fd in os.listdir(f"{base}/fd"):
            with contextlib.suppress(OSError):   # closed meanwhile
                if (path := os.readlink(f"{base}/fd/{fd}")).startswith(folder + "/"):
                    with open(f"{base}/fdinfo/{fd}") as f:
                        flags = re.search(r"flags:\s+(\d+)", f.read())
                    if flags is not None and (int(flags.group(1), 8) & 3 != 0) == write:
                        return os.path.basename(path)
    return None


def orphans(rig: Rig) -> list[str]:
    """The files of the slot folders that no meta file of either replica nor Redis entry names."""
    named = {n[:-len(".meta.json")] for d in rig.metas for n in os.listdir(d) if n.endswith(".meta.json")}
    assert rig.redis is not None
    with redis.Redis.from_url(rig.redis.url, decode_responses=True) as client:
        named |= {str(k) for ns in ("index", "sessions") for k in client.hkeys(f"lpcache:map:{ns}")}
    return sorted(f"{d}/{n}" for d in rig.dirs for n in os.listdir(d) if n != BALLAST and n not in named)


# ---- the checks after a run ----

def check(rows: list[Row], work: Path) -> dict[str, Any]:
    """Tokens, ideal and the reference answers of the answered rows, on clean servers of each model (slot 0)."""
    answered = [r for r in rows if r.answered]
    refs: dict[str, LlamaServer] = {}
    try:
        for model in sorted({r.model for r in answered}):
            refs[model] = llama(str(work / f"ref-{model}"), model)
        with httpx.Client(timeout=600) as c:
            for r in answered:
                url = refs[r.model].url
                prompt = c.post(f"{url}/apply-template", json=r.chat).json()["prompt"]
                r.tokens = c.post(f"{url}/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
            for r, ideal in zip(answered, ideal_of([r.tokens for r in answered], [r.model for r in answered]),
                                strict=True):
                r.ideal = ideal
            states: list[tuple[str, str, str, list[int]]] = []   # (model, lane, file, tokens) after each answer
            for n, r in enumerate(answered):
                url, k = refs[r.model].url, r.cache_n
                # The live slot held what an earlier answer left (resident, or its file restored): the reference's
                # own state after that answer, the conversation's own first, when it shares exactly cache_n tokens.
                found = [(lane, f) for m, lane, f, t in reversed(states) if m == r.model and shared(t, r.tokens) == k]
                src = next((x for x in found if x[0] == r.lane), found[0] if found else None)
                if k and src is not None:
                    c.post(f"{url}/slots/0?action=restore", json={"filename": src[1]}).raise_for_status()
                    r.split = "exact" if src[0] == r.lane else "restored"
                else:
                    c.post(f"{url}/slots/0?action=erase").raise_for_status()
                    if k:   # filled in one piece
                        c.post(f"{url}/completion", json={"prompt": r.tokens[:k], "n_predict": 0, "id_slot": 0,
                                                          "cache_prompt": True}).raise_for_status()
                    r.split = "approx" if k else "exact"
                doc = c.post(f"{url}/v1/chat/completions", json={
                    **r.chat, "max_tokens": MAX_TOKENS, "temperature": 0, "id_slot": 0, "cache_prompt": True,
                    "logprobs": True, "top_logprobs": 10}).json()
                c.post(f"{url}/slots/0?action=save", json={"filename": f"ref{n}"}).raise_for_status()
                steps = doc["choices"][0]["logprobs"]["content"]
                # The slot holds the prompt and the answer's tokens but the last (sampled, never decoded).
                states.append((r.model, r.lane, f"ref{n}", r.tokens + [t["id"] for t in steps][:-1]))
                r.ref_answer, ref_cache_n, _ = read_answer("chat", doc)
                r.split, r.verdict = r.split if ref_cache_n == k else "missed", "same"
                if r.ref_answer != r.answer:
                    live = c.post(f"{url}/tokenize", json={"content": r.answer}).json()["tokens"]
                    r.parted_at = i = shared(live, [t["id"] for t in steps])
                    if i < min(len(live), len(steps)):
                        top = {t["id"]: t["logprob"] for t in steps[i]["top_logprobs"]}
                        r.margin = round(steps[i]["logprob"] - top[live[i]], 4) if live[i] in top else None
                    elif i == len(live) < len(steps):
                        # The live text stops where the reference goes on: its next tokens are not in the text (the
                        # server's tool-call parser holds back a partial `<tool_call>`, or the answer ended), so
                        # the margin is the reference's pick over its runner-up there.
                        others = [t["logprob"] for t in steps[i]["top_logprobs"] if t["id"] != steps[i]["id"]]
                        r.margin = round(steps[i]["logprob"] - max(others), 4) if others else None
                    r.verdict = "near tie" if r.margin is not None and r.margin <= NEAR else "unexplained"
    finally:
        for server in refs.values():
            server.stop()
    parted = sorted((r for r in answered if r.verdict != "same"), key=lambda r: r.verdict != "unexplained")
    return {"compared": len(answered), "verdicts": dict(Counter(f"{r.split} {r.verdict}" for r in answered)),
            "examples": [{k: getattr(r, k) for k in ("round", "lane", "model", "cache_n", "split", "verdict",
                                                     "parted_at", "margin", "answer", "ref_answer")}
                         for r in parted[:10]]}


def ratio(rows: Sequence[Row]) -> float | None:
    ideal = sum(r.ideal for r in rows if r.answered)
    return round(sum(r.prompt_n for r in rows if r.answered) / ideal, 3) if ideal else None


def outcomes(rows: Sequence[Row]) -> dict[str, Any]:
    refused = [r for r in rows if r.status not in (0, 200, 500)]
    return {"requests": len(rows), "answered": sum(r.answered for r in rows),
            "refused": dict(Counter(str(r.status) for r in refused)),
            "unclear": sum(not r.clear for r in refused) + sum(r.status in (0, 200) and bool(r.error) for r in rows),
            "500s": sum(r.status == 500 for r in rows), "conn_errors_retried": sum(len(r.conn_errors) for r in rows),
            "wrong": sum(r.verdict == "unexplained" for r in rows),
            "near_ties": sum(r.verdict == "near tie" for r in rows)}


def log_lines(paths: Sequence[Path]) -> dict[str, Any]:
    """Warnings by event, and the errors and tracebacks, of every replica process of the run."""
    lines = [(p, line) for p in paths for line in p.read_text(errors="replace").splitlines()]
    events = Counter(m.group(1) for _, line in lines if (m := re.search(r" WARNING [\w.]+: (\S+)", line)))
    errors = [f"{p.name}: {line[:300]}" for p, line in lines
              if re.search(r" (ERROR|CRITICAL) ", line) or line.startswith("Traceback")]
    return {"warnings": dict(events.most_common()), "errors": errors[:20], "error_count": len(errors),
            "files": [str(p) for p in paths]}


def run(args: argparse.Namespace, faults: Sequence[str], rounds: int, say: Callable[[str], None]) -> dict[str, Any]:
    """One run: the rounds, the faults from `--first-fault` on, every `--spacing` rounds once each has happened;
    then the checks, while (after a run with faults) the orphan sweep has its grace period."""
    rng = random.Random(args.seed)
    left, nxt, done_at = list(faults), args.first_fault, None
    rows: list[Row] = []
    fired: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as folder:
        rig = Rig(Path(folder), args)
        started = time.time()
        try:
            rig.start()
            for r, jobs in enumerate(workload(args, rounds + args.spacing * 2)):   # spares: faults tried again
                if (done_at is not None and r > done_at + 2) or (not faults and r >= rounds):
                    break
                fault = left[0] if left and r >= nxt else None
                began, note = time.time(), ""
                if fault:
                    rig.begin(fault)
                with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                    list(pool.map(rig.send, jobs, [rng.randrange(2) for _ in jobs]))
                rows += jobs
                if fault and rig.end(fault, began):
                    assert rig.fired is not None
                    fired.append({"fault": fault, "round": r, "at_s": round(rig.fired.pop("at") - started, 1),
                                  **rig.fired})
                    left.pop(0)
                    nxt, done_at, note = r + args.spacing, (None if left else r), f" ({fault}: {fired[-1]['detail']})"
                elif fault:
                    note = f" ({fault}: not seen, tried again next round)"
                else:
                    rig.settle()
                say(f"round {r}{note}: {sum(j.answered for j in jobs)}/{len(jobs)} answered, "
                    f"{sum(j.restored for j in jobs)} restored, {time.time() - began:.1f} s")
            elapsed, ended, left_at_end = time.time() - started, time.time(), orphans(rig)
            checked = check(rows, Path(folder))
            say(f"  checked {checked['compared']} answers in {time.time() - ended:.0f} s: {checked['verdicts']}")
            if faults:   # the sweep's grace, then two of its periods (the check ran meanwhile)
                time.sleep(max(0.0, ended + args.grace + 2 * SWEEP_MIN_SECONDS + 10 - time.time()))
            left_after = orphans(rig)
        finally:
            rig.close()
    by_round: dict[int, list[Row]] = {}
    for row in rows:
        by_round.setdefault(row.round, []).append(row)
    edges = [f["round"] for f in fired] + [max(by_round) + 1]
    for i, f in enumerate(fired):
        r = f["round"]
        after = [ratio(by_round.get(r + k, [])) for k in (1, 2)]
        f.update(before=ratio([x for x in rows if (edges[i - 1] if i else 0) <= x.round < r]),
                 during=ratio(by_round[r]), after=after,
                 back_at_turn=next((k for k, v in enumerate(after, 1) if v is not None and v <= TARGET), None),
                 **outcomes([x for x in rows if r <= x.round < edges[i + 1]]))
    return {"rounds": len(by_round), "elapsed_s": round(elapsed, 1), "tmpfs": rig.tmpfs, "faults": fired,
            "faults_not_seen": left, "total": outcomes(rows), "x_ideal": ratio(rows),
            "per_round": {k: ratio(v) for k, v in by_round.items()}, "reference": checked,
            "orphans_at_end_of_rounds": left_at_end, "orphans": left_after, "logs": log_lines(rig.logs),
            "rows": [{k: v for k, v in asdict(r).items() if k not in ("body", "chat", "tokens")} for r in rows]}


# ---- the page ----

def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


def accepted(c: dict[str, Any]) -> dict[str, bool]:
    t = c["total"]
    return {"0 lpcache 500s": t["500s"] == 0, "0 wrong answers": t["wrong"] == 0,
            "every request answered or refused with a clear status": t["unclear"] == 0,
            "0 orphan files after the grace period": c["orphans"] == [],
            "back within 1.1x the ideal within two turns after each fault":
                all(f["back_at_turn"] for f in c["faults"]) and not c["faults_not_seen"]}


def markdown(report: dict[str, Any]) -> str:
    c, b, s, t = report["chaos"], report.get("baseline"), report["settings"], report["chaos"]["total"]
    lines = [START, "", "### The last run", "",
             f"{report['machine']}. Workload: {report['workload']}. {c['rounds']} rounds, a fault from round "
             f"{s['first_fault']} on every {s['spacing']} rounds; both replicas with `BIG_THRESHOLD_WORDS="
             f"{s['big_words']}` (every request saved), `META_MAX={LIMITS['META_MAX']}`, `META_MAX_GIB="
             f"{LIMITS['META_MAX_GIB']}`, `ORPHAN_GRACE_SECONDS={s['grace']}`, `LOG_LEVEL=INFO`. The "
             f"chaos rounds took {c['elapsed_s'] / 60:.1f} minutes, the whole run (checks and baseline included) "
             f"{report['minutes']:.1f}. `make bench` runs it; `python bench/chaos_scenario.py` alone.", "",
             table(["fault", "round", "what was hit", "answered", "refused", "500s", "conn. errors", "wrong",
                    "near ties", "x ideal before", "fault round", "turn +1", "turn +2", "≤ 1.1x at"],
                   [[FAULTS[f["fault"]], f["round"], f["detail"], f["answered"], _counts(f["refused"]), f["500s"],
                     f["conn_errors_retried"], f["wrong"], f["near_ties"], _fmt(f["before"]), _fmt(f["during"]),
                     _fmt(f["after"][0]), _fmt(f["after"][1]),
                     f"turn {f['back_at_turn']}" if f["back_at_turn"] else "NO"] for f in c["faults"]]), ""]
    if c["faults_not_seen"]:
        lines += [f"Faults never triggered: {', '.join(c['faults_not_seen'])}.", ""]
    lines += [f"In all: {t['requests']} requests, {t['answered']} answered, refused {_counts(t['refused'])} "
              f"(unclear: {t['unclear']}), {t['500s']} 500s, {t['conn_errors_retried']} connection errors retried "
              f"on the other replica; tokens computed / ideal {_fmt(c['x_ideal'])} over the run. Files no index "
              f"names: {len(c['orphans_at_end_of_rounds'])} when the rounds ended, {len(c['orphans'])} after "
              f"{s['grace']} s of grace and two sweep periods ({SWEEP_MIN_SECONDS:.0f} s each) more.", "",
              f"Answers against the reference ({c['reference']['compared']} compared, by split and verdict): "
              f"{_counts(c['reference']['verdicts'])}." + ("" if b is None else f" The fault-free baseline ("
                                                         f"{b['rounds']} rounds, tokens / ideal {_fmt(b['x_ideal'])}): "
                                                         f"{_counts(b['reference']['verdicts'])}."), ""]
    lines += [f"- round {e['round']} {e['lane']} ({e['model']}, cache_n {e['cache_n']}, {e['split']}, {e['verdict']} "
              f"at token {e['parted_at']}, margin {e['margin']}): {e['answer'][:40]!r} vs {e['ref_answer'][:40]!r}"
              for e in c["reference"]["examples"][:5]]
    lines += ["", "Acceptance: " + "; ".join(f"{k}: {'met' if v else '**NOT met**'}"
                                             for k, v in accepted(c).items()) + ".", "",
              "The replicas' warnings: " + _counts(dict(list(c["logs"]["warnings"].items())[:14]))
              + f"; errors and tracebacks: {c['logs']['error_count']}.", "",
              f"Run: {report['at']}, commit {report['commit']}, 1-minute load {report['load_1m'][0]} at the start, "
              f"{report['load_1m'][1]} at the end (other work on the machine slows the rounds).", "", END]
    return "\n".join(lines)


OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("users", 2, "story users"), ("first-words", 300, "words of a story's start"),
    ("part-words", 40, "words a story grows by each round"), ("agents", 2, "agent lanes (a session at a time each)"),
    ("agent-steps", 5, "tool exchanges of an agent session"), ("concurrency", 2, "requests at a time"),
    ("seed", 1, "the workload's and the replica choice's"), ("first-fault", 2, "the first fault's round"),
    ("spacing", 3, "rounds from a fault to the next (two clean turns: 3)"), ("grace", 20, "ORPHAN_GRACE_SECONDS"),
    ("disk-full-s", 25.0, "how long the slot disk stays full"), ("tmpfs-mib", 2048, "server 0's slot tmpfs"),
    ("baseline-rounds", 4, "the fault-free run (0: none)"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    for name, default, text in OPTIONS:
        ap.add_argument(f"--{name}", type=type(default), default=default, help=text)
    ap.add_argument("--kinds", type=lambda s: s.split(","), default=["generate", "annotate"], help="story kinds")
    ap.add_argument("--faults", default=",".join(FAULTS), help="among " + ",".join(FAULTS) + ", in this order")
    ap.add_argument("--big-words", default="100", help="BIG_THRESHOLD_WORDS (100: every request here is saved)")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if set(faults) - set(FAULTS):
        ap.error(f"unknown faults {sorted(set(faults) - set(FAULTS))}")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started, load = time.time(), os.getloadavg()[0]
    binary, gguf = llama_paths()
    gemma_path()   # fetched before the run, not during its fault
    say(f"chaos: {len(faults)} faults from round {args.first_fault}, one every {args.spacing} rounds")
    chaos = run(args, faults, args.first_fault + args.spacing * len(faults), say)
    baseline = None
    if args.baseline_rounds:
        say(f"baseline: {args.baseline_rounds} rounds of the same workload without faults")
        baseline = run(args, [], args.baseline_rounds, say)
    commit = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h"], capture_output=True, text=True)
    report = {"machine": llama_machine_text(binary, gguf), "at": time.strftime("%Y-%m-%d %H:%M"),
              "commit": commit.stdout.strip(), "minutes": round((time.time() - started) / 60, 2),
              "load_1m": [round(load, 1), round(os.getloadavg()[0], 1)],
              "workload": f"{args.users} story users x {len(args.kinds)} kinds ({args.first_words} words growing "
                          f"by {args.part_words} a round) and {args.agents} agent lanes (sessions of "
                          f"{args.agent_steps} tool exchanges on one harness), a turn of each a round, "
                          f"{args.concurrency} at a time, {MAX_TOKENS} tokens an answer, temperature 0",
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "no_docs")},
              "chaos": chaos, "baseline": baseline}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if not args.no_docs:
        replace_section(DOC, START, END, markdown(report))
    say(markdown(report))
    ok, keep = all(accepted(chaos).values()), os.environ.get("BENCH_KEEP")
    for path in chaos["logs"]["files"] + (baseline["logs"]["files"] if baseline else []):
        if ok and not keep:   # kept for a look at a failure, or when asked
            Path(path).unlink(missing_ok=True)
    if not ok or keep:
        say("the replicas' logs: " + ", ".join(chaos["logs"]["files"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
