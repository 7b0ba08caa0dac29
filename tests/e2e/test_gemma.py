"""lpcache in front of a real llama-server with Gemma 3 270M, a sliding-window model (window: 512 tokens).

Without --swa-full llama-server keeps only the last window of the sliding-window layers. After a restore it cannot
resume from the restored cache: its log says "forcing full prompt re-processing due to lack of cache data" and
`timings.cache_n` is 0. lpcache must notice the first such restore, warn once naming --swa-full, and stop saving and
restoring for that backend and model. With --swa-full the restored cache is reused.

One slot (`-np 1`) and no RAM prompt cache (`--cache-ram 0`): a second conversation pushes the first out of the
slot, and only a restore from disk can bring it back. The model comes from scripts/get-llama-server.sh (GEMMA3_GGUF).
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from lpcache.config import BackendConfig, Settings
from lpcache.flow.record import RequestRecord
from lpcache.workloads.harness import LlamaServer, gemma_path

from ..conftest import Proxy
from ..conftest import figures as show
from .test_real_llama import body, conversation, follow_up, shared, tokens

pytestmark = pytest.mark.e2e

WINDOW = 512        # Gemma 3 270M's sliding window (n_swa in llama-server's log)
WORDS = 540         # over BIG_THRESHOLD_WORDS (500), so saved; about 640 tokens, past the window
MAX_TOKENS = 8      # generating is slow on 2 cores (a 262k-token vocabulary): short answers
NOT_REUSED = "forcing full prompt re-processing"   # llama-server's log (at -lv 4) when it cannot resume a slot


@contextmanager
def gemma(tmp_path: Path, *flags: str) -> Iterator[LlamaServer]:
    """llama-server with Gemma 3 270M (the second -m wins), one slot, no RAM prompt cache, its log at -lv 4."""
    model = gemma_path()
    with LlamaServer(str(tmp_path / "slots"), n_slots=1, ctx=4096, cache_ram=0,
                     extra=["-m", model, "-lv", "4", *flags]) as server:
        assert httpx.get(f"{server.url}/props", timeout=30).json()["model_path"] == model
        yield server


@contextmanager
def proxy_for(server: LlamaServer, tmp_path: Path) -> Iterator[tuple[Proxy, Counter[str]]]:
    """lpcache in front of `server`, and a count of the slot actions (save, restore) it sends to the server."""
    proxy = Proxy(Settings(backends=(BackendConfig(server.url, None, server.slot_save_path),),
                           meta_dir=str(tmp_path / "meta"), host="127.0.0.1"))
    sent: Counter[str] = Counter()
    client = proxy.pipeline.backends[0].client
    real = client.slot_action

    async def counted(slot: int, action: str, filename: str | None = None, model: str | None = None,
                      timeout: float | None = None) -> Any:
        sent[action] += 1
        return await real(slot, action, filename, model, timeout)

    client.slot_action = counted  # type: ignore[method-assign]
    try:
        yield proxy, sent
    finally:
        proxy.stop()


def turn(proxy: Proxy, messages: list[dict[str, Any]]) -> tuple[str, RequestRecord]:
    """One request through lpcache, waited for to the end (its save included): the answer and its record."""
    n = len(proxy.records) + 1
    r = proxy.post(body(messages, max_tokens=MAX_TOKENS))
    assert r.status_code == 200, r.text
    proxy.wait_finished(n, timeout=120)
    return r.json()["choices"][0]["message"]["content"], proxy.records[n - 1]


def metric(proxy: Proxy, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", proxy.client.get("/metrics").text, re.M)
    assert found is not None, name
    return float(found.group(1))


def figures(what: str, record: RequestRecord, common: int | None = None) -> None:
    """The figures CI's log shows: what was restored, what the server took from the slot, what it computed."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} ms"

    show(f"\n  {what}: restored={record.restored} restored_tokens={record.restored_tokens} "
          f"restore={ms(record.restore_ms)} shared_prefix={common} cache_n={record.cache_n} "
          f"prompt_n={record.prompt_n} prefill={ms(record.prefill_ms)} saved={record.saved}")


def slot_files(server: LlamaServer) -> dict[str, int]:
    folder = server.slot_save_path or ""
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)}


def push_out(proxy: Proxy, first: list[dict[str, Any]], other: list[dict[str, Any]]) -> tuple[str, str]:
    """Conversation A, then B, which takes the only slot: both are saved, A is no longer in the slot."""
    answer_a, a = turn(proxy, first)
    answer_b, b = turn(proxy, other)
    assert a.big and a.saved is True and not a.restored
    assert b.big and b.saved is True and not b.restored
    assert a.slot == b.slot == 0
    return answer_a, answer_b


def test_without_swa_full_three_useless_restores_stop_restores(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The verdict rests on evidence: restores of three different files that match their prompts exactly, each
    followed by a full re-computation. Two are not enough (one request must never turn caching off)."""
    caplog.set_level(logging.WARNING)
    with gemma(tmp_path) as server, proxy_for(server, tmp_path) as (proxy, sent):
        firsts = [conversation(101 + i, WORDS) for i in range(3)]
        assert len(tokens(server.url, firsts[0])) > WINDOW + 64   # past the window: the restore cannot be resumed
        answers = [turn(proxy, m)[0] for m in firsts]               # each pushes the previous out of the only slot
        assert sent == {"save": 3}

        # Each conversation's next turn: its cache is restored from disk, and the server computes it all anyway.
        seconds = []
        for i, (first, answer) in enumerate(zip(firsts, answers, strict=True)):
            nxt = follow_up(first, answer)
            answer2, rec = turn(proxy, nxt)
            seconds.append((nxt, answer2))
            figures(f"restore {i + 1} without --swa-full", rec, shared(tokens(server.url, first),
                                                                      tokens(server.url, nxt)))
            assert rec.restored is True and rec.restore_exact is True
            assert rec.restored_tokens is not None and rec.restored_tokens > WINDOW
            assert rec.cache_n is not None and rec.cache_n < 0.1 * rec.restored_tokens
            assert rec.restore_reused is False
            verdicts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restore_not_reused")]
            assert len(verdicts) == (1 if i == 2 else 0)
            assert bool(rec.saved) is (i < 2)                      # saving stops with the verdict
        assert "--swa-full" in verdicts[0]
        assert server.log_text().count(NOT_REUSED) == 3           # the server's own word: no restore was used
        assert metric(proxy, "lpcache_restores_not_reused_total") == 3
        assert metric(proxy, "lpcache_reuse_verdicts_total") == 1
        assert sent == {"save": 5, "restore": 3}
        files = slot_files(server)

        # More turns, each with a saved cache that shares most of its prompt: none is restored or saved.
        for nxt, answer2 in seconds[:2]:
            _, rec = turn(proxy, follow_up(nxt, answer2))
            figures("later turn", rec)
            assert rec.big and not rec.restored and not rec.saved
            assert rec.prompt_n is not None and rec.prompt_n > WINDOW   # computed in full, as expected now
        assert sent == {"save": 5, "restore": 3}
        assert slot_files(server) == files
        assert server.log_text().count(NOT_REUSED) == 3
        assert len([r for r in caplog.records if r.getMessage().startswith("restore_not_reused")]) == 1


def test_with_swa_full_a_restore_is_reused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with gemma(tmp_path, "--swa-full") as server, proxy_for(server, tmp_path) as (proxy, sent):
        a1, b1 = conversation(101, WORDS), conversation(102, WORDS)
        answer_a, _ = push_out(proxy, a1, b1)

        a2 = follow_up(a1, answer_a)
        a2_tokens = tokens(server.url, a2)
        common = shared(tokens(server.url, a1), a2_tokens)
        assert common > WINDOW + 64
        _, rec = turn(proxy, a2)
        figures("restore with --swa-full", rec, common)
        assert rec.restored is True and rec.restore_reused is True
        assert rec.cache_n is not None and rec.cache_n >= 0.9 * common
        assert rec.prompt_n is not None and rec.prompt_n <= len(a2_tokens) - common + 1   # only the new part
        assert rec.saved is True                            # saving goes on
        assert sent == {"save": 3, "restore": 1}
        assert NOT_REUSED not in server.log_text()
        assert not [r for r in caplog.records if r.getMessage().startswith("restore_not_reused")]
        assert metric(proxy, "lpcache_restores_not_reused_total") == 0
        assert proxy.pipeline.reuse.turned_off == 0
