"""Running a stand-in in a background thread, for tests in the same process."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn

from lpcache.mock_llama.config import MockConfig
from lpcache.mock_llama.server import create_app
from lpcache.mock_llama.state import MockState

START_TIMEOUT_S = 10.0


class MockHandle:
    """A running stand-in: ``url``, ``port``, its live ``app_state``; ``stop()`` ends it."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, state: MockState, port: int) -> None:
        self._server = server
        self._thread = thread
        self.app_state = state
        self.port = port
        self.url = f"http://{state.config.host}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Release hung requests, ask uvicorn to exit, and wait for its thread."""
        loop = self.app_state.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.app_state.closing.set)
            except RuntimeError:  # the loop closed in between
                pass
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> MockHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_mock(config: MockConfig | None = None) -> MockHandle:
    """Start a stand-in on ``config.host:config.port`` (port 0: a free one) and wait until it serves."""
    config = config or MockConfig()
    app = create_app(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))  # bound here, so the port is known before the thread runs
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="mock-llama")
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:  # readiness: poll uvicorn's own flag
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the mock llama-server did not start")
        time.sleep(0.005)
    return MockHandle(server, thread, app.state.mock, sock.getsockname()[1])
