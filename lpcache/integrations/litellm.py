"""A LiteLLM hook for session mode: one llama-server slot, one cache file per X-Session-ID, swapped in on demand.

Enable it in LiteLLM's config.yaml, on the routes that go to a llama-server:

    model_list:
      - model_name: "*"
        litellm_params: {model: "openai/*", api_base: "http://llama-server:8080/v1", api_key: none}
        model_info:
          slot_cache: true      # or {slot: 0, model: ..., save_path: /slots, max_files: 8, max_gib: 20,
                                #     models_max: 4, save_idle_seconds: 120}
    litellm_settings:
      callbacks: lpcache.integrations.litellm.proxy_handler_instance

A request with an `X-Session-ID` on such a route (32 lower-case hex digits as they are, other text hashed to that form,
a value that cannot be a session warned about once and ignored: `lpcache.cache.session_ids`, as in lpcache) gets its
session's cache in the slot before LiteLLM sends it: the slot's previous session is saved under its own name (when it
changed), the new one's file restored (no file yet: the slot is left as it is, the request reads its prompt). This is
the same swap code lpcache's own session mode uses (`lpcache.backends.swap`); file names, limits and log lines are the
same.

- The route is LiteLLM's model group (with the wildcard, the model the client asked for) without `openai/`; files
  are `<route tag>_<session>.bin`, so two routes never share one.
- The server is the route's `api_base` without its `/v1`, with the route's `api_key`. Slot calls name the model
  (the request's, without `openai/`, or `model` of the settings): a llama-server router sends them to that model's
  instance, a single-model server ignores it.
- Settings per route in `model_info.slot_cache`, defaults from the environment: slot (LLAMA_SLOT, 0), save_path
  (LLAMA_SLOT_SAVE_PATH: the --slot-save-path folder as this process sees it; needed for limits), max_files
  (LLAMA_CACHE_MAX_FILES), max_gib (LLAMA_CACHE_MAX_GIB), models_max (LLAMA_MODELS_MAX, 4; a router's
  --models-max: the model it is about to unload has its slot saved first), save_idle_seconds
  (LLAMA_SAVE_IDLE_SECONDS, 0: save only when the slot is needed for another session).
- Slot actions go only to an idle slot (GET /slots); nothing here ever fails a request: a miss, a missing file or
  a dead server only costs a prefill.
- The request is pinned to the slot (`id_slot` in the body LiteLLM sends, through `extra_body`), and the slot is
  the request's until its answer is done: LiteLLM's success or failure event, the end of a stream (also a client
  leaving it), or at most `hold_seconds` (LLAMA_HOLD_SECONDS, 600) when LiteLLM never says. Another session's
  swap waits for it, so a slot is never saved under one session's name while another session's request runs in
  it. Calls are told apart by LiteLLM's `litellm_call_id`; without one (an unknown LiteLLM), the request is pinned
  but the slot is not held.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from lpcache.backends import swap
from lpcache.backends.backend import model_fingerprint, router_model_fingerprint
from lpcache.backends.llama import LlamaClient, client_session
from lpcache.backends.slots import Content
from lpcache.cache.cache_files import Limits
from lpcache.cache.session_ids import SessionIds
from lpcache.cache.sessions import SessionBook, route_name, route_tag, session_filename
from lpcache.errors import ProxyError

try:  # LiteLLM's base class, when LiteLLM is installed (the hook runs inside its proxy)
    from litellm.integrations.custom_logger import CustomLogger
except ImportError:  # pragma: no cover - lpcache without LiteLLM: the module still imports
    class CustomLogger:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

log = logging.getLogger("lpcache.integrations.litellm")

IDLE_SAVE_WAIT_SECONDS = 3600.0   # an idle save waits this long at most for a request of another client to end
KNOWN_MAX = 256                   # servers x models remembered (fingerprints, limits, skipped routes): client names


def _follow_litellm_logging() -> None:
    """lpcache's lines appear in LiteLLM's log (LITELLM_LOG=INFO), unless lpcache's logger is set up already."""
    try:
        from litellm._logging import verbose_proxy_logger
    except ImportError:  # pragma: no cover
        return
    ours = logging.getLogger("lpcache")
    if not ours.handlers:
        for handler in verbose_proxy_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(verbose_proxy_logger.getEffectiveLevel())
        ours.propagate = False


@dataclass(frozen=True)
class RouteOptions:
    """`model_info.slot_cache` of a route, over the LLAMA_* environment."""

    slot: int = 0
    model: str | None = None
    save_path: str | None = None
    max_files: int = 0
    max_gib: float = 0.0
    models_max: int = 4
    save_idle_seconds: float = 0.0
    hold_seconds: float = 600.0

    @classmethod
    def of(cls, value: Any, environ: Mapping[str, str]) -> RouteOptions:
        """Raises ValueError naming the setting."""
        given: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
        unknown = set(given) - {"slot", "model", "save_path", "max_files", "max_gib", "models_max",
                                "save_idle_seconds", "hold_seconds"}
        if unknown:
            raise ValueError(f"unknown slot_cache setting(s): {', '.join(sorted(unknown))}")

        def pick(name: str, env: str, default: str, parse: Any, minimum: float = 0) -> Any:
            raw = given.get(name, environ.get(env, default))
            try:
                number = parse(raw)
            except (TypeError, ValueError):
                raise ValueError(f"slot_cache {name} (or {env}): {raw!r} is not a number") from None
            if isinstance(raw, bool) or number < minimum:
                raise ValueError(f"slot_cache {name} (or {env}): {raw!r} must be a number of at least {minimum}")
            return number

        model = given.get("model")
        save_path = given.get("save_path", environ.get("LLAMA_SLOT_SAVE_PATH"))
        if model is not None and not isinstance(model, str) or save_path is not None and not isinstance(save_path,
                                                                                                        str):
            raise ValueError("slot_cache model and save_path must be strings")
        return cls(slot=pick("slot", "LLAMA_SLOT", "0", int), model=model or None, save_path=save_path or None,
                   max_files=pick("max_files", "LLAMA_CACHE_MAX_FILES", "0", int),
                   max_gib=pick("max_gib", "LLAMA_CACHE_MAX_GIB", "0", float),
                   models_max=pick("models_max", "LLAMA_MODELS_MAX", "4", int),
                   save_idle_seconds=pick("save_idle_seconds", "LLAMA_SAVE_IDLE_SECONDS", "0", float),
                   hold_seconds=pick("hold_seconds", "LLAMA_HOLD_SECONDS", "600", float, 1))


def server_root(api_base: str) -> str:
    """The slots are at the root of llama-server; a route's api_base ends in /v1."""
    base = api_base.rstrip("/")
    return base.removesuffix("/v1")


@dataclass(eq=False)
class SlotState:
    """One slot of one server (and model, on a router): the cache in it, as far as the hook knows."""

    root: str
    model: str | None
    slot: int
    content: Content | None = None   # None: unknown (after a start, or a model the router unloaded)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    idle: asyncio.Task[None] | None = None

    def cancel_idle(self) -> None:
        if self.idle is not None and not self.idle.done():
            self.idle.cancel()
        self.idle = None


@dataclass(eq=False)
class Lease:
    """A request holding its slot's lock from before it is sent until its answer is done."""

    state: SlotState
    file: str
    started: float
    expiry: asyncio.TimerHandle | None = None


def _bounded(table: dict[Any, Any], limit: int = KNOWN_MAX) -> None:
    """Forget the oldest keys of a dict keyed by client-given names (models, routes) beyond `limit`."""
    while len(table) > limit:
        del table[next(iter(table))]


class SlotCacheHook(CustomLogger):
    """The LiteLLM callback. One instance serves every route, server and session."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.environ = environ
        self.states: dict[tuple[str, str | None, int], SlotState] = {}
        self.loaded: dict[str, collections.OrderedDict[str, None]] = {}  # per router: models, used longest ago first
        self.sessions = SessionBook()
        self.session_ids = SessionIds(log, prefix="slot_cache: ")
        self.limits: dict[tuple[str | None, str], Limits] = {}           # (save_path, route tag) -> limits
        self.skipped: set[tuple[str, str]] = set()
        self.fingerprints: dict[tuple[str, str], str | None] = {}
        self.leases: dict[str, Lease] = {}                              # by LiteLLM's litellm_call_id
        self._http: aiohttp.ClientSession | None = None
        self._clients: dict[tuple[str, str | None], LlamaClient] = {}
        _follow_litellm_logging()

    # ---- LiteLLM's hook: after the router chose the deployment, before the request is sent ----

    async def async_pre_call_deployment_hook(self, kwargs: dict[str, Any], call_type: Any) -> dict[str, Any] | None:
        call = _call_id(kwargs)
        if call is not None:
            self.done(call, "retried")   # LiteLLM retries a call through this hook again: its first try is over
        try:
            slot = await self.before_request(kwargs)
        except Exception:  # the request goes on whatever happens here: a cache only ever saves time
            log.exception("slot_cache: unexpected error; the request goes on without the cache")
            return None
        if slot is None:
            return None
        extra = kwargs.get("extra_body")
        kwargs["extra_body"] = {**(extra if isinstance(extra, Mapping) else {}), "id_slot": slot}
        return kwargs

    # ---- the end of the answer: LiteLLM's events, and the end of a stream ----

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self.done(_call_id(kwargs), "answered")

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self.done(_call_id(kwargs), "failed")

    async def async_post_call_success_hook(self, data: Any, user_api_key_dict: Any, response: Any) -> Any:
        self.done(_call_id(data), "answered")
        return response

    async def async_post_call_failure_hook(self, request_data: Any, original_exception: Any,
                                           user_api_key_dict: Any, *args: Any, **kwargs: Any) -> None:
        self.done(_call_id(request_data), "failed")

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: Any) -> AsyncIterator[Any]:
        """A stream is done when its last chunk is sent, or when the client leaves it (the generator is closed)."""
        try:
            async for chunk in response:
                yield chunk
        finally:
            self.done(_call_id(request_data), "streamed")

    def done(self, call: str | None, why: str) -> None:
        """The call's answer is done (or abandoned): its slot is free for the next session's swap."""
        lease = self.leases.pop(call, None) if call is not None else None
        if lease is None:
            return
        if lease.expiry is not None:
            lease.expiry.cancel()
        if lease.state.lock.locked():
            lease.state.lock.release()
        log.debug("slot_cache: %s released slot %d (%s) after %.1f s", lease.file, lease.state.slot, why,
                  time.monotonic() - lease.started)

    def _expire(self, call: str, seconds: float) -> None:
        lease = self.leases.get(call)
        if lease is not None:
            log.warning("slot_cache: %s held slot %d for %.0f s and LiteLLM never said its answer was done; "
                        "released", lease.file, lease.state.slot, seconds)
            self.done(call, "expired")

    async def before_request(self, kwargs: Mapping[str, Any]) -> int | None:
        """The swap for a request of a session; returns the slot to pin it to (None: not a session request)."""
        headers = (kwargs.get("proxy_server_request") or {}).get("headers") or {}
        sid = self.session_ids.read(_header(headers, "x-session-id"))
        if sid is None:
            return None
        metadata = kwargs.get("metadata") or {}
        raw_options = (kwargs.get("model_info") or {}).get("slot_cache")
        api_base = kwargs.get("api_base")
        group = metadata.get("model_group") or kwargs.get("model")
        if not (raw_options and api_base and group):
            why = "no model_info.slot_cache" if not raw_options else "no api_base" if not api_base else "no route"
            self._skip(str(group), why)
            return None
        try:
            options = RouteOptions.of(raw_options, os.environ if self.environ is None else self.environ)
        except ValueError as e:
            self._skip(str(group), str(e))
            return None
        route = route_name(str(group))
        model = options.model or route_name(str(kwargs.get("model") or route))
        root = server_root(str(api_base))
        api_key = kwargs.get("api_key")
        client = self._client(root, api_key if isinstance(api_key, str) and api_key != "none" else None)
        fingerprint = await self.fingerprint(client, model)
        name = session_filename(route, sid, fingerprint)
        self.limits[(options.save_path, route_tag(route, fingerprint))] = Limits.of(options.max_files,
                                                                                    options.max_gib)
        _bounded(self.limits)
        folders = swap.Folders(options.save_path, lambda tag: self.limits.get((options.save_path, tag), Limits()))

        messages = kwargs.get("messages")
        info = self.sessions.seen(name, sid, route, messages if isinstance(messages, list) else [], time.time())
        if info.comparison is not None:
            log.info("slot_cache: %s prompt: %s", name, info.comparison.log_line())
        await self.make_room(root, model, options.models_max, client, folders)
        key = (root, model, options.slot)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = SlotState(root, model, options.slot)
            self._forget_states()
        await self.switch(state, Content(name, (), keep=True, session=sid, model=model), client, folders,
                          options.save_idle_seconds, _call_id(kwargs), options.hold_seconds)
        return options.slot

    def _forget_states(self) -> None:
        """Slots of models named by clients: at most KNOWN_MAX, the idle ones seen longest ago forgotten first."""
        for key in list(self.states):
            if len(self.states) <= KNOWN_MAX:
                return
            state = self.states[key]
            if not state.lock.locked() and (state.idle is None or state.idle.done()):
                del self.states[key]

    async def fingerprint(self, client: LlamaClient, model: str) -> str | None:
        """The identity of the model the server runs for `model` (as lpcache's proxy computes it), asked once per
        server and model; it is part of the session files' names, so a model swapped behind the same URL never
        restores the old one's files. None when the server does not tell (the names then carry the route only)."""
        key = (client.url, model)
        if key not in self.fingerprints:
            try:
                props = await client.props()
                listing = await client.get_json("/v1/models")
            except ProxyError as e:
                log.info("slot_cache: %s does not tell its model (%s); file names carry the route only", client.url,
                         e.message)
                return None   # asked again next time
            data = listing.get("data") if isinstance(listing, dict) else None
            entries = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
            if props.get("role") == "router":
                entry = next((m for m in entries if m.get("id") == model), None)
                self.fingerprints[key] = router_model_fingerprint(entry) if entry is not None else None
            else:
                self.fingerprints[key] = model_fingerprint(props, entries[0] if entries else {})
            _bounded(self.fingerprints)
        return self.fingerprints.get(key)

    def _skip(self, route: str, why: str) -> None:
        if (route, why) not in self.skipped:
            if len(self.skipped) < KNOWN_MAX:
                self.skipped.add((route, why))
            log.info("slot_cache: not used for %s: %s", route, why)

    def _client(self, root: str, api_key: str | None) -> LlamaClient:
        if self._http is None or self._http.closed:
            self._http = client_session()   # connections kept idle less long than llama-server keeps them
            self._clients.clear()
        client = self._clients.get((root, api_key))
        if client is None:
            # a swap waits for the slot to be idle and a save of a big cache takes long: no short timeout here
            client = self._clients[(root, api_key)] = LlamaClient(root, self._http, api_key=api_key,
                                                                  timeout=IDLE_SAVE_WAIT_SECONDS)
        return client

    # ---- the slot ----

    async def switch(self, state: SlotState, want: Content, client: LlamaClient, folders: swap.Folders,
                     idle_seconds: float, call: str | None = None, hold_seconds: float = 600.0) -> None:
        """Bring the session's cache into the slot. With a call id the slot stays locked for that call until its
        answer is done (`done`); without one it is free again at once."""
        await state.lock.acquire()
        held = False
        try:
            state.cancel_idle()
            await swap.bring_in(client, state.slot, state.content, want, folders, state.model)
            # the request about to be sent changes what the slot holds: it is this session's, not saved yet
            state.content = replace(want, saved=False)
            if call is not None:
                lease = self.leases[call] = Lease(state, want.key, time.monotonic())
                lease.expiry = asyncio.get_running_loop().call_later(hold_seconds, self._expire, call, hold_seconds)
                held = True
        finally:
            if not held:
                state.lock.release()
        if idle_seconds > 0:
            state.idle = asyncio.ensure_future(self._save_when_idle(state, client, folders, idle_seconds))

    async def _save_when_idle(self, state: SlotState, client: LlamaClient, folders: swap.Folders,
                              seconds: float) -> None:
        await asyncio.sleep(seconds)
        held = state.content
        # the request that started the wait may still run; a new request cancels this task, also while it waits
        if held is None or not held.dirty or not await swap.wait_idle(client, state.slot, state.model,
                                                                        IDLE_SAVE_WAIT_SECONDS):
            return
        async with state.lock:
            if state.content is not held:
                return
            result, _ = await swap.save(client, state.slot, held, folders, state.model)
            if result.ok:
                state.content = replace(held, saved=True)

    async def release(self, state: SlotState, client: LlamaClient, folders: swap.Folders) -> None:
        """The router is about to unload the model: its slot goes with it, so the cache in it is saved first (a
        save never loads an unloaded model)."""
        async with state.lock:
            state.cancel_idle()
            held = state.content
            if held is not None and held.dirty and await swap.wait_idle(client, state.slot, state.model):
                await swap.save(client, state.slot, held, folders, state.model)
            state.content = None

    async def make_room(self, root: str, model: str, models_max: int, client: LlamaClient,
                        folders: swap.Folders) -> None:
        """Follow the models a router holds, in its order; the ones it will unload for `model` are saved first."""
        if not models_max or not model:
            return
        loaded = self.loaded.setdefault(root, collections.OrderedDict())
        loaded[model] = None
        loaded.move_to_end(model)
        while len(loaded) > models_max:
            gone, _ = loaded.popitem(last=False)
            for (r, m, _slot), state in list(self.states.items()):
                if r == root and m == gone:
                    log.info("slot_cache: %s unloads %s for %s: saving its slot first", root, gone, model)
                    await self.release(state, client, folders)

    async def close(self) -> None:
        for call in list(self.leases):
            self.done(call, "closed")
        for state in self.states.values():
            state.cancel_idle()
        if self._http is not None:
            await self._http.close()


def _call_id(kwargs: Any) -> str | None:
    """LiteLLM's id of one call: in the kwargs of its hooks and events, and in the proxy's request data."""
    if not isinstance(kwargs, Mapping):
        return None
    call = kwargs.get("litellm_call_id")
    if not isinstance(call, str):
        params = kwargs.get("litellm_params")
        call = params.get("litellm_call_id") if isinstance(params, Mapping) else None
    return call if isinstance(call, str) and call else None


def _header(headers: Any, name: str) -> str | None:
    if not isinstance(headers, Mapping):
        return None
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == name:
            return value if isinstance(value, str) else None
    return None


proxy_handler_instance = SlotCacheHook()
