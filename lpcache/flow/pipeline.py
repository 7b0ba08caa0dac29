"""The way of a generation request through lpcache, one short step per method:

    parse (apis: chat, responses, messages, completions, infill) -> prefilters -> session? -> coalesce? ->
    attempts: slot (slot_fill) -> restore or swap (slot_fill, swap) -> send (llama, pinned or `unpinned`) -> relay
    ... after the answer: save (saving) -> release -> observers

A cache miss, a failed restore or a failed save only ever costs a prefill: the request itself does not fail. The
pipeline only orders the steps; each step's module knows how it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp

from lpcache.apis.base import Api, Call, off_loop
from lpcache.backends import swap
from lpcache.backends.backend import Backend
from lpcache.backends.router_models import RouterModels
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slot_truth import SlotTruth
from lpcache.backends.slots import Content
from lpcache.cache.cache_files import Limits
from lpcache.cache.index import MetaIndex
from lpcache.cache.prefix import Prompt, raw_prefix
from lpcache.cache.reuse import ReuseWatch
from lpcache.cache.session_ids import SessionIds, session_id
from lpcache.cache.sessions import SessionBook, route_name, session_filename
from lpcache.cache.speeds import SpeedBook
from lpcache.config import Settings
from lpcache.errors import ClientGone, ProxyError
from lpcache.fleet.replica import Fleet
from lpcache.flow import forwarded, prefiltering
from lpcache.flow.attempts import Attempts, Crew
from lpcache.flow.coalesce import Coalescer, coalesce_key
from lpcache.flow.guard import Caller, read_body
from lpcache.flow.plugin_api import Answer, ChatRequest, Prefilter, Serve, answer_wanted_by
from lpcache.flow.ram_presence import RamPresence
from lpcache.flow.record import Observer, RequestRecord
from lpcache.flow.relay import ClientWatch, FollowerRelay, JsonRelay, ServedRelay, SseRelay
from lpcache.flow.saving import Saver
from lpcache.flow.slot_fill import SlotFiller
from lpcache.flow.unpinned import UnpinnedMode

log = logging.getLogger("lpcache.pipeline")


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
        self.sessions = SessionBook()
        self.session_ids = SessionIds(log)
        self.speeds = SpeedBook()
        self.reuse = ReuseWatch()
        folders = [swap.Folders(b.config.slot_save_path, self._limits(b)) for b in self.backends]
        self.saver = Saver(settings, self.backends, pool, index, self.sessions, self.speeds, folders,
                           self._enabled, self.notify, self.spawn)
        self.routers = RouterModels(settings, self.backends, pool, self.saver.save_idle_slot, self._enabled)
        self.filler = SlotFiller(settings, self.backends, pool, index, self.sessions, self.speeds, self.reuse,
                                 self.routers, self.saver)
        self.presence = RamPresence(settings, self.backends, pool, self.saver.server_caches, self.spawn)
        self.truth = SlotTruth(self.backends, pool, on_restart=self.presence.restarted)
        self.unpinned = UnpinnedMode(settings, self.backends, pool, self.speeds, self.saver, self.spawn)
        self.crew = Crew(self.backends, pool, self.filler, self.saver, self.routers, self.truth, self.coalescer,
                         settings.request_timeout, self.answered, self.notify, self.spawn, self.unpinned)
        self.fleet: Fleet | None = None

    def join_fleet(self) -> Fleet:
        """REDIS_URL: share the cache map and take slot leases with the other replicas (`fleet`)."""
        assert self.settings.redis_url
        self.fleet = Fleet(self.settings.redis_url, self.settings.replica_id, self.settings.slot_lease_ms,
                           self.backends, self.pool, self.index, self.sessions, self.speeds, self.spawn,
                           ring_files=self.settings.ring_files)
        self.saver.ring = self.fleet.ring_name
        return self.fleet

    def _limits(self, backend: Backend) -> Callable[[str], Limits]:
        c, s = backend.config, self.settings
        limits = Limits.of(s.max_files if c.max_files is None else c.max_files,
                           s.max_gib if c.max_gib is None else c.max_gib)
        return lambda tag: limits

    def _enabled(self, backend: Backend, model: str) -> bool:
        return self.filler.enabled(backend, model)

    # ---- the steps ----

    async def generate(self, request: Request, record: RequestRecord, api: Api, caller: Caller) -> ASGIApp:
        """Serve one generation request of `api` from `caller`; returns the ASGI app that relays the answer. Raises
        ProxyError for an error answer, ClientGone when the client left before the answer started (its record is
        already told)."""
        started = time.perf_counter()
        record.api = api.name
        raw = await read_body(request, self.settings.max_body_bytes, self.settings.client_timeout)
        call = await Call.read(api, raw, request.url.path, self.settings)
        body, prompt, chat = call.body, call.prompt, api.name == "chat"
        record.model, record.stream = call.model, call.stream
        passed = caller.passed
        router = await self.routers.unknown(call.model)
        if router is not None:   # no router serves that model: it says so itself, and nothing is made for it
            return await forwarded.router_says(router, request.url.path, passed, body, record, self.notify)
        # Who asks: answers are shared (coalescing, the result cache) only within one client and one session.
        client = caller.identity
        session, parents, source = caller.named(api.name, body, self.settings.agent_session_ids)
        sid = self.session_ids.read(session)   # the session it names, lpcache's 32-hex id (None: prefix mode)
        view, listeners = None, []
        if self.prefilters:
            view = ChatRequest(body=dict(body) if chat else {**body, "messages": call.shown},
                               key=prompt.key if prompt else "", model=call.model, stream=call.stream,
                               text=raw_prefix(call.shown), headers=caller.shown,
                               client_key=client, session=session, api=api.name)
            served = await self.prefilter(view, record)
            if served is not None:
                return ServedRelay(served, record, self.notify, self.spawn, view, sid)
            listeners = answer_wanted_by(self.prefilters, view) if chat and prompt else []
        if prompt is None:       # a body the cache cannot key (several prompts...): a slot of the pool, uncached
            relay = await forwarded.generate(self.crew, self.settings, request.url.path, _path_qs(request),
                                             passed, raw, record)
            assert relay is not None
            return relay
        record.key, record.n_words, record.big = prompt.key, prompt.n_words, call.big
        want = await self.session_cache(caller.owner, sid, prompt, call.messages, record, len(raw),
                                        (source, parents)) if sid else None
        if call.big:
            call.send["cache_prompt"] = True

        coalesce_as = (await off_loop(len(raw), coalesce_key, body, client, session,
                                      None if chat else f"{call.path} stream={call.stream}")
                       if self.settings.coalesce_requests else None)

        # From here on a client that leaves cancels the work: waiting for a slot, restoring, or generating.
        watch = ClientWatch(request.receive)
        group = None
        if coalesce_as is not None:
            group, leader = self.coalescer.join(coalesce_as, call.stream)
            if not leader:
                record.coalesced = True
                return FollowerRelay(group, call.stream, record, watch, self.notify, sid)
            record.coalesced = False
            self.coalescer.lead(group, watch)
        attempts = Attempts(self.crew, call.send, prompt, call.big, record, caller.credential,
                            view if listeners else None, want)
        attempts.listeners, attempts.group, attempts.path = listeners, group, call.upstream_path()
        try:
            await attempts.start()
        except asyncio.CancelledError:
            watch.stop()
            left = watch.left()
            record.reason = "client_disconnected" if left else "cancelled"
            attempts.end_group({"error": {"message": "the client that asked first left", "type": "backend_error",
                                          "code": 502}})
            attempts.cancelled()   # the slot goes back either way
            if not left:
                raise
            raise ClientGone() from None
        except ProxyError as e:
            watch.stop()
            attempts.end_group(api.error_document(e), e.status)   # the followers get what the leader gets
            raise
        except BaseException:
            watch.stop()
            attempts.end_group({"error": {"message": "internal error", "type": "server_error", "code": 500}})
            raise
        if call.stream:
            return SseRelay(attempts, record, watch, self.settings.stream_queue_size, started, api,
                            api.converter(body))
        return JsonRelay(attempts, record, watch, api, body)

    async def session_cache(self, owner: str | None, sid: str, prompt: Prompt, messages: list[Any],
                            record: RequestRecord, size: int,
                            named: tuple[str, Sequence[str]] = ("x-session-id", ())) -> Content:
        """Session mode: the request's session (`sid`, from X-Session-ID or an agent's header: `named`, the source
        and the parents, `agent_ids`) keys it by route, model identity and session. Returns the cache the slot must
        hold (`<route tag>_<session>.bin`); a sub-agent's parents are noted by file name (seeding its first turn,
        `slot_fill`). Logs where the prompt differs from the session's previous one (compared off the loop)."""
        route = route_name(prompt.model)
        fingerprint = next((fp for b in self.backends if (fp := b.identity(route)) is not None), None)
        name = session_filename(route, sid, fingerprint, owner)
        record.session, (record.session_source, parents) = sid, named
        self.session_ids.sources[record.session_source] += 1
        read = await off_loop(size, self.sessions.read, name, messages)
        info = self.sessions.seen(name, sid, route, messages, time.time(), owner, read, record.api or "chat")
        if parents:
            ids = [p for name in parents if (p := session_id(name)) is not None and p != sid]
            info.parents = tuple(session_filename(route, p, fingerprint, owner) for p in ids)
        if info.comparison is not None:
            log.info("session_prompt file=%s %s", name, info.comparison.log_line())
        return Content(name, prompt.exact, keep=True, session=sid, model=prompt.model, fingerprint=fingerprint)

    async def prefilter(self, view: ChatRequest, record: RequestRecord) -> Serve | None:
        return await prefiltering.run(self.prefilters, view, record)
    def answered(self, view: ChatRequest, answer: Answer, listeners: Sequence[Prefilter]) -> None:
        """Tell the prefilters that want it what the backend answered, off the request's path."""
        for plugin in listeners:
            self.spawn(prefiltering.quietly(plugin.answered(view, answer), plugin.name))

    # ---- plumbing ----

    def notify(self, record: RequestRecord) -> None:
        record.elapsed_ms = (time.time() - record.started) * 1000.0
        self.presence.due()
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

    async def save_all(self, timeout: float) -> None:
        await self.saver.save_all(timeout)


def _path_qs(request: Request) -> str:
    return request.url.path + (f"?{request.url.query}" if request.url.query else "")
