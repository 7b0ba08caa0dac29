"""How fast each backend prefills and restores, learnt from what it reports, to tell whether a restore pays.

A restore reads the whole file (every token of the saved prompt, and its context checkpoints) before the server
computes the rest of the prompt; a prefill computes the shared part instead. On a fast GPU with a slow disk, or
for a short shared part of a long saved prompt, the prefill can be the quicker one. The rates are exponentially
weighted averages of `timings.prompt_ms / prompt_n` (prefill) and of the restore's time per restored token;
until both are known, lpcache restores (the usual case: a CPU or a consumer GPU prefills far slower than a disk
reads).
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3             # weight of the newest measurement
MIN_TOKENS = 32         # measurements over fewer tokens are mostly fixed costs: not used
MARGIN = 1.0            # restore when its time is below MARGIN x the prefill time it saves


@dataclass
class Rate:
    ms_per_token: float | None = None

    def add(self, ms: float, tokens: int) -> None:
        if tokens < MIN_TOKENS or ms <= 0:   # a stand-in reporting 0 ms says nothing
            return
        value = ms / tokens
        self.ms_per_token = value if self.ms_per_token is None else (1 - ALPHA) * self.ms_per_token + ALPHA * value


@dataclass
class Speeds:
    """One backend and model."""

    prefill: Rate
    restore: Rate

    @classmethod
    def new(cls) -> Speeds:
        return cls(Rate(), Rate())

    def restore_pays(self, file_tokens: int, reused_tokens: int) -> bool:
        """Whether restoring a file of `file_tokens` tokens beats prefilling the `reused_tokens` it would spare."""
        p, r = self.prefill.ms_per_token, self.restore.ms_per_token
        if p is None or r is None:
            return True
        return r * file_tokens < MARGIN * p * reused_tokens

    def describe(self) -> dict[str, float | None]:
        return {"prefill_ms_per_token": self.prefill.ms_per_token, "restore_ms_per_token": self.restore.ms_per_token}
