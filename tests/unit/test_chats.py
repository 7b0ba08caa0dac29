"""lpcache.chats: realistic request bodies, conversations, and near-duplicates that differ in one way only."""

from __future__ import annotations

import base64
import functools
import json
import random
import re
import unicodedata
import zlib
from typing import Any

import orjson
import pytest

from lpcache.cache.prefix import raw_prefix, words
from lpcache.workloads import chats

HARNESS = chats.harness(7)
SEEDS = range(12)


@functools.cache
def _bodies(seed: int) -> bytes:
    return orjson.dumps(chats.conversation(seed, chats.harness(seed % 3), turns=6, n_words=500, images=True))


def bodies_of(seed: int) -> list[dict[str, Any]]:
    """A six-request conversation with tools, tool calls and images (a fresh copy each time)."""
    return orjson.loads(_bodies(seed))


def all_text(body: dict[str, Any]) -> str:
    return orjson.dumps(body).decode("utf-8") + raw_prefix(body["messages"])


def word_list(body: dict[str, Any]) -> list[str]:
    return words(raw_prefix(body["messages"]))


def diff(a: Any, b: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The paths where two JSON values differ (a list of another length differs as a whole)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b)) for p in diff(a.get(k), b.get(k), (*path, k))]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in diff(x, y, (*path, i))]
    return [] if a == b else [path]


# ---- determinism, shape ----


def test_same_seed_same_output_other_seed_other_output() -> None:
    def make(seed: int) -> list[dict[str, Any]]:
        return chats.conversation(seed, chats.harness(seed % 3), turns=6, n_words=500, images=True)

    assert make(3) == make(3) == bodies_of(3)
    big = [orjson.dumps(chats.request(5, 700, HARNESS, turns=3)) for _ in range(2)]
    assert big[0] == big[1]
    assert chats.harness(1) == chats.harness(1) and chats.harness(1) != chats.harness(2)
    assert bodies_of(3)[-1]["messages"] != bodies_of(4)[-1]["messages"]
    assert chats.png(9) == chats.png(9) != chats.png(10)
    body = bodies_of(3)[-1]
    assert chats.variants(body, 1) == chats.variants(body, 1)


def test_bodies_are_json_and_shaped_as_openai_chat_requests() -> None:
    for seed in SEEDS:
        for body in bodies_of(seed):
            assert json.loads(orjson.dumps(body)) == body
            assert body["model"] == "llama.cpp"
            for m in body["messages"]:
                assert m["role"] in ("system", "user", "assistant", "tool")
                content = m["content"]
                assert content is None or isinstance(content, str) or all(
                    p["type"] in ("text", "image_url") for p in content
                )
                if "name" in m:
                    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", m["name"])
            for tool in body.get("tools", []):
                function = tool["function"]
                assert tool["type"] == "function" and function["parameters"]["type"] == "object"
                assert set(function["parameters"]["required"]) <= set(function["parameters"]["properties"])


def test_text_looks_like_real_traffic() -> None:
    text = "\n".join(all_text(body) for seed in SEEDS for body in bodies_of(seed)[-1:])
    for needle in ("```python", "```json", "```bash", "|---", "\n- ", "## ", "?", ",", ";", '"', "call_"):
        assert needle in text, needle
    assert re.search(r"\b[A-Z][a-z]+\b", text) and re.search(r"\b[A-Z]{3,}\b", text)  # mixed case
    assert re.search(r"[\u00c0-\u024f]", text)  # accented Latin
    assert re.search(r"[\u4e00-\u9fff\u3040-\u30ff\uac00-\ud7af]", text)  # CJK
    assert re.search(r"[\u0590-\u06ff]", text)  # Hebrew, Arabic (right to left)
    assert re.search(r"[\U0001f300-\U0001faff]", text)  # emoji
    assert any(unicodedata.combining(c) for c in text)  # combining marks
    assert max(chats.count_words(chats.text(random.Random(s), 3)) for s in range(20)) <= 6  # short replies


def test_several_system_messages_and_a_shared_prefix_per_harness() -> None:
    a, b = (chats.conversation(seed, HARNESS, n_words=300)[-1] for seed in (1, 2))
    assert [m["role"] for m in a["messages"][:2]] == ["system", "system"]
    assert a["messages"][0] == b["messages"][0] and a["messages"][0]["content"] == HARNESS.system
    assert a["tools"] == b["tools"] == HARNESS.tools_json() and len(a["tools"]) == 5
    assert a["messages"][1] != b["messages"][1]
    assert 2500 <= len(HARNESS.system) + len(orjson.dumps(HARNESS.tools)) <= 6000
    assert len(chats.harness(1, n_chars=8000).system) >= 8000


def test_tool_conversations_are_well_formed() -> None:
    tool_messages = calls_seen = 0
    for seed in range(40):
        messages = chats.conversation(seed, HARNESS, turns=8, n_words=300)[-1]["messages"]
        open_ids: set[str] = set()
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                tool_messages += 1
                assert m["tool_call_id"] in open_ids and messages[i - 1]["role"] in ("assistant", "tool")
                open_ids.remove(m["tool_call_id"])
                continue
            assert not open_ids, "every tool call is answered before the next message"
            if m.get("tool_calls"):
                assert m["role"] == "assistant" and (m["content"] is None or isinstance(m["content"], str))
                for call in m["tool_calls"]:
                    calls_seen += 1
                    assert call["type"] == "function" and call["id"].startswith("call_")
                    assert isinstance(json.loads(call["function"]["arguments"]), dict)
                    assert call["function"]["name"] in {t["function"]["name"] for t in HARNESS.tools}
                    open_ids.add(call["id"])
        assert not open_ids
    assert tool_messages == calls_seen > 20


def test_each_request_extends_the_previous_and_answers_fill_in() -> None:
    bodies = chats.conversation(11, HARNESS, turns=6)
    for before, after in zip(bodies, bodies[1:], strict=False):
        n = len(before["messages"])
        assert after["messages"][:n] == before["messages"] and len(after["messages"]) > n
    conv = chats.Conversation(11, HARNESS, turns=6)
    kinds = []
    for body in bodies[1:]:
        kinds.append(conv.next_is_tool)
        assert conv.advance() == body
    assert True in kinds and False in kinds
    with pytest.raises(IndexError):
        conv.advance()
    last = bodies[-1]["messages"]
    placeholders = [m["content"] for m in last if m["role"] == "assistant" and not m.get("tool_calls")]
    assert placeholders and all(re.fullmatch(r"<<answer \d>>", p) for p in placeholders)
    turn = int(placeholders[0].split()[1][:-2])
    filled = chats.fill_answer(bodies, turn, "Real answer, é 🚀.")
    assert sum(m["content"] == "Real answer, é 🚀." for m in filled[-1]["messages"]) == 1
    assert filled[: turn + 1] == bodies[: turn + 1]
    answered = chats.conversation(11, HARNESS, turns=6, answers=[f"A{i}" for i in range(5)])
    assert diff(answered[-1], bodies[-1])  # the same requests but for the answers
    for x, y in zip(answered, bodies, strict=True):
        assert all(p[0] == "messages" and x["messages"][p[1]]["role"] == "assistant" for p in diff(x, y))


def test_sizes() -> None:
    for seed in SEEDS:
        big = len(word_list(chats.request(seed, 600)))
        assert 600 <= big + 10 and big <= 700
        assert len(word_list(chats.request(seed, 600, HARNESS, turns=4))) >= 550
        assert len(word_list(chats.request(seed, 30))) <= 80
        small = chats.conversation(seed, turns=3, n_words=60)[-1]
        large = chats.conversation(seed, turns=3, n_words=3000)[-1]
        assert len(word_list(small)) < 150 < 2000 < len(word_list(large))


def test_images_are_deterministic_png_data_urls() -> None:
    part = chats.image_part(4)
    prefix, data = part["image_url"]["url"].split(",", 1)
    raw = base64.b64decode(data)
    assert prefix == "data:image/png;base64" and raw == chats.png(4) and raw.startswith(b"\x89PNG\r\n\x1a\n")
    idat = raw[raw.index(b"IDAT") + 4 : raw.index(b"IEND") - 8]
    assert len(zlib.decompress(idat)) == 2 * (1 + 3 * 2)
    images = [p for s in SEEDS for m in bodies_of(s)[-1]["messages"] if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image_url"]
    assert images
    assert not [p for m in chats.conversation(1, HARNESS)[-1]["messages"] if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image_url"]


# ---- near-duplicates ----

EXPECTED_PATHS = {
    "case": r"messages/(\d+)/content(/\d+/text)?",
    "punctuation": r"messages/(\d+)/content(/\d+/text)?",
    "role": r"messages/(\d+)/role",
    "tool_added": r"tools",
    "tool_description": r"tools/\d+/function/description",
    "tool_arguments": r"messages/(\d+)/tool_calls/\d+/function/arguments",
    "name": r"messages/(\d+)/name",
    "image": r"messages/(\d+)/content/\d+/image_url/url",
}


def test_every_kind_is_described() -> None:
    assert set(EXPECTED_PATHS) == set(chats.KINDS) >= chats.SAME_TEXT_ONLY_WORDS


@pytest.mark.parametrize("kind", list(chats.KINDS))
def test_variant_differs_only_as_intended_and_keeps_the_words(kind: str) -> None:
    tried = 0
    for seed in range(30):
        body = bodies_of(seed)[-1]
        try:
            other = chats.variant(body, kind, seed)
        except ValueError:
            continue
        tried += 1
        paths = ["/".join(map(str, p)) for p in diff(body, other)]
        assert paths and all(re.fullmatch(EXPECTED_PATHS[kind], p) for p in paths), (kind, paths)
        assert len({tuple(p.split("/")[:2]) for p in paths}) == 1, "one message (or the tools) only"
        assert word_list(other) == word_list(body), "word-based hashing cannot tell them apart"
        same_raw = raw_prefix(other["messages"]) == raw_prefix(body["messages"])
        assert same_raw is (kind not in chats.SAME_TEXT_ONLY_WORDS)
        if kind == "case":
            assert raw_prefix(other["messages"]).lower() == raw_prefix(body["messages"]).lower()
        if kind == "role":
            i = int(paths[0].split("/")[1])
            assert {body["messages"][i]["role"], other["messages"][i]["role"]} == {"system", "user"}
        if kind == "tool_added":
            assert other["tools"][:-1] == body["tools"] and len(other["tools"]) == len(body["tools"]) + 1
        if kind == "tool_arguments":
            i, j = int(paths[0].split("/")[1]), int(paths[0].split("/")[3])
            old, new = (json.loads(b["messages"][i]["tool_calls"][j]["function"]["arguments"]) for b in (body, other))
            assert len(diff(old, new)) == 1
        assert body == bodies_of(seed)[-1], "the original is left alone"
    assert tried >= 10


def test_variants_need_what_they_change() -> None:
    body = chats.request(1, 50)
    assert set(chats.variants(body)) == {"case", "punctuation", "role", "tool_added", "name"}
    for kind in ("tool_description", "tool_arguments", "image"):
        with pytest.raises(ValueError):
            chats.variant(body, kind)
    with pytest.raises(ValueError, match="unknown"):
        chats.variant(body, "emoji")
    first = chats.variant(body, "role", index=0)
    assert first["messages"][0]["role"] != body["messages"][0]["role"]
    assert chats.variant({"messages": [{"role": "user", "content": "ok"}]}, "punctuation")["messages"][0] == {
        "role": "user", "content": "ok!"}
