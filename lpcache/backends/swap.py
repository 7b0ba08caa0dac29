"""Every `/slots` call lpcache makes, and moving caches in and out of one llama-server slot: save what it holds
(when it changed since its last save), then restore the cache the next request needs. Prefix mode, session mode,
idle and shutdown saves, the liveness check and the LiteLLM hook all come through here, so a slot call is made
the same way everywhere: on a router it always names the model (and a save never loads an unloaded one).

Slot actions go only to an idle slot: llama-server parks a save/restore/erase while the slot processes a request
and releases one parked call per finished request, so a call sent to a busy slot could hold up other clients.
`wait_idle` asks `GET /slots` (`is_processing`) with a bounded wait; a server without /slots is acted on at once.

Nothing here fails a request: a miss, a missing file, a refused call or a dead server leaves the slot as the server
has it, and the request reads its prompt again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from lpcache.backends.llama import LlamaClient, SlotAction
from lpcache.backends.slots import Content
from lpcache.cache.cache_files import CacheFolder, Limits
from lpcache.cache.meta_files import inside
from lpcache.errors import BackendError, ProxyError

log = logging.getLogger("lpcache.swap")

IDLE_WAIT_SECONDS = 30.0   # how long a slot action waits for a slot busy with a request lpcache did not send
IDLE_POLL_SECONDS = 0.25
TOKEN_SLACK = 2            # n_prompt_tokens may differ this much from lpcache's count (the last generated token)


class Folders:
    """The slot-save folder of one server as lpcache sees it (None: not visible), with the limits of each route."""

    def __init__(self, path: str | None, limits_for: Callable[[str], Limits] = lambda tag: Limits()) -> None:
        self.path = path
        self.limits_for = limits_for
        self.protected: Counter[str] = Counter()   # session files a request chose to restore (a seed): kept

    def of(self, name: str) -> CacheFolder | None:
        """The route folder of a session file (`<tag>_<32 hex>.bin`); None for any other name."""
        tag, sep, rest = name.rpartition("_")
        if not sep or not rest.endswith(".bin"):
            return None
        folder = CacheFolder(self.path, tag, self.limits_for(tag))
        return folder if folder.owns(name) else None


@dataclass
class Swap:
    """What a swap did: the save of what the slot held, the restore of the wanted cache, and what the slot holds."""

    held: Content | None
    saved: SlotAction | None = None
    restored: SlotAction | None = None
    deleted: tuple[str, ...] = ()
    waited_ms: float = 0.0
    skipped: str | None = None   # why no restore: "resident", "busy", "prefill_faster"


def describe(result: SlotAction) -> str:
    """The figures llama-server gives for a slot call (it logs nothing itself): tokens, bytes, time."""
    b = result.body
    if not result.ok:
        return f"failed status={result.status} reason={result.error!r}"
    if "n_restored" in b:
        return f"ok tokens={b.get('n_restored')} bytes={b.get('n_read')} ms={result.ms:.0f}"
    if "n_saved" in b:
        return f"ok tokens={b.get('n_saved')} bytes={b.get('n_written')} ms={result.ms:.0f}"
    if "n_erased" in b:
        return f"ok tokens_dropped={b.get('n_erased')}"
    return "ok"


async def wait_idle(client: LlamaClient, slot: int, model: str | None = None,
                    limit: float | None = None) -> bool:
    """Wait (bounded) until the server says the slot processes nothing. False when it stayed busy."""
    return (await idle_tokens(client, slot, model, limit))[0]


async def idle_tokens(client: LlamaClient, slot: int, model: str | None = None,
                      limit: float | None = None) -> tuple[bool, int | None]:
    """Wait (bounded) until the server says the slot processes nothing: (False when it stayed busy, the tokens the
    server says the slot holds then, `n_prompt_tokens`, or None when it does not tell)."""
    deadline = time.monotonic() + (IDLE_WAIT_SECONDS if limit is None else limit)
    while True:
        try:
            slots = await client.slots(model)
        except ProxyError:
            return True, None   # the server does not tell: act at once
        entry = next((s for s in slots or () if s.get("id") == slot), None)
        if entry is None or not entry.get("is_processing"):
            n = entry.get("n_prompt_tokens") if entry is not None else None
            return True, n if isinstance(n, int) and not isinstance(n, bool) else None
        if time.monotonic() >= deadline:
            return False, None
        await asyncio.sleep(IDLE_POLL_SECONDS)


async def all_idle(client: LlamaClient, limit: float, polls: int) -> dict[int, int | None] | None:
    """Each slot's tokens (`n_prompt_tokens`) once GET /slots has said `polls` times in a row that no slot is
    processing; None when the server does not say (no /slots, an error) or has not said so within `limit` seconds,
    slow answers included (a call is bounded by the client's own timeout, 10 s, and the caller keeps its slots
    closed meanwhile: `flow.unpinned`)."""
    streak = 0
    try:
        async with asyncio.timeout(limit):
            while True:
                try:
                    listing = await client.slots()
                except ProxyError:
                    return None
                if listing is None:
                    return None
                streak = 0 if any(s.get("is_processing") for s in listing) else streak + 1
                if streak >= polls:
                    return {s["id"]: n if isinstance(n := s.get("n_prompt_tokens"), int) else None
                            for s in listing if isinstance(s.get("id"), int)}
                await asyncio.sleep(IDLE_POLL_SECONDS)
    except TimeoutError:
        return None


def holds(client: LlamaClient, slot: int, content: Content, tokens: int | None) -> bool:
    """Whether a slot the server says holds `tokens` tokens can hold `content` (when either count is unknown, it
    cannot tell: yes). A cache is saved under its name only then: saving what another request left in the slot
    (a replica that decided alone while Redis was down, a client that pinned it) would put another conversation
    into that file."""
    if tokens is None or content.tokens is None or abs(tokens - content.tokens) <= TOKEN_SLACK:
        return True
    log.warning("save_skipped_not_held url=%s slot=%d file=%s tokens=%d believed=%d: the slot holds something else "
                "than lpcache believed; nothing is saved under that name", client.url, slot, content.key, tokens,
                content.tokens)
    return False


async def restore_file(client: LlamaClient, slot: int, name: str, model: str | None = None) -> SlotAction:
    """Restore the file `name` into the slot. A failure clears the slot on the server."""
    result = await client.slot_action(slot, "restore", name, model=model)
    log.info("slot_restore url=%s slot=%d file=%s model=%s: %s", client.url, slot, name, model or "-",
             describe(result))
    return result


async def listing(client: LlamaClient, model: str | None = None) -> list[dict[str, Any]] | None:
    """GET /slots: what the server says each slot holds (`n_prompt_tokens`) and whether it is busy. None when it
    does not tell; a router's model that is not loaded has nothing (empty list). Raises BackendUnreachable."""
    try:
        return await client.slots(model)
    except BackendError:
        return [] if model is not None else None


async def decoded(client: LlamaClient, slot: int, model: str | None = None) -> int | None:
    """Tokens the slot's last task generated (GET /slots, `next_token[0].n_decoded`): more than 0 means its prompt
    was read to its end. None when the server does not tell."""
    try:
        slots = await listing(client, model)
    except ProxyError:
        return None
    for s in slots or ():
        if s.get("id") == slot:
            nxt = s.get("next_token")
            first = nxt[0] if isinstance(nxt, list) and nxt else nxt
            n = first.get("n_decoded") if isinstance(first, dict) else None
            return n if isinstance(n, int) else None
    return None


async def save(client: LlamaClient, slot: int, content: Content, folders: Folders | None,
               model: str | None = None, keep: frozenset[str] = frozenset(),
               timeout: float | None = None) -> tuple[SlotAction, tuple[str, ...]]:
    """Save the slot under `content.key`; after a session's save, apply its route's limits (never deleting the
    file just saved nor those in `keep`). Returns the server's answer and the files deleted."""
    result = await client.slot_action(slot, "save", content.key, model=model, timeout=timeout)
    log.info("slot_save url=%s slot=%d file=%s model=%s: %s", client.url, slot, content.key, model or "-",
             describe(result))
    if result.ok and folders is not None and folders.path:
        result = await asyncio.to_thread(written_whole, folders.path, content.key, result)
    deleted: tuple[str, ...] = ()
    folder = folders.of(content.key) if folders is not None and result.ok else None
    if folder is not None and folder.limits:
        protected = folders.protected if folders is not None else ()
        deleted = tuple(await asyncio.to_thread(folder.enforce, {content.key, *keep, *protected}))
    return result, deleted


def written_whole(folder: str, name: str, result: SlotAction) -> SlotAction:
    """A save answered 200 whose file, in a folder lpcache sees, is shorter than the `n_written` the server
    reports is a failed save, and the file is deleted: llama-server (b11434) writes through a buffered FILE and
    does not check the last flush when it closes it, so a disk that fills at the end of a save leaves a file cut
    short behind a 200, which every later restore would refuse after clearing the slot. A file not found is
    left to the caller (the folder may be another host's path of the same name)."""
    n_written = result.count("n_written")
    path = inside(folder, name)
    if n_written is None or path is None:
        return result
    try:   # opened, not only stat'ed: a network folder's cached attributes are checked again on open
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return result
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size >= n_written:
        return result
    try:
        os.remove(path)
    except OSError as e:
        log.warning("slot_file_remove_failed file=%s: %s", name, e)
    log.warning("slot_save_short file=%s size=%d n_written=%d: the file on disk is shorter than the server says it "
                "wrote (a full disk?); the save counts as failed and the file is deleted", name, size, n_written)
    error = f"the file on disk has {size} of the {n_written} bytes written (a full disk?)"
    return replace(result, ok=False, body={**result.body, "error": error})


async def bring_in(client: LlamaClient, slot: int, held: Content | None, want: Content, folders: Folders | None,
                   model: str | None = None, idle_limit: float | None = None, restore: bool = True,
                   owned: bool = False, held_saved: Callable[[Swap], Awaitable[None]] | None = None) -> Swap:
    """Put the cache `want` (a session's) into the slot that holds `held`.

    Nothing to do when the slot holds it already. Else: wait for the slot to be idle; save `held` under its own
    name if it changed since its last save (an unknown or empty slot is never saved over a good file); restore
    `want`'s file when there is one. Without a file the slot keeps what it holds: the server reuses whatever
    prefix the new prompt shares with it (an erase would gain nothing, and an empty pinned slot would bypass the
    server's RAM cache). `restore` False: the caller found a prefill faster than the restore.

    `owned`: the caller holds the slot (lpcache's pool), so no request of another client is in it and the server's
    word on its idleness (`GET /slots`, which a busy server answers only after its current batch, seconds on a CPU)
    is asked only when `held` is to be saved: the save checks the slot holds what lpcache believes.
    `held_saved` is awaited once `held` is on disk (or needs no save), before `want`'s file is looked for."""
    swap = Swap(held)
    if held is not None and held.key == want.key:
        swap.skipped = "resident"
        return swap
    started = time.perf_counter()
    if owned and (held is None or not held.dirty):
        idle, tokens = True, None
    else:
        idle, tokens = await idle_tokens(client, slot, model, idle_limit)
    swap.waited_ms = (time.perf_counter() - started) * 1000.0
    if not idle:
        log.warning("slot_busy url=%s slot=%d: the slot stayed busy with a request lpcache did not send; no swap "
                    "for %s (its prompt is read again)", client.url, slot, want.key)
        swap.skipped = "busy"
        return swap
    if held is not None and held.dirty and not holds(client, slot, held, tokens):
        swap.held = held = None
    if held is not None and held.dirty:
        swap.saved, swap.deleted = await save(client, slot, held, folders, model, frozenset({want.key}))
        if swap.saved.ok:
            swap.held = replace(held, saved=True)
    if held_saved is not None:
        await held_saved(swap)
    if not restore:
        swap.skipped = "prefill_faster"
        return swap
    folder = folders.of(want.key) if folders is not None else None
    if folder is not None and folder.has(want.key) is False:
        log.info("slot_restore url=%s slot=%d file=%s model=%s: no file yet (first request of the session)",
                 client.url, slot, want.key, model or "-")
        return swap
    swap.restored = await restore_file(client, slot, want.key, model)
    if swap.restored.ok:
        swap.held = replace(want, saved=True)
        if folder is not None:
            await asyncio.to_thread(folder.touch, want.key)
    else:
        swap.held = None   # a failed restore leaves the slot empty
    return swap
