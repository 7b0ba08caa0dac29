"""The API adapters: how each body becomes the prompt's identity, what is not cacheable, and the errors' shapes."""

from __future__ import annotations

import orjson
import pytest

from lpcache.apis import BY_PATH
from lpcache.apis.base import Call
from lpcache.apis.infill import PREFIX_EXACT_CHARS
from lpcache.apis.llama_json import json_value
from lpcache.apis.responses import Unconvertible
from lpcache.apis.responses import to_chat as to_responses_chat
from lpcache.cache.prefix import common_prefix
from lpcache.config import Settings
from lpcache.errors import BackendError, BadRequest
from lpcache.workloads import agents

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


def test_a_responses_request_shares_the_identity_of_the_chat_request_it_becomes() -> None:
    text = "Tell me about the weather in Zürich, please. " * 20
    tools = [{"type": "function", "name": "lookup", "description": "Finds a city.", "strict": False,
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    body = {"instructions": "Be brief.", "input": [{"role": "user", "content": text}], "tools": tools}
    responses = parse("/v1/responses", body)
    chat = parse("/v1/chat/completions", to_responses_chat(body))
    assert responses.prompt is not None and chat.prompt is not None
    assert responses.prompt.exact == chat.prompt.exact and responses.prompt.key != chat.prompt.key
    # the server renders a tool's name, description and parameters only: `strict` or not, one prompt
    plain = {"messages": chat.body["messages"], "tools": [{"type": "function", "function": {
        k: v for k, v in tools[0].items() if k not in ("type", "strict")}}]}
    assert parse("/v1/chat/completions", plain).prompt.exact == chat.prompt.exact   # type: ignore[union-attr]
    completion = parse("/v1/completions", {"prompt": text})
    assert shared(chat, completion) == 0 and shared(responses, completion) == 0


def test_an_agent_harness_is_one_prefix_through_responses_and_messages() -> None:
    """Two sessions of one harness, one through each API: the server renders the same tools and system prompt,
    and so does the identity (all but the last few blocks, where the tasks differ, are shared)."""
    first, second = agents.sessions(2)
    a = parse(agents.API_PATHS[first.api], first.body(0))
    b = parse(agents.API_PATHS[second.api], second.body(0))
    assert a.prompt is not None and b.prompt is not None
    assert shared(a, b) >= len(a.prompt.exact) - 5


def test_the_responses_conversion_is_llama_servers() -> None:
    """Input items as server-chat.cpp turns them into chat messages: a string content becomes a text part, a
    function call joins the assistant message before it, outputs become tool messages, reasoning the assistant's
    reasoning_content; max_output_tokens and reasoning.effort are renamed."""
    body = {"input": [
        {"role": "user", "content": "list the files", "type": "message"},
        {"role": "assistant", "type": "message", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "pwd", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "/src"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Two files."}]},
    ], "max_output_tokens": 9, "reasoning": {"effort": "low"}, "temperature": 0}
    sent = orjson.dumps(body)
    chat = to_responses_chat(body)
    assert orjson.dumps(body) == sent        # the body goes on to llama-server as it came
    assert chat["messages"] == [
        {"role": "user", "content": [{"text": "list the files", "type": "text"}]},
        {"role": "assistant", "content": [{"text": "Looking.", "type": "text"}], "tool_calls": [
            {"function": {"arguments": "{}", "name": "ls"}, "id": "c1", "type": "function"},
            {"function": {"arguments": "{}", "name": "pwd"}, "id": "c2", "type": "function"}]},
        {"content": "a.py", "role": "tool", "tool_call_id": "c1"},
        {"content": [{"type": "text", "text": "/src"}], "role": "tool", "tool_call_id": "c2"},
        {"role": "assistant", "content": [], "reasoning_content": "Two files."},
    ]
    assert chat["max_tokens"] == 9 and chat["reasoning_effort"] == "low" and chat["temperature"] == 0
    assert "max_output_tokens" not in chat and "reasoning" not in chat and "input" not in chat


def test_the_responses_conversion_never_changes_the_body_that_goes_on() -> None:
    """A function call joins the assistant item before it, which may carry lists of its own: they are copied, not
    grown (llama-server would convert the body again and see the call twice)."""
    body = {"input": [{"role": "assistant", "type": "message", "content": [], "tool_calls": []},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                      {"role": "assistant", "type": "message", "content": [{"type": "output_text", "text": "a"}]}]}
    sent = orjson.dumps(body)
    first, second = to_responses_chat(body), to_responses_chat(body)
    assert orjson.dumps(body) == sent and first == second
    assert [c["id"] for c in first["messages"][0]["tool_calls"]] == ["c1"]


def test_key_order_is_part_of_the_identity() -> None:
    """llama-server keeps a body's key order and a template writes it so: a tool schema whose properties come in
    another order is another prompt."""
    def tool(properties: dict[str, object]) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": "x" * 200}], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": properties}}}]}

    ab = parse("/v1/chat/completions", tool({"a": {"type": "string"}, "b": {"type": "string"}}))
    ba = parse("/v1/chat/completions", tool({"b": {"type": "string"}, "a": {"type": "string"}}))
    assert ab.prompt is not None and ba.prompt is not None and ab.prompt.exact != ba.prompt.exact


def test_json_value_converts_as_nlohmann_does() -> None:
    assert json_value({"n": 1.9}, "n", 5) == 1 and json_value({"n": True}, "n", 5) == 1
    assert json_value({"n": "7"}, "n", 5) == 5 and json_value({"n": None}, "n", 5) == 5
    assert json_value({"o": [1]}, "o", {}) == [1] and json_value({}, "o", {}) == {}
    assert json_value({"s": 3}, "s", "") == "" and json_value({"b": 1}, "b", False) is False


@pytest.mark.parametrize("given", [[{"type": "mystery"}], [{"role": "user", "content": [{"type": "input_file"}]}],
                                   [5], {"not": "a list"}])
def test_a_responses_body_llama_server_refuses_is_served_uncached(given: object) -> None:
    with pytest.raises(Unconvertible):
        to_responses_chat({"input": given})
    if isinstance(given, list):
        assert parse("/v1/responses", {"input": given}).prompt is None


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
