"""The API adapters: how each body becomes the prompt's identity, what is not cacheable, and the errors' shapes."""

from __future__ import annotations

import orjson
import pytest

from lpcache.apis import BY_PATH
from lpcache.apis.base import Call
from lpcache.apis.infill import PREFIX_EXACT_CHARS
from lpcache.config import Settings
from lpcache.errors import BackendError, BadRequest
from lpcache.prefix import common_prefix

from ..agent_loop import AgentLoop

SETTINGS = Settings(words_per_block=10, big_threshold_words=50)


def parse(path: str, body: object) -> Call:
    return BY_PATH[path].parse(orjson.dumps(body), path, SETTINGS)


def shared(a: Call, b: Call) -> int:
    assert a.prompt is not None and b.prompt is not None
    return common_prefix(a.prompt.exact, b.prompt.exact)


def test_an_agent_turn_extends_the_previous_turns_identity_in_every_api() -> None:
    loop = AgentLoop(1, words=80)
    before = {"/v1/responses": loop.responses_body(), "/v1/messages": loop.messages_body()}
    loop.advance()
    after = {"/v1/responses": loop.responses_body(), "/v1/messages": loop.messages_body()}
    for path in before:
        a, b = parse(path, before[path]), parse(path, after[path])
        assert a.prompt is not None and b.prompt is not None and b.big
        assert shared(a, b) >= len(a.prompt.exact) - 1, path   # all but the last, partly rewritten block
        assert len(b.prompt.exact) > len(a.prompt.exact) + 10


def test_a_messages_request_shares_its_cache_with_the_chat_request_it_becomes() -> None:
    from lpcache.apis import anthropic

    body = AgentLoop(2, words=80).messages_body()
    body.pop("extra_body")
    messages = parse("/v1/messages", body)
    chat = parse("/v1/chat/completions", anthropic.to_chat(body))
    assert messages.prompt is not None and chat.prompt is not None
    assert messages.prompt.exact == chat.prompt.exact          # the same rendered prompt: the same cache
    assert messages.prompt.key != chat.prompt.key              # not the same answers: never coalesced or served
    assert messages.send.get("messages") and "system" not in messages.send


def test_other_apis_never_share_an_identity_with_chat() -> None:
    text = "Tell me about the weather in Zürich, please. " * 20
    chat = parse("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    responses = parse("/v1/responses", {"input": [{"role": "user", "content": text}]})
    completion = parse("/v1/completions", {"prompt": text})
    assert shared(chat, responses) == 0 and shared(chat, completion) == 0 and shared(responses, completion) == 0


def test_completions_text_and_token_ids_count_as_words_and_grow_as_prefixes() -> None:
    text = parse("/completion", {"prompt": "alpha beta, gamma: delta! " * 40})
    grown = parse("/completion", {"prompt": "alpha beta, gamma: delta! " * 40 + "epsilon"})
    assert text.big and shared(text, grown) == len(text.prompt.exact)   # type: ignore[union-attr]
    ids = parse("/v1/completions", {"prompt": list(range(1, 200))})
    more = parse("/v1/completions", {"prompt": list(range(1, 260))})
    assert ids.prompt is not None and ids.prompt.n_words == 199 and ids.big
    assert shared(ids, more) >= len(ids.prompt.exact) - 1


@pytest.mark.parametrize("body", [{"prompt": ["one", "two"]}, {"prompt": [[1, 2], [3, 4]]}, {"prompt": "x", "n": 2},
                                  {"prompt": {"prompt_string": "x", "multimodal_data": []}}])
def test_several_prompts_or_answers_are_served_uncached(body: dict[str, object]) -> None:
    call = parse("/v1/completions", body)
    assert call.prompt is None and not call.big


def test_a_response_continuing_a_stored_one_is_served_uncached() -> None:
    assert parse("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}).prompt is None


def test_infill_identity_is_extra_then_prefix_then_prompt_then_suffix_and_a_long_prefix_is_left_out() -> None:
    extra = [{"filename": "a.py", "text": "import os\n" * 60}]
    body = {"input_extra": extra, "input_prefix": "def f(x):\n    ", "input_suffix": "\n    return y\n"}
    a = parse("/infill", body)
    typed = parse("/infill", {**body, "input_prefix": "def f(x):\n    y = x"})
    other_suffix = parse("/infill", {**body, "input_suffix": "\n    return None\n"})
    assert a.prompt is not None and a.messages[0]["role"] == "input_extra"
    assert [m["role"] for m in a.messages] == ["input_extra", "input_prefix", "prompt", "input_suffix"]
    assert shared(a, typed) >= 9 and shared(a, other_suffix) > shared(a, typed) - 2
    long = parse("/infill", {**body, "input_prefix": "x = 1\n" * (PREFIX_EXACT_CHARS // 6 + 1)})
    assert [m["role"] for m in long.messages] == ["input_extra"]   # only the part that stays exact


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/responses", {"model": "m"}, "input"),
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/messages", {"max_tokens": 5, "messages": []}, "messages"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/infill", {"input_prefix": 5}, "input_prefix"),
    ("/infill", {"input_extra": [{"text": 5}]}, "input_extra"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "role"),
])
def test_bad_bodies_are_the_clients_error(path: str, body: dict[str, object], field: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse(path, body)
    assert caught.value.status == 400 and field in caught.value.message


def test_messages_errors_have_anthropics_shape_and_a_backends_error_passes_on() -> None:
    api = BY_PATH["/v1/messages"]
    raw, content_type = api.error(BadRequest("'messages' must be a non-empty array"))
    assert orjson.loads(raw) == {"type": "error", "error": {"type": "invalid_request_error",
                                                            "message": "'messages' must be a non-empty array"}}
    backend = BackendError("x", status=400, raw=b'{"error":{"code":400,"n_ctx":2048}}')
    assert api.error(backend)[0] == b'{"error":{"code":400,"n_ctx":2048}}'
    raw, _ = BY_PATH["/v1/responses"].error(BadRequest("bad"))
    assert set(orjson.loads(raw)["error"]) == {"message", "type", "code"}
