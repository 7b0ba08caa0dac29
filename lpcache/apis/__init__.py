"""The generation APIs lpcache caches, one adapter each: how a body becomes the prompt's identity, where the slot
pin goes, how the answer reports its tokens and how errors look (`base.Api`).

    chat         POST /v1/chat/completions, /chat/completions
    responses    POST /v1/responses, /responses              (OpenAI Responses: Codex-style agents)
    messages     POST /v1/messages                           (Anthropic Messages: Claude-Code-style agents)
    completions  POST /v1/completions, /completions, /completion
    infill       POST /infill                                (fill-in-the-middle: editors)
"""

from __future__ import annotations

from lpcache.apis.base import Api, Call
from lpcache.apis.chat import ChatApi
from lpcache.apis.completions import CompletionsApi
from lpcache.apis.infill import InfillApi
from lpcache.apis.messages import MessagesApi
from lpcache.apis.responses import ResponsesApi

APIS: tuple[Api, ...] = (ChatApi(), ResponsesApi(), MessagesApi(), CompletionsApi(), InfillApi())
BY_PATH: dict[str, Api] = {path: api for api in APIS for path in api.paths}

__all__ = ["APIS", "BY_PATH", "Api", "Call"]
