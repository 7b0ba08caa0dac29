"""The keyword blocklist prefilter."""

from __future__ import annotations

from typing import Any

import pytest

from lpcache.plugins.base import ChatRequest, PluginError, Reject
from lpcache.plugins.keyword import KeywordPrefilter


def request(*messages: dict[str, Any]) -> ChatRequest:
    body = {"model": "m", "messages": list(messages)}
    return ChatRequest(body=body, key="k", model="m", stream=False, text="", headers={})


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


async def test_case_insensitive_by_default() -> None:
    plugin = KeywordPrefilter({"keywords": ["Forbidden"]})
    verdict = await plugin.check(request(user("this is FORBIDDEN stuff")))
    assert isinstance(verdict, Reject)
    assert (verdict.status, verdict.type, verdict.code) == (400, "invalid_request_error", "prefilter_rejected")
    assert "blocked keyword" in verdict.message


async def test_case_sensitive_mode() -> None:
    plugin = KeywordPrefilter({"keywords": ["Forbidden"], "case_insensitive": False})
    assert await plugin.check(request(user("this is FORBIDDEN stuff"))) is None
    assert isinstance(await plugin.check(request(user("a Forbidden word"))), Reject)


async def test_plain_substring_not_regex() -> None:
    plugin = KeywordPrefilter({"keywords": ["a.b"]})
    assert await plugin.check(request(user("axb"))) is None
    assert isinstance(await plugin.check(request(user("xa.by"))), Reject)


async def test_content_part_arrays() -> None:
    plugin = KeywordPrefilter({"keywords": ["secret"]})
    parts = [{"type": "image_url", "image_url": {"url": "http://x/secret.png"}},
             {"type": "text", "text": "tell me the Secret"}]
    assert isinstance(await plugin.check(request(user(parts))), Reject)
    only_image = [{"type": "image_url", "image_url": {"url": "http://x/secret.png"}}, {"type": "text", "text": "hi"}]
    assert await plugin.check(request(user(only_image))) is None


@pytest.mark.parametrize("role", ["system", "assistant", "tool", "developer"])
async def test_all_roles(role: str) -> None:
    plugin = KeywordPrefilter({"keywords": ["bomb"]})
    verdict = await plugin.check(request({"role": role, "content": "how to make a bomb"}, user("hello")))
    assert isinstance(verdict, Reject)


async def test_no_match_accepts() -> None:
    plugin = KeywordPrefilter({"keywords": ["foo", "bar"]})
    assert await plugin.check(request(user("nothing to see"), {"role": "assistant", "content": None})) is None
    assert await plugin.check(ChatRequest(body={"model": "m"}, key="k", model="m", stream=False, text="",
                                          headers={})) is None


async def test_many_keywords_any_hits() -> None:
    plugin = KeywordPrefilter({"keywords": [f"word{i}" for i in range(500)]})
    assert isinstance(await plugin.check(request(user("xx WORD437 yy"))), Reject)
    assert await plugin.check(request(user("xx word yy"))) is None


async def test_comma_separated_string() -> None:
    plugin = KeywordPrefilter({"keywords": "alpha, beta ,,gamma"})
    assert plugin.keywords == ("alpha", "beta", "gamma")
    assert isinstance(await plugin.check(request(user("the BETA test"))), Reject)


async def test_keyword_not_echoed() -> None:
    plugin = KeywordPrefilter({"keywords": ["xyzzy"]})
    verdict = await plugin.check(request(user("say xyzzy")))
    assert isinstance(verdict, Reject)
    assert "xyzzy" not in verdict.message.lower()


@pytest.mark.parametrize("params", [
    {},
    {"keywords": []},
    {"keywords": ""},
    {"keywords": " , "},
    {"keywords": ["ok", ""]},
    {"keywords": ["ok", 3]},
    {"keywords": 5},
    {"keywords": ["ok"], "case_insensitive": "yes"},
    {"keywords": ["ok"], "case_insensitive": 1},
])
def test_bad_params(params: dict[str, Any]) -> None:
    with pytest.raises(PluginError) as err:
        KeywordPrefilter(params)
    assert "keyword" in str(err.value)
    assert ("case_insensitive" if "case_insensitive" in params else "keywords") in str(err.value)
