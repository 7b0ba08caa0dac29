"""The stand-in's router mode keeps the contract of llama-server b11434 started without ``-m``.

Servers run in-process (``start_mock``) on free ports; tests synchronise on events (the
first SSE chunk, the router's own counters), never on sleeps. The same facts are checked
against the real router in tests/e2e/test_real_router.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from lpcache.mock_llama import MockConfig, MockHandle
from lpcache.mock_llama.__main__ import build_parser, config_from
from lpcache.mock_llama.tokens import render_chat, tokenize

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Tell me about the cache, please."}]
PROMPT_LEN = len(tokenize(render_chat(USER)))

MakeRouter = Callable[..., MockHandle]


@pytest.fixture
def make_router(start_backend: Callable[..., MockHandle]) -> MakeRouter:
    """Start stand-in routers (models a, b, c; 2 slots each) saving in the test's slot folder; all stop at
    teardown (conftest's `start_backend`)."""

    def make(**overrides: Any) -> MockHandle:
        return start_backend(**{"router": True, "models": ("a", "b", "c"), **overrides})

    return make


@pytest.fixture
def client(make_router: MakeRouter) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=make_router().url, timeout=10) as c:
        yield c


def error(message: str) -> dict[str, Any]:
    return {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


def statuses(c: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in c.get("/models").json()["data"]}


def stats(c: httpx.Client) -> dict[str, Any]:
    return c.get("/mock/stats").json()  # type: ignore[no-any-return]


def chat(c: httpx.Client, model: str, **body: Any) -> httpx.Response:
    return c.post(CHAT, json={"model": model, "messages": USER, "max_tokens": 4, **body})


def slot_action(c: httpx.Client, model: str | None, slot: int, action: str, query: str = "",
                **body: Any) -> httpx.Response:
    payload = {**({"model": model} if model is not None else {}), **body}
    return c.post(f"/slots/{slot}?action={action}{query}", json=payload)


# --- configuration -------------------------------------------------------------------------


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="router mode"):
        MockConfig(models=("a",))
    with pytest.raises(ValueError, match="distinct"):
        MockConfig(router=True, models=("a", "a"))
    with pytest.raises(ValueError, match="models_max"):
        MockConfig(router=True, models=("a",), models_max=-1)
    assert MockConfig(router=True, models=["a", "b"]).models == ("a", "b")  # type: ignore[arg-type]


def test_cli_flags() -> None:
    args = build_parser().parse_args(["8080", "--router", "--models", "a, b", "--models-max", "1",
                                      "--no-models-autoload"])
    config = config_from(args)
    assert (config.router, config.models, config.models_max, config.models_autoload) == (True, ("a", "b"), 1, False)
    defaults = config_from(build_parser().parse_args(["8080", "--router", "--models", "a"]))
    assert (defaults.models_max, defaults.models_autoload) == (4, True)
    assert config_from(build_parser().parse_args(["8080", "m"])).router is False  # single-model as before


# --- router endpoints ----------------------------------------------------------------------


def test_router_props_health_and_models(make_router: MakeRouter) -> None:
    with httpx.Client(base_url=make_router(models_max=2, models_autoload=False).url) as c:
        props = c.get("/props").json()
        assert props["role"] == "router" and props["max_instances"] == 2 and props["models_autoload"] is False
        assert set(props) == {"role", "max_instances", "models_autoload", "model_alias", "model_path",
                              "default_generation_settings", "ui_settings", "build_info", "cors_proxy_enabled"}
        assert c.get("/health").json() == {"status": "ok"}  # the router's own health: nothing is loaded
        for path in ("/models", "/v1/models"):
            listing = c.get(path).json()
            assert listing["object"] == "list" and "models" not in listing
            assert [m["id"] for m in listing["data"]] == ["a", "b", "c"]
            entry = listing["data"][0]
            assert entry["status"]["value"] == "unloaded" and "meta" not in entry
            assert {"id", "aliases", "tags", "object", "owned_by", "created", "status", "architecture", "source",
                    "can_remove"} == set(entry)
        assert c.get("/props?model=a&autoload=true").json()["total_slots"] == 2
        loaded = c.get("/models").json()["data"][0]
        assert loaded["status"]["value"] == "loaded" and loaded["meta"]["n_ctx"] == 8192


def test_props_with_model_is_the_childs(client: httpx.Client) -> None:
    props = client.get("/props?model=b").json()
    assert props["model_alias"] == "b" and props["total_slots"] == 2
    assert statuses(client) == {"a": "unloaded", "b": "loaded", "c": "unloaded"}  # autoload by default
    r = client.get("/props?model=c&autoload=false")
    assert r.status_code == 400 and r.json() == error("model is not loaded")


# --- model selection -------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/completion", "/tokenize", "/slots/0?action=save"])
def test_post_model_comes_from_the_body(client: httpx.Client, path: str) -> None:
    body = {"messages": USER, "prompt": "hi", "content": "hi", "filename": "f"}
    missing = "model name is missing from the request"
    for model, message in [(None, missing), (5, missing), ("", missing), ("x", "model 'x' not found")]:
        r = client.post(path, json={**body, **({} if model is None else {"model": model})})
        assert r.status_code == 400 and r.json() == error(message)
    r = client.post(path + ("&" if "?" in path else "?") + "model=a", json=body)  # a query names no POST's model
    assert r.status_code == 400 and r.json() == error(missing)
    assert all(m["loads"] == 0 for m in stats(client)["models"].values())
    assert client.post(path, json={**body, "model": "a"}).status_code == 200
    assert statuses(client)["a"] == "loaded"


def test_get_model_comes_from_the_query(client: httpx.Client) -> None:
    r = client.get("/slots")
    assert r.status_code == 400 and r.json() == error("model name is missing from the request")
    r = client.get("/slots?model=zz")
    assert r.status_code == 400 and r.json() == error("model 'zz' not found")
    r = client.get("/slots?model=a&autoload=false")
    assert r.status_code == 400 and r.json() == error("model is not loaded")
    listing = client.get("/slots?model=a")  # GETs load too, unless autoload=false
    assert listing.status_code == 200 and [s["id"] for s in listing.json()] == [0, 1]
    assert client.get("/slots?model=a&autoload=false").status_code == 200


def test_chat_answers_as_its_model(client: httpx.Client) -> None:
    r = chat(client, "b")
    assert r.status_code == 200 and r.json()["model"] == "b"
    native = client.post("/completion", json={"model": "c", "prompt": "hello there", "n_predict": 2}).json()
    assert native["model"] == "c"


def test_autoload_only_from_the_query(make_router: MakeRouter) -> None:
    with httpx.Client(base_url=make_router().url) as c:
        assert chat(c, "a", autoload=False).status_code == 200  # a body field is not the switch
        for value in ("false", "0", "no"):  # anything but true or 1 is false
            r = c.post(f"{CHAT}?autoload={value}", json={"model": "b", "messages": USER})
            assert r.status_code == 400 and r.json() == error("model is not loaded")
        assert c.post(f"{CHAT}?autoload=", json={"model": "b", "messages": USER}).status_code == 200  # empty: default
    with httpx.Client(base_url=make_router(models_autoload=False).url) as c:
        r = chat(c, "a")
        assert r.status_code == 400 and r.json() == error("model is not loaded")
        assert c.post(f"{CHAT}?autoload=1", json={"model": "a", "messages": USER}).status_code == 200
        assert chat(c, "a").status_code == 200  # loaded now: no autoload needed
        assert statuses(c) == {"a": "loaded", "b": "unloaded", "c": "unloaded"}


# --- children: own slots, shared folder ------------------------------------------------------


def test_each_model_has_its_own_slots(client: httpx.Client) -> None:
    assert chat(client, "a", id_slot=0).status_code == 200
    held = client.get("/mock/slots?model=a").json()["a"]
    assert held[0]["n_tokens"] == PROMPT_LEN + 4 - 1 and held[1]["n_tokens"] == 0
    assert all(s["n_tokens"] == 0 for s in client.get("/mock/slots?model=b").json()["b"])
    assert "n_prompt_tokens" in client.get("/slots?model=a").json()[0]
    assert "n_prompt_tokens" not in client.get("/slots?model=b").json()[0]
    assert chat(client, "a", id_slot=0).json()["timings"]["cache_n"] == PROMPT_LEN - 1
    assert chat(client, "b", id_slot=0).json()["timings"]["cache_n"] == 0  # b's slot 0 is not a's
    every = stats(client)
    assert every["models"]["a"]["chat_requests"] == 2 and every["models"]["b"]["chat_requests"] == 1
    assert every["chat_requests"] == 3 and every["requests_by_path"][CHAT] == 3


def test_slot_files_are_shared_by_name(client: httpx.Client, slot_dir: str) -> None:
    assert chat(client, "a", id_slot=1).status_code == 200
    saved = slot_action(client, "a", 1, "save", filename="shared").json()
    assert saved["n_saved"] == PROMPT_LEN + 4 - 1 and os.path.exists(os.path.join(slot_dir, "shared"))
    restored = slot_action(client, "b", 0, "restore", filename="shared").json()
    assert restored["n_restored"] == saved["n_saved"]
    held = client.get("/mock/slots").json()
    assert held["b"][0]["tokens"] == held["a"][1]["tokens"]
    assert slot_action(client, "b", 0, "erase").json()["n_erased"] == saved["n_saved"]
    every = stats(client)
    assert (every["saves"], every["restores"], every["erases"]) == (1, 1, 1)
    assert every["models"]["a"]["saves"] == 1 and every["models"]["b"]["restores"] == 1


def test_slot_actions_are_recorded_with_their_model(client: httpx.Client) -> None:
    r = slot_action(client, "a", 0, "save", "&autoload=false", filename="f")
    assert r.status_code == 400 and r.json() == error("model is not loaded")
    assert slot_action(client, None, 1, "erase").status_code == 400
    assert slot_action(client, "b", 1, "save", filename="g").status_code == 200
    assert slot_action(client, "b", 1, "save", filename="../g").status_code == 400  # the child's own check
    every = stats(client)
    assert every["slot_actions"] == [
        {"model": "a", "loaded": False, "action": "save", "id_slot": "0", "status": 400},
        {"model": None, "loaded": False, "action": "erase", "id_slot": "1", "status": 400},
        {"model": "b", "loaded": False, "action": "save", "id_slot": "1", "status": 200},
        {"model": "b", "loaded": True, "action": "save", "id_slot": "1", "status": 400},
    ]
    assert every["models"]["a"]["loads"] == 0  # the save with autoload=false never loaded a
    assert every["models"]["b"]["loads"] == 1
    reset = client.post("/mock/reset-stats").json()
    assert reset["slot_actions"] == [] and reset["models"]["b"]["loads"] == 0 and reset["models"]["b"]["loaded"]


def test_slot_action_without_save_path_is_routed_first(make_router: MakeRouter) -> None:
    with httpx.Client(base_url=make_router(slot_save_path=None).url) as c:
        r = slot_action(c, "zz", 0, "save", filename="f")
        assert r.status_code == 400 and r.json() == error("model 'zz' not found")
        assert slot_action(c, "a", 0, "save", filename="f").status_code == 501  # loaded a, then the child said no
        assert statuses(c)["a"] == "loaded"


# --- loading and unloading ------------------------------------------------------------------


def test_models_max_unloads_the_least_recently_posted(make_router: MakeRouter) -> None:
    with httpx.Client(base_url=make_router(models_max=2).url) as c:
        def tokenize_on(model: str) -> None:
            assert c.post("/tokenize", json={"model": model, "content": "hi"}).status_code == 200

        tokenize_on("a")
        tokenize_on("b")
        assert c.get("/slots?model=a").status_code == 200  # a GET: not a use
        tokenize_on("c")
        assert statuses(c) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        tokenize_on("b")  # now c is the least recently used
        tokenize_on("a")
        assert statuses(c) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        models = stats(c)["models"]
        assert [(models[m]["loads"], models[m]["unloads"]) for m in "abc"] == [(2, 1), (1, 0), (1, 1)]


def test_models_max_zero_is_unlimited(make_router: MakeRouter) -> None:
    with httpx.Client(base_url=make_router(models_max=0).url) as c:
        for model in "abc":
            assert c.get(f"/slots?model={model}").status_code == 200
        assert set(statuses(c).values()) == {"loaded"}


def test_unloading_drops_the_kv_and_files_survive(make_router: MakeRouter) -> None:
    with httpx.Client(base_url=make_router(models_max=1).url) as c:
        assert chat(c, "a", id_slot=0).status_code == 200
        saved = slot_action(c, "a", 0, "save", filename="a-0").json()
        assert c.get("/slots?model=b").status_code == 200
        assert statuses(c) == {"a": "unloaded", "b": "loaded", "c": "unloaded"}
        r = c.get("/slots?model=a&autoload=false")
        assert r.status_code == 400 and r.json() == error("model is not loaded")
        assert all(s["n_tokens"] == 0 for s in c.get("/mock/slots?model=a").json()["a"])
        reloaded = c.get("/slots?model=a").json()  # loads a again, unloading b: a starts from empty slots
        assert all("n_prompt_tokens" not in s for s in reloaded)
        restored = slot_action(c, "a", 0, "restore", filename="a-0").json()
        assert restored["n_restored"] == saved["n_saved"]
        assert chat(c, "a", id_slot=0).json()["timings"]["cache_n"] == PROMPT_LEN - 1
        models = stats(c)["models"]
        assert (models["a"]["loads"], models["a"]["unloads"], models["b"]["unloads"]) == (2, 1, 1)


async def test_a_model_in_flight_is_never_unloaded(make_router: MakeRouter) -> None:
    handle = make_router(models_max=1, gen_ms_per_token=5)
    async with httpx.AsyncClient(base_url=handle.url, timeout=10) as c:
        async def model_stats() -> dict[str, Any]:
            return (await c.get("/mock/stats")).json()["models"]  # type: ignore[no-any-return]

        payload = {"model": "a", "messages": USER, "max_tokens": 4000, "stream": True}
        async with c.stream("POST", CHAT, json=payload) as stream:
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            other = c.get("/slots?model=b")  # waits: a streams, and only one model may be loaded
            waiting = asyncio.ensure_future(other)
            deadline = asyncio.get_running_loop().time() + 5
            while (await model_stats())["b"]["waiting"] == 0:  # b's request has reached the router
                assert not waiting.done(), "b was loaded while a was streaming"
                assert asyncio.get_running_loop().time() < deadline
            now = await model_stats()
            assert (now["a"]["loaded"], now["a"]["in_flight"], now["b"]["loaded"]) == (True, 1, False)
        # the client left: the stream stops, a is idle and gives way to b
        assert (await waiting).status_code == 200
        now = await model_stats()
        a, b = now["a"], now["b"]
        assert (a["loaded"], a["unloads"], a["in_flight"], b["loaded"]) == (False, 1, 0, True)


def test_models_load_and_unload_endpoints(make_router: MakeRouter) -> None:
    with httpx.Client(base_url=make_router(models_max=1).url) as c:
        assert c.post("/models/load", json={"model": "a"}).json() == {"success": True}
        r = c.post("/models/load", json={"model": "a"})
        assert r.status_code == 400 and r.json() == error("model is already running")
        r = c.post("/models/load", json={"model": "zz"})
        assert r.status_code == 404 and r.json()["error"]["message"] == "model is not found"
        assert c.post("/models/load", json={"model": "b"}).json() == {"success": True}  # a gives way
        assert statuses(c) == {"a": "unloaded", "b": "loaded", "c": "unloaded"}
        assert c.post("/models/unload", json={"model": "b"}).json() == {"success": True}
        r = c.post("/models/unload", json={"model": "b"})
        assert r.status_code == 400 and r.json() == error("model is not running")
        assert set(statuses(c).values()) == {"unloaded"}


def test_hooks_by_model(client: httpx.Client) -> None:
    assert chat(client, "a", id_slot=1).status_code == 200
    every = client.get("/mock/slots").json()
    assert set(every) == {"a", "b", "c"} and every["a"][1]["n_tokens"] > 0
    r = client.get("/mock/slots?model=zz")
    assert r.status_code == 400 and r.json() == error("model 'zz' not found")
    assert client.get("/mock/wait-idle?model=a&slot=1&timeout=5").json() == {"idle": True}
    assert client.get("/mock/wait-idle?timeout=5").json() == {"idle": True}
