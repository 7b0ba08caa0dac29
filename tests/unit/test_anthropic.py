"""Anthropic Messages <-> chat completions, as llama-server b11434 converts them.

The recorded cases (anthropic_recorded.json) are real llama-server answers, SmolLM2 at temperature 0, slots erased
before each: its chat answer to `chat_request(body)` and its own /v1/messages answer to `body`, the latter's ids
replaced by the former's (the rest untouched but the model path, shortened in both). The servers ran the model's own
template, a Functionary-v3.2-style one (tool calls) and Qwen's QwQ template (reasoning).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from lpcache.apis.anthropic import MessagesStream, answer, chat_request, to_chat
from lpcache.apis.llama_json import dumps
from lpcache.errors import BadRequest

from ..anthropic_events import events

RECORDED: dict[str, dict[str, Any]] = json.loads((Path(__file__).parent / "anthropic_recorded.json").read_text())
STREAMS = sorted(k for k, v in RECORDED.items() if v["body"]["stream"])
ANSWERS = sorted(k for k, v in RECORDED.items() if not v["body"]["stream"] and v["status"] == 200)

USER = {"role": "user", "content": "Hi"}


def chat_of(**body: Any) -> dict[str, Any]:
    return to_chat({"messages": [USER], **body})


# ---- the request ----

def test_a_plain_request_gets_the_default_max_tokens_in_llama_servers_key_order() -> None:
    chat = to_chat({"model": "claude", "system": "Be brief.", "messages": [USER], "temperature": 0.5,
                    "stream": False, "top_k": 3, "top_p": 0.9, "chat_template_kwargs": {"a": 1}, "unknown": 1})
    assert orjson.dumps(chat) == (b'{"messages":[{"role":"system","content":"Be brief."},'
                                  b'{"role":"user","content":"Hi"}],"max_tokens":4096,"temperature":0.5,"top_p":0.9,"top_k":3,"stream":false,'
                                  b'"chat_template_kwargs":{"a":1}}')


def test_every_key_in_its_place() -> None:
    chat = to_chat({"metadata": {"user_id": "u1"}, "thinking": {"type": "enabled"}, "stream": True,
                    "max_tokens": 9, "stop_sequences": ["x"], "tool_choice": {"type": "auto"}, "tools": [],
                    "messages": [USER]})
    assert list(chat) == ["messages", "tools", "tool_choice", "stop", "max_tokens", "stream",
                          "thinking_budget_tokens", "__metadata_user_id"]


def test_a_system_array_keeps_only_its_text_blocks_and_a_system_of_another_type_is_empty() -> None:
    blocks = [{"type": "text", "text": "A. "}, {"type": "image", "text": "no"}, {"type": "text", "text": 5},
              "junk", {"type": "text", "text": "B.", "cache_control": {"type": "ephemeral"}}]
    assert chat_of(system=blocks)["messages"][0] == {"role": "system", "content": "A. B."}
    assert chat_of(system={"text": "x"})["messages"][0] == {"role": "system", "content": ""}
    assert chat_of(system="")["messages"][0] == {"role": "system", "content": ""}
    assert chat_of(system=None)["messages"] == [USER]


@pytest.mark.parametrize(("system", "expected"), [
    ("x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code.",
     "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=fffff;You are Claude Code."),
    ("x-anthropic-billing-header: cch=éabc;rest", "x-anthropic-billing-header: cch=fffff;rest"),  # 5 bytes, 4 letters
    ("x-anthropic-billing-header: cch=abcd;rest", "x-anthropic-billing-header: cch=abcd;rest"),
    ("x-anthropic-billing-header: cch=abcde", "x-anthropic-billing-header: cch=abcde"),
    ("x-anthropic-billing-header: no stamp", "x-anthropic-billing-header: no stamp"),
    ("Claude. x-anthropic-billing-header: cch=a5145;", "Claude. x-anthropic-billing-header: cch=a5145;"),
])
def test_the_billing_stamp_is_blanked_as_llama_server_does_in_bytes(system: str, expected: str) -> None:
    assert chat_of(system=system)["messages"][0]["content"] == expected
    assert chat_of(system=[{"type": "text", "text": system}])["messages"][0]["content"] == expected


def test_without_messages_the_request_is_refused() -> None:
    with pytest.raises(BadRequest, match="'messages' is required"):
        to_chat({"system": "x"})
    with pytest.raises(BadRequest):
        to_chat([USER])  # type: ignore[arg-type]
    assert to_chat({"messages": "x", "system": "s"})["messages"] == [{"role": "system", "content": "s"}]


def test_messages_that_are_not_block_lists_pass_as_they_are() -> None:
    plain = {"role": "user", "content": "Hi", "name": "bob"}
    nulled = {"role": "user", "content": None}
    odd = ["junk", {"role": "user"}, {"role": "assistant"}, plain, nulled, {"role": "user", "content": {"a": 1}}]
    assert to_chat({"messages": odd})["messages"] == ["junk", {"role": "user"}, plain, nulled, odd[-1]]
    assert to_chat({"messages": odd})["messages"][2] is plain


def test_text_and_image_blocks() -> None:
    content = [
        {"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
        {"type": "image", "source": {"type": "base64", "data": "BBB"}},
        {"type": "image", "source": {"type": "base64", "media_type": 7, "data": "CCC"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
        {"type": "image", "source": {"type": "file", "file_id": "f"}},
        {"type": "image"},
        {"type": "document", "source": {}},
        "junk",
    ]
    assert to_chat({"messages": [{"role": "user", "content": content}]})["messages"] == [{"role": "user", "content": [
        content[0],
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBB"}},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,CCC"}},
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
    ]}]


def test_a_message_of_unknown_blocks_only_is_dropped() -> None:
    assert to_chat({"messages": [{"role": "user", "content": [{"type": "document"}]},
                                 {"role": "user", "content": []}]})["messages"] == []


def test_tool_use_becomes_tool_calls_with_arguments_dumped_as_nlohmann_does() -> None:
    msg = {"role": "assistant", "extra": 1, "content": [
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1.0, "a": [1e16, "é"], "c": None}},
        {"type": "tool_use", "id": "t2", "name": "g", "input": None},
        {"type": "tool_use", "name": "h", "input": [1]},
        {"type": "tool_use", "id": 5}]}
    assert to_chat({"messages": [msg]})["messages"] == [{"role": "assistant", "content": [msg["content"][0]],
                                                          "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"b":1.0,"a":[1e+16,"é"],"c":null}'}},
        {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        {"id": "", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
        {"id": "", "type": "function", "function": {"name": "", "arguments": "{}"}}]}]


def test_tool_use_alone_gets_empty_content() -> None:
    msg = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
    assert to_chat({"messages": [msg]})["messages"] == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_tool_results_follow_their_message() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "u"}}
    msg = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "x"}, {"type": "text"},
                                                                 {"type": "text", "text": "y"}, {"type": "other"}]},
        {"type": "tool_result", "tool_use_id": "c", "content": [{"type": "text", "text": "see"}, image,
                                                                 {"type": "image", "source": {"type": "?"}}]},
        {"type": "tool_result", "tool_use_id": "d"},
        {"type": "tool_result", "content": 42},
        {"type": "text", "text": "And now?"}]}
    assert to_chat({"messages": [msg]})["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "xy"},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "see"},
                                                          {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "tool", "tool_call_id": "d", "content": ""},
        {"role": "tool", "tool_call_id": "", "content": ""}]


def test_a_message_of_tool_results_only_is_its_tool_messages() -> None:
    msg = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "x"}]}
    assert to_chat({"messages": [msg]})["messages"] == [{"role": "tool", "tool_call_id": "a", "content": "x"}]


def test_thinking_blocks_become_reasoning_content() -> None:
    msg = {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm. ", "signature": "s"},
                                            {"type": "redacted_thinking", "data": "x"},
                                            {"type": "thinking", "thinking": "Yes."}, {"type": "text", "text": "A"}]}
    assert to_chat({"messages": [msg]})["messages"] == [
        {"role": "assistant", "content": [{"type": "text", "text": "A"}], "reasoning_content": "Hm. Yes."}]
    alone = {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm."}]}
    assert to_chat({"messages": [alone]})["messages"] == [
        {"role": "assistant", "content": "", "reasoning_content": "Hm."}]


def test_tools_become_functions() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "number"}}}
    tools = [{"name": "f", "description": "does f", "input_schema": schema}, {"name": "g"},
             {"name": "h", "input_schema": None}, "junk"]
    assert chat_of(tools=tools)["tools"] == [
        {"type": "function", "function": {"name": "f", "description": "does f", "parameters": schema}},
        {"type": "function", "function": {"name": "g", "description": "", "parameters": {}}},
        {"type": "function", "function": {"name": "h", "description": "", "parameters": None}},
        {"type": "function", "function": {"name": "", "description": "", "parameters": {}}}]
    assert "tools" not in chat_of(tools={"name": "f"})


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "tool", "name": "f"}, "required"),
    ({"type": "none"}, None), ("auto", None), ({}, None)])
def test_tool_choice(choice: Any, expected: str | None) -> None:
    assert chat_of(tool_choice=choice).get("tool_choice") == expected


def test_stop_sequences_max_tokens_and_passed_keys_are_taken_as_they_are() -> None:
    chat = chat_of(stop_sequences=None, max_tokens=None, temperature=None, top_p="x")
    assert (chat["stop"], chat["max_tokens"], chat["temperature"], chat["top_p"]) == (None, None, None, "x")
    assert chat_of(stop_sequences=["a", ""])["stop"] == ["a", ""]
    assert "stop" not in chat_of()


@pytest.mark.parametrize(("thinking", "budget"), [
    ({"type": "enabled", "budget_tokens": 2048}, 2048), ({"type": "enabled"}, 10000),
    ({"type": "enabled", "budget_tokens": None}, 10000), ({"type": "enabled", "budget_tokens": "9"}, 10000),
    ({"type": "enabled", "budget_tokens": 5.9}, 5), ({"type": "enabled", "budget_tokens": -5.9}, -5),
    ({"type": "enabled", "budget_tokens": True}, 1), ({"type": "enabled", "budget_tokens": 2**32 + 7}, 7),
    ({"type": "enabled", "budget_tokens": 2**31}, -2**31), ({"type": "enabled", "budget_tokens": 1e12}, -2**31),
    ({"type": "disabled", "budget_tokens": 5}, None), ({"type": "adaptive"}, None), (None, None), ("enabled", None)])
def test_thinking_budget_follows_json_value_int(thinking: Any, budget: int | None) -> None:
    assert chat_of(thinking=thinking).get("thinking_budget_tokens") == budget


@pytest.mark.parametrize(("metadata", "user"), [
    ({"user_id": "u-1"}, "u-1"), ({"user_id": ""}, None), ({"user_id": 5}, None), ("u", None), (None, None)])
def test_metadata_user_id(metadata: Any, user: str | None) -> None:
    assert chat_of(metadata=metadata).get("__metadata_user_id") == user


def test_chat_request_asks_for_timings_in_a_stream_and_verbose_with_stop_strings() -> None:
    base = {"model": "claude-x", "messages": [USER]}
    assert chat_request(base) == {**to_chat(base), "model": "claude-x"}
    stream = chat_request({**base, "stream": True})
    assert stream["timings_per_token"] is True and "verbose" not in stream
    assert "timings_per_token" not in chat_request({**base, "stream": 1})
    assert chat_request({**base, "stop_sequences": ["x"]})["verbose"] is True
    assert chat_request({**base, "stop_sequences": None})["verbose"] is True
    assert chat_request(base, server_stops=True)["verbose"] is True
    assert "model" not in chat_request({"model": 5, "messages": [USER]})


# ---- the JSON answer ----

@pytest.mark.parametrize("name", ANSWERS)
def test_recorded_answers_are_llama_servers_bytes(name: str) -> None:
    case = RECORDED[name]
    assert dumps(answer(orjson.loads(case["chat"]), case["body"])).encode() == case["messages"].encode()


def chat_answer(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish, "index": 0, "message": {"role": "assistant", **message}}],
            "created": 1, "model": "m", "object": "chat.completion",
            "usage": {"completion_tokens": 7, "prompt_tokens": 30, "total_tokens": 37,
                      "prompt_tokens_details": {"cached_tokens": 12}}, "id": "chatcmpl-1", **extra}


def test_blocks_come_thinking_text_tools_and_a_tool_input_is_parsed_or_empty() -> None:
    message = {"content": "Sure.", "reasoning_content": "Hm.", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"x": 1.5e20, "y": "é"}'}, "id": "c1"},
        {"type": "function", "function": {"name": "g", "arguments": "{not json"}, "id": "c2"},
        {"type": "function", "function": {"name": "h", "arguments": "\ufeff[1]"}},
        {"type": "function", "function": {"name": "i", "arguments": ""}, "id": "c4"}]}
    got = answer(chat_answer(message, "tool_calls", timings={"cache_n": 12}))
    assert dumps(got) == (
        '{"id":"chatcmpl-1","type":"message","role":"assistant","content":['
        '{"type":"thinking","thinking":"Hm.","signature":""},{"type":"text","text":"Sure."},'
        '{"type":"tool_use","id":"c1","name":"f","input":{"x":1.5e+20,"y":"é"}},'
        '{"type":"tool_use","id":"c2","name":"g","input":{}},{"type":"tool_use","id":"","name":"h","input":[1]},'
        '{"type":"tool_use","id":"c4","name":"i","input":{}}],"model":"m","stop_reason":"tool_use",'
        '"stop_sequence":null,"usage":{"cache_read_input_tokens":12,"input_tokens":18,"output_tokens":7}}')


@pytest.mark.parametrize(("finish", "reason"), [("stop", "end_turn"), ("tool_calls", "tool_use"),
                                                ("length", "max_tokens")])
def test_stop_reasons(finish: str, reason: str) -> None:
    assert answer(chat_answer({"content": "x"}, finish))["stop_reason"] == reason


def test_the_stop_sequence_comes_from_verbose_which_is_not_passed_on() -> None:
    got = answer(chat_answer({"content": "Bon"}, __verbose={"stopping_word": "jour", "prompt": "..."}))
    assert got["stop_sequence"] == "jour" and "__verbose" not in dumps(got)
    assert answer(chat_answer({"content": ""}, __verbose={"stopping_word": ""}))["content"] == []
    assert answer(chat_answer({"content": ""}, __verbose={"stopping_word": ""}))["stop_sequence"] is None


# ---- the stream ----

def pieces(data: bytes, sizes: list[int]) -> list[bytes]:
    out, at = [], 0
    for size in sizes:
        out.append(data[at:at + size])
        at += size
    return [*out, data[at:]]


def convert(chunks: list[bytes]) -> bytes:
    stream = MessagesStream()
    return b"".join(stream.feed(c) for c in chunks) + stream.close()


@pytest.mark.parametrize("name", STREAMS)
def test_recorded_streams_are_llama_servers_bytes_in_any_pieces(name: str) -> None:
    chat, expected = RECORDED[name]["chat"].encode(), RECORDED[name]["messages"].encode()
    assert convert([chat]) == expected
    assert convert([chat[i:i + 1] for i in range(len(chat))]) == expected
    rng = random.Random(name)
    for _ in range(20):
        assert convert(pieces(chat, [rng.randint(0, 700) for _ in range(rng.randint(1, 30))])) == expected


def test_the_recorded_cases_cover_what_they_should() -> None:
    seen = b"".join(RECORDED[name]["messages"].encode() for name in STREAMS)
    for wanted in (b'"stop_reason":"max_tokens"', b'"stop_reason":"end_turn","stop_sequence":null',
                   b'"stop_sequence":"jour"', b'"stop_reason":"tool_use"', b'"type":"input_json_delta"',
                   b'"type":"thinking_delta"', b'"type":"signature_delta"', b"event: error",
                   b'{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}'):
        assert wanted in seen, wanted
    assert RECORDED["error"]["status"] == 500


MODEL = "m.gguf"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(delta: dict[str, Any], n: int | None = None, finish: str | None = None, **extra: Any) -> bytes:
    """A chat chunk; `n` (tokens so far) makes it the last of its result, with timings."""
    obj: dict[str, Any] = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": 1,
                           "id": "chatcmpl-7", "model": MODEL, "system_fingerprint": "b1",
                           "object": "chat.completion.chunk", **extra}
    if n is not None:
        obj["timings"] = {"cache_n": 20, "prompt_n": 5, "prompt_ms": 1.5, "predicted_n": n, "predicted_ms": 2.0}
    return sse(obj)


def starts_and_deltas(raw: bytes) -> list[tuple[str, int, str]]:
    return [(name, data["index"], (data.get("content_block") or data.get("delta"))["type"])
            for name, data in events(raw) if name in ("content_block_start", "content_block_delta")]


def test_message_start_on_the_first_token_with_the_timings_usage() -> None:
    raw = convert([chunk({"role": "assistant", "content": None}) + chunk({"content": "Hi"}, 1)])
    assert raw.split(b"\n\n")[0] == (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-7","type":"message",'
        b'"role":"assistant","content":[],"model":"m.gguf","stop_reason":null,"stop_sequence":null,'
        b'"usage":{"cache_read_input_tokens":20,"input_tokens":5,"output_tokens":0}}}')


def test_message_start_comes_first_when_the_first_token_sent_nothing() -> None:
    """A first token that is half a UTF-8 character (or the start of a stop string) makes no result: llama-server's
    first one then has n == 2, and its own /v1/messages sends no message_start at all, which Anthropic's SDKs refuse
    ("Unexpected event order"). lpcache sends it with the first result that comes, and with a final result that
    comes first (an answer of one token)."""
    assert [name for name, _ in events(convert([chunk({"content": "é"}, 2)]))] == [
        "message_start", "content_block_start", "content_block_delta"]
    only_final = [name for name, _ in events(convert([chunk({"content": "Hi"}, 1, finish="length")]))]
    assert only_final[0] == "message_start" and only_final.count("message_start") == 1
    whole = convert([chunk({"content": "é"}, 2), chunk({"content": "t"}, 3), chunk({}, 3, finish="stop")])
    assert [name for name, _ in events(whole)].count("message_start") == 1


def test_a_first_result_cut_short_still_starts_with_message_start() -> None:
    """The stream breaks inside its first result (a diff came, not the chunk with its timings): what `close` turns
    it into still starts with message_start, so the client's SDK reads the error event after it."""
    stream = MessagesStream()
    assert stream.feed(chunk({"role": "assistant", "content": None}) + chunk({"content": "Hi"})) == b""
    names = [name for name, _ in events(stream.close())]
    assert names[0] == "message_start" and names.count("message_start") == 1 and "content_block_delta" in names


def test_the_final_result_starts_again_the_blocks_its_own_diffs_touch() -> None:
    """to_json_anthropic_stream keeps its own started state: text held back until the end starts a second text
    block at the same index; a tool call continued in the final result starts again, with its full id and name."""
    raw = convert([
        chunk({"role": "assistant", "content": None}) + chunk({"content": "Hi"}, 1),
        chunk({"tool_calls": [{"index": 0, "id": "call-1", "type": "function", "function": {"name": "get"}}]}, 2),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}, 3),
        chunk({"content": " there"}) + chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]})
        + chunk({}, 3, "tool_calls")])
    assert starts_and_deltas(raw) == [
        ("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"),
        ("content_block_start", 1, "tool_use"), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"),
        ("content_block_start", 1, "tool_use"), ("content_block_delta", 1, "input_json_delta")]
    final = events(raw)
    assert final[-6][1]["content_block"] == {"type": "tool_use", "id": "call-1", "name": "get"}
    assert [(n, d.get("index")) for n, d in final[-4:]] == [
        ("content_block_stop", 0), ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert final[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                            "usage": {"output_tokens": 3}}


def test_reasoning_after_text_moves_the_text_index_in_later_results() -> None:
    raw = convert([chunk({"content": "A"}, 1), chunk({"reasoning_content": "hm"}, 2), chunk({"content": "B"}, 3),
                   chunk({}, 3, "length")])
    assert starts_and_deltas(raw) == [
        ("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_delta", 0, "signature_delta")]
    assert [(n, d.get("index"), d.get("delta", {}).get("type")) for n, d in events(raw)][-4:] == [
        ("content_block_stop", 0, None),
        ("content_block_stop", 1, None), ("message_delta", None, None), ("message_stop", None, None)]


def test_a_partial_tool_call_is_numbered_after_the_text_started_and_the_reasoning() -> None:
    raw = convert([chunk({"reasoning_content": "r"}, 1),
                   chunk({"tool_calls": [{"index": 1, "id": "c", "type": "function", "function": {"name": "f"}}]}, 2),
                   chunk({"content": "x"}) + chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}, 3)])
    assert starts_and_deltas(raw) == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_start", 2, "tool_use"),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 3, "input_json_delta")]


def test_the_stop_sequence_is_the_stopping_word_of_the_final_results_verbose() -> None:
    raw = convert([chunk({"content": "Bon"}, 1),
                   chunk({}, 1, "stop", __verbose={"stopping_word": "jour", "stop_type": "word"})])
    assert events(raw)[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": "jour"}


def test_pings_pass_done_is_dropped_and_an_error_keeps_llama_servers_bytes() -> None:
    error = b'{"code":500,"message":"The model produced output that does not match \\u00e9","type":"server_error"}'
    raw = convert([b":\n\n", chunk({"content": "x"}, 1), b"data: [DONE]\n\n", b'data: {"error":' + error + b"}\n\n"])
    assert raw.startswith(b":\n\nevent: message_start\n")
    assert raw.endswith(b"\n\nevent: error\ndata: " + error + b"\n\n")
    assert b"DONE" not in raw


def test_what_is_not_a_chat_chunk_is_left_out() -> None:
    assert convert([b"data: {not json\n\n", b"data: [1]\n\n", b"event: x\n\n", chunk({"content": "x"}, 2)]) \
        == convert([chunk({"content": "x"}, 2)])


def test_usage_is_the_last_timings_read() -> None:
    stream = MessagesStream()
    stream.feed(chunk({"content": "x"}, 1) + chunk({}, 4, "length"))
    assert (stream.usage["cache_n"], stream.usage["prompt_n"], stream.usage["predicted_n"]) == (20, 5, 4)


def test_a_result_cut_short_is_converted_at_close() -> None:
    stream = MessagesStream()
    assert stream.feed(chunk({"content": "a"}) + chunk({"content": "b"})[:-1]) == b""
    assert [d["delta"]["text"] for _, d in events(stream.close()) if "delta" in d] == ["a"]
