"""Send agent sessions (`lpcache.workloads.agents`) to a server through the Responses and Messages APIs, and measure
them.

Each session is an agent's tool loop: its next request is sent when the answer to the previous one has ended
(zero tool time), and `concurrency` requests are in flight at most. Sessions take turns: a queue holds the sessions
whose next request is ready, first come first served, so with more sessions than slots a session's next request
usually finds its slot holding another session. Every request is streamed, on a new connection (llama-server
closes a connection after a stream).

Per request it records: the prompt tokens computed, from the answer's usage (Responses: `input_tokens` −
`input_tokens_details.cached_tokens`; Messages: `input_tokens`, already without `cache_read_input_tokens`) and,
where the answer has them, `timings.prompt_n`; the prompt's size (computed + cached); the time to the first content
event (Responses: an output item or a delta; Messages: a content block; else the end of the stream) and the total
time. The ideal is the prompt tokens no earlier request shared as a token prefix: the harness once, then each
request's new tokens. The prompts are counted on llama-server itself: the chat-completions body it makes of each
request (`Session.chat`) through `/apply-template` and `/tokenize`, checked against the API's own token count
(`/v1/responses/input_tokens`, `/v1/messages/count_tokens`) for every request.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from lpcache.workloads.agents import API_PATHS, Session
from lpcache.workloads.story import ideal_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import percentile, sse_lines  # noqa: E402

COUNT_PATHS = {"responses": "/v1/responses/input_tokens", "messages": "/v1/messages/count_tokens"}
FIRST_CONTENT = frozenset({"response.output_item.added", "response.output_text.delta",
                           "response.reasoning_text.delta", "response.function_call_arguments.delta",
                           "content_block_start", "content_block_delta"})
LAST = frozenset({"response.completed", "message_stop"})


@dataclass
class AgentRow:
    session: int
    api: str
    turn: int
    status: int = 0
    computed: int | None = None      # from usage
    cached: int | None = None
    prompt_n: int | None = None      # timings.prompt_n, when the answer has timings
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int | None = None        # the prompt's length, counted on llama-server
    ideal: int | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.status != 200 or self.error is not None


def prompt_tokens(server: str, sessions: Sequence[Session]) -> dict[tuple[int, int], list[int]]:
    """Each request's prompt tokens by (session, turn), from llama-server's /apply-template and /tokenize of its
    chat-completions form; raises RuntimeError when that count differs from the API's own count."""
    out = {}
    with httpx.Client(timeout=120) as c:
        for s in sessions:
            for turn in range(s.turns):
                r = c.post(f"{server}/apply-template", json=s.chat(turn))
                r.raise_for_status()
                r = c.post(f"{server}/tokenize", json={"content": r.json()["prompt"], "add_special": True})
                r.raise_for_status()
                tokens = [int(t) for t in r.json()["tokens"]]
                r = c.post(f"{server}{COUNT_PATHS[s.api]}", json=s.body(turn))
                r.raise_for_status()
                if r.json().get("input_tokens") != len(tokens):
                    raise RuntimeError(f"session {s.index} turn {turn}: {COUNT_PATHS[s.api]} counts "
                                       f"{r.json().get('input_tokens')} tokens, its chat form {len(tokens)}")
                out[(s.index, turn)] = tokens
    return out


def _read_stream(lines: Iterator[str], start: float, row: AgentRow) -> None:
    usage: dict[str, Any] | None = None
    for line in lines:
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:].strip())
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        if kind == "error" or (kind is None and event.get("error") is not None):
            error = event.get("error")
            row.error = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
        if row.ttft_s is None and (kind in FIRST_CONTENT or kind in LAST):
            row.ttft_s = time.perf_counter() - start
        if kind == "message_start":
            usage = (event.get("message") or {}).get("usage")
        elif kind == "response.completed":
            usage = (event.get("response") or {}).get("usage")
        if isinstance(event.get("timings"), dict):
            prompt_n = event["timings"].get("prompt_n")
            row.prompt_n = prompt_n if isinstance(prompt_n, int) else row.prompt_n
    if not isinstance(usage, dict):
        row.error = row.error or "no usage in the stream"
        return
    if row.api == "responses":
        details = usage.get("input_tokens_details") or {}
        row.cached = int(details.get("cached_tokens") or 0)
        row.computed = int(usage["input_tokens"]) - row.cached
    else:
        row.cached = int(usage.get("cache_read_input_tokens") or 0)
        row.computed = int(usage["input_tokens"])


def send(url: str, session: Session, turn: int, max_tokens: int, timeout: float) -> AgentRow:
    """One streamed request on a connection of its own."""
    row = AgentRow(session.index, session.api, turn)
    start = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0)) as client, \
                client.stream("POST", url + API_PATHS[session.api],
                              json=session.body(turn, max_tokens=max_tokens, stream=True)) as r:
            row.status = r.status_code
            if r.status_code == 200:
                _read_stream(sse_lines(r.iter_bytes()), start, row)
            else:
                r.read()
                row.error = r.text[:300] or f"HTTP {r.status_code}"
    except Exception as exc:   # any failure is this request's error; the other sessions go on
        row.error = f"{type(exc).__name__}: {exc}"[:300]
    row.total_s = time.perf_counter() - start
    if row.ttft_s is None and row.status == 200:
        row.ttft_s = row.total_s
    return row


def run_sessions(url: str, sessions: Sequence[Session], *, concurrency: int, max_tokens: int = 16,
                 timeout: float = 600.0, progress: Callable[[str], None] | None = None) -> list[AgentRow]:
    """Every turn of every session, sessions taking turns (first ready, first sent), `concurrency` at a time."""
    ready: queue.Queue[tuple[Session, int] | None] = queue.Queue()
    for s in sessions:
        ready.put((s, 0))
    rows: list[AgentRow] = []
    lock = threading.Lock()
    left = [sum(s.turns for s in sessions)]

    def worker() -> None:
        while (item := ready.get()) is not None:
            session, turn = item
            row = send(url, session, turn, max_tokens, timeout)
            with lock:
                rows.append(row)
                left[0] -= 1
                done = len(rows)
                if progress and done % 10 == 0:
                    progress(f"{done} requests answered")
                if turn + 1 < session.turns:
                    ready.put((session, turn + 1))
                if left[0] == 0:
                    for _ in range(concurrency):
                        ready.put(None)

    threads = [threading.Thread(target=worker, name=f"agent-{i}", daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def summarise(rows: Sequence[AgentRow], tokens: dict[tuple[int, int], list[int]], elapsed: float) -> dict[str, Any]:
    """Sums and percentiles of one run; the ideal over every request, in the order they were sent."""
    ideal = ideal_of([tokens[(r.session, r.turn)] for r in rows])
    for r, i in zip(rows, ideal, strict=True):
        r.tokens, r.ideal = len(tokens[(r.session, r.turn)]), i
    ok = [r for r in rows if not r.failed]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    computed = sum(r.computed or 0 for r in ok)
    out: dict[str, Any] = {
        "requests": len(rows), "errors": len(rows) - len(ok),
        "error_messages": sorted({str(r.error) for r in rows if r.failed})[:5],
        "computed": computed, "ideal": sum(ideal), "prompt_tokens": sum(r.tokens or 0 for r in rows),
        "computed_over_ideal": round(computed / sum(ideal), 3) if sum(ideal) else None,
        # the prompt the answer says it had against the one counted beforehand (a proxy that changed it shows here)
        "prompt_mismatches": sum(1 for r in ok if r.computed is not None and r.cached is not None
                                 and r.computed + r.cached != r.tokens),
        "timings_prompt_n": sum(r.prompt_n for r in ok if r.prompt_n is not None),
        "timings_requests": sum(1 for r in ok if r.prompt_n is not None),
        "ttft_p50": round(percentile(ttfts, 50), 3) if ttfts else None,
        "ttft_p90": round(percentile(ttfts, 90), 3) if ttfts else None,
        "elapsed_s": round(elapsed, 1),
    }
    for api in sorted({r.api for r in rows}):
        mine = [r for r in ok if r.api == api]
        t = [r.ttft_s for r in mine if r.ttft_s is not None]
        out[f"computed_{api}"] = sum(r.computed or 0 for r in mine)
        out[f"ideal_{api}"] = sum(r.ideal or 0 for r in rows if r.api == api)
        out[f"ttft_p50_{api}"] = round(percentile(t, 50), 3) if t else None
    return out


def rows_json(rows: Sequence[AgentRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
