"""The llama-servers behind lpcache: their settings, their client, their slot count.

A backend given without `n_slots` is asked for it (`GET /props`, `total_slots`) at start. One that does not answer
is started with the N_SLOTS fallback and a warning, so lpcache comes up; its requests fail with 502 until it answers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from .config import BackendConfig, Settings
from .errors import ProxyError
from .llama import LlamaClient
from .slots import Slot

log = logging.getLogger("lpcache.backends")


@dataclass(eq=False)
class Backend:
    index: int
    config: BackendConfig
    client: LlamaClient
    n_slots: int

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def kv_cache(self) -> bool:
        return self.config.kv_cache

    def slots(self) -> list[Slot]:
        return [Slot(self.index, i, self.config.kv_cache, self.config.slot_save_path, self.url)
                for i in range(self.n_slots)]


async def start_backends(settings: Settings, session: aiohttp.ClientSession) -> list[Backend]:
    """Build a client per backend and settle each one's slot count, asking the servers in parallel."""

    async def one(i: int, config: BackendConfig) -> Backend:
        client = LlamaClient(config.url, session, api_key=settings.llama_api_key, timeout=settings.request_timeout)
        n_slots = config.n_slots
        if n_slots is None:
            try:
                n_slots = await client.total_slots()
                log.info("backend_slots url=%s total_slots=%d (from /props)", config.url, n_slots)
            except ProxyError as e:
                n_slots = settings.n_slots
                log.warning("backend_slots url=%s total_slots=unknown (%s); using N_SLOTS=%d",
                            config.url, e.message, n_slots)
        return Backend(i, config, client, n_slots)

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(settings.backends))))
