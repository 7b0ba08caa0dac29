"""Fuzz: malformed bodies and headers at POST /v1/chat/completions never make lpcache answer 5xx or leak a traceback.

One lpcache in front of one stand-in, started once for the whole hypothesis run (hypothesis cannot use
function-scoped fixtures per example), with coalescing on and two client keys: each example is sent at once three
times, twice with its Authorization and once with the other key (the same header when it holds no valid key), so
identical bodies meet in the coalescer. Every answer is either a well-formed success (JSON completion or SSE ending
in [DONE]) or an error in OpenAI's shape `{"error": {"message", "type", "code"}}`; the two keys never get the same
completion (the stand-in draws a fresh id per generation); afterwards no slot is left busy and nobody waits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lpcache.config import BackendConfig, Settings
from lpcache.mock_llama import MockConfig, MockHandle, start_mock
from lpcache.workloads.soak import KEYS

from ..conftest import Proxy

EXAMPLES = 1000
MAX_DEPTH = 1100          # raw bodies nest past orjson's parse limit (1024 levels); its dump limit is 254 levels


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MockHandle, Proxy]]:
    root = tmp_path_factory.mktemp("fuzz")
    slot_dir = os.path.join(root, "slots")
    os.makedirs(slot_dir)
    mock = start_mock(MockConfig(slots=2, slot_save_path=slot_dir))
    proxy: Proxy | None = None
    try:
        proxy = Proxy(Settings(backends=(BackendConfig(mock.url, None, slot_dir),), meta_dir=os.path.join(root, "meta"),
                               host="127.0.0.1", save_retry_delay_ms=10, big_threshold_words=50, words_per_block=10,
                               coalesce_requests=True, api_keys=KEYS))
        yield mock, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        mock.stop()


# ---- strategies ----

scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

huge_strings = st.builds(lambda unit, n: unit * n,
                         st.sampled_from(["word ", "é", "\U0001f600", "e\u0301 ", "\u202e\u200b", "a" * 97 + " ",
                                          "\n"]),
                         st.integers(2_000, 40_000))
unicode_strings = st.text(st.characters(codec="utf-8"), max_size=200)
strings = st.text(max_size=60) | unicode_strings | huge_strings


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


deep_values = st.builds(nested, st.integers(1, 300), scalars)   # built as objects: within Python's recursion limit

parts = (json_values
         | st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image_url", "", "TEXT"]) | json_values,
                                               "text": strings | json_values,
                                               "image_url": json_values}))
contents = (strings | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.booleans() | st.none()
            | st.dictionaries(st.text(max_size=8), json_values, max_size=3)
            | st.lists(parts, max_size=5) | deep_values)
roles = st.sampled_from(["user", "system", "assistant", "tool", "", "USER"]) | strings | json_values
message = st.fixed_dictionaries({}, optional={"role": roles, "content": contents, "name": json_values,
                                              "tool_calls": json_values})
good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                      "content": st.text(max_size=80) | unicode_strings | huge_strings})
messages = st.one_of(
    json_values.filter(lambda v: not isinstance(v, list)),      # not a list at all
    st.just([]),
    st.lists(json_values.filter(lambda v: not isinstance(v, dict)), min_size=1, max_size=4),
    st.lists(message, min_size=1, max_size=4),
    st.lists(good_message, min_size=1, max_size=3),
    st.lists(st.lists(good_message, max_size=2), min_size=1, max_size=2),  # nested arrays
)

# max_tokens as a valid number stays small: the stand-in generates that many tokens (a negative one: until its
# context is full), and a wrong type makes it fall back to its default of 16.
max_tokens = (st.integers(0, 8) | st.floats(0, 8) | st.text(max_size=5) | st.booleans() | st.none()
              | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), scalars, max_size=2))
odd_fields = {
    "model": strings | json_values,
    "stream": st.booleans() | json_values,
    "max_tokens": max_tokens,
    "temperature": json_values | deep_values,
    "stream_options": json_values | st.fixed_dictionaries({"include_usage": json_values}),
    "id_slot": json_values,
    "options": json_values | st.dictionaries(st.sampled_from(["id_slot", "x", "n_predict"]), scalars, max_size=3),
    "cache_prompt": json_values,
    "tools": json_values,
}
chat_objects = st.builds(
    lambda msgs, fields, extra: {**extra, "messages": msgs, **fields},
    messages,
    st.fixed_dictionaries({}, optional=odd_fields),
    st.dictionaries(st.text(max_size=10).filter(lambda k: k not in ("max_completion_tokens", "n_predict")),
                    json_values, max_size=3),
)


def dumps(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def damage(raw: bytes, cut: int, flip: int, byte: int) -> bytes:
    """A JSON body truncated, or with one byte replaced."""
    if not raw:
        return raw
    raw = bytearray(raw[: max(1, len(raw) - cut)])
    raw[flip % len(raw)] = byte
    return bytes(raw)


json_bodies = st.builds(dumps, json_values | chat_objects, st.booleans())
bodies = st.one_of(
    st.binary(max_size=2048),
    json_bodies,
    st.builds(dumps, chat_objects, st.booleans()),
    st.builds(dumps, chat_objects, st.booleans()),
    st.builds(damage, json_bodies, st.integers(0, 20), st.integers(0, 10_000), st.integers(0, 255)),
    st.builds(lambda d, leaf: b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": '
              + b"[" * d + leaf + b"]" * d + b"}", st.integers(1, MAX_DEPTH), st.sampled_from([b"", b"1", b"{}"])),
    st.sampled_from([b"", b"null", b"[]", b"{}", b"{", b'"x"', b"NaN", b"1e400", b"\xef\xbb\xbf{}",
                     b'{"messages": "\\ud800"}',
                     b'{"messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 1}',
                     b'{"messages": [{"role": "user", "content": "a"}], "messages": 1}']),
)

VCHAR = "".join(chr(c) for c in range(0x21, 0x7F)) + "".join(chr(c) for c in range(0x80, 0x100))


def header_value(min_words: int = 0) -> st.SearchStrategy[bytes]:
    """A value h11 lets a client send: visible bytes (obs-text included), inner spaces and tabs, none at the ends."""
    words = st.lists(st.text(VCHAR, min_size=1, max_size=40), min_size=min_words, max_size=6)
    return st.builds(lambda ws, sep: sep.join(ws).encode("latin-1"), words, st.sampled_from([" ", "\t", " \t "]))


long_values = st.builds(lambda unit, n: (unit * n)[:n].strip().encode("latin-1"),
                        st.sampled_from(["x", "ab ", "Bearer-", "\xe9"]), st.integers(500, 4000))
content_types = st.sampled_from([
    "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
    "application/json; charset=latin-1", "application/json; charset=utf-16", "*/*", "application/xml",
]).map(str.encode) | header_value()
VALID = [f"Bearer {k}".encode() for k in KEYS]
authorizations = (st.sampled_from(VALID) | st.sampled_from(VALID) | st.sampled_from(VALID)
                  | st.sampled_from([b"Bearer", b"bearer x", b"Basic Zm9vOmJhcg==", b"Bearer \xff\xfe"])
                  | st.builds(lambda v: b"Bearer " + v, header_value(1)) | header_value() | long_values)
names = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_!#$%&'*+.^`|~", min_size=1, max_size=20).map(
    lambda n: "x-fz-" + n)
headers = st.fixed_dictionaries({"authorization": authorizations}, optional={
    "content-type": content_types,
    "x-session-id": header_value() | long_values,
    "user-agent": header_value(),
    "accept": st.sampled_from([b"text/event-stream", b"application/json", b"*/*"]) | header_value(),
    "x-request-id": header_value(),
}).flatmap(lambda fixed: st.dictionaries(names, header_value(), max_size=3).map(lambda extra: {**extra, **fixed}))


# ---- checks ----

def assert_openai_error(raw: bytes, where: str) -> None:
    doc = json.loads(raw)
    assert isinstance(doc, dict) and isinstance(doc.get("error"), dict), where
    err = doc["error"]
    assert isinstance(err.get("message"), str) and isinstance(err.get("type"), str) and "code" in err, where


def completion_ids(r: httpx.Response) -> set[str]:
    """The completion ids in a 200 answer (the stand-in draws a fresh one per generation)."""
    if r.status_code != 200:
        return set()
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        return {json.loads(r.content)["id"]}
    events = [e[6:] for e in r.content.split(b"\n\n") if e.startswith(b"data: {")]
    return {json.loads(e).get("id") for e in events} - {None}


def other_key(hdrs: dict[str, bytes]) -> dict[str, bytes]:
    """The same headers with the other client key (unchanged when they hold no valid key)."""
    auth = hdrs.get("authorization")
    if auth not in VALID:
        return hdrs
    return {**hdrs, "authorization": VALID[1 - VALID.index(auth)]}


def check(client: httpx.Client, body: bytes, hdrs: dict[str, bytes]) -> httpx.Response:
    r = client.post("/v1/chat/completions", content=body, headers=hdrs)
    where = f"status={r.status_code} body={r.content[:400]!r}"
    assert b"Traceback" not in r.content, where
    # A healthy stand-in and one request at a time: nothing should be unreachable or busy (502/503), and a
    # malformed request is the client's fault (4xx) on either side, never a server error.
    assert r.status_code < 500, where
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), where
        assert_openai_error(r.content, where)
    else:
        assert r.status_code == 200, where
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert r.content.endswith(b"data: [DONE]\n\n"), where
        else:
            doc = json.loads(r.content)
            assert isinstance(doc["choices"][0]["message"], dict), where
    return r


def test_malformed_requests_never_get_a_5xx(servers: tuple[MockHandle, Proxy]) -> None:
    _, proxy = servers
    statuses: dict[int, int] = {}
    shared = 0
    # A fresh connection per request: an example that made the server close its connection cannot break the next.
    client = httpx.Client(base_url=proxy.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
    pool = ThreadPoolExecutor(3)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                     HealthCheck.large_base_example])
    @given(body=bodies, hdrs=headers)
    def run(body: bytes, hdrs: dict[str, bytes]) -> None:
        nonlocal shared
        mine, theirs, again = pool.map(lambda h: check(client, body, h), [hdrs, other_key(hdrs), hdrs])
        for r in (mine, theirs, again):
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if other_key(hdrs) is not hdrs:
            assert not (completion_ids(mine) | completion_ids(again)) & completion_ids(theirs), \
                "one answer went to both client keys"
        shared += bool(completion_ids(mine) & completion_ids(again))   # the same client: may share one call

    try:
        run()
    finally:
        client.close()
        pool.shutdown()
    ran = sum(statuses.values()) // 3
    print(f"\nfuzz: {ran} examples, statuses {dict(sorted(statuses.items()))}, "
          f"same-key pairs that shared an answer {shared}")
    assert ran >= EXAMPLES
    assert statuses.get(200, 0) > 0, "no example reached the backend"
    proxy.settle()
    assert proxy.busy_slots() == []
    assert proxy.pipeline.pool.waiting == 0


@pytest.mark.parametrize("depth", [100, 253, 254, 600, 1023, 1100])
def test_a_deeply_nested_field_is_not_a_server_error(servers: tuple[MockHandle, Proxy], depth: int) -> None:
    """orjson parses JSON nested up to 1024 levels but dumps at most 254: a body lpcache accepted must not fail
    when it is sent on to the backend. (`depth` arrays inside the body object: depth + 1 levels.)"""
    _, proxy = servers
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": ' + b"[" * depth + b"]" * depth
    r = httpx.post(f"{proxy.url}/v1/chat/completions", content=body + b"}",
                   headers={"content-type": "application/json", "authorization": VALID[0].decode()}, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_openai_error(r.content, r.text)
    proxy.settle()
    assert proxy.busy_slots() == []
