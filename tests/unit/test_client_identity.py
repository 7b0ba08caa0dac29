"""Who asks: client identities are digests, prefilters see no credentials and keep answers only when they want them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lpcache.flow.attempts import Attempts
from lpcache.flow.guard import client_credential, client_identity, passed_on, shown_headers
from lpcache.plugins.base import MAX_ANSWER_BYTES, Answer, ChatRequest, Prefilter
from lpcache.plugins.keyword import KeywordPrefilter


class MultiHeaders(dict[str, str]):
    """Headers as Starlette gives them: `items()` has every line, a repeated name more than once."""

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        super().__init__(lines[:1])
        self.lines = lines

    def items(self) -> Any:
        return list(self.lines)


def auth(value: str | None = None, **more: str) -> dict[str, str]:
    return ({"authorization": value} if value is not None else {}) | {k.replace("_", "-"): v for k, v in more.items()}


def test_identity_with_client_keys_is_a_digest_of_the_key() -> None:
    one = client_identity(auth("Bearer key-one"), keys_held=True)
    assert one is not None and "key-one" not in one and len(one) == 32
    assert client_identity(auth("bearer  key-one"), keys_held=True) == one          # the same key, however written
    assert client_identity(auth(x_api_key="key-one"), keys_held=True) == one        # Anthropic's clients: X-Api-Key
    assert client_identity(auth("Bearer key-two"), keys_held=True) not in (None, one)
    assert client_identity(auth(), keys_held=True) is None
    # as llama-server reads them: a key in X-Api-Key beside an Authorization does not count; a bare key, or
    # "Bearer <key>" in X-Api-Key, does
    assert client_identity(auth("Basic eDp5", x_api_key="key-one"), keys_held=True) not in (None, one)
    assert client_identity(auth("key-one"), keys_held=True) == one
    assert client_identity(auth(x_api_key="Bearer key-one"), keys_held=True) == one
    assert client_identity(auth("Bearer "), keys_held=True) is None


def test_identity_without_client_keys_is_a_digest_of_the_header_that_goes_on() -> None:
    right, wrong = client_identity(auth("Bearer right"), False), client_identity(auth("Bearer wrong"), False)
    assert right is not None and wrong is not None and right != wrong and "right" not in right
    assert client_identity(auth("Basic dTpw"), False) not in (None, right)
    assert client_identity(auth(x_api_key="right"), False) not in (None, right)
    assert client_identity(auth(), False) is None and client_identity(auth(""), False) is None


def test_the_credential_goes_on_without_client_keys_and_stays_here_with_them() -> None:
    for headers in (auth("Bearer k"), auth(x_api_key="k"), auth("Bearer k", x_api_key="other")):
        first = next(iter(headers.items()))
        assert client_credential(headers, keys_held=False) == dict([first])
        assert client_credential(headers, keys_held=True) == {}
        assert passed_on(headers | {"x-session-id": "s"}, keys_held=True) == {"x-session-id": "s"}
        assert passed_on(headers, keys_held=False) == headers
    # a repeated header goes on with its first value, the one lpcache and llama-server read
    assert passed_on(MultiHeaders([("authorization", "Bearer a"), ("authorization", "Bearer b")]), False) == {
        "authorization": "Bearer a"}


def test_prefilters_see_no_credentials() -> None:
    shown = shown_headers({"authorization": "Bearer k", "Proxy-Authorization": "x", "x-session-id": "s",
                           "X-Api-Key": "k", "cache-control": "no-cache"})
    assert shown == {"x-session-id": "s", "cache-control": "no-cache"}


def view(stream: bool = False) -> ChatRequest:
    return ChatRequest(body={"messages": []}, key="k", model="m", stream=stream, text="", headers={})


class Storing(Prefilter):
    async def answered(self, request: ChatRequest, answer: Answer) -> None:
        return None


def test_a_prefilter_wants_the_answer_only_when_it_reads_it() -> None:
    assert not Prefilter().wants_answer(view())
    assert not KeywordPrefilter({"keywords": ["x"]}).wants_answer(view())
    assert Storing().wants_answer(view())


def test_the_kept_answer_is_bounded() -> None:
    crew: Any = SimpleNamespace(request_timeout=1.0)
    attempts = Attempts(crew, {}, None, False, None, None, view())   # type: ignore[arg-type]
    attempts.tee(b"x" * 1024)
    assert attempts.collected == b"x" * 1024
    attempts.tee(b"y" * MAX_ANSWER_BYTES)                          # past the bound: nothing is kept any more
    assert attempts.collected is None
    attempts.tee(b"z")
    assert attempts.collected is None
    unwatched = Attempts(crew, {}, None, False, None, None, None)    # type: ignore[arg-type]
    unwatched.tee(b"x")
    assert unwatched.collected is None


def test_the_caller_is_read_once_with_what_each_step_reads_of_the_headers() -> None:
    """`Caller.of` at the edge: the same identity, credential, headers passed on and shown as the functions each step
    used to call on the headers, the session as sent; with client keys the key's digest owns the sessions and the
    key goes nowhere (not to llama-server, not to the plugins)."""
    from starlette.datastructures import Headers

    from lpcache.flow.guard import Caller

    raw = Headers(raw=[(b"authorization", b"Bearer sk-\xc3\xa9l\xc3\xa8ve"), (b"x-session-id", b"Chat #7 \xe2\x9c\x93"),
                       (b"x-api-key", b"other"), (b"user-agent", b"OpenAI/Python 1.60"),
                       (b"X-Session-ID", b"second value")])
    for keys_held in (False, True):
        caller = Caller.of(raw, keys_held)
        assert caller.identity == client_identity(raw, keys_held) is not None
        assert caller.credential == client_credential(raw, keys_held)
        assert caller.passed == passed_on(raw, keys_held)
        assert caller.shown == shown_headers(raw)
        assert caller.session == raw.get("x-session-id") == "Chat #7 ✓".encode().decode("latin-1"), \
            "the first X-Session-ID, as Starlette reads it (latin-1; `session_ids` reads it on)"
        assert "authorization" not in caller.shown and "x-api-key" not in caller.shown
        if keys_held:
            assert caller.owner == caller.identity and caller.credential == {}
            assert not {"authorization", "x-api-key"} & {k.lower() for k in caller.passed}
        else:
            sent = "Bearer sk-élève".encode().decode("latin-1")   # as Starlette reads a header: latin-1
            assert caller.owner is None and caller.credential == {"authorization": sent}
    assert Caller.of(Headers({}), True) == Caller(None, None, {}, {}, {}, None)
