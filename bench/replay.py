"""Replay a seeded, realistic multi-user workload against any OpenAI-compatible URL, and measure it.

Several users each write one growing story; each story gets several kinds of work (generation, annotation, redraft,
summary), as `lpcache.workloads.story.turns` builds them, round by round. The requests of one round may run
concurrently, the rounds run in order, and a command (or a Python callable) may run between rounds, for example to
restart llama-server; the replay then waits until the URL answers `/health` again.

For each request it records the prompt tokens (`timings.prompt_n + cache_n`), the tokens computed (`prompt_n`) and
taken from the cache (`cache_n`), the time to the first token (streams: to the first content delta; JSON: the whole
answer) and the total time. It computes the ideal, the prompt tokens no earlier prompt shared as a token prefix
(`/apply-template` and `/tokenize` of llama-server, or of lpcache, which forwards them), over all earlier prompts
(`ideal`) and over the earlier prompts of the same session (`ideal_session`), and sums it all up: tokens computed
over the ideal, median and p90 time to first token, elapsed time, bytes of slot files written (read from lpcache's
`/metrics`; 0 for anything else: llama-server alone writes none) and the size of the slot-save folders at the end.
Behind LiteLLM, which drops `timings`, `--llama-metrics URL` reads the computed tokens from llama-server's own
`/metrics` (started with `--metrics`).

Run:   python bench/replay.py --url http://127.0.0.1:8081 [--users 3] [--kinds generate,annotate,redraft,summary]
       [--rounds 4] [--first-words 300] [--part-words 50] [--seed 1] [--concurrency 1] [--stream]
       [--session-header] [--between CMD] [--wait-url URL] [--tokenize-url URL] [--slot-dir DIR]
       [--llama-metrics URL] [--model smollm2] [--max-tokens 8] [--header 'Name: value'] [--api-key KEY]
       [--json FILE]
Exit status: 0 when every request succeeded, 1 when some failed, 2 when the replay could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import httpx

from lpcache.workloads.story import KINDS, Turn, ideal_of, tokenize_all, turns

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import percentile, sse_lines, table  # noqa: E402

Sample = tuple[str, dict[str, str]]   # a metric's name and the labels its samples must have
LPCACHE_SAVE_BYTES: Sample = ("lpcache_slot_file_bytes_total", {"action": "save"})
LPCACHE_BACKGROUND_BYTES: Sample = ("lpcache_background_save_bytes_total", {})
LLAMA_COMPUTED: Sample = ("llamacpp:prompt_tokens_total", {})
POLL_S = 0.1


class ReplayError(Exception):
    """An expected failure (a URL that does not answer, a failed between command): one line, no traceback."""


@dataclass
class Row:
    """One request as the replay saw it."""

    user: int
    kind: str
    round: int
    session: str
    status: int = 0                    # the HTTP status; 0: no answer
    prompt_tokens: int | None = None   # prompt_n + cache_n (usage.prompt_tokens when the answer has no timings)
    prompt_n: int | None = None        # computed by the server
    cache_n: int | None = None         # taken from its cache
    ttft_s: float | None = None        # streams: to the first content delta; JSON: the whole answer
    total_s: float | None = None
    tokens: int | None = None          # the prompt's length by /apply-template and /tokenize
    ideal: int | None = None           # tokens no earlier prompt shared as a prefix
    ideal_session: int | None = None   # tokens no earlier prompt of the same session shared as a prefix
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.status != 200 or self.error is not None


@dataclass
class Report:
    rows: list[Row]
    summary: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "rows": [asdict(r) for r in self.rows]}

    def print(self, file: IO[str] | None = None) -> None:
        out = file or sys.stdout
        s = self.summary
        print(f"replay of {s['requests']} requests ({s['users']} users x {s['kinds']} kinds x {s['rounds']} rounds, "
              f"concurrency {s['concurrency']}, {'stream' if s['stream'] else 'JSON'}) to {s['url']}: "
              f"{s['errors']} failed, {s['elapsed_s']:.2f} s", file=out)
        ratio = "-" if s["computed_over_ideal"] is None else f"{s['computed_over_ideal']:.3f}"
        print(f"  prompt tokens {_n(s['prompt_tokens'])}, computed {_n(s['computed'])}"
              f"{' (llama-server /metrics)' if s['computed_source'] == 'llama_metrics' else ''}, "
              f"ideal {_n(s['ideal'])} (per session {_n(s['ideal_session'])}): computed / ideal {ratio}", file=out)
        print(f"  time to first token p50 {_s(s['ttft_p50'])}, p90 {_s(s['ttft_p90'])}", file=out)
        print(f"  slot files written {_bytes(s['bytes_written'])}, slot folders at the end "
              f"{_bytes(s['folder_bytes'])}", file=out)
        order = list(KINDS)
        kinds = sorted({r.kind for r in self.rows}, key=lambda k: (order.index(k) if k in order else len(order), k))
        if len(kinds) > 1:
            lines = []
            for kind in kinds:
                rows = [r for r in self.rows if r.kind == kind]
                lines.append([kind, len(rows), _sum(r.prompt_tokens for r in rows), _sum(r.prompt_n for r in rows),
                              _sum(r.ideal for r in rows), _s(_pct([r.ttft_s for r in rows if not r.failed], 50))])
            print(table(["kind", "requests", "prompt tokens", "computed", "ideal", "ttft p50"], lines), file=out)


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _bytes(value: int) -> str:
    return f"{value / 1e6:,.1f} MB" if value >= 100_000 else f"{value:,} B"


def _sum(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _pct(values: Sequence[float | None], q: float) -> float | None:
    present = [v for v in values if v is not None]
    return round(percentile(present, q), 4) if present else None


# ---- URLs, metrics, folders ----

def base_url(url: str) -> str:
    """The server's root: an OpenAI base URL ending in /v1 is accepted too."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _describe(exc: Exception) -> str:
    """One line: httpx's messages about a status run over several."""
    if isinstance(exc, httpx.HTTPStatusError):
        r = exc.response
        text = " ".join(r.text.split())[:200]
        return f"{r.request.method} {r.request.url.path} answered {r.status_code}" + (f": {text}" if text else "")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The sum of a metric's samples (those with all of `labels`) in Prometheus text; None when it has none."""
    total = None
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if labels and any(have.get(k) != v for k, v in labels.items()):
            continue
        try:
            total = (total or 0.0) + float(m.group(3))
        except ValueError:
            continue
    return total


def samples(text: str, keep: Callable[[str], bool] = lambda name: True) -> dict[str, float]:
    """Every sample of Prometheus text whose metric name `keep` accepts, as `name{labels}` (labels as written,
    sorted) -> value: what a server exposes at run time, without a list of names to keep up to date."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#") or not keep(m.group(1)):
            continue
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[m.group(1) + (f"{{{labels}}}" if labels else "")] = float(m.group(3))
        except ValueError:
            continue
    return out


def folder_bytes(dirs: Sequence[str]) -> int:
    total = 0
    for top in dirs:
        for root, _, files in os.walk(top):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:  # deleted meanwhile (pruning)
                    pass
    return total


class Counters:
    """lpcache's bytes written and llama-server's computed tokens, summed over the stretches between restarts. The
    requests may go to several fronts (lpcache replicas, or llama-servers a client spreads its requests over): the
    bytes are summed over those that are lpcache, and each of them is waited for at the end of a stretch."""

    def __init__(self, client: httpx.Client, urls: Sequence[str], llama_urls: Sequence[str]) -> None:
        self.client, self.llama_urls = client, list(llama_urls)
        self.fronts = []
        for u in dict.fromkeys(urls):
            text = self._metrics(u, required=False)
            if text is not None and "lpcache_slots_busy" in text:
                self.fronts.append(u)
        self.lpcache = bool(self.fronts)
        for u in self.llama_urls:
            text = self._metrics(u, required=True)
            if text is None or metric(text, *LLAMA_COMPUTED) is None:
                raise ReplayError(f"{u}/metrics has no {LLAMA_COMPUTED[0]}: is it llama-server started with "
                                  "--metrics?")
        self.bytes_written = 0
        self.llama_computed = 0
        self._start: tuple[int, int] | None = None

    def _metrics(self, url: str, required: bool) -> str | None:
        try:
            r = self.client.get(f"{url}/metrics")
        except httpx.HTTPError as exc:
            if required:
                raise ReplayError(f"{url}/metrics does not answer ({_describe(exc)})") from None
            return None
        if r.status_code != 200:
            if required:
                raise ReplayError(f"{url}/metrics answered {r.status_code}: start llama-server with --metrics")
            return None
        return r.text

    def sample(self) -> tuple[int, int]:
        written = 0
        for u in self.fronts:
            text = self._metrics(u, required=True) or ""
            written += int(sum(metric(text, *m) or 0 for m in (LPCACHE_SAVE_BYTES, LPCACHE_BACKGROUND_BYTES)))
        computed = 0
        for u in self.llama_urls:
            computed += int(metric(self._metrics(u, required=True) or "", *LLAMA_COMPUTED) or 0)
        return written, computed

    def start(self) -> None:
        self._start = self.sample()

    def stop(self, timeout: float) -> None:
        """Wait until lpcache has saved what it saves after the answers, then add what this stretch counted."""
        assert self._start is not None
        self.settle(timeout)
        end = self.sample()
        (w0, c0), (w1, c1) = self._start, end
        self.bytes_written += w1 - w0 if w1 >= w0 else w1   # a counter that went down was restarted
        self.llama_computed += c1 - c0 if c1 >= c0 else c1
        self._start = None

    def settle(self, timeout: float) -> None:
        """lpcache keeps a slot busy until its save is done and counts the bytes as it releases it."""
        deadline = time.monotonic() + timeout
        for u in self.fronts:
            while True:
                text = self._metrics(u, required=True) or ""
                if not metric(text, "lpcache_slots_busy") and not metric(text, "lpcache_waiting_requests"):
                    break
                if time.monotonic() > deadline:
                    raise ReplayError(f"{u} still had busy slots {timeout:g} s after the last answer")
                time.sleep(POLL_S)


def wait_ready(client: httpx.Client, urls: Sequence[str], timeout: float, after: str,
               say: Callable[[str], None] = lambda _: None) -> None:
    """Poll each URL's /health until it answers below 500 (llama-server answers 503 while it loads a model)."""
    deadline = time.monotonic() + timeout
    for url in urls:
        told = False
        while True:
            try:
                status = client.get(f"{url}/health", timeout=10).status_code
                if status < 500:
                    break
                last = f"it answered {status}"
            except httpx.HTTPError as exc:
                last = _describe(exc)
            if time.monotonic() > deadline:
                raise ReplayError(f"{url} did not answer /health {after} within {timeout:g} s ({last})")
            if not told:
                say(f"waiting for {url}/health {after} ({last}), at most {timeout:g} s")
                told = True
            time.sleep(POLL_S)


def check_up(client: httpx.Client, url: str, timeout: float, say: Callable[[str], None]) -> None:
    """At start: a URL that refuses the connection fails at once; one that is loading is waited for."""
    try:
        client.get(f"{url}/health", timeout=10)
    except httpx.HTTPError as exc:
        raise ReplayError(f"{url} does not answer ({_describe(exc)})") from None
    wait_ready(client, [url], timeout, "at start", say)


def run_between(between: str | Callable[[], Any], round_index: int) -> None:
    if callable(between):
        between()
        return
    env = {**os.environ, "REPLAY_ROUND": str(round_index)}
    code = subprocess.run(between, shell=True, env=env).returncode
    if code:
        raise ReplayError(f"the between command exited with status {code}: {between}")


# ---- requests ----

def read_sse(lines: Iterator[str], start: float, row: Row) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Read a chat stream to its end: the time of the first content delta, and the last timings and usage."""
    timings: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("error") is not None:
            error = event["error"]
            row.error = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
        if row.ttft_s is None:
            for choice in event.get("choices") or []:
                delta = (choice.get("delta") or {}) if isinstance(choice, dict) else {}
                if delta.get("content") or delta.get("reasoning_content"):
                    row.ttft_s = time.perf_counter() - start
                    break
        if isinstance(event.get("timings"), dict):
            timings = event["timings"]
        if isinstance(event.get("usage"), dict):
            usage = event["usage"]
    return timings, usage


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def send(client: httpx.Client, url: str, turn: Turn, body: dict[str, Any], stream: bool,
         session_header: bool) -> Row:
    row = Row(turn.user, turn.kind, turn.turn, turn.session)
    headers = {"X-Session-ID": turn.session} if session_header else {}
    payload = {**body, "messages": turn.messages}
    timings: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    try:
        if stream:
            payload |= {"stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", f"{url}/v1/chat/completions", json=payload, headers=headers) as r:
                row.status = r.status_code
                if r.status_code == 200:
                    timings, usage = read_sse(sse_lines(r.iter_bytes()), start, row)
                else:
                    r.read()
                    row.error = r.text[:300] or f"HTTP {r.status_code}"
        else:
            r = client.post(f"{url}/v1/chat/completions", json=payload, headers=headers)
            row.status = r.status_code
            if r.status_code == 200:
                answer = r.json()
                timings, usage = answer.get("timings"), answer.get("usage")
            else:
                row.error = r.text[:300] or f"HTTP {r.status_code}"
    except (httpx.HTTPError, ValueError) as exc:
        row.error = _describe(exc)[:300]
    row.total_s = time.perf_counter() - start
    if row.ttft_s is None and not stream:
        row.ttft_s = row.total_s
    elif row.ttft_s is None and row.status == 200:
        row.ttft_s = row.total_s  # a stream without content (max_tokens 0)
    if isinstance(timings, dict):
        row.prompt_n, row.cache_n = _count(timings.get("prompt_n")), _count(timings.get("cache_n"))
        if row.prompt_n is not None and row.cache_n is not None:
            row.prompt_tokens = row.prompt_n + row.cache_n
    if row.prompt_tokens is None and isinstance(usage, dict):
        row.prompt_tokens = _count(usage.get("prompt_tokens"))
    return row


def rounds_of(workload: Sequence[Turn]) -> list[list[Turn]]:
    """The workload cut where its round number changes, in its order."""
    out: list[list[Turn]] = []
    for t in workload:
        if out and out[-1][-1].turn == t.turn:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def run_round(clients: queue.Queue[httpx.Client], urls: Sequence[str], group: Sequence[Turn],
              body: dict[str, Any], concurrency: int, stream: bool, session_header: bool) -> list[Row]:
    """`urls[i]` is where `group[i]` goes."""
    def one(turn: Turn, url: str) -> Row:
        client = clients.get()
        try:
            return send(client, url, turn, body, stream, session_header)
        finally:
            clients.put(client)

    if concurrency == 1:
        return [one(t, u) for t, u in zip(group, urls, strict=True)]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="replay") as pool:
        return list(pool.map(one, group, urls))   # in the workload's order, at most `concurrency` at once


# ---- the replay ----

def replay(url: str, workload: Sequence[Turn], *, concurrency: int = 1, stream: bool = False,
           session_header: bool = False, between: str | Callable[[], Any] | None = None,
           tokenize_url: str | None = None, slot_dirs: Sequence[str] = (), model: str = "smollm2",
           max_tokens: int = 8, headers: Mapping[str, str] | None = None, llama_metrics_urls: Sequence[str] = (),
           wait_urls: Sequence[str] | None = None, health_timeout: float = 300.0, timeout: float = 600.0,
           targets: Sequence[str] | None = None, progress: Callable[[str], None] | None = None) -> Report:
    """Send `workload` to `url` round by round and measure it (see the module's docstring).

    `between` runs after each round but the last: a shell command (with REPLAY_ROUND set to the next round's index)
    or a callable; then the replay waits until `url` and every `wait_urls` (default: `llama_metrics_urls` and
    `tokenize_url`) answer /health, at most `health_timeout` seconds. Raises ReplayError for expected failures;
    a request that fails is a row with its status and error, and counts in `summary["errors"]`.
    """
    if concurrency < 1:
        raise ReplayError(f"concurrency must be at least 1, got {concurrency}")
    if not workload:
        raise ReplayError("the workload is empty")
    for d in slot_dirs:
        if not os.path.isdir(d):
            raise ReplayError(f"slot folder {d} is not an existing directory")
    if targets is not None and len(targets) != len(workload):
        raise ReplayError(f"{len(targets)} targets for {len(workload)} requests")
    url = base_url(url)
    sent_to = [base_url(t) for t in targets] if targets is not None else [url] * len(workload)
    fronts = list(dict.fromkeys(sent_to))
    tok_url = base_url(tokenize_url) if tokenize_url else url
    llama_urls = [base_url(u) for u in llama_metrics_urls]
    waits = [base_url(u) for u in wait_urls] if wait_urls is not None else [
        *llama_urls, *([tok_url] if tok_url != url else [])]
    say = progress or (lambda _: None)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    with httpx.Client(timeout=timeout, headers=dict(headers or {}), limits=limits) as control:
        for front in dict.fromkeys([url, *fronts]):
            check_up(control, front, health_timeout, say)
        if tok_url != url:
            check_up(control, tok_url, health_timeout, say)
        try:
            tokens = tokenize_all(tok_url, workload, control)
        except (httpx.HTTPError, ValueError) as exc:
            raise ReplayError(f"cannot tokenise the prompts at {tok_url} ({_describe(exc)}); --tokenize-url "
                              "should name llama-server or lpcache") from None
        ideal = ideal_of(tokens)
        ideal_session = ideal_of(tokens, [t.session for t in workload])
        counters = Counters(control, fronts, llama_urls)
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        clients: queue.Queue[httpx.Client] = queue.Queue()
        for _ in range(concurrency):
            clients.put(httpx.Client(timeout=timeout, headers=dict(headers or {})))
        rows: list[Row] = []
        groups = rounds_of(workload)
        between_s = 0.0
        started = time.perf_counter()
        sent = 0
        try:
            for i, group in enumerate(groups):
                if i and between is not None:
                    t0 = time.perf_counter()
                    run_between(between, i)
                    wait_ready(control, list(dict.fromkeys([url, *fronts, *waits])), health_timeout,
                               "after the between command", say)
                    between_s += time.perf_counter() - t0
                if i == 0 or between is not None:
                    counters.start()
                t0 = time.perf_counter()
                done = run_round(clients, sent_to[sent:sent + len(group)], group, body, concurrency, stream,
                                 session_header)
                sent += len(group)
                rows += done
                say(f"round {i + 1}/{len(groups)}: {len(done)} requests, "
                    f"{sum(r.failed for r in done)} failed, {time.perf_counter() - t0:.2f} s")
                if i == len(groups) - 1 or between is not None:
                    counters.stop(health_timeout)
        finally:
            while not clients.empty():
                clients.get().close()
        elapsed = time.perf_counter() - started
    for row, n, g, s in zip(rows, tokens, ideal, ideal_session, strict=True):
        row.tokens, row.ideal, row.ideal_session = len(n), g, s
    return Report(rows, summarise(rows, url, workload, concurrency, stream, session_header, elapsed, between_s,
                                  counters, llama_urls, slot_dirs))


def summarise(rows: Sequence[Row], url: str, workload: Sequence[Turn], concurrency: int, stream: bool,
              session_header: bool, elapsed: float, between_s: float, counters: Counters,
              llama_urls: Sequence[str], slot_dirs: Sequence[str]) -> dict[str, Any]:
    from_timings = _sum(r.prompt_n for r in rows)
    llama_computed = counters.llama_computed if llama_urls else None
    computed = from_timings if from_timings is not None else llama_computed
    ideal = sum(r.ideal or 0 for r in rows)
    ttfts = [r.ttft_s for r in rows if not r.failed]
    return {
        "url": url,
        "requests": len(rows),
        "errors": sum(r.failed for r in rows),
        "users": len({t.user for t in workload}),
        "kinds": len({t.kind for t in workload}),
        "rounds": len({t.turn for t in workload}),
        "concurrency": concurrency,
        "stream": stream,
        "session_header": session_header,
        "prompt_tokens": _sum(r.prompt_tokens for r in rows),
        "tokenized": sum(r.tokens or 0 for r in rows),
        "computed": computed,
        "computed_source": None if computed is None else "timings" if from_timings is not None else "llama_metrics",
        "llama_computed": llama_computed,
        "ideal": ideal,
        "ideal_session": sum(r.ideal_session or 0 for r in rows),
        "computed_over_ideal": round(computed / ideal, 4) if computed is not None and ideal else None,
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p90": _pct(ttfts, 90),
        "elapsed_s": round(elapsed, 3),
        "between_s": round(between_s, 3),
        "bytes_written": counters.bytes_written,
        "folder_bytes": folder_bytes(slot_dirs),
    }


# ---- command line ----

def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown kind {', '.join(unknown) or '(none)'}; choose from "
                                         f"{', '.join(KINDS)}")
    return kinds


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Replay a seeded multi-user workload against an OpenAI-compatible URL "
                                "and compare the tokens computed with the ideal.")
    p.add_argument("--url", required=True, help="the server: lpcache, llama-server, LiteLLM (a /v1 suffix is fine)")
    w = p.add_argument_group("workload")
    w.add_argument("--users", type=_positive, default=3)
    w.add_argument("--kinds", type=_kinds, default=tuple(KINDS),
                   help=f"comma-separated, from {','.join(KINDS)} (default: all)")
    w.add_argument("--rounds", "--turns", dest="rounds", type=_positive, default=4, help="turns of each kind")
    w.add_argument("--first-words", type=_positive, default=300, help="words of each story's first part")
    w.add_argument("--part-words", type=_positive, default=50, help="words each round adds to a story")
    w.add_argument("--seed", type=int, default=1)
    r = p.add_argument_group("requests")
    r.add_argument("--concurrency", type=_positive, default=1, help="requests of a round at once")
    r.add_argument("--stream", action="store_true", help="stream the answers (SSE): real time to first token")
    r.add_argument("--session-header", action="store_true", help="send X-Session-ID (lpcache's session mode)")
    r.add_argument("--model", default="smollm2")
    r.add_argument("--max-tokens", type=int, default=8)
    r.add_argument("--header", type=_header, action="append", default=[], metavar="'NAME: VALUE'")
    r.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    m = p.add_argument_group("between rounds and measurements")
    m.add_argument("--between", metavar="CMD", help="shell command run after each round but the last "
                   "(REPLAY_ROUND = the next round's index), e.g. a restart of llama-server")
    m.add_argument("--wait-url", action="append", default=None, metavar="URL",
                   help="also wait for this server's /health after --between (default: --llama-metrics and "
                   "--tokenize-url servers)")
    m.add_argument("--health-timeout", type=float, default=300.0, help="seconds to wait for /health")
    m.add_argument("--tokenize-url", metavar="URL", help="where /apply-template and /tokenize are (default --url; "
                   "give llama-server's or lpcache's URL when --url is LiteLLM)")
    m.add_argument("--slot-dir", action="append", default=[], metavar="DIR", help="slot-save folder to measure")
    m.add_argument("--llama-metrics", action="append", default=[], metavar="URL",
                   help="llama-server started with --metrics: read its computed prompt tokens")
    p.add_argument("--json", metavar="FILE", help="write rows and summary as JSON ('-': standard output)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on standard error")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    headers = dict(args.header)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    workload = turns(args.users, args.kinds, args.rounds, args.first_words, args.part_words, args.seed)
    try:
        report = replay(args.url, workload, concurrency=args.concurrency, stream=args.stream,
                        session_header=args.session_header, between=args.between, tokenize_url=args.tokenize_url,
                        slot_dirs=args.slot_dir, model=args.model, max_tokens=args.max_tokens, headers=headers,
                        llama_metrics_urls=args.llama_metrics, wait_urls=args.wait_url,
                        health_timeout=args.health_timeout, timeout=args.timeout,
                        progress=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True))
    except ReplayError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("replay: interrupted", file=sys.stderr)
        return 130
    report.print(sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        text = json.dumps(report.as_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
            except OSError as exc:
                print(f"replay: cannot write {args.json}: {exc}", file=sys.stderr)
                return 2
    return 1 if report.summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
