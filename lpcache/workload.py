"""A seeded, realistic multi-user workload of the kind session mode is for, and its ideal prefill.

Several users each write one growing story; each story gets several kinds of work (generation of the next part,
annotation of the last part, a redraft of it, a summary), as a writing application sends them, each kind with its
own `X-Session-ID` (a hash of user and kind). A kind's prompt is its own instructions, then the story so far, then
its task, so two kinds of one user share no prefix and every turn of a kind extends the story of its last turn.

The ideal is what a perfect cache would leave to compute: for each request, the prompt tokens that no earlier
prompt of the same session shared as a token prefix (llama-server's own `/apply-template` and `/tokenize` count
them). Used by the end-to-end acceptance tests and the benchmarks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .testing import story

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
