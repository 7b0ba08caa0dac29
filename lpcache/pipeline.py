"""The way of a chat request through lpcache, one short step per method:

    parse -> prompt (key, blocks) -> find a saved cache -> take a slot -> restore? -> dispatch -> relay
    ... after the client has its answer: save? -> meta index -> release the slot -> observers

A cache miss, a failed restore or a failed save only ever costs a prefill: the request itself does not fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp

from . import swap
from .attempts import Attempts
from .backends import Backend
from .cache_files import Limits
from .coalesce import Coalescer, coalesce_key
from .config import Settings
from .errors import BackendError, BadRequest, ClientGone, ProxyError, SlotsBusy
from .guard import bearer_token, read_body
from .index import Candidate, MetaEntry, MetaIndex
from .llama import SlotAction
from .plugins.base import Answer, ChatRequest, Prefilter, Reject, Serve
from .prefix import Prompt, common_prefix, raw_prefix
from .record import Observer, RequestRecord
from .relay import ClientWatch, FollowerRelay, JsonRelay, ServedRelay, SseRelay
from .sessions import SessionBook, route_name, session_filename, session_id
from .slots import Choice, Content, Slot, SlotPool, preferred
from .speeds import Speeds

log = logging.getLogger("lpcache.pipeline")

REUSE_MIN_TOKENS = 64    # a restore expected to bring fewer tokens than this says nothing about reuse
REUSE_MIN_SHARE = 0.1    # a restore is "not reused" when cache_n is below this share of what it should bring
SLOTS_TRUSTED_FOR = 1.0  # seconds after a backend's last answer during which what its slots hold is not re-checked
OWN_SLOT_WAIT = 10.0  # seconds a request waits for the busy slot that holds its conversation before going elsewhere


def parse_chat_body(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, or the error the client should see: 422 for a body that is not JSON, 400 for
    JSON that is not a chat request."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", status=422, code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_body")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", code="invalid_messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", code="invalid_messages")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", code="invalid_messages")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string or an array of parts", code="invalid_messages")
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("'model' must be a string", code="invalid_model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false", code="invalid_stream")
    return body


@dataclass
class BackgroundSaves:
    """Saves outside any request (idle, shutdown, a model about to be unloaded): they have no request record."""

    saves_ok: int = 0
    saves_failed: int = 0
    bytes: int = 0


class Pipeline:
    def __init__(self, settings: Settings, backends: Sequence[Backend], pool: SlotPool, index: MetaIndex,
                 observers: Sequence[Observer] = (), prefilters: Sequence[Prefilter] = ()) -> None:
        self.settings = settings
        self.backends = list(backends)
        self.pool = pool
        self.index = index
        self.observers = list(observers)
        self.prefilters = list(prefilters)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.coalescer = Coalescer()
        self.kv_off: set[tuple[int, str]] = set()   # (backend, model) whose restores the server does not reuse
        self.sessions = SessionBook()
        self.folders = [swap.Folders(b.config.slot_save_path, self._limits(b)) for b in self.backends]
        self.idle_saves: dict[Slot, asyncio.Task[None]] = {}
        self.background = BackgroundSaves()
        self.speeds: dict[tuple[int, str], Speeds] = {}

    def _limits(self, backend: Backend) -> Callable[[str], Limits]:
        c, s = backend.config, self.settings
        limits = Limits.of(s.max_files if c.max_files is None else c.max_files,
                           s.max_gib if c.max_gib is None else c.max_gib)
        return lambda tag: limits

    # ---- the steps ----

    async def chat(self, request: Request, record: RequestRecord) -> ASGIApp:
        """Serve one chat request; returns the ASGI app that relays the answer. Raises ProxyError for an error
        answer, ClientGone when the client left before the answer started (its record is already told)."""
        started = time.perf_counter()
        body = parse_chat_body(await read_body(request, self.settings.max_body_bytes))
        model = body.get("model") or self.settings.model_id
        stream = bool(body.get("stream"))
        prompt = Prompt.of(model, body["messages"], self.settings.words_per_block)
        big = prompt.n_words > self.settings.big_threshold_words
        record.model, record.stream, record.key, record.n_words, record.big = (
            model, stream, prompt.key, prompt.n_words, big)
        view = None
        if self.prefilters:
            view = ChatRequest(body=dict(body), key=prompt.key, model=model, stream=stream,
                               text=raw_prefix(body["messages"]), headers=dict(request.headers),
                               client_key=self.client_key(request))
            served = await self.prefilter(view, record)
            if served is not None:
                return ServedRelay(served, record, self.notify, self.spawn, view)
        want = self.session_cache(request, model, prompt, body["messages"], record)
        if big:
            body["cache_prompt"] = True

        # From here on a client that leaves cancels the work: waiting for a slot, restoring, or generating.
        watch = ClientWatch(request.receive)
        group = None
        if self.settings.coalesce_requests:
            group, leader = self.coalescer.join(coalesce_key(body), stream)
            if not leader:
                record.coalesced = True
                return FollowerRelay(group, stream, record, watch, self.notify)
            record.coalesced = False
        # With client keys, Authorization is lpcache's own; without, it goes on to llama-server as it came.
        client_auth = None if self.settings.api_keys else request.headers.get("authorization")
        attempts = Attempts(self, body, prompt, big, record, client_auth, view, want)
        attempts.group = group
        try:
            await attempts.start()
        except asyncio.CancelledError:
            watch.stop()
            if not watch.left():
                raise
            record.reason = "client_disconnected"
            attempts.end_group({"error": {"message": "the client that asked first left", "type": "backend_error",
                                          "code": 502}})
            attempts.cancelled()
            raise ClientGone() from None
        except ProxyError as e:
            watch.stop()
            attempts.end_group(e.body())
            raise
        except BaseException:
            watch.stop()
            attempts.end_group({"error": {"message": "internal error", "type": "server_error", "code": 500}})
            raise
        if stream:
            return SseRelay(attempts, record, watch, self.settings.stream_queue_size, started)
        return JsonRelay(attempts, record, watch)

    def session_cache(self, request: Request, model: str, prompt: Prompt, messages: list[Any],
                      record: RequestRecord) -> Content | None:
        """Session mode: a valid X-Session-ID keys the request by route and session. Returns the cache the slot
        must hold (its file name is `<route tag>_<session>.bin`), or None for prefix mode. Logs where the prompt
        first differs from the session's previous one."""
        header = request.headers.get("x-session-id")
        sid = session_id(header)
        if sid is None:
            if header is not None:
                log.debug("session_id_ignored: not 32 lower-case hex digits (prefix mode)")
            return None
        route = route_name(model)
        name = session_filename(route, sid)
        record.session = sid
        info = self.sessions.seen(name, sid, route, messages, time.time())
        if info.comparison is not None:
            log.info("session_prompt file=%s %s", name, info.comparison.log_line())
        return Content(name, prompt.chain, keep=True, session=sid, model=model)

    async def prefilter(self, view: ChatRequest, record: RequestRecord) -> Serve | None:
        """Run the prefilters in order: the first that rejects or serves decides. A prefilter that fails is
        logged and skipped (it did not reject on purpose)."""
        for plugin in self.prefilters:
            try:
                verdict = await plugin.check(view)
            except Exception:
                log.exception("prefilter_failed plugin=%s: the request goes on", plugin.name)
                continue
            if isinstance(verdict, Reject):
                record.reason, record.prefilter = "prefilter_reject", f"{plugin.name}:reject"
                log.info("prefilter_reject plugin=%s key=%s", plugin.name, view.key[:16])
                raise ProxyError(verdict.message, status=verdict.status, type=verdict.type, code=verdict.code)
            if isinstance(verdict, Serve):
                record.prefilter = f"{plugin.name}:serve"
                log.info("prefilter_serve plugin=%s key=%s", plugin.name, view.key[:16])
                return verdict
        return None

    def answered(self, view: ChatRequest, answer: Answer) -> None:
        """Tell the prefilters what the backend answered (a result cache stores it), off the request's path."""
        for plugin in self.prefilters:
            self.spawn(_quietly(plugin.answered(view, answer), plugin.name))

    def client_key(self, request: Request) -> str | None:
        if not self.settings.api_keys:
            return None
        return bearer_token(request.headers.get("authorization", ""))

    def kv_enabled(self, backend: Backend, model: str) -> bool:
        """Save and restore for this backend and model: on, unless off in BACKENDS or found useless."""
        return backend.kv_cache and (backend.index, model) not in self.kv_off

    def check_reuse(self, backend: Backend, model: str, record: RequestRecord) -> None:
        """After a restore: did the server use it? A sliding-window model without --swa-full (or a hybrid one)
        re-computes the whole prompt after a restore, so restoring only costs time: say so once, and stop
        saving and restoring for this backend and model until lpcache restarts."""
        if not record.restored or record.cache_n is None or not record.restored_tokens:
            return
        expected = min(record.restored_tokens, (record.prompt_tokens or 0) * (record.restore_share or 0.0))
        if expected < REUSE_MIN_TOKENS:
            return
        record.restore_reused = record.cache_n >= REUSE_MIN_SHARE * expected
        if record.restore_reused or (backend.index, model) in self.kv_off:
            return
        self.kv_off.add((backend.index, model))
        log.warning(
            "restore_not_reused backend=%s model=%s restored_tokens=%d cache_n=%d: the server computed the prompt "
            "again after the restore. A sliding-window model (Gemma 3, for one) reuses a restored cache only when "
            "llama-server runs with --swa-full; a hybrid or recurrent model only when the prompt extends the saved "
            "one exactly. lpcache stops saving and restoring for this backend and model until it restarts.",
            backend.url, model, record.restored_tokens, record.cache_n)

    def find_saved(self, prompt: Prompt) -> Candidate | None:
        """The saved cache sharing the longest prefix with the prompt, restorable on some backend."""
        readers = [b for b in self.backends if self.kv_enabled(b, prompt.model)]
        if not readers:
            return None

        def usable(e: MetaEntry) -> bool:
            return any(e.readable_by(b.url, b.config.slot_save_path) for b in readers)

        candidate = self.index.find(prompt, usable, self.settings.lcp_th)
        if candidate is not None:
            log.info("restore_candidate key=%s shared_blocks=%d of=%d ratio=%.3f", candidate.entry.key[:16],
                     candidate.shared, len(prompt.chain), candidate.ratio)
        return candidate

    async def take_slot(self, prompt: Prompt, candidate: Candidate | None, record: RequestRecord,
                        allowed: Callable[[Slot], bool] | None = None, want: Content | None = None) -> Choice:
        """A slot for the request: an idle one, or, when a busy slot will hold far more of the prompt (the
        previous turn of the conversation, still being answered or saved; in session mode, the slot that holds
        the session), that one after a bounded wait."""
        choice = None
        session = want.key if want is not None else None
        homes = self.session_homes(want)
        prefer = preferred(self.pool.slots, prompt, candidate, allowed, session, homes)
        if prefer is not None:
            wanted = prefer if allowed is None else (lambda s: allowed(s) and prefer(s))
            try:
                choice = await self.pool.acquire(prompt, candidate, wanted,
                                                 timeout=min(OWN_SLOT_WAIT, self.settings.slot_wait_timeout),
                                                 session=session, homes=homes)
                log.debug("waited_for_slot slot=%s key=%s", choice.slot.name, prompt.key[:16])
            except SlotsBusy:
                log.info("own_slot_still_busy key=%s: taking another", prompt.key[:16])
        if choice is None:
            try:
                choice = await self.pool.acquire(prompt, candidate, allowed, session=session, homes=homes)
            except SlotsBusy:
                record.reason = "slot_timeout"
                raise
        self.cancel_idle_save(choice.slot)
        choice.slot.pending = want or Content(prompt.key, prompt.chain)
        record.backend, record.slot = self.backends[choice.slot.backend].url, choice.slot.id
        return choice

    def session_homes(self, want: Content | None) -> frozenset[int]:
        """The backends whose slot-save folder has the session's file (where it was saved, or a folder shared with
        that backend)."""
        info = self.sessions.get(want.key) if want is not None else None
        if info is None or not info.homes:
            return frozenset()
        paths = {self.backends[i].config.slot_save_path for i in info.homes} - {None}
        return frozenset(b.index for b in self.backends
                         if b.index in info.homes or b.config.slot_save_path in paths)

    def slot_model(self, backend: Backend, model: str) -> str | None:
        """The model slot calls must name: on a router, the request's model (without LiteLLM's `openai/`)."""
        return route_name(model) if backend.router else None

    # ---- what the slots really hold ----

    async def check_slots(self) -> None:
        """A server restarted between two requests holds nothing, whatever lpcache believes; trusting it would
        send the next request to an empty slot instead of restoring its cache. So a backend silent for more than
        SLOTS_TRUSTED_FOR (or failed since) is asked `GET /slots` first: a slot that has run no task since the
        server started (no `n_prompt_tokens`) is empty. Costs one small request after a pause, none under load."""
        now = time.monotonic()
        due = [b for b in self.backends if now - b.last_seen > SLOTS_TRUSTED_FOR and any(
            s.backend == b.index and s.content is not None and not s.busy for s in self.pool.slots)]
        if due:
            await asyncio.gather(*(self._check_slots(b) for b in due))

    async def _check_slots(self, backend: Backend) -> None:
        mine = [s for s in self.pool.slots if s.backend == backend.index and s.content is not None]
        for model in {s.model for s in mine}:
            path = "/slots" if model is None else f"/slots?model={quote(model)}&autoload=false"
            try:
                listing = await backend.client.get_json(path)
            except BackendError:
                listing = [] if model is not None else None   # a router's unloaded model has empty slots
            except ProxyError:
                continue   # unreachable: the request will find out and fail over
            if not isinstance(listing, list):
                continue   # no /slots on this server: lpcache cannot tell
            held = {s.get("id") for s in listing if isinstance(s, dict) and s.get("n_prompt_tokens")}
            lost = [s for s in mine if s.model == model and s.id not in held and not s.busy]
            for slot in lost:
                slot.content = None
            if lost:
                log.warning("slots_emptied backend=%s model=%s slots=%s: the server holds nothing there (restarted "
                            "or unloaded); their caches are restored from disk when asked for", backend.url,
                            model or "-", ",".join(str(s.id) for s in lost))
        backend.last_seen = time.monotonic()

    # ---- routers: slots per model, and the model about to be unloaded ----

    async def model_slots(self, model: str) -> None:
        """The first request naming a model makes that model's slots on every router backend: as many as BACKENDS
        says, else as the model's instance reports (when it is loaded), else N_SLOTS."""
        route = route_name(model)
        for b in self.backends:
            if not b.router or route in b.model_slots:
                continue
            n = b.config.n_slots or await self.instance_slots(b, route)
            if n is None:
                b.slots_guessed.add(route)   # not loaded yet: asked again once a request has loaded it
            self.pool.add(b.slots_for(route, n or self.settings.n_slots))

    async def instance_slots(self, backend: Backend, route: str) -> int | None:
        """The slot count of a router's model instance, without loading it (None when it is not loaded)."""
        try:
            total = (await backend.client.props(route)).get("total_slots")
        except ProxyError:
            return None
        return total if isinstance(total, int) and total > 0 else None

    async def recount_slots(self, backend: Backend, route: str) -> None:
        n = await self.instance_slots(backend, route)
        if n is not None and route in backend.slots_guessed:
            backend.slots_guessed.discard(route)
            self.pool.add(backend.slots_for(route, n))
            log.info("router_model_slots backend=%s model=%s slots=%d", backend.url, route, n)

    async def make_room(self, backend: Backend, model: str) -> None:
        """A request for a model the router does not hold makes it unload the one used longest ago (beyond its
        --models-max), and that model's slots are gone with it: save them first. The router counts every POST
        as a use, our saves too, so a model whose slots were just saved moves to the young end, and the one it
        will unload is the oldest with nothing left to save."""
        if not backend.router:
            return
        route = route_name(model)
        limit = self.settings.models_max if backend.config.models_max is None else backend.config.models_max
        models = backend.models
        new = route not in models
        models[route] = None
        models.move_to_end(route)
        if not new or not limit:
            return
        while len(models) > limit:
            busy = {s.model for s in self.pool.slots if s.backend == backend.index and s.busy}
            victim = next((m for m in models if m != route and m not in busy), None)
            if victim is None:
                return  # every other model has a request in flight: the router unloads none of them
            slots = [s for s in self.pool.slots if s.backend == backend.index and s.model == victim]
            dirty = [s for s in slots if s.content is not None and s.content.dirty]
            if dirty and self.kv_enabled(backend, victim):
                log.info("router_unload_ahead backend=%s model=%s for=%s: saving %d slot(s) first", backend.url,
                         victim, route, len(dirty))
                for slot in dirty:
                    if not await self.save_idle_slot(slot, backend, "unload", force=True):
                        slot.content = None   # could not save it: what the router unloads is lost
                models.move_to_end(victim)    # the router saw the saves as uses
                models.move_to_end(route)
                continue
            del models[victim]
            for slot in slots:
                slot.content = None           # the instance and its slots go; a reload starts empty
            log.info("router_unloads backend=%s model=%s for=%s", backend.url, victim, route)

    async def prepare(self, choice: Choice, backend: Backend, prompt: Prompt, want: Content | None,
                      record: RequestRecord) -> None:
        """Make the slot hold the best cache for the request before it is sent: in session mode swap the session
        in; in prefix mode restore the chosen saved cache. Either way, what the slot holds is saved first when it
        is worth keeping, unsaved (SAVE_POLICY=evict, or a small session request) and about to be replaced."""
        await self.make_room(backend, prompt.model)
        if not self.kv_enabled(backend, prompt.model):
            return
        slot = choice.slot
        if want is not None:
            await self.swap_session(choice, backend, prompt, want, record)
            return
        restoring = choice.restore is not None and self.restore_pays(
            backend, prompt.model, len(choice.restore.entry.chain), choice.restore.shared, record)
        held = slot.content
        if held is not None and held.dirty and (
                restoring or common_prefix(held.chain, prompt.chain) < len(held.chain)):
            model = self.slot_model(backend, prompt.model)
            if await swap.wait_idle(backend.client, slot.id, model):
                result, _ = await swap.save(backend.client, slot.id, held, self.folders[backend.index], model)
                self.saved_held(backend, slot, held, result, record)
        if restoring:
            await self.restore(choice, record)

    def speeds_of(self, backend: Backend, model: str) -> Speeds:
        key = (backend.index, model)
        speeds = self.speeds.get(key)
        if speeds is None:
            speeds = self.speeds[key] = Speeds.new()
        return speeds

    def restore_pays(self, backend: Backend, model: str, file_blocks: int, reused_blocks: int,
                     record: RequestRecord) -> bool:
        """Whether restoring a file holding `file_blocks` blocks beats prefilling the `reused_blocks` it spares,
        at this backend's measured speeds (blocks stand for tokens: the same factor on both sides)."""
        speeds = self.speeds_of(backend, model)
        if speeds.restore_pays(file_blocks, reused_blocks):
            return True
        record.restore_skipped = True
        log.info("restore_skipped backend=%s model=%s file_blocks=%d reused_blocks=%d %s: the prefill is faster",
                 backend.url, model, file_blocks, reused_blocks,
                 " ".join(f"{k}={v:.3f}" for k, v in speeds.describe().items() if v is not None))
        return False

    async def swap_session(self, choice: Choice, backend: Backend, prompt: Prompt, want: Content,
                           record: RequestRecord) -> None:
        slot = choice.slot
        info = self.sessions.get(want.key)
        restore = True
        if info is not None and info.saved_chain and (slot.content is None or slot.content.key != want.key):
            restore = self.restore_pays(backend, prompt.model, len(info.saved_chain),
                                        common_prefix(info.saved_chain, prompt.chain), record)
        result = await swap.bring_in(backend.client, slot.id, slot.content, want, self.folders[backend.index],
                                     self.slot_model(backend, prompt.model), restore=restore)
        if result.saved is not None and slot.content is not None:
            self.saved_held(backend, slot, slot.content, result.saved, record)
        slot.content = result.held
        restored = result.restored
        if restored is not None:
            self.note_restore(backend, prompt.model, restored, record)
            if info is not None and info.saved_chain and prompt.chain:
                record.restore_share = common_prefix(info.saved_chain, prompt.chain) / len(prompt.chain)
            if restored.ok and info is not None:
                info.restores += 1
        hit = result.skipped == "resident" or bool(restored is not None and restored.ok)
        record.cache_hit = hit
        if info is not None and hit:
            info.cache_hits += 1

    def saved_held(self, backend: Backend, slot: Slot, held: Content, result: SlotAction,
                   record: RequestRecord | None) -> None:
        """Bookkeeping after the slot's previous cache was saved under its own name: its meta file (a prefix
        cache) or its session entry; a failed save of a prefix cache may have left a partial file."""
        n_written = _int_or_none(result.body.get("n_written"))
        if record is not None:
            record.swap_saved, record.swap_save_ms, record.swap_save_bytes = result.ok, result.ms, n_written
        else:
            b = self.background
            b.saves_ok, b.saves_failed = b.saves_ok + result.ok, b.saves_failed + (not result.ok)
            b.bytes += n_written or 0
        path = backend.config.slot_save_path
        if result.ok:
            if slot.content is held:
                slot.content = replace(held, saved=True)
            if held.session is not None:
                info = self.sessions.get(held.key)
                if info is not None:
                    info.saved(backend.index, n_written, held.chain)
            elif held.prompt is not None:
                self.spawn(self.index.add(held.prompt, backend.url, path))
        elif held.session is None:
            self.spawn(self.index.forget(held.key, path))

    def cancel_idle_save(self, slot: Slot) -> None:
        task = self.idle_saves.pop(slot, None)
        if task is not None:
            task.cancel()

    def schedule_idle_save(self, slot: Slot, backend: Backend) -> None:
        """SAVE_IDLE_SECONDS: save the slot's unsaved cache once no request used it for that long."""
        delay = self.settings.save_idle_seconds
        if delay <= 0 or slot.content is None or not slot.content.dirty:
            return
        self.cancel_idle_save(slot)
        self.idle_saves[slot] = asyncio.ensure_future(self._idle_save(slot, backend, delay))

    async def _idle_save(self, slot: Slot, backend: Backend, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.idle_saves.get(slot) is asyncio.current_task():
            del self.idle_saves[slot]
        await self.save_idle_slot(slot, backend, "idle")

    async def save_idle_slot(self, slot: Slot, backend: Backend, why: str, force: bool = False) -> bool:
        """Save an idle slot's unsaved cache under its own name, holding the slot meanwhile (outside a request:
        idle, shutdown, a router about to unload the model). False when there was nothing to do or the slot was
        taken."""
        held = slot.content
        if held is None or not held.dirty or not self.kv_enabled(backend, held.model):
            return False
        if not self.pool.take_idle(slot, force):
            return False
        try:
            slot_model = self.slot_model(backend, held.model)
            if not await swap.wait_idle(backend.client, slot.id, slot_model):
                return False
            result, _ = await swap.save(backend.client, slot.id, held, self.folders[backend.index], slot_model)
            log.info("background_save why=%s slot=%s file=%s ok=%s", why, slot.name, held.key,
                     str(result.ok).lower())
            self.saved_held(backend, slot, held, result, None)
            return result.ok
        finally:
            self.pool.release(slot, True, used=False)

    async def save_all(self, timeout: float) -> None:
        """At shutdown (SAVE_POLICY=evict): save every idle slot whose cache is not on disk yet."""
        for task in list(self.idle_saves.values()):
            task.cancel()
        self.idle_saves.clear()
        jobs = [self.save_idle_slot(slot, self.backends[slot.backend], "shutdown")
                for slot in self.pool.slots if slot.content is not None and slot.content.dirty]
        if jobs:
            log.info("saving %d unsaved slot cache(s) before stopping", len(jobs))
            await asyncio.wait([asyncio.ensure_future(j) for j in jobs], timeout=timeout)

    def note_restore(self, backend: Backend, model: str, result: SlotAction, record: RequestRecord) -> None:
        """A restore's answer, in the record and (when it worked) in the backend's restore speed."""
        record.restored, record.restore_ms = result.ok, result.ms
        record.restore_bytes = _int_or_none(result.body.get("n_read"))
        record.restored_tokens = _int_or_none(result.body.get("n_restored"))
        if result.ok:
            self.speeds_of(backend, model).restore.add(result.ms, record.restored_tokens or 0)

    async def restore(self, choice: Choice, record: RequestRecord) -> None:
        """Load the saved cache into the slot. On failure llama-server clears the slot; a meta whose file is gone
        is dropped. Either way the request goes on."""
        assert choice.restore is not None
        entry, slot = choice.restore.entry, choice.slot
        backend = self.backends[slot.backend]
        result = await backend.client.slot_action(slot.id, "restore", entry.key)
        self.note_restore(backend, entry.model, result, record)
        record.restore_share = choice.restore.ratio
        log.info("restore_before_chat key=%s slot=%s ok=%s n_restored=%s ms=%.1f%s", entry.key[:16], slot.name,
                 str(result.ok).lower(), result.body.get("n_restored"), result.ms,
                 "" if result.ok else f" reason={result.error!r}")
        if result.ok:
            slot.content = Content(entry.key, entry.chain, saved=True, keep=True, model=entry.model)
            self.spawn(self.index.touch(entry.key))  # the file's timestamp is rewritten off the request's path
        else:
            slot.content = None
            await self.index.discard_if_stale(entry.key)

    async def after(self, choice: Choice, backend: Backend, prompt: Prompt, big: bool, delivered: bool,
                    record: RequestRecord, want: Content | None = None) -> None:
        """After the client has its answer: save a big prompt's cache (SAVE_POLICY=eager), record it, release the
        slot, tell the observers. Runs even when the client left mid-stream: the prompt's cache is still worth
        keeping. With SAVE_POLICY=evict the cache stays unsaved in the slot until something needs the slot."""
        content: Content | None = (replace(want, chain=prompt.chain) if want is not None
                                   else Content(prompt.key, prompt.chain, keep=big, prompt=prompt,
                                                model=prompt.model))
        if record.prefill_ms is not None and record.prompt_n:
            self.speeds_of(backend, prompt.model).prefill.add(record.prefill_ms, record.prompt_n)
        if backend.router and route_name(prompt.model) in backend.slots_guessed:
            self.spawn(self.recount_slots(backend, route_name(prompt.model)))
        try:
            self.check_reuse(backend, prompt.model, record)
            if big and self.settings.save_policy == "eager" and self.kv_enabled(backend, prompt.model):
                assert content is not None
                if want is not None:
                    content = await self.save_session(choice, backend, prompt, content, record)
                else:
                    content = await self.save(choice, backend, prompt, record)
        except Exception:  # never leave the slot locked
            log.exception("save_crashed key=%s", prompt.key[:16])
            content = None
        finally:
            self.pool.release(choice.slot, content)
            self.schedule_idle_save(choice.slot, backend)
            self.notify(record)

    async def save_session(self, choice: Choice, backend: Backend, prompt: Prompt, content: Content,
                           record: RequestRecord) -> Content:
        """Eager: write the session's cache to its file now (no retries: the next swap saves it again)."""
        result, _ = await swap.save(backend.client, choice.slot.id, content, self.folders[backend.index],
                                    self.slot_model(backend, prompt.model))
        record.saved, record.save_ms = result.ok, result.ms
        record.save_bytes = _int_or_none(result.body.get("n_written"))
        if not result.ok:
            record.reason = record.reason or "save_failed"
            return content
        info = self.sessions.get(content.key)
        if info is not None:
            info.saved(backend.index, record.save_bytes, content.chain)
        return replace(content, saved=True)

    async def save(self, choice: Choice, backend: Backend, prompt: Prompt, record: RequestRecord) -> Content:
        slot = choice.slot
        attempts = 1 + self.settings.save_retries
        for attempt in range(1, attempts + 1):
            result = await backend.client.slot_action(slot.id, "save", prompt.key)
            if result.ok:
                record.saved, record.save_ms = True, result.ms
                record.save_bytes = _int_or_none(result.body.get("n_written"))
                log.info("slot_saved key=%s slot=%s n_saved=%s bytes=%s ms=%.1f", prompt.key[:16], slot.name,
                         result.body.get("n_saved"), result.body.get("n_written"), result.ms)
                # The meta file is written in the background: the slot is free once the server has saved it.
                self.spawn(self.index.add(prompt, backend.url, backend.config.slot_save_path))
                return Content(prompt.key, prompt.chain, saved=True, keep=True, prompt=prompt)
            log.warning("slot_save_failed key=%s slot=%s attempt=%d/%d status=%s reason=%r", prompt.key[:16],
                        slot.name, attempt, attempts, result.status, result.error)
            if attempt < attempts:
                await asyncio.sleep(self.settings.save_retry_delay_ms / 1000.0)
        record.saved = False
        record.reason = record.reason or "save_failed"
        # The server writes in place: a failed save may have left a partial file under this key.
        await self.index.forget(prompt.key, backend.config.slot_save_path)
        return Content(prompt.key, prompt.chain, keep=True, prompt=prompt)

    # ---- plumbing ----

    def notify(self, record: RequestRecord) -> None:
        record.elapsed_ms = (time.time() - record.started) * 1000.0
        for observer in self.observers:
            try:
                observer(record)
            except Exception:
                log.exception("observer %r failed", observer)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run bookkeeping in the background, and keep it referenced until done (see `drain`)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def settle(self) -> None:
        """Wait until no bookkeeping runs (tests, benchmarks): every save done, every slot released."""
        while self.tasks:
            await asyncio.wait(set(self.tasks))

    async def drain(self, timeout: float) -> None:
        """At shutdown: let running saves finish, within `timeout` seconds."""
        if self.tasks:
            log.info("waiting for %d background save(s)", len(self.tasks))
            await asyncio.wait(set(self.tasks), timeout=timeout)


async def _quietly(coro: Coroutine[Any, Any, None], name: str) -> None:
    try:
        await coro
    except Exception:
        log.exception("plugin_failed plugin=%s hook=answered", name)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
