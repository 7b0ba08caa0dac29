"""Whether a backend's model reuses the caches lpcache restores into it, decided on evidence only.

A sliding-window model without `--swa-full` (Gemma 3) or a hybrid one re-computes the whole prompt after a disk
restore, so restoring there only costs time. lpcache concludes that only from *conclusive* evidence: restores of
files whose content exactly matches the prompt's start (the exact identity, not a guess from words) after which the
server's `cache_n` fell short of what the file should have brought, for REUSE_EVIDENCE distinct files, with no
restore that worked in between. Then saving and restoring stop for that backend and model, with one warning giving
the evidence; after RETRY_SECONDS they are tried again (the server may have been restarted with `--swa-full`).

A foreign cache (a Rust lpcache or proxycache meta file, matched by words) that falls short says nothing about the
model: only that file is dropped. One request that resembles a saved cache in its words but not in its roles, case
or tools can never turn caching off for everyone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("lpcache.reuse")

REUSE_MIN_TOKENS = 64   # a restore expected to bring fewer tokens than this says nothing about reuse
REUSE_SHORT = 0.5       # cache_n below this share of what the restore should bring: it fell short
REUSE_EVIDENCE = 3      # distinct files that fell short, in a row, before concluding
RETRY_SECONDS = 600.0   # how long saving and restoring stay off before they are tried again


@dataclass
class Verdict:
    """What one backend and model showed: files whose restore fell short since the last that worked."""

    short: dict[str, tuple[int, int]] = field(default_factory=dict)   # file -> (expected tokens, cache_n)
    off_until: float = 0.0


class ReuseWatch:
    def __init__(self, evidence: int = REUSE_EVIDENCE, retry_seconds: float = RETRY_SECONDS) -> None:
        self.evidence = evidence
        self.retry_seconds = retry_seconds
        self._verdicts: dict[tuple[int, str], Verdict] = {}
        self.turned_off = 0   # times the verdict was reached (metric)

    def enabled(self, backend: int, model: str, now: float | None = None) -> bool:
        verdict = self._verdicts.get((backend, model))
        return verdict is None or (time.monotonic() if now is None else now) >= verdict.off_until

    def judge(self, backend: int, model: str, file: str, expected: float, cache_n: int | None,
              url: str = "", now: float | None = None) -> bool | None:
        """After an exact restore of `file` that should have brought `expected` tokens: True when the server reused
        it, False when it fell short, None when it says nothing (too small, no figures)."""
        if cache_n is None or expected < REUSE_MIN_TOKENS:
            return None
        verdict = self._verdicts.setdefault((backend, model), Verdict())
        if cache_n >= REUSE_SHORT * expected:
            verdict.short.clear()
            return True
        verdict.short[file] = (int(expected), cache_n)
        if len(verdict.short) >= self.evidence and self.enabled(backend, model, now):
            verdict.off_until = (time.monotonic() if now is None else now) + self.retry_seconds
            self.turned_off += 1
            evidence = ", ".join(f"{f[:16]}: expected {e} cache_n {c}" for f, (e, c) in list(verdict.short.items()))
            log.warning(
                "restore_not_reused backend=%s model=%s files=%d (%s): the server computed the prompt again after "
                "restores of files that exactly match the prompts' start. A sliding-window model (Gemma 3, for one) "
                "reuses a restored cache only when llama-server runs with --swa-full; a hybrid or recurrent model "
                "only when the prompt extends the saved one exactly. lpcache stops saving and restoring for this "
                "backend and model for %.0f s, then tries again.", url or backend, model or "-", len(verdict.short),
                evidence, self.retry_seconds)
            verdict.short.clear()
        return False
