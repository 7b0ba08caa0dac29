"""Anthropic Messages converted by lpcache (`lpcache.apis.anthropic`) against llama-server's own /v1/messages, on a
real llama-server (build 11434, SmolLM2-135M, -np 2, temperature 0).

Each request goes twice to the same server, both slots erased before each: to /v1/messages as it is, and as
`chat_request(body)` to /v1/chat/completions pinned to slot 0 (as lpcache sends it), its answer converted back
(`answer`, `MessagesStream`). The two answers must be the same bytes once their random ids are set aside: JSON and
SSE, usage included, so the prompts rendered are the same too.

SmolLM2's own template knows no tools and no reasoning, so two more servers run the same model with another
template: one in Functionary v3.2's format (llama-server recognises it by `>>>all` and `>>>${recipient}`), whose
grammar makes the model call a tool when one is required, and Qwen's QwQ template, whose generation prompt opens
`<think>`, so that the model's output is reasoning (until the thinking budget closes it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from lpcache.apis.anthropic import MessagesStream, answer, chat_request
from lpcache.apis.llama_json import dumps
from lpcache.workloads.harness import LlamaServer

from ..anthropic_events import events

pytestmark = pytest.mark.e2e

TOOLS_TEMPLATE = r"""{{ bos_token + '<|start_header_id|>system<|end_header_id|>\n\nRespond in this format:\n>>>${recipient}\n${content}\nAvailable functions:\n' }}
{%- for tool in tools or [] %}{{ '// ' + tool.function.description + '\ntype ' + tool.function.name + ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\n' }}{% endfor -%}
{{ '<|eot_id|>' }}
{%- for message in messages -%}
    {%- if message['role'] == 'user' or message['role'] == 'system' or message['role'] == 'tool' -%}
        {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}
    {%- else -%}
        {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'}}
        {%- if message['content'] -%}{{ '>>>all\n' + message['content'] }}{%- endif -%}
        {%- for tool_call in message['tool_calls'] or [] -%}
            {{ '>>>' + tool_call['function']['name'] + '\n' + tool_call['function']['arguments'] }}
        {%- endfor -%}
        {{ '<|eot_id|>' }}
    {%- endif -%}
{%- endfor -%}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n>>>' }}{% endif %}
"""  # noqa: E501

# Qwen/QwQ-32B's chat template, as llama.cpp keeps it in models/templates/Qwen-QwQ-32B.jinja.
THINKING_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
  {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" and not message.tool_calls %}
        {%- set content = message.content %}
        {%- if not loop.last %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if not loop.last %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
    {%- if not enable_thinking -%}{{- '</think>' -}}{%- endif -%}
{%- endif %}
"""  # noqa: E501

WEATHER = [{"name": "get_weather", "description": "Get the weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
# Two earlier calls show the model the way (a 135M model calls a tool only when the grammar leaves it no choice).
CALLS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                       "input": {"city": "Paris", "units": {"scale": 1.5e20, "exact": True}}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "Sunny, 21 C"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "It is sunny in Paris."}]},
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_02", "name": "get_weather",
                                       "input": {"city": "Rome"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02",
                                  "content": [{"type": "text", "text": "Rainy, "}, {"type": "text", "text": "15 C"}]},
                                 {"type": "text", "text": "Thanks."}]},
    {"role": "assistant", "content": [{"type": "text", "text": "It is rainy in Rome."}]},
    {"role": "user", "content": "What is the weather in Berlin?"}]
HELLO = [{"role": "user", "content": "Say hello in French."}]
IDS = re.compile(rb'"id":"[^"]*"')


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with LlamaServer(str(tmp_path_factory.mktemp("plain")), n_slots=2, ctx=8192, cache_ram=0) as server:
        yield server


def templated(folder: Path, template: str) -> LlamaServer:
    (folder / "template.jinja").write_text(template)
    return LlamaServer(str(folder / "slots"), n_slots=2, ctx=8192, cache_ram=0,
                       extra=["--chat-template-file", str(folder / "template.jinja")])


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with templated(tmp_path_factory.mktemp("tools"), TOOLS_TEMPLATE) as server:
        yield server


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with templated(tmp_path_factory.mktemp("thinking"), THINKING_TEMPLATE) as server:
        yield server


def erase(server: LlamaServer) -> None:
    for slot in (0, 1):
        r = httpx.post(f"{server.url}/slots/{slot}?action=erase", timeout=60)
        assert r.status_code == 200, r.text


def post(server: LlamaServer, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """The status and raw bytes of the answer (a stream read to its end)."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=600) as r:
        return r.status_code, b"".join(r.iter_raw())


def llama_messages(server: LlamaServer, body: dict[str, Any], fresh: bool = True) -> tuple[int, bytes]:
    if fresh:
        erase(server)
    return post(server, "/v1/messages", body)


def through_chat(server: LlamaServer, body: dict[str, Any], fresh: bool = True) -> tuple[int, bytes]:
    """What lpcache answers: the chat request pinned to slot 0, its answer converted (the stream in its TCP-sized
    pieces, as they came)."""
    if fresh:
        erase(server)
    chat = {**chat_request(body), "id_slot": 0}
    if not body.get("stream"):
        status, raw = post(server, "/v1/chat/completions", chat)
        return status, (dumps(answer(orjson.loads(raw), body)).encode() if status == 200 else raw)
    converter, out = MessagesStream(), bytearray()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for piece in r.iter_raw():
            out += converter.feed(piece)
    return r.status_code, bytes(out + converter.close())


def without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def usage(raw: bytes, stream: bool) -> dict[str, Any]:
    if not stream:
        return orjson.loads(raw)["usage"]  # type: ignore[no-any-return]
    found = [data["message"]["usage"] for name, data in events(raw) if name == "message_start"]
    return found[0]  # type: ignore[no-any-return]


def assert_same(theirs: tuple[int, bytes], ours: tuple[int, bytes], stream: bool) -> None:
    assert ours[0] == theirs[0]
    if stream:
        assert [(n, without_ids(d)) for n, d in events(ours[1])] == [(n, without_ids(d)) for n, d in events(theirs[1])]
    else:
        assert without_ids(orjson.loads(ours[1])) == without_ids(orjson.loads(theirs[1]))
    assert IDS.sub(b'"id":""', ours[1]) == IDS.sub(b'"id":""', theirs[1])


def compare(server: LlamaServer, body: dict[str, Any]) -> bytes:
    """Both ways, stream or not; llama-server's own answer is returned."""
    theirs, ours = llama_messages(server, body), through_chat(server, body)
    assert_same(theirs, ours, bool(body.get("stream")))
    if theirs[0] == 200:
        assert usage(ours[1], bool(body.get("stream"))) == usage(theirs[1], bool(body.get("stream")))
    return theirs[1]


@pytest.mark.parametrize("stream", [False, True])
def test_text_with_a_system_prompt_up_to_max_tokens(plain: LlamaServer, stream: bool) -> None:
    raw = compare(plain, {"model": "claude", "max_tokens": 12, "temperature": 0, "stream": stream,
                          "system": [{"type": "text", "text": "Be brief."}], "messages": HELLO})
    assert b'"stop_reason":"max_tokens"' in raw
    assert b'"cache_read_input_tokens":0,"input_tokens":' in raw


@pytest.mark.parametrize("stream", [False, True])
def test_text_to_its_end_with_unicode(plain: LlamaServer, stream: bool) -> None:
    raw = compare(plain, {"max_tokens": 60, "temperature": 0, "stream": stream, "system": "Answer in one word.",
                          "messages": [{"role": "user", "content": "Répète : ünïcödé 日本語 😀"}]})
    assert b'"stop_reason":"end_turn","stop_sequence":null' in raw


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_that_matches(plain: LlamaServer, stream: bool) -> None:
    raw = compare(plain, {"max_tokens": 30, "temperature": 0, "stream": stream, "system": "Be brief.",
                          "messages": HELLO, "stop_sequences": ["zzz", "jour"]})
    assert b'"stop_reason":"end_turn","stop_sequence":"jour"' in raw


@pytest.mark.parametrize("stream", [False, True])
def test_a_cached_prompt_gives_the_same_usage(plain: LlamaServer, stream: bool) -> None:
    """The second of two identical requests finds its prompt in the slot: cache_read_input_tokens > 0."""
    body = {"max_tokens": 8, "temperature": 0, "stream": stream, "system": "Be brief.", "messages": HELLO}
    llama_messages(plain, body)
    theirs = llama_messages(plain, body, fresh=False)
    through_chat(plain, body)
    ours = through_chat(plain, body, fresh=False)
    assert_same(theirs, ours, stream)
    assert usage(ours[1], stream)["cache_read_input_tokens"] > 0
    assert usage(ours[1], stream) == usage(theirs[1], stream)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_after_tool_use_and_tool_results(tools: LlamaServer, stream: bool,
                                                                choice: dict[str, Any]) -> None:
    raw = compare(tools, {"max_tokens": 40, "temperature": 0, "stream": stream, "tools": WEATHER,
                          "tool_choice": choice, "messages": CALLS})
    assert b'"stop_reason":"tool_use"' in raw
    assert b'"name":"get_weather"' in raw


@pytest.mark.parametrize("stream", [False, True])
def test_output_the_parser_refuses_is_the_same_error(tools: LlamaServer, stream: bool) -> None:
    """With tool_choice auto the model writes neither `all` nor a tool call after `>>>`: llama-server's parser fails
    the finished message, a 500 for JSON, an error event ending a stream."""
    raw = compare(tools, {"max_tokens": 40, "temperature": 0, "stream": stream, "tools": WEATHER,
                          "tool_choice": {"type": "auto"}, "messages": CALLS})
    assert (b"event: error\ndata: {" if stream else b'{"error":{"code":500') in raw


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_text(thinking: LlamaServer, stream: bool) -> None:
    raw = compare(thinking, {"max_tokens": 16, "temperature": 0, "stream": stream, "messages": HELLO,
                             "thinking": {"type": "enabled", "budget_tokens": 5}})
    assert b'{"type":"thinking","thinking":' in raw
    assert b'"type":"text"' in raw


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_blocks_in_the_history_and_emoji_split_across_tokens(thinking: LlamaServer, stream: bool) -> None:
    raw = compare(thinking, {
        "max_tokens": 12, "temperature": 0, "stream": stream, "system": "You think first.",
        "messages": [*HELLO, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Bonjour.",
                                                                "signature": "s"},
                                                               {"type": "text", "text": "Bonjour!"}]},
                     {"role": "user", "content": "And in German? ünïcödé 日本語 😀"}]})
    assert "🌍".encode() in raw
