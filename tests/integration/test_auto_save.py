"""BIG_THRESHOLD_WORDS=auto on the stand-in: short chat turns are saved where the prefill is slow (a CPU) and
nothing is written where it is fast (a GPU); a fixed threshold reports what it costs."""

from __future__ import annotations

import logging
import random
from typing import Any

import httpx

from lpcache.workloads import chats

from .conftest import mock_stats

CPU_PREFILL_MS = 4.0      # SmolLM2-135M on 2 cores: about 4 ms a token
KV_BYTES = 23_040         # SmolLM2-135M's KV cache per token (f16)


def play(proxy: Any, n_conversations: int, turns: int, seed: int = 3, words: int = 30,
         headers: Any = None) -> list[httpx.Response]:
    """Conversations taking turns (A1 B1 C1 ... A2 B2 ...), short user turns of real-looking text, the server's own
    answers fed back, as a chat client does."""
    rng = random.Random(seed)
    history: list[list[dict[str, Any]]] = [[] for _ in range(n_conversations)]
    answers = []
    for _turn in range(turns):
        for c in range(n_conversations):
            history[c].append({"role": "user", "content": chats.text(rng, words)})
            r = proxy.chat(history[c], headers=headers(c) if headers else None, max_tokens=8)
            assert r.status_code == 200, r.text
            history[c].append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            answers.append(r)
            proxy.settle()
    return answers


def metric(proxy: Any, name: str) -> float:
    total = 0.0
    for line in proxy.client.get("/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_auto_saves_short_turns_where_the_prefill_is_slow_and_restores_them(start_backend, start_proxy) -> None:
    backend = start_backend(slots=2, prefill_ms_per_token=CPU_PREFILL_MS, kv_bytes_per_token=KV_BYTES)
    proxy = start_proxy(backend, big_threshold_words=None, meta_max=0)
    answers = play(proxy, n_conversations=4, turns=3)
    stats = mock_stats(backend)
    later = answers[4:]   # each conversation's turns 2 and 3: two other conversations used both slots meanwhile
    restored = [r for r in later if r.headers["x-lpcache-restored"] == "true"]
    assert stats["saves"] >= 6, stats
    assert len(restored) >= 6, [r.headers.get("x-lpcache-restored") for r in later]
    assert metric(proxy, 'lpcache_save_decisions_total{decision="worth"}') >= 4
    # every restored turn took its whole history from the file (the conversation's previous prompt, at least): only
    # the new turn and the previous answer were computed
    for i, r in enumerate(later):
        if r in restored:
            previous = answers[i].json()["usage"]["prompt_tokens"]   # answers[i]: 4 requests before later[i]
            assert r.json()["timings"]["cache_n"] >= previous, (r.json()["timings"], previous)


def test_auto_writes_nothing_where_the_prefill_is_as_quick_as_the_disk(start_backend, start_proxy) -> None:
    """The fast profile: a prefill a hundred times quicker than the CPU's, files of a real cache's size. A fixed
    threshold below the turns' length saves every turn; auto saves none."""
    fast = start_backend(slots=2, prefill_ms_per_token=CPU_PREFILL_MS / 100, kv_bytes_per_token=KV_BYTES)
    proxy = start_proxy(fast, big_threshold_words=None, meta_max=0)
    play(proxy, n_conversations=4, turns=3, words=120)
    assert mock_stats(fast)["saves"] == 0
    assert metric(proxy, "lpcache_slot_file_bytes_total{action=\"save\"}") == 0
    decisions = {d: metric(proxy, f'lpcache_save_decisions_total{{decision="{d}"}}')
                 for d in ("worth", "probe", "not_worth", "probe_too_short")}
    assert decisions["worth"] == decisions["probe"] == 0 and decisions["probe_too_short"] >= 1, decisions


def test_a_fixed_threshold_says_what_it_costs(start_backend, start_proxy, caplog) -> None:
    backend = start_backend(slots=2, prefill_ms_per_token=CPU_PREFILL_MS, kv_bytes_per_token=KV_BYTES)
    proxy = start_proxy(backend, big_threshold_words=500, meta_max=10)
    with caplog.at_level(logging.WARNING, logger="lpcache.worth"):
        play(proxy, n_conversations=4, turns=3)
    assert mock_stats(backend)["saves"] == 0
    missed = metric(proxy, 'lpcache_prefill_missed_tokens_total{kind="threshold"}')
    seconds = metric(proxy, 'lpcache_prefill_missed_seconds_total{kind="threshold"}')
    assert missed > 100 and seconds > 0.1, (missed, seconds)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings_cost")]
    assert len(lines) == 1 and "BIG_THRESHOLD_WORDS=500" in lines[0] and "BIG_THRESHOLD_WORDS=auto" in lines[0]
