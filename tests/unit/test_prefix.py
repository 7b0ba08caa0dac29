"""Prefix hashing: raw prefix, words, block hashes, cache key, chain."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lpcache.cache import prefix
from lpcache.cache.identity import canonical_text
from lpcache.cache.prefix import (
    Prompt,
    block_hashes,
    cache_key,
    chain,
    common_prefix,
    content_text,
    raw_prefix,
    words,
)

SHA256_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def text_of(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


# ---- content_text ----

def test_content_text_string() -> None:
    assert content_text("Hello, world") == "Hello, world"
    assert content_text("") == ""


def test_content_text_parts_keeps_text_parts_in_order() -> None:
    parts = [
        {"type": "text", "text": "first"},
        {"type": "image_url", "image_url": {"url": "http://x/img.png"}},
        {"type": "text", "text": "second"},
        "not a dict",
        {"type": "text", "text": 42},
        {"type": "text"},
    ]
    assert content_text(parts) == "first\nsecond"


def test_content_text_none_and_other_types() -> None:
    assert content_text(None) == ""
    assert content_text(123) == ""
    assert content_text({"text": "x"}) == ""
    assert content_text([]) == ""


# ---- raw_prefix ----

def test_raw_prefix_strips_roles_and_joins_by_newline() -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Bye"},
    ]
    raw = raw_prefix(messages)
    assert raw == "You are helpful.\nHi\n\nBye"
    assert "system" not in raw and "user" not in raw and "assistant" not in raw


def test_raw_prefix_ignores_non_dict_messages() -> None:
    assert raw_prefix(["junk", None, 5, {"role": "user", "content": "a"}, ["x"], {"content": "b"}]) == "a\nb"
    assert raw_prefix([]) == ""


# ---- words ----

def test_words_are_w_plus_lower_cased() -> None:
    assert words("Hello, World! foo_bar 42x  -- x-y") == ["hello", "world", "foo_bar", "42x", "x", "y"]


def test_words_unicode() -> None:
    assert words("Café CRÈME brûlée") == ["café", "crème", "brûlée"]
    assert words("Привет, МИР") == ["привет", "мир"]


def test_words_empty() -> None:
    assert words("") == []
    assert words(" ,.;!? ") == []


# ---- block_hashes ----

def test_block_hashes_known_vector() -> None:
    p = Prompt.of("m", [{"role": "user", "content": "ABC"}], 1)
    assert p.blocks == (SHA256_ABC,)
    assert block_hashes(["abc"], 1) == [SHA256_ABC]


def test_block_hashes_join_words_by_single_space() -> None:
    word_list = words("The  quick\tbrown,\nfox JUMPS over")
    assert block_hashes(word_list, 2) == [
        hashlib.sha256(b"the quick").hexdigest(),
        hashlib.sha256(b"brown fox").hexdigest(),
        hashlib.sha256(b"jumps over").hexdigest(),
    ]
    assert block_hashes(word_list, 3) == [
        hashlib.sha256(b"the quick brown").hexdigest(),
        hashlib.sha256(b"fox jumps over").hexdigest(),
    ]


def test_block_hashes_only_whole_blocks() -> None:
    word_list = ["a", "b", "c", "d", "e"]
    assert block_hashes(word_list, 2) == [sha("a b"), sha("c d")]
    assert block_hashes(word_list, 5) == [sha("a b c d e")]
    assert block_hashes(word_list, 6) == []
    assert block_hashes([], 3) == []


def test_block_hashes_unicode_encoded_as_utf8() -> None:
    assert block_hashes(words("Café Noir"), 2) == [hashlib.sha256("café noir".encode()).hexdigest()]


def test_block_hashes_are_sha256_hex() -> None:
    for h in block_hashes([f"w{i}" for i in range(10)], 3):
        assert len(h) == 64
        int(h, 16)


# ---- cache_key ----

def test_cache_key() -> None:
    assert cache_key("llama.cpp", "hello\nworld") == hashlib.sha256(b"llama.cpp\nhello\nworld").hexdigest()
    assert cache_key("a", "b") != cache_key("b", "a")
    assert cache_key("m", "") == hashlib.sha256(b"m\n").hexdigest()


# ---- chain / common_prefix ----

def test_chain_equal_prefixes_equal_entries() -> None:
    a = block_hashes(words(text_of(10)), 2)
    b = block_hashes(words(text_of(6) + " x y z q"), 2)
    ca, cb = chain(a), chain(b)
    assert len(ca) == len(a) == 5 and len(cb) == 5
    assert ca[:3] == cb[:3]
    assert all(ca[i] != cb[i] for i in range(3, 5))
    assert chain(a) == ca  # deterministic


def test_chain_differs_after_first_differing_block_even_if_later_blocks_equal() -> None:
    a = [sha("a"), sha("b"), sha("c")]
    b = [sha("x"), sha("b"), sha("c")]
    ca, cb = chain(a), chain(b)
    assert all(x != y for x, y in zip(ca, cb, strict=True))


def test_chain_depends_on_order() -> None:
    assert chain([sha("a"), sha("b")])[1] != chain([sha("b"), sha("a")])[1]


def test_chain_entries_are_64_bit_ints() -> None:
    c = chain(block_hashes(words(text_of(8)), 1))
    assert len(c) == 8
    assert all(isinstance(x, int) and 0 <= x < 2**64 for x in c)
    assert len(set(c)) == 8
    assert chain([]) == ()


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ([], [], 0),
        ([1, 2, 3], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3], [1, 9, 3], 1),
        ([0, 2, 3], [1, 2, 3], 0),
        ("abcd", "abxd", 2),
    ],
)
def test_common_prefix(a, b, n) -> None:
    assert common_prefix(a, b) == n


def test_common_prefix_of_chains_counts_shared_blocks() -> None:
    a = chain(block_hashes(words(text_of(20)), 4))
    b = chain(block_hashes(words(text_of(13) + " other words here"), 4))
    assert common_prefix(a, b) == 3


# ---- Prompt.of ----

def test_prompt_of() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, General Kenobi"}]
    p = Prompt.of("model-x", messages, 2)
    assert p.model == "model-x"
    assert p.key == hashlib.sha256(f"model-x\n{canonical_text(messages)}".encode()).hexdigest()
    assert p.chars == len(canonical_text(messages))
    assert p.n_words == 6
    assert p.blocks == (sha("be brief"), sha("hello there"), sha("general kenobi"))
    assert p.chain == chain(p.blocks)
    assert len(p.chain) == 3


def test_prompt_of_counts_partial_block_words_but_does_not_hash_them() -> None:
    p = Prompt.of("m", [{"role": "user", "content": text_of(7)}], 5)
    assert p.n_words == 7
    assert p.blocks == (sha(text_of(5)),)


def test_prompt_key_depends_on_raw_text_not_only_words() -> None:
    a = Prompt.of("m", [{"role": "user", "content": "Hello world"}], 1)
    b = Prompt.of("m", [{"role": "user", "content": "hello, world!"}], 1)
    assert a.blocks == b.blocks and a.chain == b.chain
    assert a.key != b.key


def test_prompt_roles_share_words_but_not_identity() -> None:
    a = Prompt.of("m", [{"role": "user", "content": "same text " * 200}], 1)
    b = Prompt.of("m", [{"role": "system", "content": "same text " * 200}], 1)
    assert a.blocks == b.blocks and a.chain == b.chain   # the word lookup cannot tell them apart
    assert a.key != b.key and a.exact and b.exact and a.exact[0] != b.exact[0]


def test_prompt_words_count_tool_calls_and_tools_but_blocks_do_not() -> None:
    messages = [{"role": "user", "content": "look it up"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "search", "arguments": '{"q": "kv cache"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "found it"}]
    tools = {"tools": [{"type": "function", "function": {"name": "search", "description": "Search the web"}}]}
    plain = Prompt.of("m", messages, 1)
    with_tools = Prompt.of("m", messages, 1, tools)
    assert plain.blocks == with_tools.blocks
    assert with_tools.n_words > plain.n_words > len(words("look it up found it"))
    assert plain.exact[:1] != with_tools.exact[:1] or plain.chars != with_tools.chars


def test_prompt_key_depends_on_model() -> None:
    msgs = [{"role": "user", "content": "same text"}]
    a, b = Prompt.of("m1", msgs, 1), Prompt.of("m2", msgs, 1)
    assert a.key != b.key
    assert a.blocks == b.blocks


def test_prompt_empty() -> None:
    p = Prompt.of("m", [], 3)
    assert p.n_words == 0 and p.blocks == () and p.chain == () and p.exact == ()
    assert p.key == hashlib.sha256(f"m\n{canonical_text([])}".encode()).hexdigest()


def test_ascii_fast_path_matches_the_regex() -> None:
    import random
    import re
    import string

    from lpcache.cache.prefix import words

    rng = random.Random(7)
    alphabet = string.printable
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        assert words(text) == re.findall(r"\w+", text.lower())


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(["Σ", "σ", "a", "B", " ", "\n", "\t", ".", "'", "\u0301", "é", "İ", "_", "1",
                                         "日", "-", "ß"]), max_size=80),
       st.integers(min_value=1, max_value=9))
def test_a_long_text_read_in_pieces_has_the_same_words(text: str, piece: int) -> None:
    # pieces keep the interpreter lock short (a big body is parsed beside the event loop); they must not change a word
    whole = words(text)
    old = prefix.PIECE_CHARS
    prefix.PIECE_CHARS = piece
    try:
        assert words(text) == whole
    finally:
        prefix.PIECE_CHARS = old
