"""The agent routes of the stand-in against llama-server b11434 (SmolLM2-135M, -np 2): the same requests to both,
the same shapes back (keys and value types, event names and order, usage fields), not the same text.

Then the cache figures, checked alike on both: a Responses request keeps its `id_slot`, an Anthropic one loses it
and goes where its prefix is; usage splits the prompt into the cached part (`cache_n`) and the rest (`prompt_n`).
SmolLM2 has no fill-in-the-middle tokens, so `/infill` is compared with a stand-in started with `fim=False`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from lpcache.mock_llama import MockConfig, start_mock
from lpcache.workloads.harness import LlamaServer, story

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful reader. Answer briefly."
QUESTION = "Name three colours of the rainbow."
NAMES = ("real", "mock")

Shape = Any
# A new connection per request: llama-server closes a keep-alive connection idle for 5 s, and a reused closed one
# fails the request.
FRESH_CONNECTIONS = httpx.Limits(max_keepalive_connections=0)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """The real server (2 slots of 2048 tokens, no RAM prompt cache) and a stand-in like it."""
    with LlamaServer(n_slots=2, ctx=4096, cache_ram=0) as real, \
            start_mock(MockConfig(slots=2, n_ctx=2048, fim=False)) as mock:
        yield {"real": real.url, "mock": mock.url}


def shape(value: Any, opaque: frozenset[str] = frozenset()) -> Shape:
    """Keys and value types; a list is the distinct shapes of its items, in order; keys in `opaque` keep only
    their type (the stand-in's `generation_settings` is a small subset of the real one)."""
    if isinstance(value, dict):
        return {k: type(v).__name__ if k in opaque else shape(v, opaque) for k, v in value.items()}
    if isinstance(value, list):
        out: list[Shape] = []
        for item in (shape(v, opaque) for v in value):
            if item not in out:
                out.append(item)
        return out
    return type(value).__name__


def on_both(servers: dict[str, str], ask: Callable[[httpx.Client], Any]) -> dict[str, Any]:
    results = {}
    for name in NAMES:
        with httpx.Client(base_url=servers[name], timeout=120, limits=FRESH_CONNECTIONS) as c:
            results[name] = ask(c)
    return results


def same_shape(results: dict[str, Any], opaque: frozenset[str] = frozenset()) -> None:
    assert shape(results["mock"], opaque) == shape(results["real"], opaque), results


def post(c: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = c.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def events(c: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A named-event stream as (event, data) pairs; any other line (an unnamed event, `[DONE]`) fails."""
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    out = []
    for block in raw.split("\n\n"):
        if block:
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), block
            out.append((name[len("event: "):], orjson.loads(data[len("data: "):])))
    return out


def event_names(stream: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Event names with runs of one name (the deltas: their number depends on the text) counted once."""
    names: list[str] = []
    for name, _ in stream:
        if not names or names[-1] != name:
            names.append(name)
    return names


def event_shapes(stream: list[tuple[str, dict[str, Any]]]) -> dict[str, Shape]:
    return {name: shape([data for n, data in stream if n == name]) for name, _ in stream}


def test_responses_answers_have_the_real_shape(servers: dict[str, str]) -> None:
    body = {"instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 4, "temperature": 0, "id_slot": 1}
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks!"}]}]
    answers = on_both(servers, lambda c: [post(c, "/v1/responses", body),
                                          post(c, "/responses", {**body, "input": items})])
    same_shape(answers)
    assert all("timings" not in a for a in answers["real"] + answers["mock"])

    streams = on_both(servers, lambda c: events(c, "/v1/responses", body))
    assert event_names(streams["mock"]) == event_names(streams["real"]) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert event_shapes(streams["mock"]) == event_shapes(streams["real"])
    for stream in streams.values():
        assert "timings" in stream[-1][1] and all("timings" not in data for _, data in stream[:-1])

    refused = on_both(servers, lambda c: [post(c, "/v1/responses", {"model": "m"}, 400),
                                          post(c, "/v1/responses", {"input": [{"type": "mystery"}]}, 400)])
    assert refused["mock"] == refused["real"]


def test_anthropic_answers_have_the_real_shape(servers: dict[str, str]) -> None:
    body = {"system": [{"type": "text", "text": SYSTEM}], "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]}
    tools = {**body, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}
    answers = on_both(servers, lambda c: [post(c, "/v1/messages", body), post(c, "/v1/messages", tools)])
    same_shape(answers)

    streams = on_both(servers, lambda c: events(c, "/v1/messages", body))
    assert event_names(streams["mock"]) == event_names(streams["real"]) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert event_shapes(streams["mock"]) == event_shapes(streams["real"])

    refused = on_both(servers, lambda c: post(c, "/v1/messages", {"system": "s"}, 500))
    assert refused["mock"] == refused["real"]


def test_token_counting_routes_have_the_real_shape(servers: dict[str, str]) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    counts = on_both(servers, lambda c: [
        post(c, "/v1/chat/completions/input_tokens", {"messages": messages}),
        post(c, "/v1/responses/input_tokens", {"input": QUESTION}),
        post(c, "/responses/input_tokens", {"input": messages}),
        post(c, "/v1/messages/count_tokens", {"messages": messages}),
    ])
    same_shape(counts)
    for found in counts.values():
        assert len({c["input_tokens"] for c in found}) == 1  # one conversation, four ways of sending it


def test_responses_keep_id_slot_and_anthropic_drops_it(servers: dict[str, str]) -> None:
    """Slot 0 holds a long conversation, slot 1 another one. Sent pinned to slot 1, its follow-up is computed
    almost from scratch as a Responses request, and read from slot 0's cache as an Anthropic one."""
    long_question = story(7, 300) + "\nWho is in this story?"
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": long_question}]
    other = [{"role": "system", "content": "Reply in French."}, {"role": "user", "content": story(8, 300)}]

    def ask(c: httpx.Client) -> tuple[int, int, int]:
        primed = post(c, "/v1/chat/completions", {"messages": first, "max_tokens": 4, "temperature": 0, "id_slot": 0})
        post(c, "/v1/chat/completions", {"messages": other, "max_tokens": 4, "temperature": 0, "id_slot": 1})
        reply = primed["choices"][0]["message"]["content"]
        follow = [{"role": "user", "content": long_question}, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "Where does it happen?"}]
        message = post(c, "/v1/messages", {"system": SYSTEM, "messages": follow, "max_tokens": 4, "temperature": 0,
                                           "id_slot": 1})
        items = [{**m, "type": "message"} if m["role"] == "assistant" else m for m in follow]
        response = post(c, "/v1/responses", {"instructions": SYSTEM, "input": items, "max_output_tokens": 4,
                                              "temperature": 0, "id_slot": 1})
        return (primed["usage"]["prompt_tokens"], message["usage"]["cache_read_input_tokens"],
                response["usage"]["input_tokens_details"]["cached_tokens"])

    for name, (n_first, anthropic_cached, responses_cached) in on_both(servers, ask).items():
        assert anthropic_cached >= n_first, name  # went to slot 0, where the conversation is
        assert responses_cached < n_first // 10, name  # stayed on slot 1, which shares only the template's start


def test_usage_splits_the_prompt_as_the_cache_did(servers: dict[str, str]) -> None:
    question = story(9, 200) + "\nSummarise."

    def ask(c: httpx.Client) -> dict[str, Any]:
        body = {"input": question, "max_output_tokens": 4, "temperature": 0, "id_slot": 1}
        first = post(c, "/v1/responses", body)
        reply = first["output"][0]["content"][0]["text"]
        turn = [{"role": "user", "content": question},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": reply}]},
                {"role": "user", "content": "Shorter."}]
        done = events(c, "/v1/responses", {**body, "input": turn})[-1][1]
        anthropic_turn = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply},
                                       {"role": "user", "content": "Shorter."}], "max_tokens": 4, "temperature": 0}
        start = events(c, "/v1/messages", anthropic_turn)[0][1]["message"]["usage"]
        counted = post(c, "/v1/messages/count_tokens", anthropic_turn)["input_tokens"]
        return {"first": first["usage"]["input_tokens"], "done": done, "start": start, "counted": counted}

    for name, found in on_both(servers, ask).items():
        usage, timings = found["done"]["response"]["usage"], found["done"]["timings"]
        assert usage["input_tokens_details"]["cached_tokens"] == timings["cache_n"] >= found["first"], name
        assert usage["input_tokens"] == timings["cache_n"] + timings["prompt_n"], name
        start = found["start"]
        assert start["cache_read_input_tokens"] >= found["first"], name
        assert start["cache_read_input_tokens"] + start["input_tokens"] == found["counted"], name


def test_completions_take_token_ids_and_honour_id_slot(servers: dict[str, str]) -> None:
    text = "The capital of France is a city on the Seine, and its name is"

    def ask(c: httpx.Client) -> dict[str, Any]:
        ids = post(c, "/tokenize", {"content": text})["tokens"]
        more = post(c, "/tokenize", {"content": " famous. Tell me more"})["tokens"]
        return {
            "ids": ids,
            "native": post(c, "/completion", {"prompt": ids, "n_predict": 3, "id_slot": 1, "temperature": 0}),
            "again": post(c, "/completions", {"prompt": [ids + more], "n_predict": 3, "id_slot": 1}),
            "mixed": post(c, "/completion", {"prompt": [text, *more], "n_predict": 3, "id_slot": 1}),
            "oai": post(c, "/v1/completions", {"prompt": ids, "max_tokens": 3, "id_slot": 0}),
        }

    found = on_both(servers, ask)
    same_shape({name: {k: v for k, v in answers.items() if k != "ids"} for name, answers in found.items()},
               opaque=frozenset({"generation_settings"}))
    for name, answers in found.items():
        n = len(answers["ids"])
        assert answers["native"]["id_slot"] == answers["again"]["id_slot"] == 1, name
        assert answers["native"]["tokens_evaluated"] == n, name
        assert answers["again"]["timings"]["cache_n"] >= n, name  # the pinned slot held the ids
        assert answers["mixed"]["timings"]["cache_n"] >= n, name
        assert answers["oai"]["usage"]["prompt_tokens"] == n, name


def test_infill_without_fim_tokens_is_the_real_501(servers: dict[str, str]) -> None:
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "prompt": "return", "n_predict": 3,
            "input_extra": [{"filename": "util.py", "text": "x = 1\n"}], "id_slot": 1}
    answers = on_both(servers, lambda c: post(c, "/infill", body, 501))
    assert answers["mock"] == answers["real"]
    assert answers["real"]["error"]["type"] == "not_supported_error"


def test_the_official_sdks_read_both(servers: dict[str, str]) -> None:
    """What agents run: OpenAI's and Anthropic's own clients get whole answers from both, streamed or not.
    (OpenAI's `responses.stream()` helper fails on both: b11434's events carry no `output_index`/`content_index`.)"""
    for name, url in servers.items():
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        request: dict[str, Any] = {"model": "m", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 4,
                                   "temperature": 0}
        whole = oai.responses.create(**request)
        assert whole.output_text and whole.usage is not None and whole.usage.input_tokens > 0, name
        with oai.responses.create(**request, stream=True) as stream:
            seen = list(stream)
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        completed = seen[-1]
        assert completed.type == "response.completed" and completed.response.output_text == text, name
        assert completed.response.usage is not None and completed.response.usage.output_tokens > 0, name

        cold = {"temperature": 0}  # this SDK takes no temperature argument
        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        message = claude.messages.create(model="m", system=SYSTEM, max_tokens=4, extra_body=cold,
                                         messages=[{"role": "user", "content": QUESTION}])
        assert message.content and message.content[0].type == "text" and message.usage.output_tokens > 0, name
        with claude.messages.stream(model="m", system=SYSTEM, max_tokens=4, extra_body=cold,
                                    messages=[{"role": "user", "content": QUESTION}]) as message_stream:
            text = "".join(message_stream.text_stream)
            final = message_stream.get_final_message()
        assert text and final.content[0].type == "text" and final.content[0].text == text, name
        assert final.usage.output_tokens > 0, name
