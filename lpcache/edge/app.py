"""The ASGI app: routes, start and stop, and the one place errors become OpenAI-shaped responses.

Routes: every generation API (`apis`: chat, Responses, Messages, completions, infill) through the cache pipeline;
GET /v1/models (the backends' models, merged); GET /health; client slot
actions refused unless allowed; everything else is passed to a backend unchanged, so a client pointed at lpcache
instead of llama-server loses nothing. A method no route takes (TRACE, PROPFIND...) gets an OpenAI-shaped 405.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from lpcache.apis import BY_PATH
from lpcache.apis.base import Api
from lpcache.backends.admission import CLASSES
from lpcache.backends.backend import Prober, start_backends
from lpcache.backends.llama import client_session
from lpcache.backends.slot_pool import SlotPool
from lpcache.cache.cache_files import GIB
from lpcache.cache.index import MetaIndex
from lpcache.cache.orphans import OrphanSweeper
from lpcache.cache.session_ids import MAX_CHARS, read_session_id
from lpcache.config import Settings, describe, shown_url
from lpcache.config.version import __version__
from lpcache.edge import tracing
from lpcache.edge.browser_login import BrowserLogin
from lpcache.edge.http import HeaderLimits
from lpcache.edge.metrics import Metrics
from lpcache.errors import BackendUnreachable, BadRequest, ClientGone, ClientGoneReading, ProxyError
from lpcache.flow.forwarded import slot_actions_refused, slot_touched
from lpcache.flow.guard import ApiKeys, Caller, digest, read_body
from lpcache.flow.pipeline import Pipeline
from lpcache.flow.record import Observer, RequestRecord, log_record
from lpcache.flow.relay import PassThrough
from lpcache.plugins.registry import Loaded
from lpcache.plugins.registry import build as build_plugins

log = logging.getLogger("lpcache")

DISK_FIGURE_SECONDS = 5.0  # the dashboard's disk figure is this old at most (it stats up to 10,000 files)
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


class OrjsonResponse(JSONResponse):
    def render(self, content: object) -> bytes:
        import orjson

        return orjson.dumps(content)


def error_response(err: ProxyError, api: Api | None = None) -> Response:
    # a backend's own error answer as it came, else OpenAI's shape (Anthropic's on /v1/messages)
    body, content_type = api.error(err) if api is not None else err.payload()
    # 408 and 413 come before the body was read to its end: the connection cannot serve another request
    headers = {"connection": "close"} if err.status in (408, 413) else {}
    if err.retry_after is not None:   # a refusal that says when to come back (`admission`)
        headers["retry-after"] = str(max(1, math.ceil(err.retry_after)))
    return Response(body, status_code=err.status, media_type=content_type, headers=headers or None)


def client_left_reading(pipeline: Pipeline, record: RequestRecord) -> Response:
    """The client left while sending its body: its record says so (499, as nginx logs it); nobody reads the
    answer."""
    record.status, record.reason = 499, "client_disconnected"
    pipeline.notify(record)
    return Response(status_code=499)


def new_record(request: Request) -> RequestRecord:
    length = request.headers.get("content-length")
    return RequestRecord(
        method=request.method,
        path=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
        client_ip=request.client.host if request.client else None,
        user_agent=request.headers.get("user-agent"),
        bytes_in=int(length) if length and length.isdigit() else None,
        traceparent=request.headers.get("traceparent"), tracestate=request.headers.get("tracestate"),
    )


def _pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline  # type: ignore[no-any-return]


def _caller(request: Request, pipeline: Pipeline) -> Caller:
    """Who asks (`guard.Caller`), read from the request's headers once, where the request enters."""
    settings = pipeline.settings
    return Caller.of(request.headers, bool(settings.api_keys), settings.agent_session_ids,
                     request.app.state.priority_classes, settings.slot_wait_timeout)


async def generation(request: Request) -> ASGIApp:
    """Every generation API through the cache pipeline (`apis`)."""
    pipeline = _pipeline(request)
    record = new_record(request)
    api = BY_PATH[request.url.path]
    caller = _caller(request, pipeline)
    record.ticket, record.max_wait = caller.ticket, caller.max_wait
    try:
        return await pipeline.generate(request, record, api, caller)
    except ClientGoneReading:
        return client_left_reading(pipeline, record)
    except ClientGone:
        return Response(status_code=499)   # nobody reads it: the connection is gone
    except ProxyError as e:
        record.status = e.status
        record.reason = record.reason or {400: "invalid_request", 422: "invalid_request", 408: "client_timeout",
                                          413: "request_too_large"}.get(e.status, "backend_error")
        pipeline.notify(record)
        return error_response(e, api)


async def models(request: Request) -> Response:
    """The backends' models (each backend's /v1/models, merged, the first of each id kept); MODEL_ID when none
    answers."""
    pipeline = _pipeline(request)
    now = time.monotonic()

    async def one(b: Any) -> list[dict[str, Any]]:
        try:
            doc = await b.client.get_json("/v1/models")
        except ProxyError:
            return []
        data = doc.get("data") if isinstance(doc, dict) else None
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(
            data, list) else []

    found: dict[str, dict[str, Any]] = {}
    for entries in await asyncio.gather(*(one(b) for b in pipeline.backends if b.available(now))):
        for m in entries:
            found.setdefault(m["id"], m)
    if not found:
        model_id = pipeline.settings.model_id
        found[model_id] = {"id": model_id, "object": "model", "created": int(request.app.state.started),
                           "owned_by": "lpcache"}
    return OrjsonResponse({"object": "list", "data": list(found.values())})


async def health(request: Request) -> Response:
    """lpcache and each backend's state; 503 only when no backend can serve."""
    pipeline = _pipeline(request)
    now = time.monotonic()
    backends = [
        {"url": b.url, "n_slots": b.n_slots, "kv_cache": b.kv_cache, **b.breaker.describe(now),
         "busy_slots": sum(1 for s in pipeline.pool.slots if s.backend == b.index and s.busy)}
        for b in pipeline.backends
    ]
    serving = any(b.available(now) for b in pipeline.backends)
    return OrjsonResponse({"status": "ok" if serving else "unavailable", "version": __version__,
                           "backends": backends, "waiting": pipeline.pool.waiting,
                           "cached_entries": len(pipeline.index)}, status_code=200 if serving else 503)


async def sessions(request: Request) -> Response:
    """The sessions seen since start: route, file, the slot holding it, its file's size, last use, cache hits. With
    client keys, only the sessions the asking key made."""
    pipeline = _pipeline(request)
    holders = {s.content.key: s for s in pipeline.pool.slots if s.content is not None and s.content.session}
    data = []
    for info in pipeline.sessions.all(_caller(request, pipeline).owner):
        slot = holders.get(info.file)
        data.append({**info.as_dict(), "slot": None if slot is None else {
            "backend": pipeline.backends[slot.backend].url, "id": slot.id, "busy": slot.busy,
            "saved": slot.content.saved if slot.content else None}})
    return OrjsonResponse({"object": "list", "data": data})


async def session_compare(request: Request) -> Response:
    """Where the session's last prompt first differs from its previous one (`?route=` picks the route)."""
    pipeline = _pipeline(request)
    reading = read_session_id(request.path_params["session"].encode("utf-8", "surrogatepass"))
    sid = reading.id
    if sid is None:
        return error_response(BadRequest(f"not a session id ({reading.reason}): a session id is text of 1 to "
                                         f"{MAX_CHARS} characters without control characters",
                                         code="invalid_session_id"))
    info = pipeline.sessions.of_session(sid, request.query_params.get("route"), _caller(request, pipeline).owner)
    if info is None:
        return error_response(ProxyError("no such session since lpcache started", status=404, type="not_found_error",
                                         code="session_not_found"))
    if info.comparison is None:
        return error_response(ProxyError("the session has had one request: nothing to compare yet", status=404,
                                         type="not_found_error", code="no_comparison"))
    return OrjsonResponse({"session": info.session, "route": info.route, "file": info.file,
                           "requests": info.requests, "comparison": info.comparison.as_dict()})


async def forward(request: Request) -> ASGIApp:
    """Any route lpcache does not handle itself goes to a backend as it came: the first that can serve, the next
    one when it cannot be reached."""
    pipeline = _pipeline(request)
    record = new_record(request)
    path = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    path_qs = path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    headers = _caller(request, pipeline).passed
    slot_action = request.method == "POST" and request.url.path.startswith("/slots")
    if slot_action and not pipeline.settings.client_slot_actions:
        record.status, record.reason = 403, "slot_actions_refused"
        pipeline.notify(record)
        return error_response(slot_actions_refused())
    try:
        body = await read_body(request, pipeline.settings.max_body_bytes, pipeline.settings.client_timeout)
    except ClientGoneReading:
        return client_left_reading(pipeline, record)
    except ProxyError as e:
        record.status = e.status
        record.reason = record.reason or {408: "client_timeout", 413: "request_too_large"}.get(e.status)
        pipeline.notify(record)
        return error_response(e)
    return await pass_on(pipeline, request.method, path_qs, headers, body, record,
                         touched=request.url.path if slot_action else None)


async def pass_on(pipeline: Pipeline, method: str, path_qs: str, headers: dict[str, str], body: bytes,
                  record: RequestRecord, touched: str | None = None) -> ASGIApp:
    """To the first backend that can serve, the next one when it cannot be reached."""
    now = time.monotonic()
    order = sorted(pipeline.backends, key=lambda b: not b.available(now))
    error: ProxyError | None = None
    for backend in order:
        try:
            upstream = await backend.client.forward(method, path_qs, headers, body)
        except BackendUnreachable as e:
            backend.failed(e.message)
            error = e
            continue
        if touched is not None:
            slot_touched(pipeline.crew, backend, touched)
        return PassThrough(upstream, record, pipeline.notify)
    assert error is not None
    record.status, record.reason = error.status, "backend_unreachable"
    return error_response(error)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (a method no route takes: 405; no route: 404) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, exc.status_code)
    message = (f"method {request.method} not allowed on {request.url.path}" if exc.status_code == 405
               else exc.detail)
    return OrjsonResponse(ProxyError(message, status=exc.status_code, type=kind, code=code).body(),
                          status_code=exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal_error path=%s", request.url.path, exc_info=exc)
    return error_response(ProxyError("internal error in lpcache; see its log", code="internal_error"))


class DiskFigure:
    """The disk the caches use, for the dashboard: read in a worker thread (it stats up to 10,000 files), at most
    once every DISK_FIGURE_SECONDS however often the page polls."""

    def __init__(self, index: MetaIndex) -> None:
        self.index = index
        self.value: int | None = None
        self.at = -DISK_FIGURE_SECONDS
        self._reading: asyncio.Future[None] | None = None

    async def get(self) -> int | None:
        if time.monotonic() - self.at >= DISK_FIGURE_SECONDS:
            if self._reading is None:   # one read at a time: the pollers meanwhile share it
                self._reading = asyncio.ensure_future(self._read())
            await asyncio.shield(self._reading)
        return self.value

    async def _read(self) -> None:
        try:
            self.value = await asyncio.to_thread(self.index.disk_bytes_of, self.index.kv_files())
            self.at = time.monotonic()
        finally:
            self._reading = None


async def proxy_state(pipeline: Pipeline | None, started: float, disk: DiskFigure | None = None
                      ) -> dict[str, object]:
    """Live state for the dashboard: backends with breaker and slots, waiting requests, coalesced groups, cache."""
    if pipeline is None:
        return {}
    now = time.monotonic()
    backends = []
    for b in pipeline.backends:
        slots = [s for s in pipeline.pool.slots if s.backend == b.index]
        backends.append({
            "url": b.url, "kv_cache": b.kv_cache, **b.breaker.describe(now), "n_slots": len(slots),
            "busy_slots": sum(1 for s in slots if s.busy),
            "slots": [{"id": s.id, "busy": s.busy, "used": s.used,
                       "key": s.content.key[:16] if s.content else None,
                       "saved": s.content.saved if s.content else None} for s in slots]})
    return {
        "version": __version__,
        "uptime_secs": round(time.time() - started, 1),
        "backends": backends,
        "in_flight": sum(1 for s in pipeline.pool.slots if s.busy),
        "waiting": pipeline.pool.waiting,
        # per priority class: waiting now, the median and longest recent waits; refusals before waiting
        "line": pipeline.pool.line(),
        "refused": dict(pipeline.pool.refused),
        "coalesced_groups": len(pipeline.coalescer),
        "meta_entries": len(pipeline.index),
        # the settings whose cost the dashboard shows (what a saved cache would have spared)
        "big_threshold_words": "auto" if pipeline.settings.big_threshold_words is None
        else pipeline.settings.big_threshold_words,
        "meta_max": pipeline.settings.meta_max,
        "cache_disk_bytes": await (disk or DiskFigure(pipeline.index)).get(),
    }


def meta_max_bytes(settings: Settings) -> int:
    """META_MAX_GIB in bytes; `auto`: a quarter of the free space on the disk of the first slot-save folder lpcache
    sees (the files lpcache already keeps there count as free: they are its to replace), 0 when none is visible."""
    if settings.meta_max_gib is not None:
        return int(settings.meta_max_gib * GIB)
    for folder in settings.slot_save_paths:
        if os.path.isdir(folder):
            free = shutil.disk_usage(folder).free
            ours = sum(e.stat().st_size for e in os.scandir(folder) if e.is_file() and len(e.name) == 64)
            limit = (free + ours) // 4
            log.info("meta_max_gib auto=%.1f (a quarter of the free space on %s's disk)", limit / GIB, folder)
            return limit
    return 0


def create_app(settings: Settings, plugins: Loaded | None = None) -> Starlette:
    """Build the app. Plugins are built from `settings.plugins` unless given (PluginError on a bad spec); backends
    are contacted and the meta index loaded when it starts (ASGI lifespan)."""
    plugins = build_plugins(settings.plugins) if plugins is None else plugins
    metrics = Metrics(lambda: getattr(app.state, "pipeline", None), lambda: getattr(app.state, "disk", None))
    excluded = {path for r in plugins.routes for path in r.excluded_paths()}
    traces = tracing.from_settings(settings.tracing)

    def observers() -> list[Observer]:
        chosen: list[Observer] = [*([traces.observe] if traces is not None else []), log_record, metrics.observe,
                                  *(o.finished for o in plugins.observers)]
        if not excluded:
            return chosen
        def skipping(observer: Observer) -> Observer:
            def observe(record: RequestRecord) -> None:
                if record.path.split("?", 1)[0] not in excluded:
                    observer(record)
            return observe

        return [skipping(o) for o in chosen]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        session = client_session()   # connections kept idle less long than llama-server keeps them
        index = MetaIndex(settings.meta_dir, settings.words_per_block, settings.meta_max, settings.slot_save_paths,
                          meta_max_bytes(settings))
        try:
            for note in settings.notes:
                log.warning("%s", note)
            backends = await start_backends(settings, session)
            loaded = await asyncio.to_thread(index.load)
            pool = SlotPool([s for b in backends for s in b.slots()], settings.slot_wait_timeout,
                            settings.queue_max)
            app.state.started = time.time()
            app.state.pipeline = Pipeline(settings, backends, pool, index, observers=observers(),
                                          prefilters=plugins.prefilters)
            if settings.redis_url:
                fleet = app.state.pipeline.join_fleet()
                await fleet.start()
            app.state.disk = disk = DiskFigure(index)   # the dashboard's and /metrics' (lpcache_cache_disk_bytes)
            for router in plugins.routes:
                router.state = lambda: proxy_state(getattr(app.state, "pipeline", None), app.state.started, disk)
            for plugin in plugins.all:
                plugin.data_dir = settings.meta_dir   # for files of its own (the dashboard's history)
                await plugin.start()
            prober = Prober(backends, lambda b, old: pool.add(b.slots(start=old)))
            prober.start()
            app.state.pipeline.presence.due()   # whether each server keeps a RAM prompt cache (auto only)
            fleet_of = app.state.pipeline.fleet   # with Redis: only files every replica's entries are known for
            sweeper = OrphanSweeper(index.sweep_orphans, settings.orphan_grace_seconds,
                                    None if fleet_of is None else fleet_of.sweep_horizon)
            sweeper.start()
            app.state.loop = asyncio.get_running_loop()
            log.info("app_start version=%s backends=%s slots=%d meta_entries=%d plugins=%s %s", __version__,
                     ",".join(f"{shown_url(b.url)}({b.n_slots})" for b in backends), len(pool.slots), loaded,
                     ",".join(p.name for p in plugins.all) or "-", describe(settings))
            yield
            await prober.stop()
            await sweeper.stop()
            await app.state.pipeline.drain(settings.shutdown_timeout)
            await app.state.pipeline.save_all(settings.shutdown_timeout)
        finally:
            pipeline = getattr(app.state, "pipeline", None)
            if pipeline is not None and pipeline.fleet is not None:
                await pipeline.fleet.stop()
            for plugin in plugins.all:
                try:
                    await plugin.stop()
                except Exception:
                    log.exception("plugin_stop_failed plugin=%s", plugin.name)
            await index.close()
            await session.close()
            if traces is not None:
                await asyncio.to_thread(traces.shutdown)
            log.info("app_stop")

    app = Starlette(
        routes=[
            *(Route(path, generation, methods=["POST"]) for path in BY_PATH),
            Route("/v1/models", metrics.counted("/v1/models", models), methods=["GET"]),
            Route("/health", metrics.counted("/health", health), methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            Route("/lpcache/sessions", sessions, methods=["GET"]),
            Route("/lpcache/sessions/{session:path}/compare", session_compare, methods=["GET"]),
            *(route for router in plugins.routes for route in router.routes()),
            Route("/{path:path}", forward, methods=ALL_METHODS),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    # the priority class of each client key, by the identity a request shows (`guard.client_identity`)
    app.state.priority_classes = {digest(key): CLASSES.index(level) for key, level in settings.client_priorities}
    if settings.api_keys:
        pages = [list(paths) for router in plugins.routes if (paths := router.browser_paths())]
        login = BrowserLogin(settings.api_keys, pages) if pages else None
        app.add_middleware(ApiKeys, keys=settings.api_keys, login=login)
    app.add_middleware(HeaderLimits)
    return app
