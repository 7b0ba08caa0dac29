"""Start-up against a hostile or damaged META_DIR, and the reconciliation of the slot-save folders after a crash
between a save and its meta file (against the stand-in llama-server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from lpcache.workloads.harness import LpcacheProcess

from ..conftest import user, words
from .conftest import mock_stats

BIG = 200


def run_lpcache(tmp_path: Any, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("BACKENDS", "LLAMA_URL", "META_DIR")}
    environ.update({"HOST": "127.0.0.1", "PORT": "1", "LLAMA_URL": "http://127.0.0.1:9", **env})
    return subprocess.run([sys.executable, "-m", "lpcache"], env=environ, capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path))


def test_an_unusable_meta_dir_stops_start_up_with_one_line_and_status_2(tmp_path: Any) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for meta_dir, said in ((a_file, "is not a folder"), (a_file / "meta", "cannot create")):
        done = run_lpcache(tmp_path, META_DIR=str(meta_dir))
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lpcache: error: META_DIR: ") and said in lines[0], lines
        assert "Traceback" not in done.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_a_meta_file_does_not_hold_up_start_up(start_proxy: Any, backend: Any,
                                                                 tmp_path: Any) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    os.mkfifo(meta / ("f" * 64 + ".meta.json"))
    proxy = start_proxy(backend)          # waits for /health: a start that blocks on the FIFO never gets there
    assert proxy.client.get("/health").status_code == 200
    assert proxy.chat(user(words(1, 20))).status_code == 200
    assert (meta / ("f" * 64 + ".meta.json")).exists()


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_crash_between_save_and_meta_file_is_reconciled_at_the_next_start(start_backend: Any, start_proxy: Any,
                                                                            slot_dir: str, tmp_path: Any) -> None:
    """lpcache is killed while the server writes a save (the meta file is never written); the next start deletes
    the file it made and never recorded, and leaves every file that is not provably its own."""
    backend = start_backend()
    httpx.post(f"{backend.url}/mock/faults", json={"latency_ms": 1500, "paths": ["/slots/0", "/slots/1"]})
    meta = tmp_path / "meta"
    settings = {"BACKENDS": json.dumps([{"url": backend.url, "slot_save_path": slot_dir}]), "META_DIR": str(meta),
                "BIG_THRESHOLD_WORDS": "50", "WORDS_PER_BLOCK": "10", "LOG_LEVEL": "INFO"}
    first = LpcacheProcess(settings)
    try:
        answer: dict[str, Any] = {}
        client = threading.Thread(target=lambda: answer.update(r=httpx.post(
            f"{first.url}/v1/chat/completions", json={"messages": user(words(1, BIG))}, timeout=30)))
        client.start()
        wait_for(lambda: any(n.endswith(".saving") for n in os.listdir(meta)), 20, "the save's marker")
        assert first.process is not None
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)
        client.join(timeout=30)
    finally:
        first.stop()
    [marker] = [n for n in os.listdir(meta) if n.endswith(".saving")]
    key = marker.removesuffix(".saving")
    assert not (meta / (key + ".meta.json")).exists() and mock_stats(backend)["saves"] == 0
    # A real server has the save's body when lpcache dies and writes the file; the stand-in reads it after its
    # injected latency and so drops the save: the file is put where the server writes it.
    with open(os.path.join(slot_dir, key), "wb") as f:
        f.write(b"a KV file no meta file describes")
    others = ["c" * 64, "Qwen3_8B-1a2b3c4d_" + "0" * 32 + ".bin", "slotcache_" + "1" * 64 + ".bin", "notes.txt"]
    for name in others:
        with open(os.path.join(slot_dir, name), "wb") as f:
            f.write(b"not lpcache's to delete")
    httpx.delete(f"{backend.url}/mock/faults")

    again = start_proxy(backend, meta_dir=str(meta))
    assert not os.path.exists(os.path.join(slot_dir, key))
    assert sorted(n for n in os.listdir(slot_dir)) == sorted(others)
    assert not any(n.endswith(".saving") for n in os.listdir(meta))
    r = again.chat(user(words(1, BIG)))                       # saved again, recorded this time
    again.settle()
    assert r.status_code == 200 and (meta / (key + ".meta.json")).exists()
    assert os.path.exists(os.path.join(slot_dir, key)) and not (meta / marker).exists()


# ---- what answers at a backend's URL, said in one line at start ----

async def _started(caplog: Any, url: str, n_slots: int | None = None, api_key: str | None = None) -> list[str]:
    import aiohttp

    from lpcache.backends.backend import start_backends
    from lpcache.config import BackendConfig, Settings

    caplog.clear()
    settings = Settings(backends=(BackendConfig(url, n_slots),), llama_api_key=api_key, request_timeout=5)
    async with aiohttp.ClientSession() as session:
        backends = await start_backends(settings, session)
    assert len(backends) == 1
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend_unavailable_at_start")]


async def test_a_web_server_that_is_not_llama_server_is_named_with_its_error_page_in_one_line(
        caplog: Any) -> None:
    from aiohttp import web

    page = ("<!DOCTYPE html>\n<html>\n<head><title>404 Not Found</title></head>\n<body>\n<center><h1>404 Not Found"
            "</h1></center>\n<hr><center>nginx/1.22.1</center>\n" + "<!-- padding -->\n" * 40 + "</body>\n</html>\n")

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text=page, content_type="text/html", headers={"Server": "nginx/1.22.1"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        for n_slots in (None, 2):   # a slot count given: /health is asked instead, and 404s the same
            (line,) = await _started(caplog, f"http://127.0.0.1:{port}", n_slots)
            assert "\n" not in line and len(line) < 700, line
            assert "HTML page: 404 Not Found" in line and "nginx/1.22.1 answered" in line, line
            assert "without /v1" in line and "<center>" not in line, line
    finally:
        await runner.cleanup()


async def test_a_llama_server_that_wants_a_key_says_which_setting_takes_it(start_backend: Any,
                                                                          caplog: Any) -> None:
    server = start_backend(api_key="server-key, other-key")
    for n_slots in (None, 2):   # with a slot count given, its keyless /health must not hide the missing key
        (line,) = await _started(caplog, server.url, n_slots)
        assert "wants a key" in line and "LLAMA_API_KEY (--api-key)" in line and "LPCACHE_API_KEYS" in line, line
    assert await _started(caplog, server.url, None, api_key="other-key") == [], "the right key: no warning"


async def test_nothing_listening_is_said_so(caplog: Any) -> None:
    import socket

    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (line,) = await _started(caplog, f"http://127.0.0.1:{port}")
    assert "nothing answers at that address" in line and "asks it again until it answers" in line, line
