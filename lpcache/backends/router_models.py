"""llama-server routers: which models a router serves, the slots of each model's instance, and the model it is about
to unload.

A model is taken from the router's own list (`/v1/models`, asked again when a request names one it did not list)
before any slot, speed or room-making is made for it: a typo or a made-up name creates nothing here, and the router
itself answers it (400 model not found). Per-model state is therefore bounded by the router's list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from lpcache.backends.backend import Backend
from lpcache.backends.slot_pool import SlotPool
from lpcache.backends.slots import Slot
from lpcache.cache.sessions import route_name
from lpcache.config import Settings
from lpcache.errors import ProxyError

log = logging.getLogger("lpcache.router_models")

RELIST_SECONDS = 5.0   # a router's model list is asked again at most this often for a name it did not list

SaveIdle = Callable[[Slot, Backend, str, bool], Awaitable[bool]]
Enabled = Callable[[Backend, str], bool]


class RouterModels:
    def __init__(self, settings: Settings, backends: Sequence[Backend], pool: SlotPool, save_idle: SaveIdle,
                 enabled: Enabled) -> None:
        self.settings = settings
        self.backends = list(backends)
        self.pool = pool
        self.save_idle = save_idle
        self.enabled = enabled
        self._listed: dict[int, float] = {}

    @staticmethod
    def served(backend: Backend, model: str) -> str:
        """The key of per-model state on this backend: a router's model, or "" for a single-model server (which
        serves whatever a client names its model)."""
        return route_name(model) if backend.router else ""

    @staticmethod
    def slot_model(backend: Backend, model: str) -> str | None:
        """The model slot calls must name: on a router, the request's model (without LiteLLM's `openai/`)."""
        return route_name(model) if backend.router else None

    async def serves(self, backend: Backend, route: str) -> bool:
        """Whether a router lists the model (asking it again, at most every RELIST_SECONDS, for a new name)."""
        if route in backend.model_ids:
            return True
        now = time.monotonic()
        if now - self._listed.get(backend.index, 0.0) >= RELIST_SECONDS:
            self._listed[backend.index] = now
            await backend.learn_identity()
        return route in backend.model_ids

    async def unknown(self, model: str) -> Backend | None:
        """When every backend is a router and none lists the model: one of them, to answer the client itself."""
        routers = [b for b in self.backends if b.router]
        if not routers or len(routers) != len(self.backends):
            return None
        route = route_name(model)
        for b in routers:
            if await self.serves(b, route):
                return None
        return routers[0]

    async def model_slots(self, model: str) -> None:
        """The first request naming a model a router serves makes that model's slots there: as many as BACKENDS
        says, else as the model's instance reports (when it is loaded), else N_SLOTS."""
        route = route_name(model)
        for b in self.backends:
            if not b.router or route in b.model_slots or not await self.serves(b, route):
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
            if dirty and self.enabled(backend, victim):
                log.info("router_unload_ahead backend=%s model=%s for=%s: saving %d slot(s) first", backend.url,
                         victim, route, len(dirty))
                for slot in dirty:
                    if not await self.save_idle(slot, backend, "unload", True):
                        slot.content = None   # could not save it: what the router unloads is lost
                models.move_to_end(victim)    # the router saw the saves as uses
                models.move_to_end(route)
                continue
            del models[victim]
            for slot in slots:
                slot.content = None           # the instance and its slots go; a reload starts empty
            log.info("router_unloads backend=%s model=%s for=%s", backend.url, victim, route)
