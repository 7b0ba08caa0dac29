"""Fixtures: stand-in llama-servers and lpcache, each on a free port in a thread, always stopped."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from lpcache.app import create_app
from lpcache.config import BackendConfig, Settings
from lpcache.mock_llama import MockConfig, MockHandle, start_mock
from lpcache.pipeline import Pipeline
from lpcache.testing import ServerThread


class Proxy:
    """lpcache serving in a thread; `settle()` waits until its background saves are done."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self.server = ServerThread(self.app).start()
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.records: list[Any] = []
        self._finished = threading.Condition()
        self.pipeline.observers.append(self._observe)

    def _observe(self, record: Any) -> None:
        with self._finished:
            self.records.append(record)
            self._finished.notify_all()

    def wait_finished(self, n: int, timeout: float = 30) -> None:
        """Wait until `n` requests have finished (their bookkeeping done and observers told)."""
        with self._finished:
            assert self._finished.wait_for(lambda: len(self.records) >= n, timeout), "requests did not finish"

    @property
    def pipeline(self) -> Pipeline:
        return self.app.state.pipeline  # type: ignore[no-any-return]

    def settle(self, timeout: float = 30) -> None:
        asyncio.run_coroutine_threadsafe(self.pipeline.settle(), self.app.state.loop).result(timeout)

    def busy_slots(self) -> list[str]:
        return [s.name for s in self.pipeline.pool.slots if s.busy]

    def chat(self, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json={"messages": messages, **body})

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


def mock_stats(mock: MockHandle) -> dict[str, Any]:
    return httpx.get(f"{mock.url}/mock/stats").json()  # type: ignore[no-any-return]


def words(seed: int, n: int) -> str:
    """n distinct-looking words; different seeds share no block."""
    return " ".join(f"w{seed}x{i}" for i in range(n))


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.fixture
def slot_dir(tmp_path: Any) -> str:
    path = os.path.join(tmp_path, "slots")
    os.makedirs(path)
    return path


@pytest.fixture
def start_backend(slot_dir: str) -> Iterator[Callable[..., MockHandle]]:
    started: list[MockHandle] = []

    def start(**config: Any) -> MockHandle:
        config.setdefault("slot_save_path", slot_dir)
        handle = start_mock(MockConfig(**config))
        started.append(handle)
        return handle

    yield start
    for handle in started:
        handle.stop()


@pytest.fixture
def backend(start_backend: Callable[..., MockHandle]) -> MockHandle:
    return start_backend()


@pytest.fixture
def start_proxy(tmp_path: Any) -> Iterator[Callable[..., Proxy]]:
    started: list[Proxy] = []

    def start(*backends: MockHandle | BackendConfig, **settings: Any) -> Proxy:
        configs = tuple(
            b if isinstance(b, BackendConfig) else BackendConfig(b.url, None, b.app_state.config.slot_save_path)
            for b in backends
        )
        base = Settings(backends=configs, meta_dir=os.path.join(tmp_path, "meta"), host="127.0.0.1",
                        save_retry_delay_ms=10, big_threshold_words=50, words_per_block=10)
        proxy = Proxy(replace(base, **settings))
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
def proxy(start_proxy: Callable[..., Proxy], backend: MockHandle) -> Proxy:
    return start_proxy(backend)
