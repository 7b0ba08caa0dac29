"""lpcache's LiteLLM hook against the stand-in, called as LiteLLM calls it (the kwargs shape of litellm 1.108.7,
see tests/e2e/test_litellm_rig.py), then the request sent as LiteLLM would send it. The real LiteLLM proxy runs it
in tests/e2e/test_litellm_real.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import httpx
import pytest

from lpcache.cache.sessions import session_filename
from lpcache.integrations.litellm import RouteOptions, SlotCacheHook, server_root

from ..conftest import user, words
from .conftest import mock_stats

S1, S2, S3 = "1" * 32, "2" * 32, "3" * 32


def name(hook: SlotCacheHook, backend: Any, route: str, session: str) -> str:
    """A session's file: its route, the identity of the model the server runs for it, the session."""
    fingerprint = hook.fingerprints[(backend.url, route)]
    assert fingerprint is not None
    return session_filename(route, session, fingerprint)


def kwargs(backend: Any, session: str | None, model: str = "smol", slot_cache: Any = True,
           messages: list[dict[str, Any]] | None = None, group: str | None = None,
           call: str | None = None) -> dict[str, Any]:
    headers = {"x-session-id": session} if session is not None else {}
    k = {"model": f"openai/{model}", "api_base": f"{backend.url}/v1", "api_key": "none",
         "messages": messages or user("hello"), "proxy_server_request": {"headers": headers},
         "metadata": {"model_group": group or model},
         "model_info": {"id": "x", "slot_cache": slot_cache} if slot_cache is not None else {"id": "x"}}
    if call is not None:
        k["litellm_call_id"] = call
    return k


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
        await send(hook, backend, "../etc\t" + "1" * 24, "c")       # cannot be a session id: warned once
        await send(hook, backend, "../etc\t" + "1" * 24, "c")
        await send(hook, backend, "", "d")
        await send(hook, backend, S1, "e", slot_cache={"slot": "x"})  # a bad setting: said once, no action
    stats = mock_stats(backend)
    assert stats["saves"] == stats["restores"] == stats["erases"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("slot_cache: not used for smol: no model_info.slot_cache") == 1
    assert any("slot_cache slot (or LLAMA_SLOT): 'x' is not a number" in line for line in lines)
    rejected = [line for line in lines if line.startswith("slot_cache: session_id_rejected")]
    assert len(rejected) == 2 and "reason=control_character" in rejected[0] and "reason=empty" in rejected[1]
    assert hook.session_ids.rejected["control_character"] == 2 and not hook.states


async def test_any_printable_id_is_hashed_to_the_same_file_as_lpcache_names_it(hook: SlotCacheHook,
                                                                               start_backend: Any,
                                                                               slot_dir: str) -> None:
    backend = start_backend(slots=1)
    uuid, user42 = "6F9619FF-8B86-D011-B42D-00C04FC964FF", "user-42"
    zoe = "Zoë Ångström".encode().decode("latin-1")   # a UTF-8 name as LiteLLM's Starlette hands it over
    a, b, c = words(1, 200), words(2, 200), words(3, 200)
    for session, text in ((uuid, a), (user42, b), (zoe, c), (uuid, a + " more")):
        await send(hook, backend, session, text)
    sids = {v: hashlib.sha256(v.encode()).hexdigest()[:32] for v in (uuid, user42, "Zoë Ångström")}
    assert sorted(os.listdir(slot_dir)) == sorted(name(hook, backend, "smol", sid) for sid in sids.values())
    assert mock_stats(backend)["restores"] == 1          # the UUID's session came back from its file
    assert hook.session_ids.hashed == 4


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


# ---- the slot pinned and held for the whole call ----

async def upstream(backend: Any, k: dict[str, Any], stream: bool = False) -> httpx.Response:
    """The request as LiteLLM sends it after the hook: the model without `openai/`, the hook's `extra_body`
    merged into the body (as the OpenAI client does)."""
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{backend.url}/v1/chat/completions", json={
            "model": k["model"].removeprefix("openai/"), "messages": k["messages"], "max_tokens": 4,
            "stream": stream, **(k.get("extra_body") or {})})
    assert r.status_code == 200
    return r


async def call(hook: SlotCacheHook, backend: Any, session: str, text: str, call_id: str) -> dict[str, Any]:
    """One LiteLLM call: the hook, the request, then LiteLLM's success event."""
    k = kwargs(backend, session, messages=user(text), call=call_id)
    k = await hook.async_pre_call_deployment_hook(k, "acompletion") or k
    assert k["extra_body"] == {"id_slot": 0}
    r = await upstream(backend, k)
    await hook.async_log_success_event(k, r.json(), None, None)
    return r.json()  # type: ignore[no-any-return]


def saved_text(slot_dir: str, file: str) -> str:
    from lpcache.mock_llama.slotfile import decode

    with open(os.path.join(slot_dir, file), "rb") as f:
        return "".join(decode(f.read()))


async def test_two_sessions_at_once_are_each_saved_under_their_own_name(start_backend: Any, slot_dir: str) -> None:
    """Two sessions' calls at the same time, over and over: every request runs in the hook's slot (pinned), and
    every file holds its own session's conversation, never the other's."""
    backend = start_backend(slots=2, prefill_ms_per_token=0.5)
    hook = SlotCacheHook(environ={"LLAMA_SLOT_SAVE_PATH": slot_dir})
    try:
        a, b = words(1, 200), words(2, 200)
        for turn in range(3):
            await asyncio.gather(call(hook, backend, S1, a + f" turn {turn}", f"a{turn}"),
                                 call(hook, backend, S2, b + f" turn {turn}", f"b{turn}"))
        stats = mock_stats(backend)
        assert stats["chat_by_slot"] == {"0": 6} and stats["slot_actions_while_busy"] == 0
        assert stats["saves"] >= 3
        files = {s: name(hook, backend, "smol", s) for s in (S1, S2)}
        assert sorted(os.listdir(slot_dir)) == sorted(files.values())
        one, two = saved_text(slot_dir, files[S1]), saved_text(slot_dir, files[S2])
        assert "w1x" in one and "w2x" not in one
        assert "w2x" in two and "w1x" not in two
        assert hook.leases == {} and not any(s.lock.locked() for s in hook.states.values())
    finally:
        await hook.close()


async def test_the_slot_is_held_until_the_answer_is_done(start_backend: Any, slot_dir: str) -> None:
    backend = start_backend(slots=1)
    hook = SlotCacheHook(environ={"LLAMA_SLOT_SAVE_PATH": slot_dir})
    try:
        first = await hook.async_pre_call_deployment_hook(
            kwargs(backend, S1, messages=user(words(1, 100)), call="c1"), "acompletion")
        assert first is not None and "c1" in hook.leases
        second = asyncio.ensure_future(hook.async_pre_call_deployment_hook(
            kwargs(backend, S2, messages=user(words(2, 100)), call="c2"), "acompletion"))
        r = await upstream(backend, first)                # the first call's answer, while the second waits
        assert not second.done() and mock_stats(backend)["saves"] == 0
        await hook.async_log_success_event(first, r.json(), None, None)
        k2 = await asyncio.wait_for(second, 30)           # now the slot is saved under S1's name, S2's turn
        assert k2 is not None and set(hook.leases) == {"c2"}
        assert os.listdir(slot_dir) == [name(hook, backend, "smol", S1)]
        assert "w1x" in saved_text(slot_dir, name(hook, backend, "smol", S1))
        await upstream(backend, k2)
        await hook.async_post_call_success_hook(k2, None, {"ok": True})   # the proxy's own event also ends it
        assert hook.leases == {}
    finally:
        await hook.close()


async def test_the_slot_is_always_given_back(start_backend: Any, slot_dir: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A failed call, a stream the client leaves, a call LiteLLM retries, a call never reported: each frees the
    slot."""
    backend = start_backend(slots=1)
    hook = SlotCacheHook(environ={"LLAMA_SLOT_SAVE_PATH": slot_dir})

    def state() -> Any:
        [s] = hook.states.values()
        return s

    async def pre(session: str, call_id: str, **extra: Any) -> dict[str, Any]:
        k = await asyncio.wait_for(hook.async_pre_call_deployment_hook(
            kwargs(backend, session, messages=user(words(int(session[0]), 50)), call=call_id, **extra),
            "acompletion"), 30)
        assert k is not None and call_id in hook.leases and state().lock.locked()
        return k

    try:
        k = await pre(S1, "failed")
        await hook.async_log_failure_event(k, None, None, None)
        assert not state().lock.locked() and hook.leases == {}

        k = await pre(S2, "proxy-failed")
        await hook.async_post_call_failure_hook(k, RuntimeError("upstream"), None)
        assert not state().lock.locked()

        k = await pre(S1, "left")

        async def chunks() -> Any:
            for i in range(10):
                yield {"chunk": i}

        stream = hook.async_post_call_streaming_iterator_hook(None, chunks(), {"litellm_call_id": "left"})
        assert await stream.__anext__() == {"chunk": 0}
        assert state().lock.locked()
        await stream.aclose()                             # the client left the stream
        assert not state().lock.locked()

        await pre(S2, "retried")
        await pre(S2, "retried")                          # LiteLLM's retry of the same call: no deadlock
        hook.done("retried", "test")
        assert not state().lock.locked()

        await pre(S1, "silent", slot_cache={"hold_seconds": 1})
        with caplog.at_level("WARNING", logger="lpcache"):
            deadline = asyncio.get_running_loop().time() + 10
            while state().lock.locked():
                assert asyncio.get_running_loop().time() < deadline, "the lease never expired"
                await asyncio.sleep(0.02)
        assert any("never said its answer was done" in r.getMessage() for r in caplog.records)
        assert hook.leases == {}

        await pre(S2, "open")
        await hook.close()                                # closing frees what is still held
        assert not state().lock.locked()
    finally:
        await hook.close()


async def test_without_a_call_id_the_request_is_pinned_but_the_slot_not_held(hook: SlotCacheHook,
                                                                            start_backend: Any) -> None:
    backend = start_backend(slots=2)
    k = await hook.async_pre_call_deployment_hook(kwargs(backend, S1, messages=user("hi")), "acompletion")
    assert k is not None and k["extra_body"] == {"id_slot": 0}
    assert hook.leases == {} and not any(s.lock.locked() for s in hook.states.values())
    plain = kwargs(backend, None)
    assert await hook.async_pre_call_deployment_hook(plain, "acompletion") is None and "extra_body" not in plain
