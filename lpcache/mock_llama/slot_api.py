"""``GET /slots`` and ``POST /slots/{id}?action=save|restore|erase``, checked in the real order.

A slot action waits for its slot like any task, so a save sent during a stream runs
when the stream ends and captures the generated tokens. The files are written inline:
tiny, unless ``kv_bytes_per_token`` gives them a real cache's weight. A file of another weight per token is refused
on restore, as the real server refuses a file saved under another KV cache type (`-ctk` / `-ctv`).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lpcache.mock_llama import slotfile
from lpcache.mock_llama.api import ApiError, read_json, state_of
from lpcache.mock_llama.errors import error_response, json_response
from lpcache.mock_llama.slots import Slot, wrap_slot_id
from lpcache.mock_llama.state import MockState

_STOI = re.compile(r"\s*[+-]?\d+")
_INT_MAX = 2**31 - 1
RESTORE_INVALID = "No available space in KV cache or invalid slot save file"
RESTORE_TOO_BIG = "Restored prompt does not fit in the slot context"
_JSON_TYPES = {int: "number", float: "number", bool: "boolean", list: "array", type(None): "null"}


def slot_json(slot: Slot) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": slot.id,
        "n_ctx": slot.n_ctx,
        "speculative": False,
        "is_processing": slot.processing,
    }
    task = slot.task
    if task is not None:  # only slots that have run a task report what they hold
        out.update(
            id_task=task.id_task,
            n_prompt_tokens=len(slot.tokens),
            n_prompt_tokens_processed=task.n_prompt_tokens_processed,
            n_prompt_tokens_cache=task.n_prompt_tokens_cache,
            params={"n_predict": task.n_predict},
            next_token=[
                {
                    "has_next_token": slot.processing and task.n_remain > 0,
                    "has_new_line": False,
                    "n_remain": task.n_remain,
                    "n_decoded": task.n_decoded,
                }
            ],
        )
    return out


async def get_slots(request: Request) -> Response:
    slots = state_of(request).pool.slots
    if request.query_params.get("fail_on_no_slot") and all(s.processing for s in slots):
        return error_response(503, "no slot available")
    return json_response([slot_json(s) for s in slots])


def parse_slot_id(raw: str) -> int:
    """``std::stoi``: leading digits count, trailing junk is ignored, overflow is an error."""
    match = _STOI.match(raw)
    if match is None or abs(int(match.group())) > _INT_MAX:
        raise ApiError(400, "Invalid slot ID")
    return int(match.group())


async def read_filename(request: Request) -> str:
    body = await read_json(request)
    if "filename" not in body:
        raise ApiError(400, "[json.exception.out_of_range.403] key 'filename' not found")
    filename = body["filename"]
    if not isinstance(filename, str):
        kind = _JSON_TYPES.get(type(filename), "object")
        raise ApiError(400, f"[json.exception.type_error.302] type must be string, but is {kind}")
    if not slotfile.is_valid_filename(filename):
        raise ApiError(400, "Invalid filename")
    return filename


async def slot_action(request: Request) -> Response:
    state = state_of(request)
    if state.config.slot_save_path is None:
        return error_response(501, "This server does not support slots action. Start it with `--slot-save-path`")
    id_slot = parse_slot_id(request.path_params["id_slot"])
    action = request.query_params.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise ApiError(400, "Invalid action")
    filename = await read_filename(request) if action != "erase" else ""
    index = wrap_slot_id(id_slot, state.config.slots)
    if index is None:
        raise ApiError(400, "Invalid slot ID")
    slot = state.pool.slots[index]
    if not slot.idle:
        state.stats.slot_actions_while_busy += 1
    await state.pool.acquire(index)
    try:
        if action == "save":
            return save(state, slot, filename)
        if action == "restore":
            return restore(state, slot, filename)
        return erase(state, slot)
    finally:
        state.pool.release(slot, used=False)


def _path(state: MockState, filename: str) -> str:
    assert state.config.slot_save_path is not None
    return os.path.join(state.config.slot_save_path, filename)


def save(state: MockState, slot: Slot, filename: str) -> Response:
    t0 = time.perf_counter()
    status = state.faults.take_save_status()
    if status is not None:
        state.stats.save_failures += 1
        return error_response(status, "Unable to save slot")
    data = slotfile.encode(slot.tokens, state.config.kv_bytes_per_token * len(slot.tokens))
    # `save_short`: llama-server b11434 writes through a buffered FILE and ignores the flush's error at close, so a
    # disk that fills during the last buffer leaves a shorter file than the `n_written` it answers
    kept = len(data) - min(4096, len(data) // 2) if state.faults.take_save_short() else len(data)
    try:
        with open(_path(state, filename), "wb") as f:  # in place, not atomic, like llama.cpp
            f.write(data[:kept])
    except OSError:
        state.stats.save_failures += 1
        return error_response(500, "Unable to save slot")
    state.stats.saves += 1
    return json_response(
        {
            "id_slot": slot.id,
            "filename": filename,
            "n_saved": len(slot.tokens),
            "n_written": len(data),
            "timings": {"save_ms": (time.perf_counter() - t0) * 1000},
        }
    )


def restore(state: MockState, slot: Slot, filename: str) -> Response:
    """Load a file into the slot; any failure leaves the slot empty. Not a use for LRU."""
    t0 = time.perf_counter()
    try:
        with open(_path(state, filename), "rb") as f:
            data = f.read()
        tokens = slotfile.decode(data)
        reason = RESTORE_TOO_BIG if len(tokens) > slot.n_ctx else None
        if len(data) != len(slotfile.encode(tokens, state.config.kv_bytes_per_token * len(tokens))):
            reason = RESTORE_INVALID   # saved under another KV cache type (another size per token): refused
    except (OSError, slotfile.SlotFileError):
        reason = RESTORE_INVALID
    if reason is not None:
        slot.tokens = []
        state.stats.restore_failures += 1
        return error_response(400, f"Unable to restore slot: {reason}")
    slot.tokens = tokens
    slot.restored = True
    state.stats.restores += 1
    return json_response(
        {
            "id_slot": slot.id,
            "filename": filename,
            "n_restored": len(tokens),
            "n_read": len(data),
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1000},
        }
    )


def erase(state: MockState, slot: Slot) -> Response:
    n_erased = len(slot.tokens)
    slot.tokens = []
    state.stats.erases += 1
    return json_response({"id_slot": slot.id, "n_erased": n_erased})
