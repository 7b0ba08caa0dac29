"""The llama-servers behind lpcache: their settings, their client, their slot count, their health.

A backend given without `n_slots` is asked for it (`GET /props`, `total_slots`) at start. One that does not answer
is marked down (its breaker open) and lpcache starts anyway; the prober asks again after each cooldown, and the
backend serves once it answers.

A llama-server router (`/props` says `role: router`, or `"router": true` in BACKENDS) holds many models, each an
instance with its own slots: its slots are made per model when a request first names it (one of the models its
`/v1/models` lists), and lpcache follows which models it holds (least recently used first) to save the slots of the
one it is about to unload.

Every cache is tied to the model that made it: a backend's *fingerprint* is a digest of what `/props` and
`/v1/models` say of its model (path, chat template, special tokens, size, parameters, vocabulary, training context;
and the file's size and time when lpcache sees the same path) and of the server's build (`build_info`: a build may
save in another format), per model on a router. What else decides whether a file loads (the KV cache's type, the
slot's context) is `loadable`'s. A file saved under one
fingerprint is never restored into a server with another: a GGUF swapped behind the same URL starts a new cache.

Each backend has a circuit breaker. A failure (connection refused or reset, timeout, 5xx) opens it for a cooldown
that doubles with each failure in a row (BREAKER_COOLDOWN_MS up to BREAKER_MAX_COOLDOWN_MS). After the cooldown the
backend is half-open: exactly one request (or the prober's GET /health) is let through as a probe, claimed on the
tick its slot is chosen; success closes the breaker and resets the backoff, failure opens it again for longer.
A backend that did not answer at all (down, not erring) is also asked by the prober every PROBE interval during its
cooldown, and serves again as soon as it answers; the prober itself survives anything a probe raises.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from lpcache.backends.clients import backend_client
from lpcache.backends.llama import LlamaClient
from lpcache.backends.loadable import Loadable
from lpcache.backends.slots import Slot
from lpcache.cache.server_cache import RamWatch
from lpcache.config import BackendConfig, Settings
from lpcache.errors import BackendError, ProxyError

log = logging.getLogger("lpcache.backends")


CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class Breaker:
    """Circuit breaker of one backend. Pure state: the caller passes the time (monotonic seconds)."""

    base_cooldown: float = 1.0
    max_cooldown: float = 60.0
    state: str = CLOSED
    failures: int = 0          # in a row
    cooldown: float = 0.0      # of the current opening
    open_until: float = 0.0
    probing: bool = False      # half-open, and the one probe is out
    down: bool = False         # the last failure was no answer at all (not an error answer)

    def available(self, now: float) -> bool:
        """Whether a request may go to this backend now (without claiming the probe)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return now >= self.open_until
        return not self.probing

    def claim(self, now: float) -> bool:
        """A try goes to this backend: when the cooldown is over and no probe is out, it is the half-open probe
        (True). False when the breaker lets nothing through (the caller tries anyway only when nothing else can
        serve)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN and now >= self.open_until:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def unclaim(self) -> None:
        """The probe never reached the backend (the client left, the body could not be sent): let another try."""
        self.probing = False

    def success(self) -> None:
        self.state, self.failures, self.cooldown, self.probing, self.down = CLOSED, 0, 0.0, False, False

    def failure(self, now: float, down: bool = True) -> None:
        self.failures += 1
        self.cooldown = min(self.max_cooldown, self.base_cooldown * 2 ** (self.failures - 1))
        self.state, self.open_until, self.probing, self.down = OPEN, now + self.cooldown, False, down

    def describe(self, now: float) -> dict[str, object]:
        doc: dict[str, object] = {"state": self.state, "failures": self.failures}
        if self.state == OPEN:
            doc["retry_in_s"] = round(max(0.0, self.open_until - now), 3)
        return doc


@dataclass(eq=False)
class Backend:
    index: int
    config: BackendConfig
    client: LlamaClient
    n_slots: int
    breaker: Breaker = field(default_factory=Breaker)
    slots_known: bool = True   # False while n_slots is the N_SLOTS fallback of a server that did not answer
    router: bool = False       # a llama-server router: slots belong to a model's instance (BACKENDS or /props)
    models: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)  # router: loaded
    model_slots: dict[str, int] = field(default_factory=dict)  # router: slots made per model
    slots_guessed: set[str] = field(default_factory=set)        # router: models whose count is N_SLOTS for now
    last_seen: float = 0.0     # monotonic time of its last good answer (0: never, or it failed since)
    fingerprint: str | None = None   # the identity of its model (None: not known yet; a router: per model)
    model_ids: tuple[str, ...] = ()  # what its /v1/models lists (a router: the models it can serve)
    model_fingerprints: dict[str, str] = field(default_factory=dict)  # router: per model
    suspect: bool = False      # something may have changed its slots behind lpcache (checked with GET /slots)
    ram: RamWatch = field(default_factory=RamWatch)   # what its RAM prompt cache (--cache-ram) does with prompts
    launched_at: float = 0.0   # the send (monotonic) of the last request whose answer began: the server had launched
                               # it, copying the slots idle by then to its RAM (`ram_reach.holds`)
    task_marks: dict[str | None, int] = field(default_factory=dict)   # per model instance (None: the server's own),
                               # the highest task number its slots showed (GET /slots `id_task`): lower later, restarted
    loadable: Loadable = field(default_factory=Loadable)   # what it can load beyond the model (`loadable`)
    saves_off: bool = False    # it answered a slot call 501 (no --slot-save-path): no saves, no restores until it
                               # is seen down and back (restarted, perhaps with the flag)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def kv_cache(self) -> bool:
        return self.config.kv_cache

    def slots(self, start: int = 0) -> list[Slot]:
        """The slots of a single-model server (a router has none until a model is asked for)."""
        if self.router:
            return []
        return [Slot(self.index, i, self.config.kv_cache, self.config.slot_save_path, self.url,
                     loadable=self.loadable) for i in range(start, self.n_slots)]

    def slots_for(self, model: str, n: int) -> list[Slot]:
        """A router's slots of one model, beyond those made already."""
        start = self.model_slots.get(model, 0)
        self.model_slots[model] = max(start, n)
        return [Slot(self.index, i, self.config.kv_cache, self.config.slot_save_path, self.url, model=model,
                     loadable=self.loadable) for i in range(start, n)]

    def identity(self, route: str) -> str | None:
        """The fingerprint of the model a request for `route` runs on here (None: unknown, so nothing is cached)."""
        if self.router:
            return self.model_fingerprints.get(route)
        return self.fingerprint

    async def discover(self) -> None:
        """Router or not, the slot count and the model's identity: from GET /props and /v1/models (a router answers
        `role: router`). Raises ProxyError when the server does not answer."""
        if self.config.router is False and self.slots_known:
            try:
                props = await self.client.props()
            except BackendError as e:
                if e.status in (401, 403):
                    raise   # /health needs no key: it would hide a key lpcache lacks
                await self.client.get_json("/health")   # a server without /props: no identity, nothing cached
                return
            await self.learn_identity(props)
            return
        try:
            props = await self.client.props()
        except BackendError as e:
            if self.config.router or not self.slots_known or e.status in (401, 403):
                raise
            await self.client.get_json("/health")   # a server without /props, its slot count given
            return
        if self.config.router or props.get("role") == "router":
            if not self.router:
                log.info("backend_router url=%s: a llama-server router; slots are made per model", self.url)
            self.router, self.slots_known = True, True
            await self.learn_identity(props)
            return
        n = props.get("total_slots")
        if not self.slots_known:
            if not isinstance(n, int) or n < 1:
                raise BackendError("/props has no total_slots", status=502)
            self.n_slots, self.slots_known = n, True
            log.info("backend_slots url=%s total_slots=%d (from /props)", self.url, self.n_slots)
        await self.learn_identity(props)

    async def learn_identity(self, props: dict[str, Any] | None = None) -> bool:
        """Read the model's identity (and a router's models). True when it changed from a known one: the server now
        runs another model, and what lpcache believed of its slots is void."""
        try:
            if props is None:
                props = await self.client.props()
            models = await self.client.get_json("/v1/models")
        except ProxyError as e:
            log.debug("identity_unknown url=%s reason=%s", self.url, e.message)
            return False
        data = models.get("data") if isinstance(models, dict) else None
        entries = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(
            data, list) else []
        self.model_ids = tuple(m["id"] for m in entries)
        if self.router:
            old = dict(self.model_fingerprints)
            self.model_fingerprints = {m["id"]: router_model_fingerprint(m, props.get("build_info"))
                                       for m in entries}
            swapped = [k for k, v in old.items() if self.model_fingerprints.get(k, v) != v]
            for name in swapped:
                log.warning("backend_model_changed url=%s model=%s: another model file behind the same name; its "
                            "old caches are not restored", self.url, name)
            return bool(swapped)
        fingerprint = model_fingerprint(props, entries[0] if entries else {})
        changed = self.fingerprint is not None and fingerprint != self.fingerprint
        if changed:
            log.warning("backend_model_changed url=%s model_path=%s build=%s: the server runs another model or build "
                        "than before; caches saved before are not restored into it", self.url,
                        props.get("model_path"), props.get("build_info"))
        if self.fingerprint != fingerprint:
            log.info("backend_model url=%s fingerprint=%s model_path=%s", self.url, fingerprint,
                     props.get("model_path"))
        self.fingerprint = fingerprint
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        self.loadable.n_ctx = n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None
        return changed

    def available(self, now: float | None = None) -> bool:
        return self.breaker.available(time.monotonic() if now is None else now)

    def failed(self, reason: str, down: bool = True) -> None:
        """A failure: `down` when the backend did not answer (refused, reset, timed out, broke its answer), not
        when it answered an error of its own (5xx): only a down backend is probed during its cooldown."""
        self.last_seen = 0.0   # it may come back restarted: what its slots hold is checked before it is trusted
        if down:
            self.loadable.restarted()   # and with other slot contexts: read again from its next GET /slots
        was = self.breaker.state
        self.breaker.failure(time.monotonic(), down)
        log.warning("backend_down url=%s reason=%s cooldown_s=%.1f failures=%d%s", self.url, reason,
                    self.breaker.cooldown, self.breaker.failures, "" if was != CLOSED else " (breaker opened)")

    def succeeded(self) -> None:
        if self.breaker.state != CLOSED:
            log.info("backend_up url=%s", self.url)
            self.saves_off = False
        self.breaker.success()
        self.last_seen = time.monotonic()


IDENTITY_PROPS = ("model_path", "chat_template", "bos_token", "eos_token", "build_info")   # a build may change the
                                                                                      # save format
IDENTITY_META = ("n_params", "size", "n_vocab", "n_embd", "n_ctx_train", "vocab_type", "ftype")


def _digest(facts: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(facts, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()[:16]


def _file_identity(path: Any) -> list[int] | None:
    """Size and modification time of the model file, when lpcache sees the same path (a file swapped in place)."""
    if not isinstance(path, str) or not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def model_fingerprint(props: dict[str, Any], model: dict[str, Any]) -> str:
    """The identity of a single-model server's model, from its /props and its /v1/models entry."""
    meta: dict[str, Any] = model["meta"] if isinstance(model.get("meta"), dict) else {}
    facts = {k: props.get(k) for k in IDENTITY_PROPS}
    facts.update({k: meta.get(k) for k in IDENTITY_META})
    facts["file"] = _file_identity(props.get("model_path"))
    return _digest(facts)


def router_model_fingerprint(model: dict[str, Any], build: Any = None) -> str:
    """The identity of one model of a router, from its /v1/models entry: its name, where it comes from, and the
    model file its instance is started with (the value after -m/--model in its arguments); and the router's build."""
    status: dict[str, Any] = model["status"] if isinstance(model.get("status"), dict) else {}
    args: list[Any] = status["args"] if isinstance(status.get("args"), list) else []
    path = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-m", "--model")), None)
    return _digest({"id": model.get("id"), "source": model.get("source"), "path": path,
                    "file": _file_identity(path), "build_info": build})


def start_problem(e: ProxyError) -> str:
    """What a backend's failure to answer GET /props at start most likely means, for its start-up line."""
    if not isinstance(e, BackendError):
        return "nothing answers at that address (is llama-server running, on that host and port?)"
    who = f" ({e.server} answered)" if e.server else ""
    if e.status in (401, 403):
        return (f"it wants a key{who}: give lpcache llama-server's --api-key as LLAMA_API_KEY (--api-key); "
                "LPCACHE_API_KEYS (--api-keys) are the keys clients send to lpcache")
    if e.status == 503:
        return f"it is not ready{who} (llama-server answers 503 while it loads its model)"
    if e.status == 404:
        return (f"no /props there{who}: not a llama-server, or not its root URL (LLAMA_URL is the server's root, "
                "such as http://127.0.0.1:8080, without /v1)")
    return f"that is not a llama-server's answer{who}"


async def start_backends(settings: Settings, session: aiohttp.ClientSession) -> list[Backend]:
    """Build a client per backend and settle each one's slot count, asking the servers in parallel. A server that
    does not answer is marked down, not fatal."""

    async def one(i: int, config: BackendConfig) -> Backend:
        client = backend_client(config.client)(config.url, session, api_key=settings.llama_api_key,
                                               timeout=settings.request_timeout)
        backend = Backend(i, config, client, config.n_slots or settings.n_slots,
                          Breaker(settings.breaker_cooldown_ms / 1000.0, settings.breaker_max_cooldown_ms / 1000.0),
                          slots_known=config.n_slots is not None)
        try:
            await backend.discover()
        except ProxyError as e:
            log.warning("backend_unavailable_at_start url=%s reason=%s: %s; lpcache starts anyway and asks it again "
                        "until it answers%s", config.url, e.message, start_problem(e), "" if backend.slots_known else
                        f" (till then it counts N_SLOTS={backend.n_slots} slot(s) there)")
            backend.failed("unavailable at start")
        return backend

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(settings.backends))))


class Prober:
    """Asks the backends whose cooldown is over, and every interval the down ones, whether they are back (/props,
    /health), so a backend recovers without waiting for a client to risk a request on it."""

    def __init__(self, backends: list[Backend], on_slots: Callable[[Backend, int], None],
                 interval: float = 0.5) -> None:
        self.backends = backends
        self.on_slots = on_slots
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)  # a polling period, not synchronisation
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:   # never let the prober die: backends would recover only when a client risks it
                log.exception("prober_failed: the prober goes on")

    async def round(self) -> None:
        """Probe, at once, the backends whose cooldown is over (each probe claims the half-open state, on this
        tick) and the down ones (asked every interval, without escalating their cooldown)."""
        now = time.monotonic()
        due: list[tuple[Backend, bool]] = []
        for b in self.backends:
            if b.breaker.state == CLOSED:
                continue
            if b.available(now):
                if b.breaker.claim(now):
                    due.append((b, True))
            elif b.breaker.down and not b.breaker.probing:
                due.append((b, False))
        await asyncio.gather(*(self.probe(b, half_open) for b, half_open in due))

    async def probe(self, backend: Backend, half_open: bool = True) -> bool:
        """Ask the backend whether it is back. `half_open`: this is the cooldown's probe, whose failure opens the
        breaker for longer; else a failure changes nothing (a down backend asked during its cooldown)."""
        if half_open:
            backend.breaker.claim(time.monotonic())
        try:
            known, old = backend.slots_known, backend.n_slots
            await backend.discover()
            if not known:
                self.on_slots(backend, 0 if backend.router else old)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, ProxyError):
                log.exception("probe_crashed url=%s", backend.url)
            if half_open:
                backend.failed(f"probe: {e.message if isinstance(e, ProxyError) else type(e).__name__}")
            elif backend.breaker.state != CLOSED:
                log.debug("probe_failed url=%s during its cooldown", backend.url)
            return False
        backend.succeeded()
        return True
