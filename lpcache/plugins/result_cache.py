"""The result cache prefilter (`result_cache`): answers a request from a stored backend result of the same request.

An entry is `{dir}/{entry_key}.json` holding `{"created": unix_time, "completion": <chat.completion>}`. The entry
key is the SHA-256 of the canonical JSON of what shapes the answer: the body without `stream`/`stream_options`, the
resolved model, who asks (`client_key`: a digest of the client's lpcache key, or of the credential header that
goes on to llama-server when lpcache holds no client keys: Authorization, else X-Api-Key) and the X-Session-ID:
one client never gets another's answer. It is not lpcache's prefix cache key. Results are stored by `answered`
after a successful backend call; streaming requests are neither served nor stored unless `cache_streaming` (then
the aggregated completion is stored and hits are served to them as SSE).

Every `sweep_secs` the folder is swept: expired entries are deleted whether or not their request comes back, and
past `max_entries` the oldest ones go, so the folder stays bounded however many distinct requests clients send.

With `redis_url` (set from REDIS_URL unless the spec says otherwise: several replicas then share one result cache),
entries are Redis keys `lpcache:result:<entry_key>` with the same JSON, expiring after `ttl_secs` (Redis drops them:
no sweep), instead of files. A Redis that does not answer is a miss, and a result not stored: never a failed request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import orjson

from lpcache.cache.meta_files import write_atomic
from lpcache.flow.coalesce import completion_to_sse
from lpcache.plugins.base import Answer, ChatRequest, PluginError, PostCleanup, Prefilter, Serve, Verdict, param

log = logging.getLogger("lpcache.plugins.result_cache")

REDIS_PAUSE = 2.0   # seconds the result cache leaves a Redis that failed alone (a miss meanwhile)
_NOT_IN_KEY = ("stream", "stream_options")  # how the answer is delivered, not what it says


def entry_key(request: ChatRequest) -> str:
    """SHA-256 of the canonical JSON of everything that changes the answer to `request`."""
    body = {k: v for k, v in request.body.items() if k not in _NOT_IN_KEY}
    doc = {"body": body, "model": request.model, "client_key": request.client_key}
    if request.session is not None:   # (only when set: the keys of requests without a session are unchanged)
        doc["session"] = request.session
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()


def no_cache(headers: Mapping[str, str]) -> bool:
    """Whether the Cache-Control header carries the no-cache directive."""
    value = headers.get("cache-control") or ""
    return any(part.split("=", 1)[0].strip().lower() == "no-cache" for part in value.split(","))


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("result cache: cannot delete %s: %s", path, e)
        return False


_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.json")


def _created(path: str) -> float | None:
    """An entry's creation time, or None when it is corrupt. One that cannot be read (or is gone) is left alone."""
    try:
        with open(path, "rb") as f:
            doc = orjson.loads(f.read())
    except OSError:
        return float("inf")
    except orjson.JSONDecodeError:
        return None
    created = doc.get("created") if isinstance(doc, dict) else None
    if not isinstance(created, int | float) or isinstance(created, bool) or not isinstance(doc.get("completion"), dict):
        return None
    return float(created)


class RemoveAfterServe(PostCleanup):
    """Deletes a served entry's file, once: the one-shot cleanup of `remove_after_serve`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._done = False

    async def run(self, request: ChatRequest) -> None:
        if self._done:
            return
        self._done = True
        await asyncio.to_thread(_unlink, self.path)


class RemoveKeyAfterServe(PostCleanup):
    """`remove_after_serve` with entries in Redis: the served key goes, once."""

    def __init__(self, plugin: ResultCachePrefilter, key: str) -> None:
        self.plugin, self.key, self._done = plugin, key, False

    async def run(self, request: ChatRequest) -> None:
        if not self._done and self.plugin.redis is not None:
            self._done = True
            try:
                await self.plugin.redis.delete(self.key)
            except Exception as e:
                log.warning("result cache: cannot delete %s from Redis: %s", self.key, e)


class ResultCachePrefilter(Prefilter):
    """Serves fresh stored results; stores successful backend results."""

    name: ClassVar[str] = "result_cache"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        p = self.params
        self.dir: str = param(p, "dir", str, None, plugin=self.name, check=bool, rule="a non-empty path string")
        self.ttl_secs: int = param(p, "ttl_secs", int, 300, plugin=self.name, check=lambda v: v >= 0,
                                   rule="an integer >= 0")
        self.cache_streaming: bool = param(p, "cache_streaming", bool, False, plugin=self.name)
        self.cache_control: bool = param(p, "cache_control", bool, False, plugin=self.name)
        self.remove_after_serve: bool = param(p, "remove_after_serve", bool, False, plugin=self.name)
        self.sweep_secs: float = param(p, "sweep_secs", (int, float), 60, plugin=self.name, check=lambda v: v > 0,
                                       rule="a number > 0")
        self.max_entries: int = param(p, "max_entries", int, 10000, plugin=self.name, check=lambda v: v >= 0,
                                      rule="an integer >= 0")
        self.redis_url: str | None = param(p, "redis_url", str, "", plugin=self.name) or None
        self.redis: Any = None
        self._redis_quiet_until = 0.0   # after a failed call, Redis is left alone for REDIS_PAUSE seconds
        self.clock: Callable[[], float] = time.time  # replaced by tests
        self._storing: set[str] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.redis_url:
            from lpcache.fleet.shared_map import connect  # redis-py only when asked for

            self.redis = connect(self.redis_url)
            return
        try:
            await asyncio.to_thread(os.makedirs, self.dir, exist_ok=True)
        except OSError as e:
            raise PluginError(f"plugin {self.name!r}: parameter 'dir': cannot create {self.dir!r}: {e}") from e
        self._sweeper = asyncio.create_task(self._sweep_every())

    async def stop(self) -> None:
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()
            self.redis = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def _sweep_every(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_secs)
            try:
                removed = await asyncio.to_thread(self.sweep)
            except Exception as e:  # a folder that cannot be read now may be readable at the next sweep
                log.warning("result cache: sweep failed: %s", e)
                continue
            if removed:
                log.info("result_cache_swept removed=%d", removed)

    def sweep(self) -> int:
        """Delete the expired and corrupt entries, then the oldest past `max_entries`; returns how many went. Only
        entry files (`<64 hex digits>.json`) are looked at."""
        now, kept, removed = self.clock(), [], 0
        with os.scandir(self.dir) as found:
            entries = [e.path for e in found if _ENTRY_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)]
        for path in entries:
            created = _created(path)
            if created is None or (self.ttl_secs > 0 and now - created >= self.ttl_secs):
                removed += _unlink(path)
            else:
                kept.append((created, path))
        if self.max_entries and len(kept) > self.max_entries:
            kept.sort()
            for _, path in kept[:len(kept) - self.max_entries]:
                removed += _unlink(path)
        return removed

    def wants_answer(self, request: ChatRequest) -> bool:
        return request.api == "chat" and (self.cache_streaming or not request.stream)

    def entry_path(self, request: ChatRequest) -> str:
        return os.path.join(self.dir, entry_key(request) + ".json")

    async def check(self, request: ChatRequest) -> Verdict:
        if request.api != "chat":   # it keeps chat completions only
            return None
        if self.cache_control and no_cache(request.headers):
            return None
        if request.stream and not self.cache_streaming:
            return None
        if self.redis is not None:
            return await self._check_redis(request)
        try:
            found = await asyncio.to_thread(self._lookup, request)
        except Exception as e:  # a cache that cannot be read is a miss, never a failed request
            log.warning("result cache: lookup failed: %s", e)
            return None
        if found is None:
            return None
        path, completion = found
        cleanup = RemoveAfterServe(path) if self.remove_after_serve else None
        if request.stream:
            return Serve(body=completion_to_sse(completion), content_type="text/event-stream", cleanup=cleanup)
        return Serve(body=orjson.dumps(completion), content_type="application/json", cleanup=cleanup)

    def redis_key(self, request: ChatRequest) -> str:
        return f"lpcache:result:{entry_key(request)}"

    def _redis_usable(self) -> bool:
        return self.clock() >= self._redis_quiet_until

    def _redis_failed(self, what: str, e: Exception) -> None:
        """Redis down: one warning, then no call for REDIS_PAUSE seconds (each would wait for its timeout)."""
        self._redis_quiet_until = self.clock() + REDIS_PAUSE
        log.warning("result cache: %s in Redis failed, not tried again for %gs: %s", what, REDIS_PAUSE, e)

    async def _check_redis(self, request: ChatRequest) -> Verdict:
        if not self._redis_usable():
            return None
        key = await asyncio.to_thread(self.redis_key, request)
        try:
            raw = await self.redis.get(key)
        except Exception as e:   # Redis down: a miss
            self._redis_failed("a lookup", e)
            return None
        try:
            doc = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            doc = None
        completion = doc.get("completion") if isinstance(doc, dict) else None
        if not isinstance(completion, dict):
            return None
        cleanup = RemoveKeyAfterServe(self, key) if self.remove_after_serve else None
        if request.stream:
            return Serve(body=completion_to_sse(completion), content_type="text/event-stream", cleanup=cleanup)
        return Serve(body=orjson.dumps(completion), content_type="application/json", cleanup=cleanup)

    def _lookup(self, request: ChatRequest) -> tuple[str, dict[str, Any]] | None:
        """The entry's path and completion when fresh; a corrupt or expired entry is deleted."""
        path = self.entry_path(request)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("result cache: cannot read %s: %s", path, e)
            return None
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            doc = None
        created = doc.get("created") if isinstance(doc, dict) else None
        completion = doc.get("completion") if isinstance(doc, dict) else None
        if not isinstance(completion, dict) or not isinstance(created, int | float) or isinstance(created, bool):
            log.warning("result cache: deleting corrupt entry %s", path)
            _unlink(path)
            return None
        if self.ttl_secs > 0 and self.clock() - created >= self.ttl_secs:
            _unlink(path)
            return None
        return path, completion

    async def answered(self, request: ChatRequest, answer: Answer) -> None:
        completion = answer.completion
        if answer.status != 200 or not isinstance(completion, dict):
            return
        if answer.stream and not self.cache_streaming:
            return
        if not isinstance(completion.get("choices"), list) or not completion["choices"]:
            return
        if self.redis is not None:
            if not self._redis_usable():
                return
            try:
                key = await asyncio.to_thread(self.redis_key, request)
                data = orjson.dumps({"created": self.clock(), "completion": completion})
                await self.redis.set(key, data, px=self.ttl_secs * 1000 if self.ttl_secs > 0 else None)
            except Exception as e:
                self._redis_failed("storing a result", e)
            return
        try:
            path = await asyncio.to_thread(self.entry_path, request)
            if path in self._storing:  # an identical answer is being stored: one writer per entry
                return
            self._storing.add(path)
            try:
                data = orjson.dumps({"created": self.clock(), "completion": completion})
                await asyncio.to_thread(self._write, path, data)
            finally:
                self._storing.discard(path)
        except Exception as e:
            log.warning("result cache: cannot store a result: %s", e)

    def _write(self, path: str, data: bytes) -> None:
        os.makedirs(self.dir, exist_ok=True)
        write_atomic(path, data)
