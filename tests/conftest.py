"""Shared by the integration (stand-in) and end-to-end (real llama-server) tests: lpcache in a thread."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from lpcache.config import Settings
from lpcache.edge.app import create_app
from lpcache.edge.http import server_options
from lpcache.flow.pipeline import Pipeline
from lpcache.workloads.harness import RedisServer, ServerThread


class Proxy:
    """lpcache serving in a thread; `settle()` waits until its background saves are done."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self.server = ServerThread(self.app, **server_options(settings)).start()
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=300)   # a real prefill on a busy 2-core machine
        self.records: list[Any] = []
        self._finished = threading.Condition()
        self.pipeline.observers.append(self._observe)

    def _observe(self, record: Any) -> None:
        with self._finished:
            self.records.append(record)
            self._finished.notify_all()

    def wait_finished(self, n: int, timeout: float = 30) -> None:
        """Wait until `n` requests have finished (observers told) and every background write is done."""
        with self._finished:
            assert self._finished.wait_for(lambda: len(self.records) >= n, timeout), \
                f"requests did not finish: {len(self.records)} records of {n}"
        self.settle(timeout)

    @property
    def pipeline(self) -> Pipeline:
        return self.app.state.pipeline  # type: ignore[no-any-return]

    def settle(self, timeout: float = 30) -> None:
        asyncio.run_coroutine_threadsafe(self.pipeline.settle(), self.app.state.loop).result(timeout)

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on lpcache's event loop (to await its own tasks, or call the pipeline)."""
        return asyncio.run_coroutine_threadsafe(coro, self.app.state.loop).result(timeout)

    def busy_slots(self) -> list[str]:
        return [s.name for s in self.pipeline.pool.slots if s.busy]

    def chat(self, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
             **body: Any) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json={"messages": messages, **body}, headers=headers)

    def push(self, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
             **body: Any) -> httpx.Response:
        """A request whose save is done before the next one chooses its slot (for tests of slot choice)."""
        r = self.chat(messages, headers, **body)
        self.settle()
        return r

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json=body)

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


# What a test that takes a server's RAM cache as seen serving its returns says it served: the whole context of a
# slot, so that the bound on the RAM's bet (`RamWatch.bets`) covers every prompt of the test.
RAM_SERVED_TOKENS = 8192.0


def words(seed: int, n: int) -> str:
    """n distinct-looking words; different seeds share no block."""
    return " ".join(f"w{seed}x{i}" for i in range(n))


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


_config: Any = None


def pytest_configure(config: Any) -> None:
    global _config
    _config = config


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--browser-optional", action="store_true",
                     help="skip the tests marked `browser` when a file they name (chromium, chromedriver) is missing, "
                          "instead of failing them (make test-fast; make test and CI always run them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With --browser-optional, a test marked `browser(path, ...)` whose browser files are not all there is skipped,
    the reason naming them; without it, the test runs and fails on its own terms."""
    if not config.getoption("--browser-optional"):
        return
    for item in items:
        marker = item.get_closest_marker("browser")
        if marker is None:
            continue
        missing = [path for path in marker.args if not os.access(path, os.X_OK)]
        if missing:
            item.add_marker(pytest.mark.skip(
                reason=f"{', '.join(missing)} not installed (`make browser` installs Debian's chromium and "
                       "chromium-driver, as root)"))


BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """A script of bench/ as a module (bench/ is not a package), to test its pure parts or run it small."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def figures(line: str) -> None:
    """Show measured figures in the run's output (the CI log), past pytest's output capture."""
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    capture = _config.pluginmanager.get_plugin("capturemanager") if _config is not None else None
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line.strip("\n"))


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server of the test's own on a free port (saved to its folder at shutdown, so `restart()` is a
    Redis restart), removed after the test."""
    server = RedisServer(persist=True)
    try:
        yield server
    finally:
        server.remove()
