"""Fixtures: stand-in llama-servers and lpcache, each on a free port in a thread, always stopped."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.mock_llama import MockConfig, MockHandle, start_mock

from ..conftest import Proxy, user, words  # noqa: F401  (re-exported for the tests here)


def until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    """Poll `condition` (every 5 ms, leaving the GIL to lpcache's thread) until it holds; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def mock_stats(mock: MockHandle) -> dict[str, Any]:
    return httpx.get(f"{mock.url}/mock/stats").json()  # type: ignore[no-any-return]


@pytest.fixture
def slot_dir(tmp_path: Any) -> str:
    path = os.path.join(tmp_path, "slots")
    os.makedirs(path)
    return path


MakeMock = Callable[..., MockHandle]


@pytest.fixture
def make_mock(tmp_path: Any) -> Iterator[MakeMock]:
    """Stand-ins started by the test (model "test-model", slot files under tmp_path), each stopped at its end."""
    handles: list[MockHandle] = []

    def make(**overrides: Any) -> MockHandle:
        handle = start_mock(MockConfig(**{"model": "test-model", "slot_save_path": str(tmp_path), **overrides}))
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        handle.stop()


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


def stand_in_fingerprint(**config: Any) -> str:
    """The model fingerprint lpcache computes for a stand-in of this config (its /props and /v1/models), which
    names its session files and tags its prefix caches."""
    from starlette.testclient import TestClient

    from lpcache.backends.backend import model_fingerprint
    from lpcache.mock_llama import create_app

    with TestClient(create_app(MockConfig(**config))) as c:
        return model_fingerprint(c.get("/props").json(), c.get("/v1/models").json()["data"][0])


STAND_IN_FP = stand_in_fingerprint()
