"""The stand-in llama-server keeps the reference contract that lpcache's tests rely on.

Servers run in-process (``start_mock``) on free ports. Tests synchronise on events (the
first SSE chunk, ``/mock/wait-idle``), never on sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from lpcache.mock_llama import MockConfig, MockHandle, create_app
from lpcache.mock_llama.__main__ import build_parser, config_from
from lpcache.mock_llama.faults import Faults
from lpcache.mock_llama.slotfile import SlotFileError, decode, encode, is_valid_filename
from lpcache.mock_llama.slots import Slot, choose_slot, wrap_slot_id
from lpcache.mock_llama.tokens import lcp, render_chat, reply_stream, tokenize
from lpcache.workloads import chats

from .conftest import MakeMock

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Tell me about the cache, please."}]



@pytest.fixture
def mock(make_mock: MakeMock) -> MockHandle:
    return make_mock()


@pytest.fixture
async def client(mock: MockHandle) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        yield c


def prompt_len(messages: list[dict[str, Any]]) -> int:
    return len(tokenize(render_chat(messages)))


async def read_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] async for line in response.aiter_lines() if line.startswith("data: ")]


async def wait_idle(c: httpx.AsyncClient, slot: int | None = None) -> None:
    params = {"timeout": "5"} if slot is None else {"slot": str(slot), "timeout": "5"}
    r = await c.get("/mock/wait-idle", params=params)
    assert r.json() == {"idle": True}


# --- pure logic -------------------------------------------------------------------------


def test_tokenizer_and_template() -> None:
    assert tokenize("Hi, there!  x_1") == ["Hi", ",", "there", "!", "x_1"]
    parts = [{"type": "text", "text": "a "}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "b"}]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]
    assert render_chat(messages) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na b<|im_end|>\n<|im_start|>assistant\n"
    )


def test_reply_is_deterministic_per_prompt() -> None:
    def first(prompt: list[str], n: int = 8) -> list[str]:
        stream = reply_stream(prompt)
        return [next(stream) for _ in range(n)]

    assert first(["a", "b"]) == first(["a", "b"])
    assert first(["a", "b"]) != first(["a", "c"])


def test_lcp_and_slot_ids() -> None:
    assert lcp(["a", "b", "c"], ["a", "b", "x"]) == 2
    assert lcp([], ["a"]) == 0
    assert [wrap_slot_id(i, 4) for i in (0, 5, -1, -4, -5)] == [0, 1, None, 0, None]


def test_choose_slot_prefers_similar_then_lru() -> None:
    a, b, c = Slot(0, 100), Slot(1, 100), Slot(2, 100)
    a.tokens, a.t_last_used = ["x", "y", "z"], 5
    b.tokens, b.t_last_used = ["p", "q"], 3
    c.t_last_used = 4
    assert choose_slot([a, b, c], ["x", "y", "w"]) == 0  # similarity 2/3
    assert choose_slot([a, b, c], ["m", "n"]) == 1  # no match: least recently used
    a.claims = 1
    assert choose_slot([a, b, c], ["x", "y", "w"]) == 1  # busy slots are never chosen
    b.claims = c.claims = 1
    assert choose_slot([a, b, c], ["x"]) is None


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "a..b", "a/b", "a\\b", "a:b", "a*b", "a?b", 'a"b', "a<b", "a>b", "a|b", " a", "a ", "a.", "a\x01b",
     "a\x7fb", "a\u0085b", "a\ufeffb", "a\u2215b", "x" * 256],
)  # fmt: skip
def test_invalid_filenames(name: str) -> None:
    assert not is_valid_filename(name)


@pytest.mark.parametrize("name", ["slot.bin", "a.b.c", "x" * 255, "ünï-code_1", ".hidden"])
def test_valid_filenames(name: str) -> None:
    assert is_valid_filename(name)


def test_slot_file_round_trip() -> None:
    data = encode(["a", "<", "b"])
    assert data.startswith(b"GGSQ")
    assert decode(data) == ["a", "<", "b"]
    for bad in (b"", b"XXXX\x01\x00\x00\x00[]", data[:-1], data[:8] + b'{"a":1}'):
        with pytest.raises(SlotFileError):
            decode(bad)


def test_faults_count_down_and_validate() -> None:
    faults = Faults()
    faults.update({"status": 503, "status_count": 2})
    assert [faults.take_status() for _ in range(3)] == [503, 503, None]
    faults.update({"status": 500})
    assert [faults.take_status() for _ in range(3)] == [500, 500, 500]  # count -1: every request
    with pytest.raises(ValueError, match="unknown fault"):
        faults.update({"nope": 1})
    with pytest.raises(ValueError):
        faults.update({"drop": -1})


def test_cli_flags_make_a_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["9000", "m", "--slots", "3", "--slot-save-path", str(tmp_path), "--n-ctx", "64", "--faults", '{"drop": 1}']
    )
    config = config_from(args)
    assert (config.port, config.model, config.slots, config.n_ctx) == (9000, "m", 3, 64)
    assert config.faults == {"drop": 1}
    with pytest.raises(ValueError):
        config_from(build_parser().parse_args(["1", "m", "--faults", "[1]"]))


# --- info endpoints ---------------------------------------------------------------------


async def test_health_models_props_in_process() -> None:
    app = create_app(MockConfig(model="m1", slots=3, n_ctx=512))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as c:
        assert (await c.get("/health")).json() == {"status": "ok"}
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        model = models["data"][0]
        assert (model["id"], model["object"], model["owned_by"]) == ("m1", "model", "llamacpp")
        assert isinstance(model["created"], int)
        props = (await c.get("/props")).json()
        assert props["total_slots"] == 3 and props["model_alias"] == "m1"
        assert props["default_generation_settings"]["n_ctx"] == 512
        assert props["build_info"] == "mock" and props["role"] == "model"
        r = await c.get("/no/such/route")
        assert r.status_code == 404
        assert r.json() == {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}


async def test_slots_listing(client: httpx.AsyncClient) -> None:
    slots = (await client.get("/slots")).json()
    assert [s["id"] for s in slots] == [0, 1]
    assert slots[0] == {"id": 0, "n_ctx": 8192, "speculative": False, "is_processing": False}
    await client.post(CHAT, json={"messages": USER, "id_slot": 1, "max_tokens": 3})
    slot = (await client.get("/slots")).json()[1]
    assert slot["n_prompt_tokens"] == prompt_len(USER) + 3 - 1
    assert slot["next_token"][0]["n_decoded"] == 3 and "id_task" in slot


# --- chat ---------------------------------------------------------------------------------


async def test_chat_json_answer(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json={"messages": USER, "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "test-model"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    n = prompt_len(USER)
    assert body["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 5,
        "total_tokens": n + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    timings = body["timings"]
    assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == (0, n, 5)
    assert {"prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms"} <= timings.keys()
    again = (await client.post("/chat/completions", json={"messages": USER, "max_tokens": 5})).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


async def test_prefix_reuse_on_pinned_slot(client: httpx.AsyncClient) -> None:
    first = (await client.post(CHAT, json={"messages": USER, "id_slot": 0, "max_tokens": 4})).json()
    reply = first["choices"][0]["message"]["content"]
    follow_up = [*USER, {"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
    second = (await client.post(CHAT, json={"messages": follow_up, "id_slot": 0, "max_tokens": 4})).json()
    # The slot held prompt + 3 of the 4 answer tokens (the last one is never decoded).
    assert second["timings"]["cache_n"] == prompt_len(USER) + 3
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_len(USER) + 3
    assert second["timings"]["prompt_n"] == prompt_len(follow_up) - prompt_len(USER) - 3
    same = (await client.post(CHAT, json={"messages": follow_up, "id_slot": 2, "max_tokens": 4})).json()
    assert same["timings"]["cache_n"] == prompt_len(follow_up) - 1  # id 2 wraps to slot 0
    assert same["timings"]["prompt_n"] == 1  # at least one token is always evaluated
    fresh = (await client.post(CHAT, json={"messages": follow_up, "id_slot": 0, "cache_prompt": False})).json()
    assert fresh["timings"]["cache_n"] == 0
    stats = (await client.get("/mock/stats")).json()
    assert stats["chat_by_slot"] == {"0": 4} and stats["max_concurrent_per_slot"] == 1


async def test_unpinned_requests_follow_similarity_then_lru(client: httpx.AsyncClient) -> None:
    # Plain prompts: chat prompts all share the template's opening tokens, which is
    # enough similarity (above 0.1) to pull every conversation into the same slot.
    first, other = "the quick brown fox jumps", "lorem ipsum dolor sit amet"
    r1 = (await client.post("/completion", json={"prompt": first})).json()
    r2 = (await client.post("/completion", json={"prompt": other})).json()
    r3 = (await client.post("/completion", json={"prompt": first})).json()
    assert r1["id_slot"] != r2["id_slot"]  # no similarity: the least recently used slot
    assert r3["id_slot"] == r1["id_slot"] and r3["timings"]["cache_n"] == 5 - 1
    assert r3["tokens_cached"] == 5 + 16 - 1


async def test_chat_errors(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    bodies: list[dict[str, Any]] = [{}, {"messages": []}, {"messages": "hi"}, {"messages": [{"content": "no role"}]}]
    for body in bodies:
        r = await client.post(CHAT, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400


async def test_prompt_longer_than_context(make_mock: MakeMock) -> None:
    mock = make_mock(n_ctx=10)
    async with httpx.AsyncClient(base_url=mock.url) as c:
        r = await c.post(CHAT, json={"messages": USER})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["code"] == 400 and error["n_ctx"] == 10


async def test_sse_event_order(client: httpx.AsyncClient) -> None:
    body = {"messages": USER, "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    async with client.stream("POST", CHAT, json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = await read_events(r)
    assert raw[-1] == "[DONE]"
    events = [orjson.loads(e) for e in raw[:-1]]
    assert [e["object"] for e in events] == ["chat.completion.chunk"] * 6
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    words = [e["choices"][0]["delta"]["content"] for e in events[1:4]]
    assert all(isinstance(w, str) and w.strip() for w in words) and words[1].startswith(" ")
    assert events[4]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    assert events[5]["choices"] == [] and events[5]["usage"]["completion_tokens"] == 3
    assert [("timings" in e) for e in events] == [False] * 5 + [True]
    assert events[5]["timings"]["predicted_n"] == 3

    async with client.stream("POST", CHAT, json={"messages": USER, "stream": True, "max_tokens": 2}) as r:
        plain = [orjson.loads(e) for e in (await read_events(r))[:-1]]
    assert [("timings" in e) for e in plain] == [False, False, False, True]
    assert plain[-1]["choices"][0]["finish_reason"] == "length"


async def test_streamed_and_json_answers_agree(client: httpx.AsyncClient) -> None:
    whole = (await client.post(CHAT, json={"messages": USER, "max_tokens": 6})).json()
    async with client.stream("POST", CHAT, json={"messages": USER, "stream": True, "max_tokens": 6}) as r:
        events = [orjson.loads(e) for e in (await read_events(r))[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == whole["choices"][0]["message"]["content"]


async def test_completion_endpoints_and_tokens(client: httpx.AsyncClient) -> None:
    native = (await client.post("/completion", json={"prompt": "one two three", "n_predict": 2})).json()
    assert native["id_slot"] in (0, 1) and native["tokens_cached"] == 3 + 2 - 1 and native["stop"] is True
    assert native["timings"]["prompt_n"] == 3
    oai = (await client.post("/v1/completions", json={"prompt": "one two", "max_tokens": 2})).json()
    assert oai["object"] == "text_completion" and oai["usage"]["completion_tokens"] == 2 and "timings" in oai
    tokens = (await client.post("/tokenize", json={"content": "one two!", "add_special": True})).json()["tokens"]
    assert len(tokens) == 3 and all(isinstance(t, int) for t in tokens)
    assert (await client.post("/detokenize", json={"tokens": tokens})).json() == {"content": "one two !"}
    pieces = (await client.post("/tokenize", json={"content": "one", "with_pieces": True})).json()["tokens"]
    assert pieces == [{"id": tokens[0], "piece": "one"}]
    rendered = (await client.post("/apply-template", json={"messages": USER})).json()
    assert rendered == {"prompt": render_chat(USER)}
    by_ids = (await client.post("/completion", json={"prompt": tokens, "n_predict": 1})).json()
    assert by_ids["tokens_evaluated"] == 3


# --- slot actions -------------------------------------------------------------------------


async def test_save_erase_restore_round_trip(client: httpx.AsyncClient, tmp_path: Path) -> None:
    first = (await client.post(CHAT, json={"messages": USER, "id_slot": 1, "max_tokens": 4})).json()
    n_cached = prompt_len(USER) + 4 - 1
    saved = (await client.post("/slots/1?action=save", json={"filename": "conv.bin"})).json()
    assert saved["id_slot"] == 1 and saved["filename"] == "conv.bin" and saved["n_saved"] == n_cached
    assert saved["n_written"] == (tmp_path / "conv.bin").stat().st_size and "save_ms" in saved["timings"]
    assert (tmp_path / "conv.bin").read_bytes().startswith(b"GGSQ")
    assert (await client.post("/slots/1?action=erase")).json() == {"id_slot": 1, "n_erased": n_cached}
    assert (await client.get("/slots")).json()[1]["n_prompt_tokens"] == 0
    restored = (await client.post("/slots/3?action=restore", json={"filename": "conv.bin"})).json()
    assert restored["id_slot"] == 1 and restored["n_restored"] == n_cached
    assert restored["n_read"] == saved["n_written"] and "restore_ms" in restored["timings"]
    reply = first["choices"][0]["message"]["content"]
    follow_up = [*USER, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    after = (await client.post(CHAT, json={"messages": follow_up, "id_slot": 1})).json()
    assert after["timings"]["cache_n"] == n_cached
    stats = (await client.get("/mock/stats")).json()
    assert (stats["saves"], stats["erases"], stats["restores"]) == (1, 1, 1)


async def test_save_of_empty_slot(client: httpx.AsyncClient) -> None:
    r = await client.post("/slots/0?action=save", json={"filename": "empty.bin"})
    assert r.status_code == 200 and r.json()["n_saved"] == 0


async def test_failed_restore_clears_slot(client: httpx.AsyncClient, tmp_path: Path) -> None:
    await client.post(CHAT, json={"messages": USER, "id_slot": 0})
    r = await client.post("/slots/0?action=restore", json={"filename": "missing.bin"})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "code": 400,
            "type": "invalid_request_error",
            "message": "Unable to restore slot: No available space in KV cache or invalid slot save file",
        }
    }
    assert (await client.get("/slots")).json()[0]["n_prompt_tokens"] == 0
    (tmp_path / "junk.bin").write_bytes(b"not a slot file")
    r = await client.post("/slots/0?action=restore", json={"filename": "junk.bin"})
    assert r.status_code == 400


async def test_restore_too_big_for_context(make_mock: MakeMock, tmp_path: Path) -> None:
    (tmp_path / "big.bin").write_bytes(encode(["w"] * 50))
    mock = make_mock(n_ctx=20)
    async with httpx.AsyncClient(base_url=mock.url) as c:
        r = await c.post("/slots/0?action=restore", json={"filename": "big.bin"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unable to restore slot: Restored prompt does not fit in the slot context"


async def test_slot_actions_need_save_path(make_mock: MakeMock) -> None:
    mock = make_mock(slot_save_path=None)
    async with httpx.AsyncClient(base_url=mock.url) as c:
        for url in ("/slots/0?action=erase", "/slots/0?action=save", "/slots/x?action=bogus"):
            r = await c.post(url, json={"filename": "a.bin"})
            assert r.status_code == 501
            assert r.json()["error"] == {
                "code": 501,
                "type": "not_supported_error",
                "message": "This server does not support slots action. Start it with `--slot-save-path`",
            }


@pytest.mark.parametrize(
    ("url", "body", "message"),
    [
        ("/slots/abc?action=save", {"filename": "a.bin"}, "Invalid slot ID"),
        ("/slots/-1?action=erase", None, "Invalid slot ID"),
        ("/slots/0?action=bogus", {"filename": "a.bin"}, "Invalid action"),
        ("/slots/0", {"filename": "a.bin"}, "Invalid action"),
        ("/slots/0?action=save", {"filename": "../a.bin"}, "Invalid filename"),
        ("/slots/0?action=restore", {"filename": "a/b"}, "Invalid filename"),
        ("/slots/0?action=save", {}, None),
        ("/slots/0?action=save", {"filename": 3}, None),
    ],
)
async def test_slot_action_bad_requests(
    client: httpx.AsyncClient, url: str, body: dict[str, Any] | None, message: str | None
) -> None:
    r = await client.post(url, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if message is not None:
        assert error["message"] == message


async def test_save_waits_for_busy_slot(make_mock: MakeMock) -> None:
    mock = make_mock(gen_ms_per_token=20)
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        body = {"messages": USER, "id_slot": 0, "max_tokens": 40, "stream": True}
        async with c.stream("POST", CHAT, json=body) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # the slot is now busy
            save = asyncio.create_task(c.post("/slots/0?action=save", json={"filename": "busy.bin"}))
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        saved = (await save).json()
        stats = (await c.get("/mock/stats")).json()
    assert saved["n_saved"] == prompt_len(USER) + 40 - 1  # taken after the stream, with its tokens
    assert stats["slot_actions_while_busy"] == 1 and stats["max_concurrent_per_slot"] == 1


async def test_pinned_requests_queue_on_their_slot(make_mock: MakeMock) -> None:
    mock = make_mock(gen_ms_per_token=2)
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        bodies = [{"messages": USER + [{"role": "user", "content": str(i)}], "id_slot": 0} for i in range(4)]
        answers = await asyncio.gather(*(c.post(CHAT, json=b) for b in bodies))
        stats = (await c.get("/mock/stats")).json()
    assert all(a.status_code == 200 for a in answers)
    assert stats["chat_by_slot"] == {"0": 4} and stats["max_concurrent_per_slot"] == 1


async def test_unpinned_requests_wait_for_a_free_slot(make_mock: MakeMock) -> None:
    mock = make_mock(slots=2, gen_ms_per_token=2)
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        prompts = [f"request number {i} " + "filler " * i for i in range(6)]
        answers = await asyncio.gather(*(c.post("/completion", json={"prompt": p}) for p in prompts))
        stats = (await c.get("/mock/stats")).json()
    assert all(a.status_code == 200 for a in answers)
    assert stats["chat_requests"] == 6 and stats["max_concurrent_per_slot"] == 1


async def test_fail_on_no_slot(make_mock: MakeMock) -> None:
    mock = make_mock(slots=1, gen_ms_per_token=20)
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        async with c.stream("POST", CHAT, json={"messages": USER, "max_tokens": 20, "stream": True}) as r:
            lines = r.aiter_lines()  # kept: dropping the iterator would close the stream
            await anext(lines)
            busy = await c.get("/slots?fail_on_no_slot=1")
            listing = await c.get("/slots")
        await wait_idle(c)
        free = await c.get("/slots?fail_on_no_slot=1")
    assert busy.status_code == 503 and busy.json()["error"]["type"] == "unavailable_error"
    assert listing.json()[0]["is_processing"] is True
    assert free.status_code == 200


async def test_client_disconnect_releases_slot_with_partial_tokens(make_mock: MakeMock) -> None:
    mock = make_mock(gen_ms_per_token=20)
    n_prompt = prompt_len(USER)
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        body = {"messages": USER, "id_slot": 0, "max_tokens": 500, "stream": True}
        async with c.stream("POST", CHAT, json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 4:  # role chunk + 3 tokens
                    break
        await wait_idle(c, 0)
        held = (await c.get("/mock/slots")).json()[0]
        slot = (await c.get("/slots")).json()[0]
    assert held["idle"] and not slot["is_processing"]
    assert n_prompt + 2 <= held["n_tokens"] < n_prompt + 499


# --- faults and auth ----------------------------------------------------------------------


async def test_fault_status(client: httpx.AsyncClient) -> None:
    armed = (await client.post("/mock/faults", json={"status": 500, "status_count": 1})).json()
    assert armed["status"] == 500
    r = await client.post(CHAT, json={"messages": USER})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert (await client.post(CHAT, json={"messages": USER})).status_code == 200
    assert (await client.post("/mock/faults", json={"bogus": 1})).status_code == 400
    await client.post("/mock/faults", json={"status": 503})
    assert (await client.delete("/mock/faults")).json()["status"] is None
    assert (await client.post(CHAT, json={"messages": USER})).status_code == 200


async def test_fault_drop_closes_connection_before_any_byte(client: httpx.AsyncClient, mock: MockHandle) -> None:
    await client.post("/mock/faults", json={"drop": 2})
    with pytest.raises(httpx.TransportError):
        await client.post(CHAT, json={"messages": USER})
    body = orjson.dumps({"messages": USER})
    reader, writer = await asyncio.open_connection("127.0.0.1", mock.port)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: mock\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    try:
        received = await reader.read()
    except ConnectionResetError:
        received = b""
    writer.close()
    assert received == b""
    assert (await client.post(CHAT, json={"messages": USER})).status_code == 200
    assert (await client.get("/mock/faults")).json()["drop"] == 0


async def test_fault_stream_break(client: httpx.AsyncClient) -> None:
    await client.post("/mock/faults", json={"stream_break_after": 3, "stream_break_count": 1})
    events: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", CHAT, json={"messages": USER, "stream": True, "id_slot": 0}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
    assert len(events) == 3 and "data: [DONE]" not in events
    await wait_idle(client, 0)
    async with client.stream("POST", CHAT, json={"messages": USER, "stream": True}) as r:
        assert (await read_events(r))[-1] == "[DONE]"


async def test_fault_stream_break_halfway_through_an_event(client: httpx.AsyncClient) -> None:
    await client.post("/mock/faults", json={"stream_break_after": 2, "stream_break_count": 1,
                                            "stream_break_half": True})
    raw = b""
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", CHAT, json={"messages": USER, "stream": True, "id_slot": 0}) as r:
            async for chunk in r.aiter_raw():
                raw += chunk
    whole, half = raw.rsplit(b"\n\n", 1)
    assert whole.count(b"\n\n") == 1 and half.startswith(b"data: {") and not half.endswith(b"}")


async def test_a_silent_stream_sends_keepalive_comments(make_mock: MakeMock) -> None:
    """llama-server's `sse_ping_interval` (30 s by default; the stand-in's none unless asked): a `:` event after
    that many seconds without one, during the prefill and between tokens."""
    mock = make_mock(prefill_ms_per_token=20, gen_ms_per_token=150)
    async with httpx.AsyncClient(base_url=mock.url, timeout=10) as c:
        raw = (await c.post(CHAT, json={"messages": USER, "stream": True, "max_tokens": 3, "id_slot": 0,
                                        "sse_ping_interval": 0.025})).content
        quiet = (await c.post(CHAT, json={"messages": USER, "stream": True, "max_tokens": 3, "id_slot": 1})).content
    assert b"\n\n:\n\n" not in b"\n\n" + quiet and quiet.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[0] == b":" and events[-2] == b"data: [DONE]"
    tokens = [i for i, e in enumerate(events) if b'"content":"' in e]
    assert len(tokens) == 3 and all(b":" in events[i - 1:i] for i in tokens[1:])   # a keep-alive before each


async def test_fault_hang_until_client_gives_up(client: httpx.AsyncClient) -> None:
    await client.post("/mock/faults", json={"hang": 1})
    with pytest.raises(httpx.ReadTimeout):
        await client.post(CHAT, json={"messages": USER}, timeout=0.3)
    assert (await client.post(CHAT, json={"messages": USER})).status_code == 200


async def test_fault_latency_and_save_failure(client: httpx.AsyncClient, tmp_path: Path) -> None:
    await client.post("/mock/faults", json={"save_status": 500, "save_fail_count": 1})
    r = await client.post("/slots/0?action=save", json={"filename": "f.bin"})
    assert r.status_code == 500 and not (tmp_path / "f.bin").exists()
    assert (await client.post("/slots/0?action=save", json={"filename": "f.bin"})).status_code == 200
    stats = (await client.get("/mock/stats")).json()
    assert (stats["saves"], stats["save_failures"]) == (1, 1)
    assert stats["requests_by_path"]["/slots/0"] == 2
    await client.post("/mock/reset-stats")
    assert (await client.get("/mock/stats")).json()["saves"] == 0


async def test_faults_armed_at_start(make_mock: MakeMock) -> None:
    mock = make_mock(faults={"status": 503, "status_count": 1})
    async with httpx.AsyncClient(base_url=mock.url) as c:
        assert (await c.post(CHAT, json={"messages": USER})).status_code == 503
        assert (await c.post(CHAT, json={"messages": USER})).status_code == 200


async def test_api_key(make_mock: MakeMock) -> None:
    mock = make_mock(api_key="sekrit")
    async with httpx.AsyncClient(base_url=mock.url) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/v1/models")
        assert r.status_code == 401
        assert r.json() == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
        assert (await c.get("/slots", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})).status_code == 200
        assert (await c.post(CHAT, json={"messages": USER}, headers={"X-Api-Key": "sekrit"})).status_code == 200
        assert (await c.get("/mock/stats")).status_code == 200


# --- chat template: tools, tool calls, names, images (bodies from lpcache.workloads.chats) ----------------------------


def chat_tokens(body: dict[str, Any]) -> list[str]:
    return tokenize(render_chat(body["messages"], body.get("tools")))


async def test_routes_render_tools_tool_calls_and_images_alike(client: httpx.AsyncClient) -> None:
    body = chats.conversation(2, chats.harness(2), turns=5, n_words=200, images=True)[-1]
    prompt = render_chat(body["messages"], body["tools"])
    assert all(marker in prompt for marker in ("<tools>", "<tool_call>", "<tool_response>", "<__image_", " name="))
    assert (await client.post("/apply-template", json=body)).json() == {"prompt": prompt}
    counted = (await client.post("/v1/chat/completions/input_tokens", json=body)).json()
    assert counted == {"input_tokens": len(tokenize(prompt)), "object": "response.input_tokens"}
    answer = (await client.post(CHAT, json=body | {"max_tokens": 2})).json()
    assert answer["usage"]["prompt_tokens"] == len(tokenize(prompt))
    assert (await client.post(CHAT, json=body | {"tools": {"get_time": {}}})).status_code == 400
    broken = body | {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}
    assert (await client.post("/apply-template", json=broken)).status_code == 400


async def test_prefix_reuse_follows_token_lcp_in_a_tool_conversation(client: httpx.AsyncClient) -> None:
    """A slot reuses the token LCP of what it holds and the new prompt: the last prompt and answer after a text
    answer, the last prompt only after a tool call (the fake model's answer was not that call), and, for a
    near-duplicate, up to where the rendered prompts part."""
    held: list[str] = []

    async def send(body: dict[str, Any]) -> tuple[str, int]:
        """The answer and its cache_n, checked against the token LCP; the slot then holds prompt and answer."""
        nonlocal held
        prompt = chat_tokens(body)
        answer = (await client.post(CHAT, json=body | {"id_slot": 0, "max_tokens": 4})).json()
        cache_n: int = answer["timings"]["cache_n"]
        assert cache_n == min(lcp(held, prompt), len(prompt) - 1)
        text: str = answer["choices"][0]["message"]["content"]
        held = prompt + tokenize(text)[:-1]
        return text, cache_n

    conv = chats.Conversation(4, chats.harness(4), turns=7, n_words=300, images=True)
    body = conv.body
    tool_turns = []
    for _ in range(6):
        answer, _ = await send(body)
        n_prompt = len(chat_tokens(body))
        tool_turns.append(conv.next_is_tool)
        body = conv.advance(answer)
        assert lcp(held, chat_tokens(body)) == (n_prompt if tool_turns[-1] else len(held))
    await send(body)
    assert True in tool_turns and False in tool_turns
    variants = chats.variants(body)
    assert set(variants) == set(chats.KINDS)
    for other in variants.values():
        await send(body)
        _, cache_n = await send(other)
        assert cache_n < len(chat_tokens(other)) - 1, "the server computes again from where they part"
