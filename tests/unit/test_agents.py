"""lpcache.agents: seeded agent sessions in the Responses and Messages shapes (and their chat-completions form)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from lpcache.workloads import agents

SESSIONS = agents.sessions(4, steps=8, seed=3)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def every_body(sessions: list[agents.Session]) -> list[bytes]:
    return [dumps([s.responses(t), s.messages(t), s.chat(t)]) for s in sessions for t in range(s.turns)]


def test_the_same_seed_gives_the_same_bodies_and_another_seed_others() -> None:
    assert every_body(agents.sessions(4, steps=8, seed=3)) == every_body(SESSIONS)
    other = every_body(agents.sessions(4, steps=8, seed=4))
    assert not set(other) & set(every_body(SESSIONS))


def test_sessions_alternate_the_two_apis_and_have_every_turn() -> None:
    assert [s.api for s in SESSIONS] == ["responses", "messages", "responses", "messages"]
    for s in SESSIONS:
        assert s.turns == 9 and len(s.steps) == 8
        assert s.body(0) == (s.responses(0) if s.api == "responses" else s.messages(0))
        with pytest.raises(IndexError):
            s.body(s.turns)
    assert len({s.task for s in SESSIONS}) == len(SESSIONS)


def test_every_request_extends_the_previous_one_in_each_shape() -> None:
    for s in SESSIONS:
        for turn in range(1, s.turns):
            before, after = s.responses(turn - 1), s.responses(turn)
            assert after["input"][:len(before["input"])] == before["input"]
            added = after["input"][len(before["input"]):]
            assert [i["type"] for i in added] == (["function_call"] * len(s.steps[turn - 1])
                                                  + ["function_call_output"] * len(s.steps[turn - 1]))
            assert {k: v for k, v in after.items() if k != "input"} == {k: v for k, v in before.items()
                                                                        if k != "input"}
            before, after = s.messages(turn - 1), s.messages(turn)
            assert after["messages"][:len(before["messages"])] == before["messages"]
            assert [m["role"] for m in after["messages"][len(before["messages"]):]] == ["assistant", "user"]
            for api in agents.APIS:
                before, after = s.chat(turn - 1, api), s.chat(turn, api)
                assert after["messages"][:len(before["messages"])] == before["messages"]


def test_every_session_shares_one_harness_in_both_shapes() -> None:
    harness = SESSIONS[0].harness
    assert all(s.harness == harness for s in SESSIONS)
    assert {dumps((s.responses(t)["instructions"], s.responses(t)["tools"])) for s in SESSIONS
            for t in range(s.turns)} == {dumps((harness.system, harness.responses_tools()))}
    assert {dumps((s.messages(t)["system"], s.messages(t)["tools"])) for s in SESSIONS
            for t in range(s.turns)} == {dumps((harness.system, harness.messages_tools()))}
    names = [t["name"] for t in harness.messages_tools()]
    assert names == ["read_file", "write_file", "apply_patch", "run_shell", "search_code", "list_dir",
                     "glob_files", "todo_write"]
    for tool in harness.tools:
        assert tool.parameters["type"] == "object" and set(tool.parameters["required"]) <= set(
            tool.parameters["properties"])
        assert len(tool.description.split()) >= 30   # long descriptions, as agents write them


def test_tool_call_ids_match_their_outputs() -> None:
    for s in SESSIONS:
        last = s.turns - 1
        items = s.responses(last)["input"]
        calls = [i["call_id"] for i in items if i["type"] == "function_call"]
        outputs = [i["call_id"] for i in items if i["type"] == "function_call_output"]
        assert calls == outputs and len(set(calls)) == len(calls) == sum(len(step) for step in s.steps)
        assert all(c.startswith("call_") for c in calls)
        messages = s.messages(last)["messages"]
        for use, result in zip(messages[1::2], messages[2::2], strict=True):
            assert use["role"] == "assistant" and result["role"] == "user"
            assert [b["id"] for b in use["content"]] == [b["tool_use_id"] for b in result["content"]]
            assert all(b["id"].startswith("toolu_") for b in use["content"])
        chat = s.chat(last)["messages"]
        for i, m in enumerate(chat):
            if m["role"] == "tool":
                owner = next(c for c in reversed(chat[:i]) if c["role"] == "assistant")
                assert m["tool_call_id"] in [c["id"] for c in owner["tool_calls"]]


def test_tool_calls_name_a_harness_tool_with_valid_arguments_and_the_same_call_in_every_shape() -> None:
    tools = {t.name: t.parameters for t in SESSIONS[0].harness.tools}
    for s in SESSIONS:
        for turn in range(1, s.turns):
            calls = s.steps[turn - 1]
            responses = [i for i in s.responses(turn)["input"] if i["type"] == "function_call"][-len(calls):]
            uses = s.messages(turn)["messages"][-2]["content"]
            for call, item, use in zip(calls, responses, uses, strict=True):
                schema = tools[call.name]
                assert set(schema["required"]) <= set(call.arguments) <= set(schema["properties"])
                assert item["name"] == use["name"] == call.name
                assert json.loads(item["arguments"]) == use["input"] == call.arguments
                assert isinstance(call.output, str) and call.output


def test_tool_results_look_like_real_tool_output() -> None:
    outputs = [c.output for s in agents.sessions(8, steps=8, seed=1) for step in s.steps for c in step]
    text = "\n".join(outputs)
    assert any(not ch.isascii() for ch in text)                 # Unicode in code, logs and messages
    assert sum(ch in "{}()[];:=<>\"'`|" for ch in text) > len(text) / 40
    assert "exit code:" in text and "\t" in text                # shell output, numbered file lines
    assert max(len(o) for o in outputs) > 500 and len({c.name for s in SESSIONS for st in s.steps for c in st}) >= 5


def test_request_options_are_small_generations_of_the_api_in_question() -> None:
    s = SESSIONS[0]
    r = s.responses(2, max_tokens=8, stream=True)
    assert (r["max_output_tokens"], r["stream"], r["temperature"]) == (8, True, 0)
    assert r["tools"][0]["type"] == "function" and "parameters" in r["tools"][0]
    m = s.messages(2, max_tokens=8)
    assert (m["max_tokens"], m["stream"], m["temperature"]) == (8, False, 0)
    assert "input_schema" in m["tools"][0] and "type" not in m["tools"][0]
