"""How fast each backend prefills, generates, saves and restores, learnt from what it reports: the costs behind
every "restore or prefill?" and "wait for that busy slot or go elsewhere?" decision.

A restore reads the whole file before the server computes the rest of the prompt; a prefill computes the shared part
instead. On a fast GPU with a slow disk, or for a short shared part of a long saved prompt, the prefill can be the
quicker one. The rates are taken from `timings.prompt_ms / prompt_n` (prefill: the median of the recent measures),
`predicted_ms / predicted_n` (generation: the quickest of them) and the save's and restore's time per token
(exponentially weighted averages); until a rate is known, the decisions that need it take their safe default
(restore; wait only for a slot that is saving).

Identity blocks (`identity.BLOCK_CHARS` characters of canonical text) are turned into tokens with the characters
per token seen on this backend (canonical text is JSON-escaped: a little longer than what the template renders).

A `/slots` call also waits: llama-server runs it between two of its batches, so it waits for the batch under way
(another slot's prefill: seconds on a CPU), and the request after it waits one more. That wait (`wait_ms`: the call's
time less the server's own `save_ms` / `restore_ms`) is a fixed cost per call, whatever the file's size: a restore
pays only when the prefill it spares beats it too, and a short prompt's file may not be worth its save. It is the
mean of the last RECENT calls' waits less the longest one: one call that came during another slot's long prompt
(18 s of a 1,300-token prefill on a loaded CPU) made an average of every call several seconds for the decisions
right after it, enough to judge a session's restore sparing 400 tokens slower than their prefill; a server whose
calls often wait that long (a third of them, say) still counts it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lpcache.cache.identity import BLOCK_CHARS

ALPHA = 0.3             # weight of the newest measurement
MIN_TOKENS = 32         # measurements over fewer tokens are mostly fixed costs: not used ...
MIN_DECODED = 4         # ... but a decode step per token has none to speak of: short answers teach generation
MARGIN = 1.0            # restore when its time is below MARGIN x the prefill time it saves
RECENT = 16             # measures a quantile rate (and the /slots calls' wait) is taken from
DECODE_QUANTILE = 0.0   # the generation rate: the quickest of the recent measures
PREFILL_QUANTILE = 0.5  # the prefill rate: the median of the recent measures
CHARS_PER_TOKEN = 4.0   # until measured


@dataclass
class Rate:
    """A cost per token: the EWMA of the measures, or with `quantile`, that quantile of the RECENT last ones."""

    ms_per_token: float | None = None
    min_tokens: int = MIN_TOKENS
    quantile: float | None = None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def add(self, ms: float, tokens: int) -> None:
        if tokens < self.min_tokens or ms <= 0:   # a stand-in reporting 0 ms says nothing
            return
        value = ms / tokens
        if self.quantile is not None:
            self.recent.append(value)
            ranked = sorted(self.recent)
            self.ms_per_token = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
            return
        self.ms_per_token = value if self.ms_per_token is None else (1 - ALPHA) * self.ms_per_token + ALPHA * value

    def seconds(self, tokens: float) -> float | None:
        return None if self.ms_per_token is None else self.ms_per_token * tokens / 1000.0


@dataclass
class Speeds:
    """One backend and model."""

    # A prompt prefilled in the same batch as another slot's reports the batch's time: 66 tokens in 6 s beside a
    # 1,288-token prompt (91 ms a token where 4 is the rule). Such measures only ever read slower, and an average
    # took one of them for seconds of prefill on every decision after it (waits, saves, the RAM's misses): the
    # median of the recent ones is the server's rate, and follows a server that really got slower.
    prefill: Rate = field(default_factory=lambda: Rate(quantile=PREFILL_QUANTILE))
    restore: Rate = field(default_factory=Rate)
    # A short answer's decode steps wait for whatever the server computes beside it (another slot's prefill, on
    # a CPU many times the answer itself): those measures say nothing of a slot's next answer. The quickest of the
    # recent ones is what a decode step costs (on a loaded machine 13 of 16 answers waited so, and a quarter-low
    # quantile read 1.4 s a token); a wait planned on it is capped by the prefill it spares anyway.
    generate: Rate = field(default_factory=lambda: Rate(min_tokens=MIN_DECODED, quantile=DECODE_QUANTILE))
    save: Rate = field(default_factory=Rate)
    chars_per_token: float | None = None
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))   # recent /slots calls' waits, ms

    @classmethod
    def new(cls) -> Speeds:
        return cls()

    def learn_chars(self, chars: int, tokens: int | None) -> None:
        """A request of `chars` canonical characters had `tokens` prompt tokens."""
        if tokens is None or tokens < MIN_TOKENS or chars <= 0:
            return
        value = chars / tokens
        old = self.chars_per_token
        self.chars_per_token = value if old is None else (1 - ALPHA) * old + ALPHA * value

    def learn_wait(self, call_ms: float, work_ms: float) -> None:
        """A /slots call took `call_ms`, of which the server worked `work_ms` on the file: the rest was waiting."""
        if call_ms <= 0 or work_ms <= 0 or work_ms > call_ms:
            return   # the server did not say (a stand-in), or clocks disagree: nothing learnt
        self.waits.append(call_ms - work_ms)

    @property
    def wait_ms(self) -> float | None:
        """A /slots call's wait for the server's batch under way (ms; None until measured): the recent calls'
        mean without the longest."""
        waits = sorted(self.waits)
        if len(waits) > 1:
            waits.pop()
        return sum(waits) / len(waits) if waits else None

    def tokens_of(self, blocks: int) -> float:
        """Tokens in `blocks` identity blocks, as far as this backend's ratio tells."""
        return blocks * BLOCK_CHARS / (self.chars_per_token or CHARS_PER_TOKEN)

    def restore_pays(self, file_tokens: int, reused_tokens: float) -> bool:
        """Whether restoring a file of `file_tokens` tokens beats prefilling the `reused_tokens` it would spare
        (the tokens it brings beyond what the chosen slot already holds)."""
        p, r = self.prefill.ms_per_token, self.restore.ms_per_token
        if p is None or r is None:
            return True
        return r * file_tokens + (self.wait_ms or 0.0) < MARGIN * p * reused_tokens

    def describe(self) -> dict[str, float | None]:
        return {"prefill_ms_per_token": self.prefill.ms_per_token, "restore_ms_per_token": self.restore.ms_per_token,
                "generate_ms_per_token": self.generate.ms_per_token, "save_ms_per_token": self.save.ms_per_token,
                "slot_call_wait_ms": self.wait_ms}


class SpeedBook:
    """The speeds of every (backend, model) pair. Keys are backends and the models a router really serves (never
    a client's free-form model string), so the book stays bounded."""

    def __init__(self) -> None:
        self._speeds: dict[tuple[int, str], Speeds] = {}
        # With REDIS_URL (`fleet`): told after each measurement, to share it with the other replicas.
        self.on_learnt: Callable[[int, str, Speeds], None] | None = None

    def learnt(self, backend: int, model: str) -> None:
        if self.on_learnt is not None:
            self.on_learnt(backend, model, self.of(backend, model))

    def of(self, backend: int, model: str) -> Speeds:
        key = (backend, model)
        speeds = self._speeds.get(key)
        if speeds is None:
            speeds = self._speeds[key] = Speeds()
        return speeds

    def __len__(self) -> int:
        return len(self._speeds)

    def items(self) -> list[tuple[tuple[int, str], Speeds]]:
        """((backend, model), speeds) of every pair measured, in order."""
        return sorted(self._speeds.items(), key=lambda kv: kv[0])
