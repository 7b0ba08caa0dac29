"""Test hooks under ``/mock/``: counters, faults, slot contents, and waiting for idle.

They exist only on the stand-in; they need no API key and are not counted in
``requests_by_path``. ``/mock/wait-idle`` lets a test wait for an event (a slot
going idle) instead of sleeping. In router mode ``/mock/slots`` and ``/mock/wait-idle``
take ``?model=X`` (default: every model) and ``/mock/stats`` reports per model too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lpcache.mock_llama.api import ApiError, read_json, state_of
from lpcache.mock_llama.errors import json_response
from lpcache.mock_llama.state import MockState, Stats


def children(request: Request) -> dict[str, MockState]:
    """The states a hook acts on: the server's own, or in router mode ``?model=X`` or every child."""
    state = state_of(request)
    if state.router is None:
        return {state.config.model: state}
    return state.router.children(request)


async def stats(request: Request) -> Response:
    """The counters; in router mode summed over the children, plus ``models`` (each child's, with loaded,
    loads, unloads) and ``slot_actions`` (every ``POST /slots/{id}`` received, with its model)."""
    state = state_of(request)
    return json_response(state.stats.to_json() if state.router is None else state.router.stats_json())


async def reset_stats(request: Request) -> Response:
    state = state_of(request)
    if state.router is None:
        state.stats = Stats()
    else:
        state.router.reset_stats()
    return await stats(request)


async def faults(request: Request) -> Response:
    """GET shows the armed faults, POST arms some (merging), DELETE disarms all."""
    state = state_of(request)
    if request.method == "POST":
        try:
            state.faults.update(await read_json(request))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
    elif request.method == "DELETE":
        state.faults.reset()
    return json_response(state.faults.to_json())


def slots_json(state: MockState) -> list[dict[str, Any]]:
    return [
        {"id": s.id, "tokens": s.tokens, "n_tokens": len(s.tokens), "idle": s.idle, "t_last_used": s.t_last_used}
        for s in state.pool.slots
    ]


async def slots(request: Request) -> Response:
    """Exactly what each slot holds, token pieces included; in router mode ``{model: slots}``."""
    state = state_of(request)
    if state.router is None:
        return json_response(slots_json(state))
    return json_response({name: slots_json(child) for name, child in children(request).items()})


async def wait_idle(request: Request) -> Response:
    """Block until ``?slot=N`` (default: every slot) is idle; 504 after ``?timeout=`` seconds.
    In router mode this is the slots of ``?model=X``, or of every model."""
    targets = children(request)
    try:
        raw = request.query_params.get("slot")
        slot = None if raw is None else int(raw)
        timeout = float(request.query_params.get("timeout", "10"))
    except ValueError as exc:
        raise ApiError(400, "bad slot or timeout") from exc

    async def all_idle() -> None:
        for state in targets.values():
            pool = state.pool
            await pool.wait_idle(pool.slots if slot is None else [pool.slots[slot % len(pool.slots)]])

    try:
        await asyncio.wait_for(all_idle(), timeout)
    except TimeoutError:
        return json_response({"idle": False}, 504)
    return json_response({"idle": True})
