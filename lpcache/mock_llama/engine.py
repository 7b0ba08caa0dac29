"""The fake model at work: one inference task on one held slot.

Prefix reuse and simulated latency follow llama-server: ``n_past`` is the common
prefix of the slot's tokens and the prompt, at least one prompt token is always
evaluated, and the slot's tokens are kept current as tokens are produced, so a task
cut short leaves exactly what it computed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lpcache.mock_llama.slots import Slot, TaskInfo
from lpcache.mock_llama.state import MockState
from lpcache.mock_llama.tokens import lcp, reply_stream


@dataclass
class TaskParams:
    prompt: list[str]
    n_predict: int  # -1: until the slot's context is full
    cache_prompt: bool = True
    slot_id: int | None = None  # pinned slot (already wrapped), or None to let the server choose
    # A stream's keep-alive: a comment (`:`) after this many seconds without an event; 0 or less: none. The body's
    # `sse_ping_interval`; llama-server's default is 30 s, the stand-in's none (its answers are that slow only
    # when a test makes them so, and then it asks for pings)
    sse_ping_interval: float = 0.0


def timings_json(
    cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float
) -> dict[str, Any]:
    def per_token(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_second(ms: float, n: int) -> float:
        return 1000.0 * n / ms if ms > 0 else 0.0

    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
        "prompt_per_second": per_second(prompt_ms, prompt_n),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per_token(predicted_ms, predicted_n),
        "predicted_per_second": per_second(predicted_ms, predicted_n),
    }


class Generation:
    """An inference task holding its slot from ``start`` until ``release``."""

    def __init__(self, state: MockState, slot: Slot, params: TaskParams) -> None:
        self.state = state
        self.slot = slot
        self.params = params
        self.n_past = 0
        self.prompt_ms = 0.0
        self.predicted_ms = 0.0
        self.generated: list[str] = []
        self._released = False
        room = slot.n_ctx - len(params.prompt)
        self.limit = room if params.n_predict < 0 else min(params.n_predict, room)
        slot.processing = True
        slot.task = TaskInfo(id_task=state.next_task_id(), n_predict=params.n_predict, n_remain=self.limit)

    @classmethod
    async def start(cls, state: MockState, params: TaskParams) -> Generation:
        """Wait for a slot (the pinned one, or the best idle one) and take it."""
        stats = state.stats
        if params.slot_id is None:
            stats.unpinned_requests += 1
        elif state.pool.slots[params.slot_id].processing:
            stats.pinned_to_busy += 1   # llama-server would run its RAM cache's load on the live slot
        stats.queued += 1
        stats.max_queued = max(stats.max_queued, stats.queued)
        try:
            slot = await state.pool.acquire(params.slot_id, params.prompt)
        finally:
            stats.queued -= 1
        stats.chat_requests += 1
        stats.chat_by_slot[slot.id] += 1
        stats.max_concurrent_per_slot = max(stats.max_concurrent_per_slot, slot.active)
        return cls(state, slot, params)

    @property
    def prompt_n(self) -> int:
        return len(self.params.prompt) - self.n_past

    async def prefill(self) -> None:
        prompt, slot = self.params.prompt, self.slot
        if self.params.cache_prompt and not (slot.restored and self.state.config.swa):
            self.n_past = max(0, min(lcp(slot.tokens, prompt), len(prompt) - 1))
        slot.restored = False
        slot.tokens = prompt[: self.n_past]  # the KV past the common prefix is discarded
        assert slot.task is not None
        slot.task.n_prompt_tokens_cache = self.n_past
        slot.task.n_prompt_tokens_processed = self.prompt_n
        t0 = time.perf_counter()
        if self.state.config.prefill_ms_per_token:
            await asyncio.sleep(self.state.config.prefill_ms_per_token * self.prompt_n / 1000)
        slot.tokens = list(prompt)
        self.prompt_ms = (time.perf_counter() - t0) * 1000
        self.state.stats.prompt_tokens_computed += self.prompt_n

    async def tokens(self) -> AsyncIterator[str]:
        """Produce the answer token by token; the slot keeps all but the newest one."""
        gen_ms = self.state.config.gen_ms_per_token
        replies = reply_stream(self.params.prompt)
        task = self.slot.task
        assert task is not None
        t0 = time.perf_counter()
        for _ in range(self.limit):
            if gen_ms:
                await asyncio.sleep(gen_ms / 1000)
            piece = next(replies)
            if self.generated:
                self.slot.tokens.append(self.generated[-1])
            self.generated.append(piece)
            task.n_decoded += 1
            task.n_remain -= 1
            self.predicted_ms = (time.perf_counter() - t0) * 1000
            yield piece

    async def run(self) -> None:
        """Prefill and generate the whole answer (the non-streaming path)."""
        await self.prefill()
        async for _ in self.tokens():
            pass

    def release(self) -> None:
        """Hand the slot back; safe to call more than once."""
        if not self._released:
            self._released = True
            self.slot.processing = False
            self.state.pool.release(self.slot, used=True)

    def timings(self) -> dict[str, Any]:
        return timings_json(self.n_past, self.prompt_n, self.prompt_ms, len(self.generated), self.predicted_ms)

    def usage(self) -> dict[str, Any]:
        n_prompt, n_gen = len(self.params.prompt), len(self.generated)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_gen,
            "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": self.n_past},
        }
