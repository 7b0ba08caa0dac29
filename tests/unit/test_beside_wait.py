"""How long a request waits for a busy slot on the one server it could otherwise prefill on (`beside_wait`)."""

from __future__ import annotations

import math
import time

from lpcache.backends.placement import beside_wait, prefill_left
from lpcache.backends.slots import Content, Slot
from lpcache.cache.speeds import Speeds

BLOCK_TOKENS = 16   # 64 characters at the default 4 characters a token


def busy(blocks: int, computing: int, *, stream: bool = True, sent: float | None = 1.0,
         first_token: float | None = None) -> Slot:
    now = time.monotonic()
    slot = Slot(0, 0, busy=True, used=True, phase="generate", stream=stream, computing=computing,
                pending=Content("k", tuple(range(blocks))))
    slot.sent_at = None if sent is None else now - sent
    slot.first_token_at = None if first_token is None else now - first_token
    return slot


def learnt(prefill_ms: float = 1.0, generate_ms: float = 20.0) -> Speeds:
    speeds = Speeds()
    speeds.prefill.add(prefill_ms * 1000, 1000)
    speeds.generate.add(generate_ms * 100, 100)
    return speeds


def test_a_streamed_prefill_shorter_than_the_requests_own_is_waited_out_then_decided_again() -> None:
    # an agent harness of 150 blocks in both; each has 10 blocks of its own: the busy one computes all 160
    assert beside_wait(busy(160, 160), mine=160 * BLOCK_TOKENS, blocks=150, speeds=Speeds()) == math.inf
    # a busy prompt five times as long as the request's prompt and what they share: its prefill outlasts going now
    assert beside_wait(busy(2000, 2000), mine=160 * BLOCK_TOKENS, blocks=150, speeds=Speeds()) == 0.0
    # ... unless most of it was cached: what it computes counts, not its length
    assert beside_wait(busy(2000, 100), mine=160 * BLOCK_TOKENS, blocks=150, speeds=Speeds()) == math.inf
    # at learnt speeds, the part it already computed counts off (1 ms a token, 5 s since it was sent: all done)
    assert beside_wait(busy(2000, 2000, sent=40.0), mine=160 * BLOCK_TOKENS, blocks=150,
                       speeds=learnt()) == math.inf


def test_after_the_first_token_the_wait_is_the_prefill_it_spares() -> None:
    # nothing learnt: measured on the busy slot's own prefill (2 s for 160 blocks; 150 shared: 1.875 s), 0.5 s ago
    wait = beside_wait(busy(160, 160, sent=2.5, first_token=0.5), mine=2560, blocks=150, speeds=Speeds())
    assert 1.3 < wait < 1.4
    # learnt: 150 blocks are 2,400 tokens at 1 ms: 2.4 s from the first token, 0.5 s ago
    wait = beside_wait(busy(160, 160, sent=2.5, first_token=0.5), mine=2560, blocks=150, speeds=learnt())
    assert 1.85 < wait < 1.95
    # long past that: no more waiting
    assert beside_wait(busy(160, 160, sent=9.0, first_token=5.0), mine=2560, blocks=150, speeds=learnt()) == 0.0


def test_a_json_answer_is_waited_for_only_at_learnt_speeds() -> None:
    slot = busy(160, 160, stream=False, sent=0.0)
    assert beside_wait(slot, mine=2560, blocks=150, speeds=Speeds()) == 0.0
    wait = beside_wait(slot, mine=2560, blocks=150, speeds=learnt())     # its prefill left (2.56 s) + 2.4 s spared
    assert 4.9 < wait < 5.0
    # an answer of 64 tokens takes longer than the prefill it would spare: no wait
    assert beside_wait(slot, mine=2560, blocks=150, speeds=learnt(generate_ms=100.0)) == 0.0


def test_the_prefill_a_busy_slot_has_left_counts_what_it_computes_less_the_time_since_it_was_sent() -> None:
    speeds = learnt(prefill_ms=1.0)                  # 16 ms a block
    now = time.monotonic()
    assert prefill_left(busy(2000, 1000, sent=None), speeds, now) == 16.0   # not sent yet: all of it
    assert math.isclose(prefill_left(busy(2000, 1000, sent=10.0), speeds, now), 6.0, abs_tol=0.05)
    assert prefill_left(busy(2000, 1000, sent=20.0), speeds, now) == 0.0    # done by now, at that speed
    assert prefill_left(busy(2000, 1000, sent=1.0, first_token=0.5), speeds, now) == 0.0   # its answer began
    assert prefill_left(busy(2000, 1000), Speeds(), now) == 0.0             # no speed learnt: nothing known
    saving = busy(2000, 1000)
    saving.phase, saving.free_at = "save", now + 3.0
    assert prefill_left(saving, speeds, now) == 3.0                         # a save: until its expected end
    saving.free_at = None
    assert prefill_left(saving, speeds, now) == 0.0
    idle = Slot(0, 1, used=True, computing=1000)
    assert prefill_left(idle, speeds, now) == 0.0
