"""After the answer: what the server reports (`cache_n`) says about the slot. A restore is judged (`reuse`: a
foreign file that fell short is dropped), the server's RAM prompt cache seen serving or missing, and a slot that did
not hold what lpcache believed marked suspect (its slots are then checked: `slot_truth`)."""

from __future__ import annotations

import logging
import math
import time

from lpcache.backends.backend import Backend
from lpcache.backends.placement import Choice
from lpcache.backends.router_models import RouterModels
from lpcache.cache.index import MetaIndex
from lpcache.cache.prefix import Prompt, common_prefix
from lpcache.cache.reuse import REUSE_MIN_TOKENS, REUSE_SHORT, ReuseWatch
from lpcache.cache.server_cache import RAM_HIT_SHARE
from lpcache.cache.speeds import SpeedBook
from lpcache.flow.record import RequestRecord
from lpcache.flow.saving import Saver

log = logging.getLogger("lpcache.slot_fill")


def judge(choice: Choice, backend: Backend, prompt: Prompt, record: RequestRecord, index: MetaIndex,
          speeds_book: SpeedBook, reuse: ReuseWatch, saver: Saver) -> None:
    """Check `cache_n` against what the slot was believed to hold: a restore for `reuse` (foreign files that
    fell short are dropped), a resident prefix for the truth about the slots."""
    if record.cache_n is None:
        return
    if record.restored and record.restore_expected:
        # An infill prompt's layout is the model's (FIM tokens; suffix first in SPM mode; long parts cut): one
        # that fell short says nothing about the model, its file is dropped like a foreign one.
        if record.restore_exact and record.api != "infill":
            record.restore_reused = reuse.judge(
                backend.index, RouterModels.served(backend, prompt.model),
                choice.restore.entry.key if choice.restore is not None else (record.session or ""),
                record.restore_expected, record.cache_n, backend.url)
        elif record.cache_n < REUSE_SHORT * record.restore_expected and choice.restore is not None:
            record.restore_reused = False
            saver.spawn(index.drop(choice.restore.entry.key, "foreign_not_reused"))
        else:
            record.restore_reused = record.cache_n >= REUSE_SHORT * record.restore_expected
        return
    speeds = speeds_book.of(backend.index, RouterModels.served(backend, prompt.model))
    # More from the cache than the slot's shared blocks hold, and more than all the slot held (it still holds
    # what it held, until the request's slot is released): the server's RAM prompt cache served it. A slot whose
    # content lpcache does not know (another lpcache's, a restart's) may have held it itself: no sign then. A
    # prompt left to the RAM (`ram_expected`) that came back short is a miss of the RAM's.
    held = choice.slot.content
    explained = held is None or (held.tokens is not None and record.cache_n <= held.tokens)
    now = time.monotonic()
    served = not record.restored and not explained and \
        record.cache_n >= REUSE_MIN_TOKENS + speeds.tokens_of(choice.resident + 2)
    # what the RAM kept beside the prompt, if it served it
    beside = speeds.tokens_of(saver.server_caches.since(backend.index, prompt.exact)) \
        if record.ram_expected or served else 0.0
    if record.ram_expected:
        # left to the RAM in a slot chosen because it shares little with the prompt: what it shares is all the
        # slot itself could have given (the slot holding more tokens in all says nothing here)
        shared = speeds.tokens_of(common_prefix(held.chain, prompt.exact) + 2) if held is not None else math.inf
        hit = record.cache_n > shared and record.cache_n >= RAM_HIT_SHARE * record.ram_expected
        if not backend.ram.served and hit:
            log.info("backend_ram_cache url=%s cache_n=%d: llama-server's RAM prompt cache served a prompt no "
                     "slot held; what it likely holds is left to it rather than restored from disk while it "
                     "does", backend.url, record.cache_n)
        backend.ram.seen(hit, now, record.cache_n, beside)
        log.debug("ram_outcome slot=%s hit=%s cache_n=%s expected=%.0f slot_shared=%s", choice.slot.name,
                  str(hit).lower(), record.cache_n, record.ram_expected, shared)
    elif served:
        backend.ram.seen(True, now, record.cache_n, beside)
    if record.cache_hit and choice.resident:
        expected = speeds.tokens_of(choice.resident)
        if expected >= REUSE_MIN_TOKENS and record.cache_n < REUSE_SHORT * expected:
            backend.suspect = True
            record.cache_hit = False
            log.warning("slot_belief_wrong slot=%s expected_tokens=%d cache_n=%d: the slot did not hold what "
                        "lpcache believed; its slots are checked before their next use", choice.slot.name,
                        expected, record.cache_n)
