"""Router mode: one child per model, loaded on demand, at most ``models_max`` at once.

This follows llama-server b11434 started without ``-m``. A request names its model: POSTs
in the body field ``model``, GETs in ``?model=``. ``?autoload=true|1|false`` says whether an
unloaded model may be loaded for it (default ``models_autoload``). When the limit is reached,
loading unloads the least recently used idle model; a model with requests in flight is
never unloaded. Only POSTs count as a use. A child is the single-model state (``MockState``)
with its own slots; unloading empties them, so the KV they held is gone, while save files,
in the one shared folder, stay. Loading is instant.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from lpcache.mock_llama.api import CHILD_KEY, ApiError, read_json
from lpcache.mock_llama.errors import json_response
from lpcache.mock_llama.info import model_meta
from lpcache.mock_llama.state import MockState, Stats

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(eq=False)
class Model:
    """One model of the router and its child."""

    name: str
    state: MockState
    loaded: bool = False
    loads: int = 0
    unloads: int = 0
    in_flight: int = 0  # requests routed to it and not finished: while any, it is never unloaded
    waiting: int = 0  # requests waiting for it to be loaded
    last_used: int = 0  # LRU clock: set by loading and by each POST routed to it

    def to_json(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "loads": self.loads,
            "unloads": self.unloads,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "last_used": self.last_used,
            **self.state.stats.to_json(),
        }


class Router:
    """The models, which are loaded, and the LRU choice of which to unload."""

    def __init__(self, state: MockState) -> None:
        self.state = state
        self.config = state.config
        self.models = {name: Model(name, state.child(name)) for name in self.config.models}
        self.slot_actions: list[dict[str, Any]] = []  # every POST /slots/{id} received, with its model
        self._clock = 0
        self._changed = asyncio.Event()

    def find(self, name: str, autoload: bool) -> Model:
        """The model a request names, checked in the order of llama-server's ``router_validate_model``."""
        if not name:
            raise ApiError(400, "model name is missing from the request")
        model = self.models.get(name)
        if model is None:
            raise ApiError(400, f"model '{name}' not found")
        if not autoload and not model.loaded:
            raise ApiError(400, "model is not loaded")
        return model

    async def enter(self, model: Model, *, post: bool) -> None:
        """Count a request on ``model``, loading it first (waiting for room if every loaded model is busy)."""
        model.waiting += 1
        try:
            while not model.loaded:
                if self._make_room():
                    self._load(model)
                else:
                    await self._wait()
        finally:
            model.waiting -= 1
        if post:
            self._touch(model)
        model.in_flight += 1

    def leave(self, model: Model) -> None:
        model.in_flight -= 1
        self._notify()

    def load(self, model: Model) -> None:
        """``POST /models/load``: load now, or fail when no loaded model can give way."""
        if not self._make_room():
            raise ApiError(500, "model limit reached, try again later")
        self._load(model)

    async def unload(self, model: Model) -> None:
        """``POST /models/unload``: unload once the requests in flight on it are done."""
        while model.in_flight:
            await self._wait()
        if model.loaded:
            self._unload(model)

    def _make_room(self) -> bool:
        """True if one more model may be loaded, after unloading the least recently used idle one if needed."""
        loaded = [m for m in self.models.values() if m.loaded]
        if not self.config.models_max or len(loaded) < self.config.models_max:
            return True
        idle = [m for m in loaded if m.in_flight == 0 and m.waiting == 0]
        if not idle:
            return False
        self._unload(min(idle, key=lambda m: m.last_used))
        return True

    def _load(self, model: Model) -> None:
        model.loaded = True
        model.loads += 1
        self._touch(model)
        self._notify()

    def _unload(self, model: Model) -> None:
        model.loaded = False
        model.unloads += 1
        model.state.reset_slots()
        self._notify()

    def _touch(self, model: Model) -> None:
        self._clock += 1
        model.last_used = self._clock

    async def _wait(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- test hooks ---------------------------------------------------------------------

    def stats_json(self) -> dict[str, Any]:
        """The counters of all children added up (requests by path are the router's), then per model."""
        total = Stats()
        for stats in [self.state.stats, *(m.state.stats for m in self.models.values())]:
            for f in fields(Stats):
                mine, theirs = getattr(total, f.name), getattr(stats, f.name)
                merged = max(mine, theirs) if f.name == "max_concurrent_per_slot" else mine + theirs
                setattr(total, f.name, merged)
        return {
            **total.to_json(),
            "models": {name: m.to_json() for name, m in self.models.items()},
            "slot_actions": list(self.slot_actions),
        }

    def reset_stats(self) -> None:
        self.state.stats = Stats()
        self.slot_actions.clear()
        for m in self.models.values():
            m.state.stats = Stats()
            m.loads = m.unloads = 0

    def children(self, request: Request) -> dict[str, MockState]:
        """The children a hook acts on: ``?model=X``, or all of them."""
        name = request.query_params.get("model")
        if name is None:
            return {n: m.state for n, m in self.models.items()}
        if name not in self.models:
            raise ApiError(400, f"model '{name}' not found")
        return {name: self.models[name].state}


def router_of(request: Request) -> Router:
    router: Router | None = request.app.state.mock.router
    assert router is not None
    return router


def autoload_of(request: Request, router: Router) -> bool:
    raw = request.query_params.get("autoload", "")
    return router.config.models_autoload if not raw else raw in ("true", "1")


class _AfterSent(Response):
    """A response that calls ``done`` once it has been sent, or has failed: a stream counts until its end."""

    def __init__(self, inner: Response, done: Callable[[], None]) -> None:  # no super().__init__: only wraps
        self.inner = inner
        self.done = done
        self.status_code = inner.status_code

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.done()


def proxied(handler: Endpoint, *, post: bool, slot_action: bool = False) -> Endpoint:
    """``handler`` served by the child of the model the request names, as the router forwards it."""

    async def endpoint(request: Request) -> Response:
        router = router_of(request)
        seen: dict[str, Any] = {"model": None, "loaded": False}
        status = 500
        try:
            response = await forward(request, router, handler, post, seen)
            status = response.status_code
            return response
        except ApiError as exc:
            status = exc.status
            raise
        finally:
            if slot_action:
                action = request.query_params.get("action", "")
                router.slot_actions.append(
                    {**seen, "action": action, "id_slot": request.path_params.get("id_slot"), "status": status}
                )

    return endpoint


async def forward(request: Request, router: Router, handler: Endpoint, post: bool, seen: dict[str, Any]) -> Response:
    name = (await read_json(request)).get("model") if post else request.query_params.get("model")
    name = name if isinstance(name, str) else ""
    seen["model"] = name or None
    seen["loaded"] = name in router.models and router.models[name].loaded
    model = router.find(name, autoload_of(request, router))
    await router.enter(model, post=post)
    request.scope[CHILD_KEY] = model.state
    try:
        response = await handler(request)
    except BaseException:
        router.leave(model)
        raise
    return _AfterSent(response, lambda: router.leave(model))


def router_props(child_props: Endpoint) -> Endpoint:
    """``GET /props``: the router's own without ``?model=``, else the child's."""

    async def endpoint(request: Request) -> Response:
        if request.query_params.get("model"):
            return await child_props(request)
        config = router_of(request).config
        return json_response(
            {
                "role": "router",
                "max_instances": config.models_max,
                "models_autoload": config.models_autoload,
                "model_alias": "llama-server",
                "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0},
                "ui_settings": {},
                "build_info": "mock",
                "cors_proxy_enabled": False,
            }
        )

    return endpoint


async def router_models(request: Request) -> Response:
    """``GET /models`` and ``/v1/models``: every model and its status; a loaded one adds its child's ``meta``."""
    router = router_of(request)
    created = int(time.time())
    data = []
    for name, m in router.models.items():
        entry: dict[str, Any] = {
            "id": name,
            "aliases": [],
            "tags": [],
            "object": "model",
            "owned_by": "llamacpp",
            "created": created,
            "status": {"value": "loaded" if m.loaded else "unloaded", "args": ["mock-llama", "--alias", name]},
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": "models_dir",
            "can_remove": False,
        }
        if m.loaded:
            entry["meta"] = model_meta(m.state.config)
        data.append(entry)
    return json_response({"data": data, "object": "list"})


async def body_model(request: Request, router: Router, missing_status: int) -> Model:
    name = (await read_json(request)).get("model")
    model = router.models.get(name) if isinstance(name, str) else None
    if model is None:
        raise ApiError(missing_status, "model is not found")
    return model


async def load_model(request: Request) -> Response:
    """``POST /models/load`` ``{"model": X}``."""
    router = router_of(request)
    model = await body_model(request, router, 404)
    if model.loaded:
        raise ApiError(400, "model is already running")
    router.load(model)
    return json_response({"success": True})


async def unload_model(request: Request) -> Response:
    """``POST /models/unload`` ``{"model": X}``."""
    router = router_of(request)
    model = await body_model(request, router, 400)
    if not model.loaded:
        raise ApiError(400, "model is not running")
    await router.unload(model)
    return json_response({"success": True})
