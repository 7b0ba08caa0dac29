"""The RAM check's reading of the server's answers (`backends.ram_check`): what the third request took from the
server's cache decides, whatever the tokenizer (a BOS token or not, few tokens or many)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from lpcache.backends.ram_check import AGAIN, NUDGE, PROMPTS, copy_to_ram, ram_cache_found
from lpcache.errors import ProxyError


class Answer:
    def __init__(self, doc: Any) -> None:
        self.raw = doc if isinstance(doc, bytes) else orjson.dumps(doc)

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        return self.raw


class FakeServer:
    """Answers each `/completion` with the next (cache_n, prompt_n), and notes what it was sent."""

    def __init__(self, *timings: tuple[int, int] | Any) -> None:
        self.timings = list(timings)
        self.sent: list[tuple[str, int, str]] = []
        self.url = "http://fake:8080"

    async def chat(self, body: dict[str, Any], slot: int, path: str = "") -> Answer:
        self.sent.append((body["prompt"], slot, path))
        step = self.timings.pop(0)
        if isinstance(step, Exception):
            raise step
        if not isinstance(step, tuple):
            return Answer(step)
        cached, computed = step
        return Answer({"content": "x", "timings": {"cache_n": cached, "prompt_n": computed}})


async def check(*timings: Any) -> tuple[bool | None, FakeServer]:
    server = FakeServer(*timings)
    return await ram_cache_found(server, 1), server  # type: ignore[arg-type]


async def test_three_prompts_pinned_to_the_slot_A_then_B_then_A_again() -> None:
    found, server = await check((0, 4), (0, 1), (4, 2))
    a, b = PROMPTS
    assert server.sent == [(a, 1, "/completion"), (b, 1, "/completion"), (a + AGAIN, 1, "/completion")]
    assert found is True


@pytest.mark.parametrize("third, found", [
    ((4, 2), True),     # SmolLM2: A's 4 tokens back from the RAM, " Again." computed
    ((3, 2), True),     # a tokenizer that makes A 3 tokens and the third 5
    ((2, 2), True),     # ... or A 2 tokens and the third 4
    ((5, 2), True),     # a BOS token: BOS and A's 4
    ((0, 6), False),    # --cache-ram 0: the slot holds B, which shares nothing with the third
    ((1, 6), False),    # --cache-ram 0 with a BOS token both prompts start with
    ((1, 1), False),    # one token cached is never a RAM hit, whatever its share
    ((2, 5), False),    # less than half the third's prompt: not the RAM giving A back
])
async def test_the_third_requests_cache_n_decides(third: tuple[int, int], found: bool) -> None:
    assert (await check((0, 4), (0, 1), third))[0] is found


@pytest.mark.parametrize("answers", [
    [(0, 4), (0, 1), {"content": "x"}],                             # no timings: not llama-server's answer
    [(0, 4), (0, 1), {"timings": {"cache_n": "4", "prompt_n": 2}}],  # not numbers
    [(0, 4), (0, 1), b"not json"],
    [{"content": "x"}, (0, 1), (4, 2)],                               # the first one did not say either
])
async def test_unknown_when_the_server_does_not_answer_as_llama_server(answers: list[Any]) -> None:
    assert (await check(*answers))[0] is None


async def test_unknown_when_a_request_fails() -> None:
    found, server = await check((0, 4), ProxyError("loading model", status=503, type="unavailable_error"))
    assert found is None
    assert len(server.sent) == 2   # the third was not sent


async def test_copy_to_ram_sends_the_tiny_prompt_to_the_slot() -> None:
    server = FakeServer((0, 1))
    assert await copy_to_ram(server, 0) is True  # type: ignore[arg-type]
    assert server.sent == [(NUDGE, 0, "/completion")]
    failing = FakeServer(ProxyError("connection reset", status=502))
    assert await copy_to_ram(failing, 0) is False  # type: ignore[arg-type]
