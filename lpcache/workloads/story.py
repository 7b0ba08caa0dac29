"""A seeded, realistic multi-user workload of the kind session mode is for, and its ideal prefill.

Several users each write one growing story; each story gets several kinds of work (generation of the next part,
annotation of the last part, a redraft of it, a summary), as a writing application sends them, each kind with its
own `X-Session-ID` (a hash of user and kind). A kind's prompt is its own instructions, then the story so far, then
its task, so two kinds of one user share no prefix and every turn of a kind extends the story of its last turn.

The ideal is what a perfect cache would leave to compute: for each request, the prompt tokens that no earlier
prompt of the same session shared as a token prefix (llama-server's own `/apply-template` and `/tokenize` count
them). Used by the end-to-end acceptance tests and the benchmarks. `ideals` gives that and the global ideal (no
earlier prompt of any session) from one tokenization pass (bench/replay.py).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from lpcache.workloads.harness import story

KINDS = {
    "generate": ("You are a novelist. Continue the story in the same voice.",
                 "Write the next part of the story."),
    "annotate": ("You are an editor. You annotate stories: mark what is unclear, what contradicts, what works.",
                 "Annotate the last part of the story."),
    "redraft": ("You are a careful rewriter. You keep the plot and improve the prose.",
                "Redraft the last part of the story."),
    "summary": ("You write short summaries of stories for the author's notes.",
                "Summarise the story so far in three sentences."),
}


@dataclass(frozen=True)
class Turn:
    """One request of the workload."""

    user: int
    kind: str
    turn: int
    session: str                       # the X-Session-ID: 32 lower-case hex digits
    messages: list[dict[str, Any]]


def session_of(user: int, kind: str) -> str:
    return hashlib.sha256(f"user-{user}/{kind}".encode()).hexdigest()[:32]


def turns(users: int = 3, kinds: Sequence[str] = ("generate", "annotate", "redraft"), rounds: int = 4,
          first_words: int = 300, part_words: int = 50, seed: int = 1) -> list[Turn]:
    """Round by round, user by user, kind by kind; each user's story grows by a part every round."""
    stories = {u: story(seed * 1000 + u, first_words) for u in range(users)}
    out = []
    for r in range(rounds):
        for u in range(users):
            if r:
                stories[u] += "\n\n" + story(seed * 1000 + u * 100 + r, part_words)
            for kind in kinds:
                system, task = KINDS[kind]
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": f"The story so far:\n\n{stories[u]}\n\n{task}"}]
                out.append(Turn(u, kind, r, session_of(u, kind), messages))
    return out


def prompt_tokens(server: str, messages: list[dict[str, Any]], client: httpx.Client | None = None) -> list[int]:
    """The exact tokens llama-server computes for a chat prompt: /apply-template, then /tokenize."""
    c = client or httpx.Client(timeout=60)
    prompt = c.post(f"{server}/apply-template", json={"messages": messages}).json()["prompt"]
    return c.post(f"{server}/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]  # type: ignore[no-any-return]


def shared(a: Sequence[int], b: Sequence[int]) -> int:
    n, m = 0, min(len(a), len(b))
    while n < m and a[n] == b[n]:
        n += 1
    return n


def ideal(server: str, workload: Sequence[Turn], per_session: bool = True) -> list[int]:
    """For each turn, the prompt tokens no earlier prompt (of the same session, or of any) shared as a prefix."""
    seen: dict[str, list[list[int]]] = {}
    out = []
    with httpx.Client(timeout=60) as client:
        for t in workload:
            tokens = prompt_tokens(server, t.messages, client)
            earlier = seen.setdefault(t.session if per_session else "", [])
            best = max((shared(tokens, e) for e in earlier), default=0)
            out.append(len(tokens) - best)
            earlier.append(tokens)
    return out


def tokenize_all(server: str, workload: Sequence[Turn], client: httpx.Client | None = None) -> list[list[int]]:
    """Each turn's prompt tokens (as `prompt_tokens`), in the workload's order, on one connection. A refused call
    raises `httpx.HTTPStatusError`; an answer without the expected field raises `ValueError`."""
    own = client is None
    c = client or httpx.Client(timeout=60)
    out = []
    try:
        for t in workload:
            r = c.post(f"{server}/apply-template", json={"messages": t.messages})
            r.raise_for_status()
            prompt = _field(r, "prompt", str)
            r = c.post(f"{server}/tokenize", json={"content": prompt, "add_special": True})
            r.raise_for_status()
            tokens = _field(r, "tokens", list)
            out.append([int(x) for x in tokens])
    finally:
        if own:
            c.close()
    return out


def _field(r: httpx.Response, name: str, kind: type) -> Any:
    body = r.json()
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kind):
        raise ValueError(f"{r.request.url} answered without a {kind.__name__} '{name}', unlike llama-server")
    return value


def ideal_of(tokens: Sequence[Sequence[int]], groups: Sequence[str] | None = None) -> list[int]:
    """For each prompt, its tokens that no earlier prompt (of the same group, or of any when `groups` is None)
    shared as a prefix. The earlier prompts are kept sorted: the longest prefix one shares with a new prompt is
    the one its neighbours in that order share, so each prompt costs a binary search, not a pass over all."""
    seen: dict[str, list[tuple[int, ...]]] = {}
    out = []
    for i, t in enumerate(tokens):
        key = tuple(t)
        earlier = seen.setdefault("" if groups is None else groups[i], [])
        at = bisect.bisect_left(earlier, key)
        best = max((shared(key, earlier[j]) for j in (at - 1, at) if 0 <= j < len(earlier)), default=0)
        out.append(len(key) - best)
        earlier.insert(at, key)
    return out


def ideals(server: str, workload: Sequence[Turn], client: httpx.Client | None = None) -> tuple[list[int], list[int]]:
    """`ideal` over all earlier prompts and per session, from one tokenization pass: (global, per session)."""
    tokens = tokenize_all(server, workload, client)
    return ideal_of(tokens), ideal_of(tokens, [t.session for t in workload])
