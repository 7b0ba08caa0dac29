"""The routes coding agents use besides chat: OpenAI Responses, Anthropic Messages, and fill-in-the-middle.

As on llama-server b11434, Responses and Anthropic bodies become chat bodies (`convert`) and run as chat requests, so
they share the chat template, the slots and the prompt cache; only their answers differ (`agent_shapes`). A
Responses body keeps `id_slot`; an Anthropic body loses it, so the server picks the slot itself. `/infill` builds its
prompt as `format_prompt_infill` does (server-common.cpp), so requests sharing the extra chunks and the prefix share
a cached prefix, and answers like `/completion`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lpcache.mock_llama.agent_shapes import AnthropicShape, ResponsesShape
from lpcache.mock_llama.api import ApiError, read_json, state_of
from lpcache.mock_llama.convert import anthropic_to_chat, responses_to_chat, value
from lpcache.mock_llama.errors import json_response
from lpcache.mock_llama.inference import mixed_tokens, render_messages, run_task, task_params
from lpcache.mock_llama.shapes import NativeShape
from lpcache.mock_llama.state import MockState
from lpcache.mock_llama.tokens import tokenize

# The stand-in imitates a model with repository-level FIM tokens (as Qwen2.5-Coder's); each is one token.
FIM_PRE, FIM_SUF, FIM_MID = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
FIM_REP, FIM_SEP = "<|repo_name|>", "<|file_sep|>"
N_BATCH = 2048  # llama-server's default --batch-size, which bounds the prefix and suffix kept
N_PREDICT = -1  # llama-server's default --n-predict, which bounds the extra context kept
NO_FIM = "Infill is not supported by this model: prefix token is missing. suffix token is missing. " \
         "middle token is missing. "


async def responses(request: Request) -> Response:
    state = state_of(request)
    body = responses_to_chat(await read_json(request))
    params = task_params(state, body, tokenize(render_messages(body)))
    return await run_task(request, params, ResponsesShape(state.config.model), body.get("stream") is True)


async def anthropic_messages(request: Request) -> Response:
    state = state_of(request)
    body = anthropic_to_chat(await read_json(request))
    params = task_params(state, body, tokenize(render_messages(body)))
    return await run_task(request, params, AnthropicShape(state.config.model), body.get("stream") is True)


async def responses_input_tokens(request: Request) -> Response:
    count = len(tokenize(render_messages(responses_to_chat(await read_json(request)))))
    return json_response({"input_tokens": count, "object": "response.input_tokens"})


async def anthropic_count_tokens(request: Request) -> Response:
    count = len(tokenize(render_messages(anthropic_to_chat(await read_json(request)))))
    return json_response({"input_tokens": count})


async def infill(request: Request) -> Response:
    state = state_of(request)
    if not state.config.fim:
        raise ApiError(501, NO_FIM)
    body = await read_json(request)
    prompt = infill_prompt(state, body)
    shape = NativeShape(state.config.model, " ".join(prompt))
    return await run_task(request, task_params(state, body, prompt), shape, body.get("stream") is True)


def infill_prompt(state: MockState, body: dict[str, Any]) -> list[str]:
    """`[REP]myproject [SEP]file text ... [SEP]filename [PRE]prefix prompt [SUF]suffix [MID]`: the extra chunks
    first (the oldest dropped past `n_ctx - n_batch - 2 n_predict` tokens), the prefix's last 3/4 batch, the
    prompt, then as much of the suffix's start as fits in the batch's last quarter."""
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise ApiError(400, '"prompt" must be a string')
    for field in ("input_prefix", "input_suffix"):
        if field not in body:
            raise ApiError(400, f'"{field}" is required')
    extra_chunks = body.get("input_extra", [])
    if not isinstance(extra_chunks, list):
        raise ApiError(400, '"input_extra" must be an array of {"filename": string, "text": string}')
    extra = [FIM_REP, *tokenize("myproject\n")]
    for chunk in extra_chunks:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ApiError(400, 'extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise ApiError(400, 'extra_context chunk\'s "filename" field must be a string')
        extra += [FIM_SEP, *tokenize(value(chunk, "filename", "tmp") + "\n"), *tokenize(chunk["text"])]
    extra += [FIM_SEP, *tokenize("filename\n")]

    prompt = tokenize(body.get("prompt", ""))
    prefix = mixed_tokens(state, body["input_prefix"], "input_prefix")
    suffix = mixed_tokens(state, body["input_suffix"], "input_suffix")
    n_prefix = min(len(prefix), 3 * (N_BATCH // 4))
    n_suffix = min(len(suffix), max(0, N_BATCH // 4 - (2 + len(prompt))))
    n_extra = min(max(0, state.config.n_ctx - N_BATCH - 2 * N_PREDICT), len(extra))
    return [*extra[len(extra) - n_extra :], FIM_PRE, *prefix[len(prefix) - n_prefix :], *prompt,
            FIM_SUF, *suffix[:n_suffix], FIM_MID]
