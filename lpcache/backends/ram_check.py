"""Whether a llama-server keeps a RAM prompt cache (`--cache-ram`, on by default) that a pinned request finds, asked
with three tiny requests on one idle slot rather than learnt from the returns of a whole workload.

Why: until lpcache knows, it treats the RAM as an even bet. It saves and restores files for returns the RAM may well
hold, and leaves a return to the RAM only on a probe, which waits until the files have spared many prefills
(`server_cache.PROBE_PAYBACK`). On a server whose RAM holds the working set, that learning phase costs restores and
hand-overs the server alone never pays; on one started with `--cache-ram 0`, every probe costs a prefill.

How (llama-server b11434, "The built-in RAM prompt cache"): prompt A, then prompt B, then A and a few more words, each
pinned to the same slot. B replaces A in the slot, and a server with a RAM cache copies A there first; the third request
then loads A from RAM (its `timings.cache_n` is most of its prompt). Without a RAM cache (or with
`--slot-prompt-similarity 0`, under which a pinned request never looks there) the slot holds B, which shares nothing
with A: `cache_n` is 0, or 1 for a shared BOS token. The prompts are a few tokens of text unlike anything a client sends
(A and B share nothing, not even a first token), and one token is generated; the slot is left holding A. Short,
because the server computes them and counts them in its own figures: 7 tokens in all on SmolLM2 (they were 88, then
13).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from lpcache.backends.llama import LlamaClient
from lpcache.errors import ProxyError

log = logging.getLogger("lpcache.ram_check")

PROMPTS = (
    "Amber falcon.",   # 4 tokens on SmolLM2, 3 on the stand-in, at least 2 on any tokenizer (MIN_HIT)
    "Yes",             # 1 token, sharing nothing with A (with a BOS token, the third still shares too little with it
                       # to keep its slot: `f_keep` < 0.5, and the server looks in its RAM)
)
AGAIN = " Again."   # the third prompt extends A, as a real return does (a recurrent or hybrid model reuses a cache
                    # only for a prompt that goes beyond it)
HIT_SHARE = 0.5   # the third request took at least this share of its prompt from the server's cache: a RAM hit
MIN_HIT = 2       # ... and more tokens than a BOS token both prompts may start with (whatever the tokenizer)


async def ram_cache_found(client: LlamaClient, slot: int) -> bool | None:
    """Whether the server's RAM prompt cache gave back a prompt its slot no longer held (see the module's
    docstring). None when the server did not answer as llama-server does (an error, no `timings.cache_n`): unknown,
    and lpcache learns it from the returns as before. The caller holds `slot` idle for lpcache meanwhile."""
    first, other = PROMPTS
    try:
        opened = await _completion(client, first, slot)
        await _completion(client, other, slot)
        again = await _completion(client, first + AGAIN, slot)
    except ProxyError as e:
        log.info("ram_check_failed url=%s slot=%d: %s", client.url, slot, e.message)
        return None
    if opened is None or again is None:
        return None
    cached, total = again
    found = cached >= MIN_HIT and cached >= HIT_SHARE * total
    log.info("ram_check url=%s slot=%d cache_n=%d of %d prompt tokens: %s", client.url, slot, cached, total,
             "llama-server's RAM prompt cache serves pinned requests" if found else
             "no RAM prompt cache serves pinned requests (--cache-ram 0, or --slot-prompt-similarity 0)")
    return found


NUDGE = "Yes"   # a prompt of one token (two with a BOS), sharing nothing with a chat's template nor with A


async def copy_to_ram(client: LlamaClient, slot: int) -> bool:
    """Have the server copy its idle slots' caches to its RAM prompt cache now: a one-token `/completion` of a tiny
    prompt pinned to the idle `slot` makes it copy that slot's cache there (the new prompt shares nothing with it)
    and, as the task starts, every other idle slot's (`--cache-idle-slots`). Afterwards `slot` holds the tiny prompt.
    Whether the server answered."""
    try:
        return await _completion(client, NUDGE, slot) is not None
    except ProxyError as e:
        log.info("ram_copy_failed url=%s slot=%d: %s", client.url, slot, e.message)
        return False


async def _completion(client: LlamaClient, prompt: str, slot: int) -> tuple[int, int] | None:
    """(cache_n, prompt tokens) of one `/completion` pinned to `slot`, or None when its answer does not say."""
    body: dict[str, Any] = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True}
    upstream = await client.chat(body, slot, path="/completion")
    async with upstream:
        raw = await upstream.read()
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    timings = doc.get("timings") if isinstance(doc, dict) else None
    if not isinstance(timings, dict):
        return None
    cached, computed = timings.get("cache_n"), timings.get("prompt_n")
    if not isinstance(cached, int) or not isinstance(computed, int):
        return None
    return cached, cached + computed
