"""Test hooks under ``/mock/``: counters, faults, slot contents, and waiting for idle.

They exist only on the stand-in; they need no API key and are not counted in
``requests_by_path``. ``/mock/wait-idle`` lets a test wait for an event (a slot
going idle) instead of sleeping.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from .api import ApiError, read_json, state_of
from .errors import json_response
from .state import Stats


async def stats(request: Request) -> Response:
    return json_response(state_of(request).stats.to_json())


async def reset_stats(request: Request) -> Response:
    state = state_of(request)
    state.stats = Stats()
    return json_response(state.stats.to_json())


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


async def slots(request: Request) -> Response:
    """Exactly what each slot holds, token pieces included."""
    return json_response(
        [
            {"id": s.id, "tokens": s.tokens, "n_tokens": len(s.tokens), "idle": s.idle, "t_last_used": s.t_last_used}
            for s in state_of(request).pool.slots
        ]
    )


async def wait_idle(request: Request) -> Response:
    """Block until ``?slot=N`` (default: every slot) is idle; 504 after ``?timeout=`` seconds."""
    state = state_of(request)
    try:
        raw = request.query_params.get("slot")
        targets = state.pool.slots if raw is None else [state.pool.slots[int(raw) % len(state.pool.slots)]]
        timeout = float(request.query_params.get("timeout", "10"))
    except ValueError as exc:
        raise ApiError(400, "bad slot or timeout") from exc

    try:
        await asyncio.wait_for(state.pool.wait_idle(targets), timeout)
    except TimeoutError:
        return json_response({"idle": False}, 504)
    return json_response({"idle": True})
