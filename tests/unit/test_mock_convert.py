"""The stand-in turns Responses and Anthropic bodies into chat bodies as llama-server b11434 does (server-chat.cpp):
what it keeps, drops, merges and refuses."""

from __future__ import annotations

from typing import Any

import pytest

from lpcache.mock_llama.api import ApiError
from lpcache.mock_llama.convert import anthropic_to_chat, normalize_billing_header, responses_to_chat

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_responses_string_input_keeps_every_other_field() -> None:
    body = {"model": "m", "instructions": "Be brief.", "input": "Hi", "id_slot": 1, "stream": True,
            "max_output_tokens": 7, "reasoning": {"effort": "low"}, "cache_prompt": False}
    assert responses_to_chat(body) == {
        "model": "m", "id_slot": 1, "stream": True, "cache_prompt": False, "max_tokens": 7, "reasoning_effort": "low",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }


def test_responses_items_become_messages_and_tool_calls_merge_into_the_assistant() -> None:
    body: dict[str, Any] = {"input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}], "status": "x"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
    ], "tools": [{"type": "function", "name": "weather", "parameters": PARAMS}, {"type": "web_search"}]}
    call = {"function": {"arguments": '{"city":"Oslo"}', "name": "weather"}, "id": "c1", "type": "function"}
    assert responses_to_chat(body) == {
        "messages": [
            {"role": "developer", "content": [{"text": "Use tools.", "type": "text"}]},
            {"role": "user", "content": [{"text": "Weather?", "type": "text"}]},
            {"role": "assistant", "content": [{"text": "Checking.", "type": "text"}], "tool_calls": [call]},
            {"content": "sunny", "role": "tool", "tool_call_id": "c1"},
            {"content": [{"type": "text", "text": "rain"}], "role": "tool", "tool_call_id": "c2"},
            {"role": "assistant", "tool_calls": [
                {"function": {"arguments": "{}", "name": "weather"}, "id": "c3", "type": "function"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": PARAMS, "strict": True}}],
    }


@pytest.mark.parametrize(("body", "message"), [
    ({}, "'input' is required"),
    ({"input": "x", "previous_response_id": "r1"}, "llama.cpp does not support 'previous_response_id'."),
    ({"input": 3}, "'input' must be a string or array of objects"),
    ({"input": [{"type": "mystery"}]}, "Cannot determine type of 'item'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "'input_file' is not supported by llamacpp at this moment"),
    ({"input": "x", "tools": {}}, "'tools' must be an array of objects"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "'Input text' requires 'text'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "'image_url' is required"),
    ({"input": [{"role": "user", "content": [{"type": "audio"}]}]},
     "'type' must be one of 'input_text', 'input_image', or 'input_file'"),
    ({"input": [{"role": "assistant", "type": "message", "content": [{"type": "output_text"}]}]},
     "'Output text' requires 'text'"),
    ({"input": [{"role": "assistant", "type": "message", "content": [{"type": "refusal"}]}]},
     "'Refusal' requires 'refusal'"),
    ({"input": [{"role": "assistant", "type": "message", "content": [{"type": "x"}]}]},
     "'type' must be one of 'output_text' or 'refusal'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": "t"}]}]},
     "Output of tool call missing 'type' field"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "file"}]}]},
     "Output of tool call should be 'Input text' or 'Input image'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "'image_url' is required"),
    ({"input": [{"type": "reasoning", "summary": [], "content": 5}]}, "item['content'] is not an array"),
    ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "item['content'] is empty"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{}]}]}, "item['content']['text'] is not a string"),
])
def test_responses_refusals_are_400s_with_the_real_messages(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError) as refused:
        responses_to_chat(body)
    assert (refused.value.status, refused.value.message) == (400, message)


def test_anthropic_blocks_become_chat_messages_and_id_slot_is_dropped() -> None:
    body: dict[str, Any] = {
        "model": "m", "id_slot": 1, "cache_prompt": False, "n_predict": 3, "stream": True, "temperature": 0,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool."},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo", "days": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sun"},
                                                                         {"type": "text", "text": "ny"}]},
                {"type": "text", "text": "Thanks."}]},
            {"role": "assistant"},
        ],
        "tools": [{"name": "weather", "description": "Forecast.", "input_schema": PARAMS}],
        "tool_choice": {"type": "any"}, "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
    }
    call = {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo","days":2}'}}
    assert anthropic_to_chat(body) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [call],
             "reasoning_content": "Use the tool."},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
            {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Forecast.",
                                                    "parameters": PARAMS}}],
        "tool_choice": "required", "stop": ["END"], "max_tokens": 4096, "temperature": 0, "stream": True,
        "__metadata_user_id": "u1",
    }


def test_anthropic_tool_only_turn_and_missing_messages() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}],
            "max_tokens": 5}
    assert anthropic_to_chat(body)["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "ok"}]
    with pytest.raises(ApiError) as refused:
        anthropic_to_chat({"system": "s"})
    assert (refused.value.status, refused.value.message) == (500, "'messages' is required")


def test_billing_header_stamp_is_blanked_so_the_prefix_cache_gets_past_it() -> None:
    header = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude."
    assert normalize_billing_header(header) == header.replace("cch=a5145", "cch=fffff")
    assert normalize_billing_header("You are Claude. cch=a5145;") == "You are Claude. cch=a5145;"
    body = {"system": header, "messages": [{"role": "user", "content": "hi"}]}
    assert anthropic_to_chat(body)["messages"][0]["content"] == normalize_billing_header(header)
