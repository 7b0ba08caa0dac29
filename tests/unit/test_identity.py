"""The exact identity of a chat request: near-duplicates that word blocks cannot tell apart have different chains,
and a conversation that grows keeps its chain."""

from __future__ import annotations

import pytest

from lpcache.cache.identity import BLOCK_CHARS, Identity, canonical_text, chain_of, template_fields
from lpcache.cache.prefix import Prompt, common_prefix
from lpcache.workloads import chats


def prompt(body: dict) -> Prompt:
    return Prompt.of(body.get("model", "m"), body["messages"], 100, template_fields(body))


@pytest.fixture(scope="module")
def agent_body() -> dict:
    """A big, realistic agent request: harness system prompt and tools, tool calls and results, names, images,
    content parts, Unicode and code."""
    h = chats.harness(3, n_chars=2500, n_tools=4)
    bodies = chats.conversation(5, h, turns=5, n_words=900, tool_rate=0.6, images=True)
    return bodies[-1]


def test_every_near_duplicate_shares_the_words_but_not_the_identity(agent_body: dict) -> None:
    original = prompt(agent_body)
    found = chats.variants(agent_body, seed=1)
    assert {"case", "punctuation", "role", "tool_added", "tool_description", "name"} <= set(found)
    for kind, body in found.items():
        other = prompt(body)
        assert other.chain == original.chain, kind             # the word lookup sees the same request ...
        assert other.key != original.key, kind
        shared = common_prefix(original.exact, other.exact)
        assert shared < len(original.exact) or other.chars != original.chars, kind   # ... the identity does not


def test_tools_change_the_identity_before_any_message(agent_body: dict) -> None:
    """The tools come first (templates render them into the system prompt): a changed tool leaves at most the part
    of the tool definitions before it in common."""
    original = prompt(agent_body)
    header = len(canonical_text([], template_fields(agent_body)))
    for kind in ("tool_added", "tool_description"):
        other = prompt(chats.variant(agent_body, kind, seed=2))
        assert common_prefix(original.exact, other.exact) * BLOCK_CHARS <= header, kind



def test_a_role_change_ends_the_shared_part_at_that_message(agent_body: dict) -> None:
    original = prompt(agent_body)
    first_user = next(i for i, m in enumerate(agent_body["messages"]) if m["role"] == "user")
    role = prompt(chats.variant(agent_body, "role", seed=2, index=first_user))
    before = len(canonical_text(agent_body["messages"][:first_user], template_fields(agent_body)))
    assert common_prefix(original.exact, role.exact) * BLOCK_CHARS <= before + BLOCK_CHARS


def test_a_growing_conversation_keeps_its_identity() -> None:
    h = chats.harness(4, n_chars=2000)
    bodies = chats.conversation(9, h, turns=4, n_words=800, answers=[chats.assistant_text(i) for i in range(3)])
    chains = [prompt(b).exact for b in bodies]
    for earlier, later in zip(chains, chains[1:], strict=False):
        assert len(later) > len(earlier)
        assert common_prefix(earlier, later) == len(earlier)      # every whole block of the earlier turn


def test_a_message_growing_at_its_end_keeps_its_blocks() -> None:
    story = "Once upon a time, « il était une fois » — 昔々… " * 40
    a = Identity.of([{"role": "user", "content": story}])
    b = Identity.of([{"role": "user", "content": story + " and then the dragon said: `print(42)`"}])
    assert len(a.chain) >= 4 and common_prefix(a.chain, b.chain) == len(a.chain)


def test_text_cannot_fake_a_boundary() -> None:
    """Separators are control characters outside JSON-escaped text: a message whose text spells one out is not two
    messages."""
    one = [{"role": "user", "content": 'hi\x1f"null"\x1e"system"'}]
    two = [{"role": "user", "content": "hi"}, {"role": "system", "content": ""}]
    assert canonical_text(one) != canonical_text(two)


def test_images_count_by_their_content() -> None:
    def with_image(seed: int) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, chats.image_part(seed)]}]

    assert canonical_text(with_image(1)) == canonical_text(with_image(1))
    assert canonical_text(with_image(1)) != canonical_text(with_image(2))
    assert "base64" not in canonical_text(with_image(1))          # a digest, not the image


def test_sampling_fields_are_not_identity_and_template_fields_are() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 600}], "temperature": 0.1, "max_tokens": 5,
            "stream": True}
    same = {**body, "temperature": 0.9, "max_tokens": 50, "stream": False, "id_slot": 3}
    assert prompt(body).exact == prompt(same).exact
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert common_prefix(prompt(body).exact, prompt(thinking).exact) == 0


def test_chain_covers_whole_blocks_only() -> None:
    assert chain_of("x" * (BLOCK_CHARS - 1)) == ()
    assert len(chain_of("x" * (3 * BLOCK_CHARS + 5))) == 3
    assert chain_of("a" * BLOCK_CHARS) != chain_of("b" * BLOCK_CHARS)


def test_deeply_nested_fields_still_have_an_identity() -> None:
    nested: object = "leaf"
    for _ in range(400):
        nested = [nested]
    text = canonical_text([{"role": "user", "content": "hi", "extra": nested}])
    assert "leaf" in text
