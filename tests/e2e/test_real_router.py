"""Router mode: the same assertions against the real llama-server (b11434, SmolLM2) and the stand-in.

The real router is started without ``-m`` and with ``--models-dir`` holding the one GGUF under
several names (symlinks ``a.gguf``, ``b.gguf``...), so each name is a model of its own with a
child process of its own. ``LLAMA_CACHE`` points at an empty folder so that no model from a
Hugging Face cache joins the list. The stand-in is started the same way, from its command line.
Each test runs once per backend: what passes on both is what the stand-in imitates faithfully.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from lpcache.workloads.harness import _Process, llama_paths

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
ROUTER_PROPS = {"role", "max_instances", "models_autoload", "model_alias", "model_path",
                "default_generation_settings", "ui_settings", "build_info", "cors_proxy_enabled"}
MODEL_ENTRY = {"id", "aliases", "tags", "object", "owned_by", "created", "status", "architecture", "source",
               "can_remove"}


class RealRouter(_Process):
    """llama-server in router mode: 2 slots of 1024 tokens per child, the RAM prompt cache off."""

    name = "llama-router"

    def __init__(self, work: Path, models: tuple[str, ...], models_max: int) -> None:
        super().__init__()
        binary, gguf = llama_paths()
        models_dir, cache = work / "models", work / "hf-cache"
        models_dir.mkdir()
        cache.mkdir()
        for name in models:
            (models_dir / f"{name}.gguf").symlink_to(gguf)
        self.slot_dir = work / "slots"
        self.slot_dir.mkdir()
        argv = [binary, "--models-dir", str(models_dir), "--models-max", str(models_max), "--host", "127.0.0.1",
                "--port", str(self.port), "-np", "2", "-c", "2048", "--cache-ram", "0",
                "--slot-save-path", str(self.slot_dir), "--no-webui"]
        env = {**os.environ, "LD_LIBRARY_PATH": os.path.dirname(binary), "LLAMA_CACHE": str(cache)}
        self._start(argv, env, 60)

    def queued(self, model: str) -> bool:
        """The router has a request waiting for ``model`` to be loaded (its log says so)."""
        return f"request for name={model} queued" in self.log_text()


class MockRouter(_Process):
    """The stand-in in router mode, started from its command line with the real router's shape."""

    name = "mock-router"

    def __init__(self, work: Path, models: tuple[str, ...], models_max: int) -> None:
        super().__init__()
        self.slot_dir = work / "slots"
        self.slot_dir.mkdir()
        argv = [sys.executable, "-m", "lpcache.mock_llama", str(self.port), "--router", "--models", ",".join(models),
                "--models-max", str(models_max), "--slots", "2", "--n-ctx", "1024",
                "--slot-save-path", str(self.slot_dir), "--gen-ms-per-token", "5"]
        self._start(argv, None, 30)

    def queued(self, model: str) -> bool:
        return bool(httpx.get(f"{self.url}/mock/stats").json()["models"][model]["waiting"])


Backend = RealRouter | MockRouter
StartRouter = Callable[..., Backend]


@pytest.fixture(params=["mock", "real"])
def start_router(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StartRouter]:
    kind = RealRouter if request.param == "real" else MockRouter
    started: list[Backend] = []

    def start(models: tuple[str, ...] = ("a", "b"), models_max: int = 1) -> Backend:
        work = tmp_path / f"router{len(started)}"
        work.mkdir()
        backend = kind(work, models, models_max)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.stop()
        print(f"--- {backend.name} log (last lines) ---\n{backend.log_tail(80)}")  # shown if the test failed


def error(message: str) -> dict[str, Any]:
    return {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


def router_client(url: str, timeout: float) -> httpx.Client:
    """A client that opens a new connection per request: the router closes idle keep-alive connections
    (cpp-httplib's 5 s timeout, and while it swaps models), and a reused closed one fails the request."""
    return httpx.Client(base_url=url, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))


def statuses(c: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in c.get("/models").json()["data"]}


def chat(c: httpx.Client, model: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **extra}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # polling interval of an event check, not a fixed wait


def test_router_answers_for_itself_and_rejects_bad_model_names(start_router: StartRouter) -> None:
    router = start_router(models_max=1)
    with router_client(router.url, 60) as c:
        assert c.get("/health").json() == {"status": "ok"}
        props = c.get("/props").json()
        assert set(props) == ROUTER_PROPS
        assert (props["role"], props["max_instances"], props["models_autoload"]) == ("router", 1, True)
        listing = c.get("/v1/models").json()
        assert listing["object"] == "list" and [set(m) for m in listing["data"]] == [MODEL_ENTRY, MODEL_ENTRY]
        assert statuses(c) == {"a": "unloaded", "b": "unloaded"}

        rejected = [
            (c.get("/slots"), "model name is missing from the request"),
            (c.get("/slots?model=zz"), "model 'zz' not found"),
            (c.get("/slots?model=a&autoload=false"), "model is not loaded"),
            (c.get("/props?model=a&autoload=0"), "model is not loaded"),
            (c.post("/slots/0?action=save", json={"filename": "f"}), "model name is missing from the request"),
            (c.post("/slots/0?action=save&model=a", json={"filename": "f"}), "model name is missing from the request"),
            (c.post("/slots/0?action=save", json={"filename": "f", "model": "zz"}), "model 'zz' not found"),
            (c.post("/slots/0?action=save&autoload=false", json={"filename": "f", "model": "a"}),
             "model is not loaded"),
            (c.post("/v1/chat/completions?autoload=false", json={"model": "b", "messages": MESSAGES}),
             "model is not loaded"),
        ]
        for response, message in rejected:
            assert (response.status_code, response.json()) == (400, error(message))
        assert statuses(c) == {"a": "unloaded", "b": "unloaded"}  # nothing was loaded on the way
        assert list(router.slot_dir.iterdir()) == []


def test_slot_files_survive_an_unload_and_restore_into_the_reloaded_model(start_router: StartRouter) -> None:
    router = start_router(models_max=1)
    with router_client(router.url, 120) as c:
        first = chat(c, "a", id_slot=0)
        assert first["model"] == "a"
        assert statuses(c) == {"a": "loaded", "b": "unloaded"}
        props = c.get("/props?model=a").json()
        assert (props["total_slots"], props["model_alias"]) == (2, "a")

        usage = first["usage"]
        saved = c.post("/slots/0?action=save", json={"filename": "a-0", "model": "a"}).json()
        assert saved["n_saved"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert (router.slot_dir / "a-0").exists()

        assert c.get("/slots?model=b").status_code == 200  # a GET loads b too; only one model fits: a goes
        assert statuses(c) == {"a": "unloaded", "b": "loaded"}
        r = c.post("/slots/0?action=save&autoload=false", json={"filename": "a-0", "model": "a"})
        assert (r.status_code, r.json()) == (400, error("model is not loaded"))  # and the file is untouched
        assert statuses(c) == {"a": "unloaded", "b": "loaded"}

        reloaded = c.get("/slots?model=a").json()
        assert statuses(c) == {"a": "loaded", "b": "unloaded"}
        assert len(reloaded) == 2 and all("n_prompt_tokens" not in s for s in reloaded)  # the KV went with a

        restored = c.post("/slots/0?action=restore", json={"filename": "a-0", "model": "a"}).json()
        assert restored["n_restored"] == saved["n_saved"]
        again = chat(c, "a", id_slot=0)
        assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens"] - 1  # the restored KV is used


def test_only_posts_count_as_a_use(start_router: StartRouter) -> None:
    router = start_router(models=("a", "b", "c"), models_max=2)
    with router_client(router.url, 120) as c:
        for model in ("a", "b"):
            assert c.post("/tokenize", json={"model": model, "content": "hi"}).status_code == 200
        assert c.get("/slots?model=a").status_code == 200  # newer than b's POST, but a GET
        assert c.post("/tokenize", json={"model": "c", "content": "hi"}).status_code == 200
        assert statuses(c) == {"a": "unloaded", "b": "loaded", "c": "loaded"}


def test_a_model_with_a_request_in_flight_is_not_unloaded(start_router: StartRouter) -> None:
    router = start_router(models_max=1)
    body = {"model": "a", "messages": MESSAGES, "max_tokens": 900, "temperature": 0, "stream": True}
    with router_client(router.url, 120) as c, ThreadPoolExecutor(1) as pool:
        with c.stream("POST", "/v1/chat/completions", json=body) as stream:
            chunks = stream.iter_lines()
            assert any(line.startswith("data: ") for line in chunks)
            other = pool.submit(c.get, "/slots?model=b")
            wait_until(lambda: router.queued("b") or other.done(), "the request for b to wait")
            assert not other.done()
            for _ in range(3):  # a goes on streaming while b waits
                assert next(chunks) is not None
            assert statuses(c) == {"a": "loaded", "b": "unloaded"}
        # the client left: a's request ends, a is idle and gives way to b
        assert other.result(timeout=60).status_code == 200
        assert statuses(c) == {"a": "unloaded", "b": "loaded"}
