"""The official openai SDK (Python) against lpcache in front of the stand-in, as docs/clients.md sets it up: chat
completions JSON and streamed, the models list, the session sent with `default_headers` or per request with
`extra_headers`, and lpcache's headers read back (`with_raw_response`, `with_streaming_response`)."""

from __future__ import annotations

import hashlib
from typing import Any

import openai
import pytest

from ..conftest import Proxy, words
from .conftest import mock_stats

BIG = 200   # words: big with the test threshold of 50


def sha32(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:32]


def client(proxy: Proxy, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0, timeout=60, **options)


def story(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Tu es un relecteur exigeant ; réponds en français."},
            {"role": "user", "content": f"Voici le chapitre {seed} — « L'été à Åre » :\n" + words(seed, BIG)}]


@pytest.fixture
def one_slot(start_backend: Any) -> Any:
    return start_backend(slots=1)


@pytest.fixture
def proxy(start_proxy: Any, one_slot: Any) -> Proxy:
    return start_proxy(one_slot)


def test_the_models_list(proxy: Proxy) -> None:
    models = client(proxy).models.list()
    assert [m.id for m in models.data] == ["mock-model"]             # the backend's own list, as lpcache merges it
    assert models.data[0].object == "model"


def test_chat_json_and_stream_say_which_session_they_used(proxy: Proxy) -> None:
    sdk = client(proxy, default_headers={"X-Session-ID": "user-42"})
    raw = sdk.chat.completions.with_raw_response.create(model="llama.cpp", messages=story(1), max_tokens=5)
    assert raw.headers["x-lpcache-session"] == sha32("user-42")
    completion = raw.parse()
    assert completion.choices[0].message.content and completion.usage is not None
    assert completion.usage.completion_tokens == 5

    with sdk.chat.completions.with_streaming_response.create(model="llama.cpp", messages=story(1), max_tokens=5,
                                                             stream=True) as response:
        assert response.headers["x-lpcache-session"] == sha32("user-42")
        assert response.headers["x-lpcache-cache-hit"] == "true"      # the session's slot held the story
        text = "".join(chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices)
    assert text


def test_a_session_per_request_and_its_restore(proxy: Proxy, one_slot: Any) -> None:
    sdk = client(proxy)                                               # no default session: one per request
    a, b = "6F9619FF-8B86-D011-B42D-00C04FC964FF", "equipe-relecture/Are #2"
    for session, seed in ((a, 2), (b, 3)):
        raw = sdk.chat.completions.with_raw_response.create(model="llama.cpp", messages=story(seed), max_tokens=3,
                                                            extra_headers={"X-Session-ID": session})
        assert raw.headers["x-lpcache-session"] == sha32(session)
        proxy.settle()
    before = mock_stats(one_slot)["restores"]
    turn = story(2) + [{"role": "assistant", "content": "Bien."}, {"role": "user", "content": "Et la fin ?"}]
    raw = sdk.chat.completions.with_raw_response.create(model="llama.cpp", messages=turn, max_tokens=3,
                                                        extra_headers={"X-Session-ID": a})
    assert raw.headers["x-lpcache-session"] == sha32(a) and raw.headers["x-lpcache-restored"] == "true"
    assert raw.http_response.json()["timings"]["cache_n"] >= BIG      # the story came back from a's file
    assert mock_stats(one_slot)["restores"] == before + 1
    plain = sdk.chat.completions.with_raw_response.create(model="llama.cpp", messages=turn, max_tokens=3)
    assert "x-lpcache-session" not in plain.headers                   # no header sent: prefix mode


def test_a_value_that_cannot_be_a_session_is_served_in_prefix_mode(proxy: Proxy) -> None:
    sdk = client(proxy, default_headers={"X-Session-ID": "x" * 300})
    raw = sdk.chat.completions.with_raw_response.create(model="llama.cpp", messages=story(4), max_tokens=3)
    assert raw.parse().choices[0].message.content
    assert "x-lpcache-session" not in raw.headers
    assert proxy.pipeline.session_ids.rejected["too_long"] == 1


def test_the_sdk_sends_only_ascii_header_values(proxy: Proxy) -> None:
    # why docs/clients.md says to hash a name outside ASCII first: the SDK refuses to send it, lpcache never sees it
    sdk = client(proxy, default_headers={"X-Session-ID": "Zoë"})
    with pytest.raises(UnicodeEncodeError):
        sdk.chat.completions.create(model="llama.cpp", messages=story(5), max_tokens=3)
    assert proxy.records == []
