"""The app factory: routes (single-model or router), API key check, fault layer and the error envelope."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lpcache.mock_llama import agent_routes, hooks, inference, info, slot_api
from lpcache.mock_llama.api import ApiError
from lpcache.mock_llama.config import MockConfig
from lpcache.mock_llama.errors import error_response
from lpcache.mock_llama.faults import FaultMiddleware, capture_transport
from lpcache.mock_llama.router import Endpoint, Router, load_model, proxied, router_models, router_props, unload_model
from lpcache.mock_llama.state import MockState

PUBLIC_PATHS = ("/health", "/v1/health")
HOOK_PREFIX = "/mock/"


class ApiKeyMiddleware:
    """With keys configured, everything but health and the test hooks needs one of them."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and not _is_public(scope["path"]):
            headers = Headers(scope=scope)
            # as llama-server (server-http.cpp): Authorization, else X-Api-Key; a "Bearer " prefix is dropped
            key = headers.get("authorization") or headers.get("x-api-key") or ""
            key = key.removeprefix("Bearer ")
            if key not in self.keys:
                await error_response(401, "Invalid API Key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(HOOK_PREFIX)


class MockApp(Starlette):
    """Starlette, plus two things only the outermost layer can do: reach the connection's
    transport (for the connection faults) and count every request by path."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            capture_transport(scope, send)
            if not scope["path"].startswith(HOOK_PREFIX):
                self.state.mock.stats.requests_by_path[scope["path"]] += 1
        await super().__call__(scope, receive, send)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, exc.type, **exc.extra)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code in (404, 405):  # llama-server has no "method not allowed"
        return error_response(404, "File Not Found")
    return error_response(exc.status_code, str(exc.detail))


async def server_error(request: Request, exc: Exception) -> Response:
    return error_response(500, f"mock server error: {exc!r}")


def routes(router: bool) -> list[Route]:
    """The routes; in router mode the model-specific ones go through the model the request names."""
    post = ["POST"]

    def by_body(handler: Endpoint, slot_action: bool = False) -> Endpoint:
        return proxied(handler, post=True, slot_action=slot_action) if router else handler

    def by_query(handler: Endpoint) -> Endpoint:
        return proxied(handler, post=False) if router else handler

    models = router_models if router else info.models
    extra = [Route("/models/load", load_model, methods=post), Route("/models/unload", unload_model, methods=post)]
    return [
        Route("/health", info.health),
        Route("/v1/health", info.health),
        Route("/models", models),
        Route("/v1/models", models),
        Route("/props", router_props(by_query(info.props)) if router else info.props),
        Route("/v1/chat/completions", by_body(inference.chat_completions), methods=post),
        Route("/chat/completions", by_body(inference.chat_completions), methods=post),
        Route("/completion", by_body(inference.native_completion), methods=post),
        Route("/completions", by_body(inference.native_completion), methods=post),
        Route("/v1/completions", by_body(inference.v1_completions), methods=post),
        Route("/v1/responses", by_body(agent_routes.responses), methods=post),
        Route("/responses", by_body(agent_routes.responses), methods=post),
        Route("/v1/messages", by_body(agent_routes.anthropic_messages), methods=post),
        Route("/infill", by_body(agent_routes.infill), methods=post),
        Route("/tokenize", by_body(inference.tokenize_route), methods=post),
        Route("/detokenize", by_body(inference.detokenize_route), methods=post),
        Route("/apply-template", by_body(inference.apply_template), methods=post),
        Route("/v1/chat/completions/input_tokens", by_body(inference.input_tokens), methods=post),
        Route("/chat/completions/input_tokens", by_body(inference.input_tokens), methods=post),
        Route("/v1/responses/input_tokens", by_body(agent_routes.responses_input_tokens), methods=post),
        Route("/responses/input_tokens", by_body(agent_routes.responses_input_tokens), methods=post),
        Route("/v1/messages/count_tokens", by_body(agent_routes.anthropic_count_tokens), methods=post),
        Route("/slots", by_query(slot_api.get_slots)),
        Route("/slots/{id_slot}", by_body(slot_api.slot_action, slot_action=True), methods=post),
        *(extra if router else []),
        Route("/mock/stats", hooks.stats),
        Route("/mock/reset-stats", hooks.reset_stats, methods=post),
        Route("/mock/faults", hooks.faults, methods=["GET", "POST", "DELETE"]),
        Route("/mock/slots", hooks.slots),
        Route("/mock/wait-idle", hooks.wait_idle),
    ]


def create_app(config: MockConfig) -> Starlette:
    """A stand-in llama-server for ``config``; its live state is ``app.state.mock``."""
    state = MockState(config)
    if config.router:
        state.router = Router(state)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        yield
        state.closing.set()

    app = MockApp(
        routes=routes(config.router),
        middleware=[
            Middleware(ApiKeyMiddleware, keys=config.api_keys),
            Middleware(FaultMiddleware, faults=state.faults, closing=state.closing),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.mock = state
    return app
