"""The stand-in's chat template: ChatML as before for plain requests; tools, tool calls, tool results, names and
images rendered as a real template would, so near-duplicate requests get different tokens."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from lpcache.mock_llama.tokens import image_marker, lcp, render_chat, tokenize
from lpcache.workloads import chats

TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Now.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def chatml(messages: list[dict[str, Any]]) -> str:
    """The stand-in's template before tools, names and images: role and text, nothing else."""
    def text(content: Any) -> str:
        return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")

    return "".join(f"<|im_start|>{m['role']}\n{text(m['content'])}<|im_end|>\n" for m in messages) + (
        "<|im_start|>assistant\n"
    )


def rendered(body: dict[str, Any]) -> list[str]:
    return tokenize(render_chat(body["messages"], body.get("tools")))


def test_plain_requests_render_as_before() -> None:
    assert render_chat([{"role": "system", "content": "S."}, {"role": "user", "content": "Hi!"}]) == (
        "<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    for seed in range(20):
        body = chats.request(seed, 300, turns=3, names=False)
        assert "tools" not in body
        assert render_chat(body["messages"]) == render_chat(body["messages"], []) == chatml(body["messages"])


def test_tools_tool_calls_and_tool_responses() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz":"Asia/Tokyo"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"time":"09:00"}'},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "later"},
        {"role": "assistant", "content": "Nine.", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
        ]},
    ]
    assert render_chat(messages, TOOLS) == (
        "<|im_start|>system\n# Tools\n\n<tools>\n"
        '{"type": "function", "function": {"name": "get_time", "description": "Now.", '
        '"parameters": {"type": "object", "properties": {}}}}\n</tools><|im_end|>\n'
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"time":"09:00"}\n</tool_response>\n'
        "<tool_response name=get_time>\nlater\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\nNine.\n<tool_call>\n{"name": "get_time", "arguments": "not json"}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_names_and_images() -> None:
    url = chats.image_part(1)["image_url"]["url"]
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "image_url", "image_url": {}}, {"type": "text", "text": " ok?"}]
    prompt = render_chat([{"role": "user", "name": "alice", "content": parts}])
    assert image_marker(url) == f"<__image_{hashlib.sha256(url.encode()).hexdigest()[:8]}__>"
    assert prompt == f"<|im_start|>user name=alice\nLook: {image_marker(url)} ok?<|im_end|>\n<|im_start|>assistant\n"
    assert image_marker(url) != image_marker(chats.image_part(2)["image_url"]["url"])


def test_malformed_tool_calls_are_refused() -> None:
    for calls in ("x", [{"function": "x"}], [{"function": {"arguments": "{}"}}]):
        with pytest.raises(ValueError):
            render_chat([{"role": "assistant", "content": None, "tool_calls": calls}])


@pytest.mark.parametrize("kind", list(chats.KINDS))
def test_near_duplicates_get_other_tokens(kind: str) -> None:
    """What word-based hashing cannot tell apart, the server's tokens do (as on a real llama-server)."""
    tried = 0
    for seed in range(12):
        body = chats.conversation(seed, chats.harness(seed), turns=5, n_words=300, images=True)[-1]
        try:
            other = chats.variant(body, kind, seed)
        except ValueError:
            continue
        tried += 1
        a, b = rendered(body), rendered(other)
        assert a != b
        if kind in ("tool_added", "tool_description"):
            assert lcp(a, b) < len(tokenize(render_chat([], body["tools"]))), "diverges inside the tools block"
    assert tried >= 3
