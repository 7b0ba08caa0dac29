"""SIGTERM: lpcache stops accepting, lets requests in flight finish, lets their saves finish, and exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from lpcache.workloads.harness import LpcacheProcess, MockProcess

from ..conftest import user, words


def test_sigterm_lets_requests_and_saves_finish(tmp_path: Any) -> None:
    slots, meta = tmp_path / "slots", tmp_path / "meta"
    slots.mkdir()
    with MockProcess(str(slots), n_slots=2, extra=["--gen-ms-per-token", "20"]) as backend, \
            LpcacheProcess({"BACKENDS": json.dumps([{"url": backend.url, "slot_save_path": str(slots)}]),
                            "META_DIR": str(meta), "BIG_THRESHOLD_WORDS": "50", "WORDS_PER_BLOCK": "10",
                            "SHUTDOWN_TIMEOUT": "20"}) as proxy:
        def one(seed: int) -> httpx.Response:
            return httpx.post(f"{proxy.url}/v1/chat/completions", timeout=60,
                              json={"messages": user(words(seed, 200)), "max_tokens": 50})   # about 1 s each

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(one, seed) for seed in (1, 2)]
            deadline = time.monotonic() + 20
            while httpx.get(f"{backend.url}/mock/stats").json()["chat_requests"] < 2:   # both in flight
                assert time.monotonic() < deadline
            assert proxy.process is not None
            proxy.process.send_signal(signal.SIGTERM)
            responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200, 200]
        # uvicorn re-raises the signal once it has shut down cleanly, so the exit status says SIGTERM
        assert proxy.process.wait(timeout=60) in (0, -signal.SIGTERM)
        log = proxy.log_text()
        assert "app_stop" in log and "Traceback" not in log
        saved = sorted(f for f in os.listdir(meta) if f.endswith(".meta.json"))
        assert len(saved) == 2 and sorted(os.listdir(slots)) == sorted(f.removesuffix(".meta.json") for f in saved)
        assert not [f for f in os.listdir(meta) if ".tmp-" in f]
        for name in saved:
            assert isinstance(json.loads((meta / name).read_text())["blocks"], list)
