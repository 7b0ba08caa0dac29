"""What LiteLLM's proxy hands `CustomLogger.async_pre_call_deployment_hook`, proven against the real proxy.

A real `litellm` proxy (scripts/get-litellm.sh, pinned) runs in front of lpcache's stand-in llama-server with the
routes of the slot-cache hook (a wildcard "*", an "openai/*" route for names with a slash, a named one, one without
`slot_cache`). A probe callback writes what it is given to a JSON-lines file; the tests assert where the hook finds
the api_base, api_key, model_info, the route and the client's headers, that it runs (and is awaited) before the
request goes upstream, for streams as well. Run with -s to see the shapes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lpcache.workloads.harness import REPO, MockProcess, ServerThread, chat

from .litellm_rig import LiteLLMProxy, read_jsonl, route

pytestmark = pytest.mark.e2e

# The probe: everything the hook might use, as JSON. HOLD (a file) parks it until the test removes the file.
PROBE = '''
import asyncio, json, os, time, urllib.request
from litellm.integrations.custom_logger import CustomLogger
import lpcache  # the checkout, on PYTHONPATH, with its dependencies in litellm's virtualenv

OUT, HOLD, ENTERED, RAISE, STATS = {out!r}, {hold!r}, {entered!r}, {raise_!r}, {stats!r}


def chats():
    with urllib.request.urlopen(STATS, timeout=10) as resp:
        return json.loads(resp.read())["chat_requests"]


def plain(value):
    return json.loads(json.dumps(value, default=repr))


class Probe(CustomLogger):
    async def async_pre_call_deployment_hook(self, kwargs, call_type):
        at_entry = await asyncio.to_thread(chats)
        held = os.path.exists(HOLD)
        if held:
            open(ENTERED, "w").close()
            deadline = time.monotonic() + 120
            while os.path.exists(HOLD) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        metadata = kwargs.get("metadata") or {{}}
        request = kwargs.get("proxy_server_request") or {{}}
        record = {{
            "call_type": str(call_type),
            "keys": sorted(kwargs),
            "types": {{k: type(v).__name__ for k, v in kwargs.items()}},
            "model": kwargs.get("model"),
            "api_base": kwargs.get("api_base"),
            "api_key": kwargs.get("api_key"),
            "model_info": plain(kwargs.get("model_info")),
            "stream": kwargs.get("stream"),
            "messages": plain(kwargs.get("messages")),
            "litellm_session_id": kwargs.get("litellm_session_id"),
            "metadata_keys": sorted(metadata),
            "metadata": plain({{k: metadata.get(k) for k in ("model_group", "deployment", "deployment_model_name",
                                                            "api_base", "model_info", "headers", "session_id")}}),
            "request": plain({{k: request.get(k) for k in ("url", "method", "headers")}}),
            "request_body_model": (request.get("body") or {{}}).get("model"),
            "raw_header_names": sorted(((kwargs.get("secret_fields") or {{}}).get("raw_headers") or {{}})),
            "chats_at_entry": at_entry,
            "held": held,
            "chats_at_exit": await asyncio.to_thread(chats),
            "lpcache": lpcache.__file__,
        }}
        with open(OUT, "a") as f:
            f.write(json.dumps(record) + "\\n")
        if os.path.exists(RAISE):
            raise RuntimeError("probe refuses")
        return None


proxy_handler_instance = Probe()
'''

SESSION = "0123456789abcdef" * 2  # 32 hex digits, as Marginalia sends
NAMED_OPTIONS = {"slot": 0, "save_path": "/var/cache/llama-slots", "max_files": 8, "max_gib": 2.5, "model": "qwen",
                 "models_max": 1, "save_idle_seconds": 120}


class Recorder:
    """An OpenAI-style upstream that records the body of each chat request (what name LiteLLM sends upstream)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

        async def completions(request: Request) -> JSONResponse:
            body = await request.json()
            self.bodies.append(body)
            return JSONResponse({"id": "chatcmpl-rec", "object": "chat.completion", "created": 0,
                                 "model": body.get("model"),
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": "recorded"}}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = ServerThread(Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])]))


class Rig:
    def __init__(self, folder: Path, mock: MockProcess, recorder: Recorder, proxy: LiteLLMProxy) -> None:
        self.folder, self.mock, self.recorder, self.proxy = folder, mock, recorder, proxy
        self.out, self.hold = folder / "probe.jsonl", folder / "hold"
        self.entered, self.raise_ = folder / "entered", folder / "raise"

    def chats(self) -> int:
        return int(httpx.get(self.mock.url + "/mock/stats", timeout=10).json()["chat_requests"])

    def send(self, model: str, *, session: str | None = SESSION, **extra: Any) -> tuple[Any, list[dict[str, Any]]]:
        """One chat request through the proxy; the probe's records of it (tagged by a header of its own)."""
        tag = uuid.uuid4().hex
        headers = {**self.proxy.headers, "X-Probe-Tag": tag, **({"X-Session-ID": session} if session else {})}
        result = chat(self.proxy.url, [{"role": "user", "content": f"hello {tag[:6]}"}], model=model,
                      max_tokens=8, timeout=120, headers=headers, **extra)
        return result, self.records(tag)

    def records(self, tag: str) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.out) if (r["request"]["headers"] or {}).get("x-probe-tag") == tag]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    folder = tmp_path_factory.mktemp("litellm-rig")
    with MockProcess(n_slots=1) as mock:
        recorder = Recorder()
        recorder.server.start()
        try:
            paths = {"out": str(folder / "probe.jsonl"), "hold": str(folder / "hold"),
                     "entered": str(folder / "entered"), "raise_": str(folder / "raise"),
                     "stats": mock.url + "/mock/stats"}
            model_list = [
                route("named-route", "openai/mock-model", mock.url + "/v1", api_key="os.environ/LPCACHE_PROBE_KEY",
                      model_info={"slot_cache": NAMED_OPTIONS}),
                route("plain-route", "openai/mock-model", mock.url + "/v1", api_key="sk-plain"),
                route("openai/*", "openai/*", recorder.server.url + "/v1", api_key="sk-slash",
                      model_info={"slot_cache": {"slot": 1}}),
                route("*", "openai/*", mock.url + "/v1", model_info={"slot_cache": True}),
            ]
            with LiteLLMProxy(model_list, callbacks="lpcache_probe.proxy_handler_instance",
                              modules={"lpcache_probe": PROBE.format(**paths)}, env={"LPCACHE_PROBE_KEY": "sk-named"},
                              folder=folder / "proxy") as proxy:
                print(f"\nlitellm proxy ready after {proxy.startup_seconds:.1f} s")
                yield Rig(folder, mock, recorder, proxy)
        finally:
            recorder.server.stop()


def show(what: str, record: dict[str, Any]) -> None:
    print(f"\n--- {what}\n" + json.dumps(record, indent=1, sort_keys=True))


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # polling interval


def test_wildcard_route_gives_the_hook_api_base_model_info_header_and_route(rig: Rig) -> None:
    before = rig.chats()
    result, records = rig.send("smol")
    assert result.status == 200, result.raw
    assert len(records) == 1
    r = records[0]
    show("wildcard route '*', model 'smol', not streamed", r)
    assert r["call_type"] == "CallTypes.acompletion"
    assert r["model"] == "openai/smol"                       # the client's name with the provider of the route
    assert r["api_base"] == rig.mock.url + "/v1"             # the deployment's, as written in the config
    assert r["api_key"] == "none"
    assert r["model_info"]["slot_cache"] is True
    assert r["metadata"]["model_group"] == "smol"            # the route: the name the client asked for
    assert r["metadata"]["deployment_model_name"] == "*"
    assert r["metadata"]["model_info"] == r["model_info"]
    assert r["metadata"]["api_base"] == r["api_base"]
    headers = r["request"]["headers"]
    assert headers["x-session-id"] == SESSION                # lower-cased header names
    assert r["metadata"]["headers"]["x-session-id"] == SESSION
    assert "authorization" not in headers and "authorization" in r["raw_header_names"]
    assert r["litellm_session_id"] == SESSION                # LiteLLM takes X-Session-ID as its own session id
    assert r["messages"][-1]["content"].startswith("hello ")
    assert r["lpcache"] == str(REPO / "lpcache" / "__init__.py")
    assert r["stream"] is False
    # run before the request went upstream
    assert r["chats_at_entry"] == r["chats_at_exit"] == before
    assert rig.chats() == before + 1


def test_streaming_requests_go_through_the_hook(rig: Rig) -> None:
    before = rig.chats()
    result, records = rig.send("smol", stream=True)
    assert result.status == 200 and result.text, result.raw
    assert len(records) == 1
    r = records[0]
    show("wildcard route '*', model 'smol', streamed", {k: r[k] for k in ("keys", "model", "api_base", "stream")})
    assert r["stream"] is True
    assert "stream_options" in r["keys"]
    assert (r["model"], r["api_base"], r["model_info"]["slot_cache"]) == ("openai/smol", rig.mock.url + "/v1", True)
    assert r["metadata"]["model_group"] == "smol"
    assert r["request"]["headers"]["x-session-id"] == SESSION
    assert r["chats_at_entry"] == before
    assert rig.chats() == before + 1


def test_route_for_names_with_a_slash(rig: Rig) -> None:
    result, records = rig.send("openai/org/model")
    assert result.status == 200, result.raw
    assert len(records) == 1
    r = records[0]
    show("route 'openai/*', model 'openai/org/model'", {k: r[k] for k in ("model", "api_base", "api_key",
                                                                          "model_info", "metadata")})
    assert r["model"] == "openai/org/model"
    assert r["metadata"]["model_group"] == "openai/org/model"
    assert r["metadata"]["deployment_model_name"] == "openai/*"  # the more specific wildcard wins over "*"
    assert r["api_base"] == rig.recorder.server.url + "/v1"
    assert r["api_key"] == "sk-slash"
    assert r["model_info"]["slot_cache"] == {"slot": 1}
    assert rig.recorder.bodies[-1]["model"] == "org/model"   # upstream gets the name without "openai/"


def test_named_route_keeps_model_info_of_its_own(rig: Rig) -> None:
    result, records = rig.send("named-route")
    assert result.status == 200, result.raw
    r = records[0]
    show("named route 'named-route'", {k: r[k] for k in ("model", "api_base", "api_key", "model_info")})
    assert r["model"] == "openai/mock-model"                 # litellm_params.model, not the route
    assert r["metadata"]["model_group"] == "named-route"
    assert r["metadata"]["deployment_model_name"] == "named-route"
    assert r["api_key"] == "sk-named"                        # "os.environ/NAME" arrives resolved
    assert r["model_info"]["slot_cache"] == NAMED_OPTIONS    # keys and types survive (float, str, int)
    assert {"id", "db_model"} <= set(r["model_info"])        # LiteLLM adds its own keys next to ours


def test_route_without_slot_cache_and_request_without_header(rig: Rig) -> None:
    result, records = rig.send("plain-route", session=None)
    assert result.status == 200, result.raw
    r = records[0]
    show("route without model_info, no X-Session-ID", {k: r[k] for k in ("model_info", "litellm_session_id")})
    assert "slot_cache" not in r["model_info"]
    assert "x-session-id" not in r["request"]["headers"]
    assert r["metadata"]["model_group"] == "plain-route"


def test_the_request_waits_for_the_hook(rig: Rig) -> None:
    """While the hook is parked the stand-in gets nothing and the client no answer; after it, both."""
    before = rig.chats()
    rig.hold.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(rig.send, "smol")
            wait_for(rig.entered.exists, 120, "the hook to be called")
            assert rig.chats() == before
            assert not future.done()
            rig.hold.unlink()
            result, records = future.result(timeout=120)
    finally:
        rig.hold.unlink(missing_ok=True)
        rig.entered.unlink(missing_ok=True)
    assert result.status == 200, result.raw
    assert records[0]["held"] and records[0]["chats_at_exit"] == before
    assert rig.chats() == before + 1


def test_an_exception_in_the_hook_fails_the_request(rig: Rig) -> None:
    """LiteLLM does not catch what the hook raises: the request fails (after its retries) and never goes upstream.
    So the slot-cache hook must catch its own errors."""
    before = rig.chats()
    rig.raise_.touch()
    try:
        started = time.monotonic()
        result, records = rig.send("smol")
    finally:
        rig.raise_.unlink()
    print(f"\n--- hook raising: status {result.status} after {time.monotonic() - started:.1f} s, "
          f"hook called {len(records)} times: {result.raw[:300]!r}")
    assert result.status >= 400
    assert len(records) >= 1
    assert rig.chats() == before

