"""Cache decisions on realistic traffic, against the real llama-server (b11434, SmolLM2; Gemma 3 for the model swap).

The requests come from `lpcache.workloads.chats` (mixed case, punctuation, Unicode, code, several system messages,
tools, tool calls and results, names, content parts). Every answer that says it hit or restored must get at least 90 %
of the tokens it shares, exactly (llama-server's own /apply-template and /tokenize), with what the slot or the file
held; near-duplicates never turn caching off; a request lpcache passes on (completions, Messages) leaves no false hit
behind; a model swapped behind the URL is never restored into; a router caches in prefix mode.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lpcache.cache.meta_files import prefix_file
from lpcache.config import BackendConfig, Settings
from lpcache.workloads import chats
from lpcache.workloads.harness import LlamaServer, gemma_path

from ..conftest import Proxy, figures

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6


def tokens(url: str, body: dict[str, Any]) -> list[int]:
    """The exact prompt tokens llama-server computes for a chat body (its template sees the tools too)."""
    template = {k: v for k, v in body.items() if k in ("messages", "tools", "tool_choice")}
    prompt = httpx.post(f"{url}/apply-template", json=template, timeout=60).json()["prompt"]
    return httpx.post(f"{url}/tokenize", json={"content": prompt, "add_special": True},  # type: ignore[no-any-return]
                      timeout=60).json()["tokens"]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Ledger:
    """Sends chat bodies through lpcache and checks each claimed hit against what the slot or file really held."""

    def __init__(self, proxy: Proxy, server: str) -> None:
        self.proxy, self.server = proxy, server
        self.slots: dict[str, list[int]] = {}
        self.files: dict[str, list[int]] = {}
        self.hits = 0

    def send(self, body: dict[str, Any], what: str = "") -> httpx.Response:
        n = len(self.proxy.records)
        r = self.proxy.client.post("/v1/chat/completions", json={**body, "max_tokens": MAX_TOKENS, "temperature": 0},
                                   timeout=300)
        assert r.status_code == 200, r.text
        self.proxy.wait_finished(n + 1, timeout=300)
        record = self.proxy.records[n]
        mine = tokens(self.server, body)
        cache_n = r.json()["timings"]["cache_n"]
        if r.headers["x-lpcache-cache-hit"] == "true":
            held = (self.files[record.restore_file] if record.restored and record.restore_file
                    else self.slots[r.headers["x-lpcache-slot"]])
            common = lcp(held, mine)
            figures(f"  {what or 'request'}: hit, restored={record.restored} shared={common} cache_n={cache_n} "
                    f"prompt_n={r.json()['timings']['prompt_n']}")
            assert cache_n >= 0.9 * common, (what, cache_n, common)
            self.hits += 1
        self.slots[r.headers["x-lpcache-slot"]] = mine
        if record.saved and record.save_file:
            self.files[record.save_file] = mine
        return r


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """-np 1, the RAM prompt cache off: a second conversation pushes the first out, only a file brings it back."""
    with LlamaServer(str(tmp_path_factory.mktemp("slots")), n_slots=1, cache_ram=0) as server:
        yield server


def proxy_for(server: LlamaServer, tmp_path: Path, **settings: Any) -> Proxy:
    return Proxy(Settings(backends=(BackendConfig(server.url, None, server.slot_save_path),),
                          meta_dir=str(tmp_path / "meta"), host="127.0.0.1", big_threshold_words=200, **settings))


def test_near_duplicates_never_turn_caching_off_and_every_hit_is_one(one_slot: LlamaServer, tmp_path: Path) -> None:
    proxy = proxy_for(one_slot, tmp_path)
    try:
        ledger = Ledger(proxy, one_slot.url)
        h = chats.harness(1, n_chars=1200, n_tools=3)
        base = chats.request(11, 350, h, turns=3, tool_rate=0.7)
        other = chats.request(12, 300)
        ledger.send(base, "base")
        near = chats.variants(base, seed=3)
        for kind in ("case", "punctuation", "role", "tool_added", "tool_arguments", "name"):
            if kind not in near:
                continue
            ledger.send(other, "other")           # pushes the last one out of the only slot
            ledger.send(near[kind], kind)
            assert proxy.records[-1].restore_reused is not False, kind
        assert proxy.pipeline.reuse.turned_off == 0
        assert not [r for r in proxy.records if r.restore_reused is False]
        assert ledger.hits >= 3
    finally:
        proxy.stop()


def test_a_tool_conversation_is_restored_turn_after_turn(one_slot: LlamaServer, tmp_path: Path) -> None:
    proxy = proxy_for(one_slot, tmp_path)
    try:
        ledger = Ledger(proxy, one_slot.url)
        h = chats.harness(2, n_chars=1500, n_tools=4)
        conv = chats.Conversation(21, h, turns=4, n_words=700, tool_rate=0.5)
        other = chats.Conversation(22, h, turns=4, n_words=700, tool_rate=0.5)
        for turn in range(4):
            answer = ledger.send(conv.body, f"conversation, turn {turn}").json()["choices"][0]["message"]["content"]
            ledger.send(other.body, f"other, turn {turn}")
            if turn < 3:
                conv.advance(answer or "Done.")
                other.advance("Noted.")
        restored = [r for r in proxy.records if r.restored]
        assert len(restored) >= 2 and all(r.restore_exact and r.restore_reused for r in restored)
    finally:
        proxy.stop()


def test_a_completion_between_two_chat_turns_leaves_no_false_hit(one_slot: LlamaServer, tmp_path: Path) -> None:
    proxy = proxy_for(one_slot, tmp_path)
    try:
        ledger = Ledger(proxy, one_slot.url)
        conv = chats.Conversation(31, chats.harness(3, n_chars=1200), turns=2, n_words=500)
        answer = ledger.send(conv.body, "first turn").json()["choices"][0]["message"]["content"]
        r = proxy.client.post("/v1/completions", json={"prompt": chats.text(random.Random(5), 300),
                                                       "max_tokens": 4}, timeout=300)
        assert r.status_code == 200
        proxy.wait_finished(2, timeout=300)
        held = proxy.pipeline.pool.slots[0].content              # what it holds now: the completion's prompt
        completion = next(record for record in proxy.records if record.api == "completions")
        assert held is not None and held.prompt is not None and held.prompt.key == completion.key
        r = ledger.send(conv.advance(answer or "Done."), "next turn after a completion")
        assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
    finally:
        proxy.stop()


def test_a_messages_request_the_server_places_itself_leaves_no_false_hit(tmp_path: Path) -> None:
    """/v1/messages drops the slot pin in llama-server: the server puts it in a slot of its choice. lpcache checks
    that backend's slots (GET /slots) before their next use, so a conversation whose slot was taken is restored from
    its file instead of being claimed as a hit."""
    with LlamaServer(str(tmp_path / "slots"), n_slots=2, cache_ram=0) as server:
        proxy = proxy_for(server, tmp_path)
        try:
            ledger = Ledger(proxy, server.url)
            convs = [chats.Conversation(41 + i, turns=2, n_words=450) for i in range(2)]
            answers = [ledger.send(c.body, f"conversation {i}").json()["choices"][0]["message"]["content"]
                       for i, c in enumerate(convs)]
            for text in ("Tell me a story about a lighthouse keeper.", "Write a haiku about the sea, then explain."):
                m = proxy.client.post("/v1/messages", json={"model": "llama.cpp", "max_tokens": 4, "messages": [
                    {"role": "user", "content": text * 20}]}, timeout=300)
                assert m.status_code == 200, m.text
            proxy.settle()
            for i, c in enumerate(convs):
                ledger.send(c.advance(answers[i] or "Done."), f"conversation {i} after Messages requests")
            assert proxy.busy_slots() == []
        finally:
            proxy.stop()


def test_a_model_swapped_behind_the_url_is_never_restored_into(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import lpcache.backends.slot_truth

    monkeypatch.setattr(lpcache.backends.slot_truth, "SLOTS_TRUSTED_FOR", 0.0)   # check before every request
    slots = str(tmp_path / "slots")
    conv = chats.Conversation(51, turns=2, n_words=450)
    first = LlamaServer(slots, n_slots=1, cache_ram=0)
    proxy = proxy_for(first, tmp_path)
    try:
        assert proxy.client.post("/v1/chat/completions", json={**conv.body, "max_tokens": 4}).status_code == 200
        proxy.settle()
        saved = proxy.records[-1].save_file
        assert saved and os.path.exists(os.path.join(slots, saved))
        port = first.port
        first.stop()
        with LlamaServer(slots, port=port, n_slots=1, cache_ram=0, ctx=4096, extra=["-m", gemma_path()]):
            r = proxy.client.post("/v1/chat/completions", json={**conv.advance("An answer."), "max_tokens": 4},
                                  timeout=300)
            assert r.status_code == 200, r.text
            proxy.settle()
            record = proxy.records[-1]
            assert record.restored is None and r.headers["x-lpcache-cache-hit"] == "false"
            assert r.json()["timings"]["cache_n"] == 0
            assert proxy.pipeline.backends[0].fingerprint not in {e.fingerprint
                                                                  for e in proxy.pipeline.index._entries.values()
                                                                  if e.key == saved}
    finally:
        proxy.stop()
        first.stop()


def post(proxy: Proxy, body: dict[str, Any]) -> tuple[httpx.Response, Any]:
    r = proxy.client.post("/v1/chat/completions", json={**body, "max_tokens": 4, "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    proxy.settle()
    return r, proxy.records[-1]


def test_files_of_another_kv_cache_type_are_not_offered_after_the_server_changed_it(tmp_path: Path) -> None:
    """The same model and build behind the URL, restarted with a q8_0 KV cache (`-ctk q8_0 -ctv q8_0`) after saving
    with the default f16: llama-server refuses such a file (400). One restore of an old file is refused, no other
    old file is offered after it, and the new server's own files are restored."""
    slots = str(tmp_path / "slots")
    old = [chats.Conversation(81 + i, turns=2, n_words=450) for i in range(2)]
    first = LlamaServer(slots, n_slots=1, cache_ram=0)
    proxy = proxy_for(first, tmp_path)
    try:
        for conv in old:
            _, record = post(proxy, conv.body)
            assert record.saved and record.save_file, record
        port = first.port
        first.stop()
        with LlamaServer(slots, port=port, n_slots=1, cache_ram=0, extra=["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]):
            _, record = post(proxy, old[0].advance("An answer."))
            assert record.restored is False, record   # offered (nothing told yet), refused by the server
            _, record = post(proxy, old[1].advance("An answer."))
            assert record.restored is None and not record.restore_file, "the other old file is not offered"
            fresh = chats.Conversation(91, turns=3, n_words=450)
            _, record = post(proxy, fresh.body)
            _, record = post(proxy, chats.request(93, 450))   # the slot holds another conversation now
            r, record = post(proxy, fresh.advance("An answer."))
            assert record.restored is True and r.headers["x-lpcache-cache-hit"] == "true", record
            assert r.json()["timings"]["cache_n"] > 0
            figures(f"  KV type changed: restore_failed once, then old files passed over; new file restored with "
                    f"cache_n={r.json()['timings']['cache_n']}")
    finally:
        proxy.stop()
        first.stop()


def test_a_sliding_window_models_short_file_is_restored_after_a_long_save(tmp_path: Path) -> None:
    """Gemma 3 (a window of 512) saves 18.5 KB a token up to its window and fewer past it (5.7 KB at 3,000): one
    layout all the same, so its short file is still offered, and restored, after the server saved a long one."""
    slots = str(tmp_path / "slots")
    short, long = chats.Conversation(97, turns=2, n_words=260), chats.Conversation(98, turns=2, n_words=1600)
    with LlamaServer(slots, n_slots=1, cache_ram=0, ctx=8192, extra=["-m", gemma_path(), "--swa-full"]) as server:
        proxy = Proxy(Settings(backends=(BackendConfig(server.url, None, slots),), meta_dir=str(tmp_path / "meta"),
                               host="127.0.0.1", big_threshold_words=50))
        try:
            sizes = []
            for conv in (short, long):
                r, record = post(proxy, conv.body)
                assert record.saved and record.save_file, record
                entry = proxy.pipeline.index._entries[record.save_file]
                sizes.append((entry.n_tokens, entry.size))
            (t_short, b_short), (t_long, b_long) = sizes
            assert t_short < 512 < t_long and b_short / t_short > 1.5 * b_long / t_long, sizes
            r, record = post(proxy, short.advance("An answer."))
            assert record.restored is True and r.headers["x-lpcache-cache-hit"] == "true", record
            assert r.json()["timings"]["cache_n"] > 0
            figures(f"  Gemma 3 files: {t_short} tokens in {b_short:,} bytes, {t_long} in {b_long:,}; the short one "
                    f"restored after the long save, cache_n={r.json()['timings']['cache_n']}")
        finally:
            proxy.stop()


def test_a_file_larger_than_the_slots_context_is_not_offered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversation saved on a server with a large context; the server restarted with a smaller one (`-c 2048`):
    the file holds more tokens than a slot there, so a prompt sharing its start is computed, not restored into a
    failure."""
    import lpcache.backends.slot_truth

    monkeypatch.setattr(lpcache.backends.slot_truth, "SLOTS_TRUSTED_FOR", 0.0)   # this restart takes under 1 s
    slots = str(tmp_path / "slots")
    conv = chats.Conversation(95, turns=3, n_words=2400)
    first_turn = conv.body
    conv.advance("An answer, short.")
    whole = conv.advance("Another answer, short.")
    first = LlamaServer(slots, n_slots=1, cache_ram=0, ctx=8192)
    proxy = proxy_for(first, tmp_path)
    try:
        r, record = post(proxy, whole)
        assert record.saved and r.json()["usage"]["prompt_tokens"] > 2048, r.json()["usage"]
        post(proxy, chats.request(96, 450))   # the slot holds another conversation: only the file holds it
        port = first.port
        first.stop()
        with LlamaServer(slots, port=port, n_slots=1, cache_ram=0, ctx=2048):
            r, record = post(proxy, first_turn)
            assert r.json()["usage"]["prompt_tokens"] < 2048
            assert proxy.pipeline.backends[0].loadable.n_ctx == 2048
            assert record.restored is None and not record.restore_file, record
    finally:
        proxy.stop()
        first.stop()


def test_a_router_saves_and_restores_in_prefix_mode(tmp_path: Path) -> None:
    from .test_real_router import RealRouter

    router = RealRouter(tmp_path, ("a", "b"), 2)
    proxy = Proxy(Settings(backends=(BackendConfig(router.url, None, str(router.slot_dir)),),
                           meta_dir=str(tmp_path / "meta"), host="127.0.0.1", big_threshold_words=80))
    try:   # the router's instances have 1,024 tokens a slot: short conversations
        conv = chats.Conversation(61, turns=2, n_words=220)
        others = [chats.request(62 + i, 150) for i in range(2)]

        def send(body: dict[str, Any]) -> httpx.Response:
            r = proxy.client.post("/v1/chat/completions", json={**body, "model": "a", "max_tokens": 4}, timeout=300)
            assert r.status_code == 200, r.text
            proxy.settle()
            return r

        answer = send(conv.body).json()["choices"][0]["message"]["content"]
        for body in others:                       # both of a's slots now hold others
            send(body)
        r = send(conv.advance(answer or "Done."))
        assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
        prompt = r.json()["timings"]["cache_n"] + r.json()["timings"]["prompt_n"]
        figures(f"\nrouter, prefix mode: restored, cache_n {r.json()['timings']['cache_n']} of {prompt}")
        assert r.json()["timings"]["cache_n"] >= 0.5 * prompt
        last = proxy.records[-1].save_file
        assert last and os.path.exists(os.path.join(str(router.slot_dir), last))     # the new turn's file ...
        assert not os.path.exists(os.path.join(str(router.slot_dir), proxy.records[0].save_file or ""))  # supersedes
        fingerprint = proxy.pipeline.backends[0].model_fingerprints["a"]
        assert proxy.records[0].save_file == prefix_file(proxy.records[0].key, fingerprint)
    finally:
        proxy.stop()
        router.stop()
