"""Generation requests lpcache cannot key (`apis.Api.view` is None: several prompts in one completion, `n` > 1,
`previous_response_id`) and client slot actions: they change what slots hold, so they go through the slot pool too.

Such a request takes a slot like any request does (the coldest idle one; its cache saved first when it is worth
keeping and not on disk) and is pinned to it with `id_slot` where the route carries the pin; afterwards that slot's
content is unknown to lpcache (never saved, never taken for a hit). On a route that drops the pin (`/v1/messages`
in llama-server b11434, should one come here) the server picks a slot itself: the slot held for it keeps the count
of busy slots right, and the backend's slots are checked with GET /slots before their next use (`slot_truth`).

`POST /slots/...` from a client (save, restore, erase) is refused with 403 unless CLIENT_SLOT_ACTIONS allows it;
then the slot it names is marked unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from starlette.types import ASGIApp

from lpcache.backends.backend import Backend
from lpcache.backends.llama import unpin
from lpcache.backends.placement import Want
from lpcache.backends.slots import Slot
from lpcache.cache.sessions import route_name
from lpcache.config import Settings
from lpcache.errors import BackendUnreachable, BadRequest, ProxyError
from lpcache.flow.attempts import Crew
from lpcache.flow.record import RequestRecord
from lpcache.flow.relay import PassThrough

log = logging.getLogger("lpcache.forwarded")

UNPINNED_ROUTES = frozenset({"/v1/messages"})   # llama-server drops `id_slot` there


def slot_actions_refused() -> ProxyError:
    return ProxyError("slot actions (POST /slots/...) are made by lpcache itself: one from a client would change "
                      "a slot behind its back. Set CLIENT_SLOT_ACTIONS=true to allow them.", status=403,
                      type="permission_error", code="slot_actions_refused")


async def generate(crew: Crew, settings: Settings, path: str, path_qs: str, headers: Mapping[str, str], raw: bytes,
                   record: RequestRecord) -> ASGIApp | None:
    """Send a generation request through a slot of the pool. None when its body is not a JSON object (it goes to
    a backend as it came, which answers the error)."""
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    model = body.get("model") if isinstance(body.get("model"), str) else None
    model = model or settings.model_id
    await crew.routers.model_slots(model)
    route = route_name(model)
    route_pins = path not in UNPINNED_ROUTES
    tried: set[int] = set()
    error: ProxyError | None = None
    for _ in range(len(crew.backends)):
        def allowed(slot: Slot) -> bool:
            return slot.backend not in tried and (slot.model is None or slot.model == route) and (
                crew.backends[slot.backend].available() or len(tried) + 1 >= len(crew.backends))

        if not any(allowed(s) for s in crew.pool.slots):
            break
        choice = await crew.pool.acquire(Want(allowed=allowed, ticket=record.ticket), record.max_wait)
        slot, backend = choice.slot, crew.backends[choice.slot.backend]
        # never pinned where the backend's requests go unpinned (`flow.unpinned`): the server may run one there
        pinned = route_pins and not crew.pool.unpinned(slot.backend)
        crew.saver.cancel_idle_save(slot)
        record.backend, record.slot = backend.url, slot.id
        try:
            held = slot.content
            if pinned and held is not None and held.dirty and crew.filler.enabled(backend, held.model):
                await crew.saver.save_held(backend, slot, held, record)
            crew.pool.handed_over(slot)
            unpinned = crew.pool.unpinned(slot.backend)
            if pinned:
                body["id_slot"] = slot.id
            elif unpinned:
                unpin(body)   # not the client's own pin either, where the server may run an unpinned request
            try:
                data = orjson.dumps(body) if pinned or unpinned else raw
            except TypeError as e:   # orjson reads 1024 levels of nesting but writes only 254
                raise BadRequest(f"request body cannot be passed on: {e}", code="invalid_body") from e
            slot.phase = "generate"
            upstream = await backend.client.forward("POST", path_qs, headers, data)
        except BackendUnreachable as e:
            backend.failed(e.message)
            crew.pool.release(slot, True)
            tried.add(backend.index)
            error = e
            continue
        except BaseException:
            crew.pool.release(slot, True)
            raise
        return PassThrough(upstream, record, _done(crew, slot, backend, pinned))
    record.status, record.reason = (error.status if error else 503), "backend_unreachable"
    raise error or ProxyError("no backend can serve this request", status=503, type="unavailable_error",
                              code="no_backend")


def _done(crew: Crew, slot: Slot, backend: Backend, pinned: bool) -> Any:
    def done(record: RequestRecord) -> None:
        if pinned:
            crew.pool.release(slot, None)      # it holds the answer's prompt now: unknown to lpcache
        else:
            crew.pool.release(slot, True)
        backend.suspect = True   # the server chose a slot itself (no pin, or n > 1): check them before their next use
        crew.notify(record)

    return done


def slot_touched(crew: Crew, backend: Backend, path: str) -> None:
    """A client's slot action went to `backend`: the slot it names no longer holds what lpcache believed."""
    tail = path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    for slot in crew.pool.slots:
        if slot.backend == backend.index and (not tail.isdigit() or slot.id == int(tail)) and not slot.busy:
            slot.content = None
    backend.suspect = True


async def router_says(router: Backend, path: str, headers: dict[str, str], body: dict[str, Any],
                      record: RequestRecord, notify: Callable[[RequestRecord], None]) -> ASGIApp:
    """A model no llama-server router behind lpcache serves: the router's own answer (its error, in its words) is
    passed on as it is, and nothing is made for that model."""
    headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
    upstream = await router.client.forward("POST", path, headers, orjson.dumps(body))
    return PassThrough(upstream, record, notify)
