"""Inference and token routes: chat, completions, tokenize, detokenize, apply-template."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from lpcache.mock_llama.api import ApiError, body_int, read_json, state_of
from lpcache.mock_llama.engine import Generation, TaskParams
from lpcache.mock_llama.errors import json_response
from lpcache.mock_llama.faults import cut_connection, wait_disconnect
from lpcache.mock_llama.shapes import ChatShape, NativeShape, Shape, TextCompletionShape
from lpcache.mock_llama.slots import wrap_slot_id
from lpcache.mock_llama.state import MockState
from lpcache.mock_llama.tokens import render_chat, tokenize


class SlotStreamingResponse(StreamingResponse):
    """A stream that gives its slot back however it ends: done, cut, or client gone."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def render_messages(body: dict[str, Any]) -> str:
    """The chat prompt of a request body (messages and tools), the same for the chat route, /apply-template and
    /v1/chat/completions/input_tokens (see `tokens.render_chat`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty array")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError(400, "every message must be an object with a string 'role'")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be an array")
    try:
        return render_chat(messages, tools)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def task_params(state: MockState, body: dict[str, Any], prompt: list[str]) -> TaskParams:
    """Read the task's settings from the body root, as llama-server does."""
    n_ctx = state.config.n_ctx
    if not prompt:
        raise ApiError(400, "the prompt is empty")
    if len(prompt) >= n_ctx:  # no room left to generate even one token
        message = (
            f"request ({len(prompt)} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"
        )
        raise ApiError(400, message, "exceed_context_size_error", n_prompt_tokens=len(prompt), n_ctx=n_ctx)
    n_predict = state.config.max_tokens_default
    for key in ("max_completion_tokens", "max_tokens", "n_predict"):
        if key in body:
            n_predict = body_int(body, key, n_predict)
            break
    id_slot = body_int(body, "id_slot", -1)
    slot_id = None if id_slot == -1 else wrap_slot_id(id_slot, state.config.slots)
    ping = body.get("sse_ping_interval", 0)   # seconds (here a fraction too, for quick tests)
    if not isinstance(ping, int | float) or isinstance(ping, bool):
        raise ApiError(400, "'sse_ping_interval' must be a number")
    return TaskParams(prompt, n_predict, body.get("cache_prompt") is not False, slot_id, float(ping))


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def pinging(events: AsyncGenerator[bytes, None], interval: float) -> AsyncGenerator[bytes, None]:
    """The stream with llama-server's keep-alive: a comment event (`:`) after every `interval` seconds without an
    event (its `sse_ping_interval`: during a long prefill, or between slow tokens)."""
    pending = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield b":\n\n"
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(events.__anext__())
    finally:
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
        await events.aclose()


async def cut_after(events: AsyncGenerator[bytes, None], limit: int, scope: Scope,
                    half: bool = False) -> AsyncGenerator[bytes, None]:
    """Pass ``limit`` events on (and with ``half``, the first half of the next one), then drop the connection (the
    stream-break fault)."""
    sent = 0
    if limit > 0 or half:
        async for event in events:
            if sent >= limit:   # half
                yield event[: len(event) // 2]
                break
            yield event
            sent += 1
            if sent >= limit and not half:
                break
        else:
            return  # the stream was shorter than the limit: it ends normally
    await events.aclose()
    await cut_connection(scope)


async def run_task(request: Request, params: TaskParams, shape: Shape, stream: bool) -> Response:
    state = state_of(request)
    gen = await Generation.start(state, params)
    if not stream:
        # Like llama-server, a JSON request whose client hangs up stops generating: the slot keeps what it
        # computed so far and is free at once.
        run = asyncio.ensure_future(gen.run())
        gone = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
                return Response(status_code=499)  # nobody is there to read it
            run.result()
        finally:
            gone.cancel()
            gen.release()
        return json_response(shape.body(gen))
    events = shape.events(gen)
    if params.sse_ping_interval > 0:
        events = pinging(events, params.sse_ping_interval)
    cut = state.faults.take_stream_break()
    if cut is not None:
        events = cut_after(events, cut, request.scope, state.faults.stream_break_half)
    return SlotStreamingResponse(events, gen.release)


async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    body = await read_json(request)
    params = task_params(state, body, tokenize(render_messages(body)))
    shape = ChatShape(state.config.model, include_usage(body), body.get("timings_per_token") is True)
    return await run_task(request, params, shape, body.get("stream") is True)


def completion_prompt(state: MockState, body: dict[str, Any]) -> list[str]:
    """A completion prompt as llama-server reads one: a string; an array holding token ids, maybe mixed with
    strings (one prompt, the strings tokenized in place); or an array of one such prompt. Several prompts in one
    request (the real server answers each) are not imitated."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not any(is_token_id(p) for p in prompt):
        prompt = prompt[0]
    if isinstance(prompt, list) and not prompt:
        prompt = None
    return mixed_tokens(state, prompt, "prompt")


def mixed_tokens(state: MockState, value: Any, name: str) -> list[str]:
    """The tokens of a string, or of an array of token ids and strings (`tokenize_mixed`)."""
    if isinstance(value, str):
        return tokenize(value)
    if isinstance(value, list) and all(is_token_id(p) or isinstance(p, str) for p in value):
        out: list[str] = []
        for part in value:
            if isinstance(part, str):
                out += tokenize(part)
                continue
            piece = state.vocab.piece(part)
            if piece is None:
                raise ApiError(400, f"invalid token in {name}")
            out.append(piece)
        return out
    raise ApiError(400, f"'{name}' must be a string, an array of token ids (and strings), or an array of one of those")


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def native_completion(request: Request) -> Response:
    state = state_of(request)
    body = await read_json(request)
    prompt = completion_prompt(state, body)
    shape = NativeShape(state.config.model, " ".join(prompt))
    return await run_task(request, task_params(state, body, prompt), shape, body.get("stream") is True)


async def v1_completions(request: Request) -> Response:
    state = state_of(request)
    body = await read_json(request)
    prompt = completion_prompt(state, body)
    shape = TextCompletionShape(state.config.model, include_usage(body))
    return await run_task(request, task_params(state, body, prompt), shape, body.get("stream") is True)


async def tokenize_route(request: Request) -> Response:
    """``add_special`` is accepted and has no effect: the toy vocabulary has no BOS token."""
    state = state_of(request)
    body = await read_json(request)
    content = body.get("content", "")
    if not isinstance(content, str):
        raise ApiError(400, "'content' must be a string")
    pieces = tokenize(content)
    ids = state.vocab.ids(pieces)
    if body.get("with_pieces") is True:
        return json_response({"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces, strict=True)]})
    return json_response({"tokens": ids})


async def detokenize_route(request: Request) -> Response:
    state = state_of(request)
    tokens = (await read_json(request)).get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ApiError(400, "'tokens' must be an array of token ids")
    pieces = (state.vocab.piece(t) for t in tokens)
    return json_response({"content": " ".join(p for p in pieces if p is not None)})


async def apply_template(request: Request) -> Response:
    return json_response({"prompt": render_messages(await read_json(request))})


async def input_tokens(request: Request) -> Response:
    count = len(tokenize(render_messages(await read_json(request))))
    return json_response({"input_tokens": count, "object": "response.input_tokens"})
