"""A real llama-server restarted between two turns holds nothing; lpcache notices it (GET /slots after a pause) and
restores the conversation's cache from disk instead of sending the follow-up to an empty slot."""

from __future__ import annotations

from typing import Any

import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.workloads.harness import LlamaServer

from ..conftest import Proxy, figures
from .test_real_llama import body, conversation, follow_up, shared, tokens

pytestmark = pytest.mark.e2e


def test_cache_survives_a_server_restart(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import lpcache.backends.slot_truth

    monkeypatch.setattr(lpcache.backends.slot_truth, "SLOTS_TRUSTED_FOR", 0.0)   # no need to wait a second in a test
    slots = str(tmp_path / "slots")
    first = conversation(7, n_words=700)
    server = LlamaServer(slots, n_slots=1, ctx=4096)
    proxy = Proxy(Settings(backends=(BackendConfig(server.url, None, slots),), meta_dir=str(tmp_path / "meta"),
                           host="127.0.0.1"))
    try:
        r = proxy.post(body(first))
        assert r.status_code == 200
        proxy.wait_finished(1)
        assert proxy.records[0].saved is True
        second = follow_up(first, r.json()["choices"][0]["message"]["content"])
        port = server.port
        server.stop()
        server = LlamaServer(slots, n_slots=1, ctx=4096, port=port)      # empty: its slot files are on disk
        r = proxy.post(body(second))
        assert r.status_code == 200
        proxy.wait_finished(2)
        record = proxy.records[1]
        common = shared(tokens(server.url, first), tokens(server.url, second))
        cache_n = r.json()["timings"]["cache_n"]
        figures(f"\nafter a restart: restored={record.restored} cache_n={cache_n} of {common} shared tokens, "
              f"prompt_n={r.json()['timings']['prompt_n']}")
        assert record.restored is True
        assert cache_n >= 0.9 * common
    finally:
        proxy.stop()
        server.stop()
