"""LiteLLM in front of lpcache: a real LiteLLM proxy (litellm[proxy] 1.108.7, scripts/get-litellm.sh) as the team's
gateway, lpcache as a model's `api_base`, in front of a real llama-server with one slot (-np 1 --cache-ram 0); and a
model group of two lpcache hosts (each in front of a stand-in) to show which host a session goes to.

What this proves about LiteLLM 1.108.7, as docs/sessions.md's recipe says it:
- `X-Session-ID` reaches lpcache only for the model groups `litellm_settings.model_group_settings.
  forward_client_headers_to_llm_api` lists; then session mode works through LiteLLM (a session's next turn after
  another session used the slot is restored from its file).
- lpcache's response headers come back renamed `llm_provider-x-lpcache-...`, on chat completions and Responses,
  JSON and streamed; LiteLLM passes none on for Messages and completions (the session still reaches lpcache).
- `router_settings.model_group_affinity_config: {group: [session_affinity]}` keeps a session on one host of a
  group, for the ids LiteLLM takes as session ids.
- a header value outside ASCII fails inside LiteLLM (500), before lpcache.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lpcache.cache.session_ids import session_id
from lpcache.config import BackendConfig, Settings
from lpcache.mock_llama import MockConfig, MockHandle, start_mock
from lpcache.workloads import chats
from lpcache.workloads.harness import LlamaServer

from ..conftest import Proxy, figures
from .litellm_rig import LiteLLMProxy, route

pytestmark = pytest.mark.e2e

FORWARDED = ["smollm2", "pair"]      # the groups whose clients' x- headers go on to lpcache


def sha32(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:32]


class Host:
    """lpcache on one llama.cpp host, and the records of the requests it served."""

    def __init__(self, backend_url: str, slots: str | None, meta: Path) -> None:
        self.proxy = Proxy(Settings(backends=(BackendConfig(backend_url, None, slots),), meta_dir=str(meta),
                                    host="127.0.0.1", big_threshold_words=200))
        self.seen = 0

    def next_record(self) -> Any:
        """The record of the one request sent to this host since the last call (saves done)."""
        self.seen += 1
        self.proxy.wait_finished(self.seen, timeout=300)
        assert len(self.proxy.records) == self.seen, "LiteLLM sent more than one request"
        return self.proxy.records[-1]


class Rig:
    def __init__(self, server: LlamaServer, host: Host, pair: list[Host], gateway: LiteLLMProxy) -> None:
        self.server, self.host, self.pair, self.gateway = server, host, pair, gateway
        self.client = httpx.Client(base_url=gateway.url, headers=gateway.headers, timeout=600)

    def chat(self, model: str, messages: list[dict[str, Any]], session: str | bytes | None,
             **body: Any) -> httpx.Response:
        headers = {"X-Session-ID": session} if session is not None else {}
        return self.client.post("/v1/chat/completions", headers=headers,
                                json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0,
                                      **body})


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    base = tmp_path_factory.mktemp("front")
    mocks: list[MockHandle] = []
    hosts: list[Host] = []
    try:
        with LlamaServer(str(base / "slots"), n_slots=1, cache_ram=0, ctx=8192) as server:
            host = Host(server.url, server.slot_save_path, base / "meta")
            hosts.append(host)
            for i in range(2):
                (base / f"pair{i}").mkdir()
                mocks.append(start_mock(MockConfig(slots=1, slot_save_path=str(base / f"pair{i}"))))
                hosts.append(Host(mocks[-1].url, str(base / f"pair{i}"), base / f"pair-meta{i}"))
            model_list = [route("smollm2", "openai/smollm2", f"{host.proxy.url}/v1"),
                          route("unlisted", "openai/unlisted", f"{host.proxy.url}/v1"),
                          *(route("pair", "openai/pair", f"{h.proxy.url}/v1") for h in hosts[1:])]
            with LiteLLMProxy(model_list,
                              litellm_settings={"model_group_settings": {
                                  "forward_client_headers_to_llm_api": FORWARDED}},
                              router_settings={"model_group_affinity_config": {"pair": ["session_affinity"]}}
                              ) as gateway:
                r = Rig(server, host, hosts[1:], gateway)
                yield r
                r.client.close()
    finally:
        for h in hosts:
            h.proxy.stop()
        for m in mocks:
            m.stop()


def story(seed: int, n_words: int = 450) -> list[dict[str, Any]]:
    """A writing session's prompt: instructions, then a long story in mixed scripts (big: saved after each turn)."""
    rng = random.Random(seed)
    return [{"role": "system", "content": "Du bist Lektorin. Antworte kurz, auf Deutsch, ohne Aufzählungen."},
            {"role": "user", "content": chats.text(rng, n_words)}]


def test_the_session_reaches_lpcache_only_for_the_listed_groups(rig: Rig) -> None:
    r = rig.chat("unlisted", story(1, 40), "user-42")
    assert r.status_code == 200, r.text
    assert rig.host.next_record().session is None                     # LiteLLM dropped X-Session-ID
    assert r.headers["llm_provider-x-lpcache-slot"] == "0:0"          # lpcache's headers come back, renamed
    assert "llm_provider-x-lpcache-session" not in r.headers
    r = rig.chat("smollm2", story(1, 40), "user-42")
    assert r.status_code == 200, r.text
    assert rig.host.next_record().session == sha32("user-42")
    assert r.headers["llm_provider-x-lpcache-session"] == sha32("user-42")
    assert "x-lpcache-session" not in r.headers                       # only under LiteLLM's name


def test_a_session_comes_back_from_its_file_through_litellm(rig: Rig) -> None:
    a, b = "6F9619FF-8B86-D011-B42D-00C04FC964FF", "team-redaktion.zusammenfassung"
    story_a, story_b = story(2), story(3)
    for session, messages in ((a, story_a), (b, story_b)):
        assert rig.chat("smollm2", messages, session).status_code == 200
        assert rig.host.next_record().session == sha32(session)
    turn = story_a + [{"role": "assistant", "content": "Gut. Der Anfang trägt."},
                      {"role": "user", "content": "Und das Ende? Zwei Sätze, bitte — ehrlich."}]
    r = rig.chat("smollm2", turn, a)                                  # B used the only slot in between
    record = rig.host.next_record()
    assert r.status_code == 200, r.text
    assert r.headers["llm_provider-x-lpcache-session"] == sha32(a)
    assert r.headers["llm_provider-x-lpcache-restored"] == "true" and record.restored is True
    assert record.session == sha32(a) and record.route == "session"
    assert record.cache_n is not None and record.prompt_n is not None and record.cache_n > 10 * record.prompt_n
    figures(f"\nthrough LiteLLM, a session's next turn after another's: restored, cache_n {record.cache_n}, "
            f"prompt_n {record.prompt_n}")

    assert rig.chat("smollm2", story_b + [{"role": "user", "content": "Weiter."}], b).status_code == 200
    rig.host.next_record()
    with rig.client.stream("POST", "/v1/chat/completions", headers={"X-Session-ID": a},
                           json={"model": "smollm2", "messages": turn, "max_tokens": 8, "stream": True}) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
        headers = s.headers
    assert events[-1] == "data: [DONE]"
    assert headers["llm_provider-x-lpcache-session"] == sha32(a)
    assert headers["llm_provider-x-lpcache-restored"] == "true"
    assert rig.host.next_record().restored is True


@pytest.mark.parametrize("path, body, headers_back", [
    ("/v1/responses", {"input": "Wer schrieb »Der Process«?", "max_output_tokens": 8}, True),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Wer schrieb »Der Process«?"}], "max_tokens": 8},
     False),
    ("/v1/completions", {"prompt": "Kafka schrieb »Der Process« in", "max_tokens": 8}, False),
])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_other_apis_through_litellm(rig: Rig, path: str, body: dict[str, Any], headers_back: bool,
                                        stream: bool) -> None:
    session = "lektorat-7f3a"
    r = rig.client.post(path, headers={"X-Session-ID": session}, json={"model": "smollm2", **body, "stream": stream})
    assert r.status_code == 200, r.text
    record = rig.host.next_record()
    assert record.session == sha32(session)                           # the session reached lpcache
    # LiteLLM sends a Messages request for an openai/ route as a Responses request
    assert record.path == ("/v1/responses" if path == "/v1/messages" else path)
    assert (r.headers.get("llm_provider-x-lpcache-session") == sha32(session)) is headers_back


def test_several_hosts_keep_each_session_on_one_with_session_affinity(rig: Rig) -> None:
    sessions = ["6f9619ff-8b86-d011-b42d-00c04fc964ff", "user-0042", "3f9a0c1d5b7e4a2c8d6f1e0b9a7c5d3e"]
    served: dict[str | None, set[int]] = {session_id(s): set() for s in sessions}
    for turn in range(4):
        for session in sessions:
            r = rig.chat("pair", [{"role": "user", "content": f"Runde {turn}: Grüße an {session}!"}], session)
            assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while sum(len(h.proxy.records) for h in rig.pair) < 4 * len(sessions):   # the last records' bookkeeping
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for i, host in enumerate(rig.pair):
        for record in host.proxy.records:
            served[record.session].add(i)
    assert sum(len(h.proxy.records) for h in rig.pair) == 4 * len(sessions)
    assert all(len(hosts) == 1 for hosts in served.values()), served


def test_a_header_outside_ascii_fails_in_litellm_and_a_bad_one_is_prefix_mode(rig: Rig) -> None:
    before = len(rig.host.proxy.records)
    r = rig.chat("smollm2", story(4, 30), "Zoë Ångström".encode())
    assert r.status_code == 500 and "ascii" in r.text                 # LiteLLM's own client cannot send it
    assert len(rig.host.proxy.records) == before                      # lpcache never saw the request
    r = rig.chat("smollm2", story(4, 30), "user\t42")
    assert r.status_code == 200 and "llm_provider-x-lpcache-session" not in r.headers
    assert rig.host.next_record().session is None                     # forwarded, rejected: prefix mode
    rejected = rig.host.proxy.pipeline.session_ids.rejected
    assert rejected["control_character"] >= 1


def test_the_openai_sdk_through_litellm_reads_lpcaches_session(rig: Rig) -> None:
    client = openai.OpenAI(base_url=f"{rig.gateway.url}/v1", api_key=rig.gateway.master_key, max_retries=0,
                           default_headers={"X-Session-ID": "sdk-user-42"}, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", max_tokens=8, messages=[{"role": "user", "content": "Ein Satz über Köln, bitte."}])
    assert raw.headers["llm_provider-x-lpcache-session"] == sha32("sdk-user-42")
    assert isinstance(raw.parse().choices[0].message.content, str)
    assert rig.host.next_record().session == sha32("sdk-user-42")
