"""lpcache's LiteLLM hook against the stand-in, called as LiteLLM calls it (the kwargs shape of litellm 1.108.7,
see tests/e2e/test_litellm_rig.py), then the request sent as LiteLLM would send it. The real LiteLLM proxy runs it
in tests/e2e/test_litellm_real.py."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from lpcache.integrations.litellm import RouteOptions, SlotCacheHook, server_root
from lpcache.sessions import session_filename

from ..conftest import user, words
from .conftest import mock_stats

S1, S2, S3 = "1" * 32, "2" * 32, "3" * 32


def name(hook: SlotCacheHook, backend: Any, route: str, session: str) -> str:
    """A session's file: its route, the identity of the model the server runs for it, the session."""
    fingerprint = hook.fingerprints[(backend.url, route)]
    assert fingerprint is not None
    return session_filename(route, session, fingerprint)


def kwargs(backend: Any, session: str | None, model: str = "smol", slot_cache: Any = True,
           messages: list[dict[str, Any]] | None = None, group: str | None = None) -> dict[str, Any]:
    headers = {"x-session-id": session} if session is not None else {}
    return {"model": f"openai/{model}", "api_base": f"{backend.url}/v1", "api_key": "none",
            "messages": messages or user("hello"), "proxy_server_request": {"headers": headers},
            "metadata": {"model_group": group or model},
            "model_info": {"id": "x", "slot_cache": slot_cache} if slot_cache is not None else {"id": "x"}}


async def send(hook: SlotCacheHook, backend: Any, session: str | None, text: str, **extra: Any) -> dict[str, Any]:
    """The hook, then the request as LiteLLM sends it upstream (the model without `openai/`, not pinned)."""
    k = kwargs(backend, session, messages=user(text), **extra)
    await hook.async_pre_call_deployment_hook(k, "acompletion")
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{backend.url}/v1/chat/completions", json={
            "model": k["model"].removeprefix("openai/"), "messages": k["messages"], "max_tokens": 4})
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture
async def hook(slot_dir: str) -> Any:
    h = SlotCacheHook(environ={"LLAMA_SLOT_SAVE_PATH": slot_dir})
    yield h
    await h.close()


async def test_sessions_take_turns_on_the_slot(hook: SlotCacheHook, start_backend: Any, slot_dir: str) -> None:
    backend = start_backend(slots=1)
    a, b = words(1, 200), words(2, 200)
    await send(hook, backend, S1, a)
    assert mock_stats(backend)["saves"] == 0              # nothing known in the slot yet: nothing saved
    await send(hook, backend, S2, b)                      # S1 saved under its name; S2 has no file yet
    assert sorted(os.listdir(slot_dir)) == [name(hook, backend, "smol", S1)]
    answer = await send(hook, backend, S1, a + " more")   # S2 saved, S1 restored
    assert answer["timings"]["cache_n"] >= 200
    stats = mock_stats(backend)
    assert (stats["saves"], stats["restores"], stats["slot_actions_while_busy"]) == (2, 1, 0)
    assert sorted(os.listdir(slot_dir)) == sorted(name(hook, backend, "smol", s) for s in (S1, S2))
    before = mock_stats(backend)
    await send(hook, backend, S1, a + " more and more")   # the session is in the slot: no slot call
    after = mock_stats(backend)
    assert (after["saves"], after["restores"]) == (before["saves"], before["restores"])


async def test_requests_the_hook_must_leave_alone(hook: SlotCacheHook, start_backend: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    backend = start_backend(slots=1)
    with caplog.at_level("INFO", logger="lpcache"):
        await send(hook, backend, S1, "a", slot_cache=None)          # a route without slot_cache
        await send(hook, backend, S2, "b", slot_cache=None)
        await send(hook, backend, "../" + "1" * 29, "c")             # not a session id
        await send(hook, backend, "A" * 32, "d")
        await send(hook, backend, S1, "e", slot_cache={"slot": "x"})  # a bad setting: said once, no action
    stats = mock_stats(backend)
    assert stats["saves"] == stats["restores"] == stats["erases"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("slot_cache: not used for smol: no model_info.slot_cache") == 1
    assert any("slot_cache slot (or LLAMA_SLOT): 'x' is not a number" in line for line in lines)


async def test_dead_server_costs_nothing_but_the_cache(hook: SlotCacheHook) -> None:
    dead = type("Dead", (), {"url": "http://127.0.0.1:9"})()
    await hook.async_pre_call_deployment_hook(kwargs(dead, S1), "acompletion")   # no exception
    await hook.async_pre_call_deployment_hook(kwargs(dead, S2), "acompletion")


async def test_route_files_limits_and_slot_setting(start_backend: Any, slot_dir: str) -> None:
    backend = start_backend(slots=2)
    hook = SlotCacheHook(environ={"LLAMA_SLOT_SAVE_PATH": slot_dir, "LLAMA_CACHE_MAX_FILES": "1"})
    try:
        settings = {"slot": 1}

        async def turn(session: str) -> dict[str, Any]:
            return await send(hook, backend, session, words(3, 100) + session, slot_cache=settings,
                              model="org/model", group="openai/org/model")

        def names() -> list[str]:
            return sorted(os.listdir(slot_dir))

        await turn(S1)
        await turn(S2)                                    # saves S1
        assert names() == [name(hook, backend, "org/model", S1)]
        restores = mock_stats(backend)["restores"]
        await turn(S1)                                    # saves S2: over max_files 1, but S1 is being restored
        assert mock_stats(backend)["restores"] == restores + 1
        assert names() == sorted(name(hook, backend, "org/model", s) for s in (S1, S2))
        await turn(S3)                                    # saves S1; S2, used longest ago, goes
        assert names() == [name(hook, backend, "org/model", S1)]
        assert {k[2] for k in hook.states} == {1}
    finally:
        await hook.close()


async def test_idle_save_writes_the_session_once(start_backend: Any, slot_dir: str) -> None:
    backend = start_backend(slots=1)
    hook = SlotCacheHook(environ={"LLAMA_SLOT_SAVE_PATH": slot_dir, "LLAMA_SAVE_IDLE_SECONDS": "0.2"})
    try:
        await send(hook, backend, S1, words(1, 100))
        [state] = hook.states.values()
        assert state.idle is not None
        await state.idle
        assert os.listdir(slot_dir) == [name(hook, backend, "smol", S1)]
        assert state.content is not None and state.content.saved
        saves = mock_stats(backend)["saves"]
        await send(hook, backend, S2, words(2, 100))       # S1 is on disk already: not written again
        assert mock_stats(backend)["saves"] == saves
    finally:
        await hook.close()


def test_route_options_and_server_root() -> None:
    assert RouteOptions.of(True, {}) == RouteOptions()
    env = {"LLAMA_SLOT": "2", "LLAMA_CACHE_MAX_GIB": "1.5", "LLAMA_MODELS_MAX": "0", "LLAMA_SLOT_SAVE_PATH": "/s"}
    o = RouteOptions.of({"max_files": 3, "model": "qwen"}, env)
    assert (o.slot, o.max_files, o.max_gib, o.models_max, o.model, o.save_path) == (2, 3, 1.5, 0, "qwen", "/s")
    for bad in ({"slot": -1}, {"max_gib": "lots"}, {"colour": 1}, {"model": 3}, {"models_max": True}):
        with pytest.raises(ValueError):
            RouteOptions.of(bad, {})
    assert server_root("http://h:8080/v1/") == "http://h:8080"
    assert server_root("https://h/llama") == "https://h/llama"


async def test_router_model_about_to_be_unloaded_is_saved_first(slot_dir: str) -> None:
    from lpcache.mock_llama import MockConfig, start_mock

    router = start_mock(MockConfig(router=True, models=("a", "b"), models_max=1, slot_save_path=slot_dir))
    hook = SlotCacheHook(environ={"LLAMA_SLOT_SAVE_PATH": slot_dir, "LLAMA_MODELS_MAX": "1"})
    try:
        story = words(1, 150)
        await send(hook, router, S1, story, model="a")
        await send(hook, router, S2, words(2, 150), model="b")   # the router unloads a: a's slot saved first
        actions = mock_stats(router)["slot_actions"]
        saves = [x for x in actions if x["action"] == "save"]
        assert saves and saves[0]["model"] == "a" and saves[0]["loaded"] is True and saves[0]["status"] == 200
        answer = await send(hook, router, S1, story + " more", model="a")   # b saved, a reloaded, S1 restored
        assert answer["timings"]["cache_n"] >= 150
        assert all(x["loaded"] for x in mock_stats(router)["slot_actions"] if x["action"] == "save")
        assert sorted(os.listdir(slot_dir)) == sorted([name(hook, router, "a", S1), name(hook, router, "b", S2)])
    finally:
        await hook.close()
        router.stop()
