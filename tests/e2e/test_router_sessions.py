"""lpcache in front of a llama-server router holding one model at a time (--models-max 1), with sessions on two
models: the router is detected from /props, slot calls name the model, and the slot of the model the router is
about to unload is saved before the request that makes it unload, so the session comes back restored after the
model was reloaded. Run against the stand-in's router and the real one (b11434, SmolLM2 under two names)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lpcache.cache.sessions import session_filename
from lpcache.config import BackendConfig, Settings
from lpcache.workloads.harness import story

from ..conftest import Proxy, figures
from .test_real_router import MockRouter, RealRouter

S1, S2 = "a1" * 16, "b2" * 16


@pytest.fixture(params=["mock", pytest.param("real", marks=pytest.mark.e2e)])
def router(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RealRouter | MockRouter]:
    kind = RealRouter if request.param == "real" else MockRouter
    backend = kind(tmp_path, ("a", "b"), 1)
    yield backend
    backend.stop()
    print(f"--- {backend.name} log (last lines) ---\n{backend.log_tail(40)}")


def ask(proxy: Proxy, model: str, session: str, text: str) -> dict[str, Any]:
    r = proxy.client.post("/v1/chat/completions", headers={"X-Session-ID": session}, json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    proxy.settle()
    return r.json()  # type: ignore[no-any-return]


def test_sessions_survive_the_router_unloading_their_model(router: RealRouter | MockRouter, tmp_path: Path) -> None:
    slot_dir = str(router.slot_dir)
    proxy = Proxy(Settings(backends=(BackendConfig(router.url, None, slot_dir),), meta_dir=str(tmp_path / "meta"),
                           host="127.0.0.1", save_policy="evict", models_max=1, big_threshold_words=50))
    try:
        [backend] = proxy.pipeline.backends
        assert backend.router and proxy.pipeline.pool.slots == []
        a, b = story(1, 300), story(2, 300)
        first = ask(proxy, "a", S1, a)
        assert {s.model for s in proxy.pipeline.pool.slots} == {"a"}
        ask(proxy, "b", S2, b)                           # the router unloads a: its slot is saved first
        assert proxy.pipeline.saver.background.saves_ok == 1
        assert sorted(httpx.get(f"{router.url}/models", timeout=30).json()["data"][i]["status"]["value"]
                      for i in range(2)) == ["loaded", "unloaded"]
        back = ask(proxy, "a", S1, a + " And then?")     # b saved, a reloaded, S1 restored into it
        assert proxy.pipeline.saver.background.saves_ok == 2
        record = proxy.records[-1]
        assert record.restored is True
        prompt = first["usage"]["prompt_tokens"]
        assert back["timings"]["cache_n"] >= 0.9 * prompt
        figures(f"\nrouter ({router.name}): restored {record.restored_tokens} tokens after the reload of a, "
              f"cache_n {back['timings']['cache_n']} of {back['usage']['prompt_tokens']}")
        names = set(Path(slot_dir).iterdir())
        fps = backend.model_fingerprints
        assert {p.name for p in names} >= {session_filename("a", S1, fps["a"]), session_filename("b", S2, fps["b"])}
    finally:
        proxy.stop()


def test_router_model_slots_are_counted_once_the_model_is_loaded(router: RealRouter | MockRouter,
                                                                  tmp_path: Path) -> None:
    proxy = Proxy(Settings(backends=(BackendConfig(router.url, None, str(router.slot_dir)),),
                           meta_dir=str(tmp_path / "meta"), host="127.0.0.1"))
    try:
        ask(proxy, "a", S1, "hello")       # a was not loaded: one slot (N_SLOTS) until it is
        assert sorted(s.id for s in proxy.pipeline.pool.slots if s.model == "a") == [0, 1]
        ask(proxy, "b", S2, "hello")
        assert sorted((s.model, s.id) for s in proxy.pipeline.pool.slots) == [("a", 0), ("a", 1), ("b", 0),
                                                                               ("b", 1)]
    finally:
        proxy.stop()
