"""Cache decisions on traffic as clients really send it (lpcache.workloads.chats: mixed case, punctuation, Unicode,
code, several system messages, tools, tool calls and results, names, images), against the stand-in, which renders
all of it into its prompt as a chat template does.

Every "hit" must be one (the server took from the slot what lpcache believed it held), no near-duplicate may turn
caching off, nothing sent past lpcache's pool may leave a false belief behind, a file of another model is never
restored, a router caches in prefix mode, and a working set a little larger than META_MAX keeps most of its hits.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from lpcache.cache.meta_files import prefix_file
from lpcache.cache.prefix import Prompt
from lpcache.config import BackendConfig
from lpcache.workloads import chats

from ..conftest import Proxy, user, words
from .conftest import STAND_IN_FP, mock_stats

PREFILL = 0.5   # ms per token on the stand-in: a restore pays (the stand-in's restores take about no time)


def tokens(backend: Any, body: dict[str, Any]) -> list[int]:
    prompt = httpx.post(f"{backend.url}/apply-template", json=body).json()["prompt"]
    return httpx.post(f"{backend.url}/tokenize", json={"content": prompt}).json()["tokens"]  # type: ignore[no-any-return]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def send(proxy: Proxy, body: dict[str, Any]) -> httpx.Response:
    r = proxy.client.post("/v1/chat/completions", json={**body, "max_tokens": 4})
    assert r.status_code == 200, r.text
    proxy.settle()
    return r


class Ledger:
    """What each slot and each file holds, by the bodies that made them, to check lpcache's claims independently:
    a request that says it hit (or restored) must get at least 90 % of the tokens it shares with what was there."""

    def __init__(self, proxy: Proxy, backend: Any, fingerprint: str = STAND_IN_FP) -> None:
        self.proxy, self.backend, self.fingerprint = proxy, backend, fingerprint
        self.slots: dict[str, list[int]] = {}
        self.files: dict[str, list[int]] = {}
        self.checked = 0

    def send(self, body: dict[str, Any]) -> httpx.Response:
        n = len(self.proxy.records)
        r = send(self.proxy, body)
        self.proxy.wait_finished(n + 1)
        record = self.proxy.records[n]
        mine = tokens(self.backend, body)
        cache_n = r.json()["timings"]["cache_n"]
        held = None
        if record.restored and record.restore_file:
            held = self.files[record.restore_file]
        elif r.headers["x-lpcache-cache-hit"] == "true":
            held = self.slots[r.headers["x-lpcache-slot"]]
        if r.headers["x-lpcache-cache-hit"] == "true":
            assert held is not None
            assert cache_n >= 0.9 * lcp(held, mine) - 1, (record.restore_file, cache_n, lcp(held, mine))
            self.checked += 1
        self.slots[r.headers["x-lpcache-slot"]] = mine
        if record.saved:
            self.files[prefix_file(record.key, self.fingerprint)] = mine
        return r


def test_near_duplicates_never_turn_caching_off_and_every_hit_is_one(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend)
    ledger = Ledger(proxy, backend)
    h = chats.harness(1, n_chars=1500, n_tools=4)
    base = chats.request(11, 300, h, turns=4, images=True, tool_rate=0.7)
    other = chats.request(12, 300)
    ledger.send(base)
    for kind, near in chats.variants(base, seed=3).items():
        ledger.send(other)                      # pushes the last one out of the only slot
        r = ledger.send(near)
        record = proxy.records[-1]
        assert record.restore_reused is not False, kind
        assert r.headers["x-lpcache-restored"] in ("true", "false")
    assert proxy.pipeline.reuse.turned_off == 0
    assert not [r for r in proxy.records if r.restore_reused is False]
    assert ledger.checked >= 5                 # hits and restores happened, and each was checked
    assert [r for r in proxy.records if r.restored]


def test_a_conversation_with_tool_calls_is_restored_exactly(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend)
    ledger = Ledger(proxy, backend)
    h = chats.harness(2, n_chars=2000, n_tools=5)
    conv = chats.Conversation(21, h, turns=6, n_words=900, tool_rate=0.6, images=True)
    interloper = chats.Conversation(22, h, turns=6, n_words=900, tool_rate=0.6)
    for _ in range(5):
        ledger.send(conv.body)
        ledger.send(interloper.body)            # the same harness: a shared prefix, then another conversation
        conv.advance(chats.assistant_text(conv.turn))
        interloper.advance(chats.assistant_text(100 + interloper.turn))
    later = [r for r in proxy.records[2:] if r.restored]
    assert later and all(r.restore_exact and r.restore_reused for r in later)
    assert proxy.pipeline.reuse.turned_off == 0


def test_a_completion_between_two_chat_turns_leaves_no_false_hit(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend)
    ledger = Ledger(proxy, backend)
    conv = chats.Conversation(31, chats.harness(3), turns=3, n_words=500)
    ledger.send(conv.body)
    r = proxy.client.post("/v1/completions", json={"prompt": "Ünïcode, code `x = 1`; and more " * 20,
                                                   "max_tokens": 3})
    assert r.status_code == 200
    proxy.settle()
    assert mock_stats(backend)["chat_by_slot"] == {"0": 2}     # pinned to the slot lpcache gave it
    completion = next(record for record in proxy.records if record.api == "completions")
    held = proxy.pipeline.pool.slots[0].content                # what it holds now: the completion's prompt
    assert completion.api == "completions" and held is not None and held.prompt is not None
    assert held.prompt.key == completion.key
    r = ledger.send(conv.advance(chats.assistant_text(1)))
    assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
    assert proxy.busy_slots() == []


def test_client_slot_actions_are_refused_unless_allowed(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=1)
    proxy = start_proxy(backend)
    send(proxy, chats.request(41, 200))
    r = proxy.client.post("/slots/0?action=erase", json={})
    assert r.status_code == 403
    error = r.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "slot_actions_refused"
    assert "CLIENT_SLOT_ACTIONS" in error["message"]
    assert mock_stats(backend)["erases"] == 0
    assert proxy.client.get("/slots").status_code == 200       # reading is fine

    allowed = start_proxy(backend, client_slot_actions=True)
    send(allowed, chats.request(42, 200))
    assert allowed.pipeline.pool.slots[0].content is not None
    assert allowed.client.post("/slots/0?action=erase", json={}).status_code == 200
    allowed.settle()
    assert allowed.pipeline.pool.slots[0].content is None and mock_stats(backend)["erases"] == 1


def test_a_model_swapped_behind_the_url_is_never_restored_into(start_backend: Any, start_proxy: Any,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    import lpcache.backends.slot_truth

    monkeypatch.setattr(lpcache.backends.slot_truth, "SLOTS_TRUSTED_FOR", 0.0)   # check before every request
    first = start_backend(slots=1, model="base-model", prefill_ms_per_token=PREFILL)
    proxy = start_proxy(first)
    conv = chats.Conversation(51, turns=3, n_words=400)
    send(proxy, conv.body)
    send(proxy, chats.request(52, 300))                  # conv is pushed out: only its file holds it
    port = int(first.url.rsplit(":", 1)[1])
    first.stop()
    swapped = start_backend(slots=1, model="finetuned-model", port=port, prefill_ms_per_token=PREFILL)
    r = send(proxy, conv.advance("An answer."))
    assert r.headers["x-lpcache-restored"] == "false" and r.headers["x-lpcache-cache-hit"] == "false"
    assert mock_stats(swapped)["restores"] == 0
    assert "backend_model_changed" in caplog.text
    # Its own caches work as before.
    again = send(proxy, conv.advance("Another answer."))
    assert again.headers["x-lpcache-cache-hit"] == "true"


def test_files_of_another_kv_cache_type_are_not_offered_after_the_server_changed_it(
        start_backend: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The same model behind the URL, restarted with another KV cache type (the stand-in: another size per token;
    it refuses such a file as llama-server does). Before any save there, two restores of old files are refused (the
    chosen one, then the slot's previous one: one refusal alone may be no room in a unified KV cache) and no other old
    file is offered after them; once a save there shows the new layout, none is, and the new files are restored as
    before."""
    first = start_backend(slots=1, prefill_ms_per_token=PREFILL, kv_bytes_per_token=2000)
    proxy = start_proxy(first)
    old = [chats.Conversation(61 + i, turns=3, n_words=400) for i in range(3)]
    for conv in old:
        send(proxy, conv.body)   # each pushes the one before out of the only slot: files hold them
    port = int(first.url.rsplit(":", 1)[1])
    first.stop()
    changed = start_backend(slots=1, prefill_ms_per_token=PREFILL, kv_bytes_per_token=1000, port=port)
    assert all(e.fingerprint == proxy.pipeline.backends[0].fingerprint for e in proxy.pipeline.index._entries.values())
    r = send(proxy, old[0].advance("An answer."))   # offered (nothing tells yet), refused by the server
    assert r.headers["x-lpcache-restored"] == "false" and mock_stats(changed)["restore_failures"] == 2
    r = send(proxy, old[1].advance("An answer."))
    assert r.headers["x-lpcache-restored"] == "false" and mock_stats(changed)["restore_failures"] == 2, \
        "the other old files are not offered"
    fresh = chats.Conversation(71, turns=3, n_words=400)
    send(proxy, fresh.body)   # saved with the new layout
    send(proxy, old[2].advance("An answer."))
    r = send(proxy, fresh.advance("An answer."))
    assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
    assert mock_stats(changed)["restore_failures"] == 2


def test_a_restore_refused_for_the_slots_context_does_not_stop_the_files_of_its_layout(
        start_backend: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Only "invalid slot save file" tells a layout: a file refused as longer than the slot's context (a context
    lpcache did not know) leaves the other files of its kind offered."""
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL, kv_bytes_per_token=2000)
    proxy = start_proxy(backend)
    old = [chats.Conversation(81 + i, turns=3, n_words=400) for i in range(2)]
    for conv in old:
        send(proxy, conv.body)
    send(proxy, chats.request(83, 300))   # both old ones only in their files now
    slot = backend.app_state.pool.slots[0]
    slot.n_ctx = 64   # the server's slot is smaller than lpcache read: the restore is refused as too long
    proxy.client.post("/v1/chat/completions", json=old[0].advance("An answer."))
    assert mock_stats(backend)["restore_failures"] >= 1   # and the slot's previous file, given back, too long too
    assert "restore_failed" in caplog.text and "its KV layout is not offered there" not in caplog.text
    slot.n_ctx = 8192
    r = send(proxy, old[1].advance("An answer."))
    assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"


def test_damaged_files_are_deleted_and_do_not_stop_the_files_of_their_layout(
        start_backend: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Two files cut short after their saves (a server killed while saving, a disk that lost their end): each is
    refused by the server once, then deleted with its entry as damaged (its size is not what its save wrote), and
    the two refusals do not mark the server's layout as another: the intact file of the same layout is restored."""
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL, kv_bytes_per_token=2000)
    proxy = start_proxy(backend)
    folder = backend.app_state.config.slot_save_path
    convs = [chats.Conversation(91 + i, turns=3, n_words=400) for i in range(3)]
    for conv in convs:
        send(proxy, conv.body)   # each pushes the one before out of the only slot: files hold them
    send(proxy, chats.request(94, 300))   # the last one too
    files = [proxy.records[i].save_file for i in range(3)]
    assert all(f and os.path.isfile(os.path.join(folder, f)) for f in files)
    for name in files[:2]:
        path = os.path.join(folder, name)
        os.truncate(path, os.path.getsize(path) // 2)
    for i, name in enumerate(files[:2]):
        r = send(proxy, convs[i].advance("An answer."))
        assert r.headers["x-lpcache-restored"] == "false"
        assert not os.path.exists(os.path.join(folder, name)) and name not in proxy.pipeline.index
    assert mock_stats(backend)["restore_failures"] == 2
    assert caplog.text.count("kv_file_damaged") == 2 and "its KV layout is not offered there" not in caplog.text
    r = send(proxy, convs[2].advance("An answer."))
    assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
    assert mock_stats(backend)["restore_failures"] == 2


def test_a_save_cut_short_by_a_full_disk_counts_as_failed_and_leaves_no_file(
        start_backend: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """llama-server answers 200 with the whole `n_written` when its last write at close fails (a full disk): the
    file is shorter than that. lpcache takes the save for failed, deletes the file, keeps no entry of it, and never
    asks for it; the next save there works as before."""
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL, kv_bytes_per_token=2000)
    proxy = start_proxy(backend)
    folder = backend.app_state.config.slot_save_path
    httpx.post(f"{backend.url}/mock/faults", json={"save_short": 1}).raise_for_status()
    short = chats.Conversation(101, turns=3, n_words=400)
    send(proxy, short.body)
    assert proxy.records[0].saved is False
    assert os.listdir(folder) == [] and len(proxy.pipeline.index) == 0   # the short file deleted, no entry of it
    assert "slot_save_short" in caplog.text
    whole = chats.Conversation(102, turns=3, n_words=400)
    send(proxy, whole.body)   # saved whole, and pushes the short one's conversation out of the slot
    assert proxy.records[-1].saved is True and os.path.isfile(os.path.join(folder, proxy.records[-1].save_file))
    send(proxy, chats.request(103, 300))
    r = send(proxy, whole.advance("An answer."))
    assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
    assert mock_stats(backend)["restore_failures"] == 0


def test_a_router_caches_in_prefix_mode_and_ignores_unknown_models(start_backend: Any, start_proxy: Any) -> None:
    router = start_backend(router=True, models=("a", "b"), slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(router)
    conv = chats.Conversation(61, turns=3, n_words=400)
    send(proxy, {**conv.body, "model": "a"})
    send(proxy, {**chats.request(62, 300), "model": "a"})        # pushes conv out of a's only slot
    r = send(proxy, {**conv.advance("An answer."), "model": "a"})
    assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
    actions = mock_stats(router)["slot_actions"]
    assert {a["action"] for a in actions} == {"save", "restore"}
    assert all(a["model"] == "a" and a["status"] == 200 for a in actions)

    slots, speeds = len(proxy.pipeline.pool.slots), len(proxy.pipeline.speeds)
    typo = proxy.client.post("/v1/chat/completions", json={**chats.request(63, 300), "model": "gpt-4o"})
    assert typo.status_code == 400 and "not found" in typo.json()["error"]["message"]
    assert len(proxy.pipeline.pool.slots) == slots and len(proxy.pipeline.speeds) == speeds
    assert "gpt-4o" not in proxy.pipeline.backends[0].models


def test_a_cyclic_working_set_larger_than_meta_max_keeps_most_of_its_hits(start_backend: Any,
                                                                         start_proxy: Any) -> None:
    """Five conversations take turns, META_MAX is 3 and one slot holds the last one: least-recently-used pruning
    deletes exactly the conversation that comes next (no restore ever hits). The replacement order keeps most of
    what fits (at most 3 of 5 a round)."""
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend, meta_max=3)
    convs = [chats.Conversation(70 + i, turns=6, n_words=300) for i in range(5)]
    for c in convs:
        send(proxy, c.body)
    restored = 0
    for round_ in range(1, 6):
        for c in convs:
            r = send(proxy, c.advance(chats.assistant_text(round_)))
            restored += r.headers["x-lpcache-restored"] == "true"
        assert len(proxy.pipeline.index) <= 3
    assert restored >= 0.3 * 5 * len(convs), restored   # LRU: 0 (each restore finds its file just deleted)
    assert proxy.pipeline.index.lost == 0


def test_a_client_leaving_during_the_prefill_saves_nothing_and_keeps_the_last_file(
        start_backend: Any, start_proxy: Any, slot_dir: str) -> None:
    backend = start_backend(slots=1, prefill_ms_per_token=20)
    proxy = start_proxy(backend)
    conv = chats.Conversation(81, turns=3, n_words=300)
    send(proxy, conv.body)
    [saved] = list(proxy.pipeline.index._entries)
    body = {**conv.advance("An answer."), "stream": True, "max_tokens": 50}
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", proxy.server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    deadline = time.monotonic() + 10
    while mock_stats(backend)["chat_requests"] < 2:      # the server is reading the prompt (20 ms a token)
        assert time.monotonic() < deadline
    sock.close()
    proxy.wait_finished(2)
    record = proxy.records[1]
    assert record.reason == "client_disconnected" and not record.saved
    assert list(proxy.pipeline.index._entries) == [saved]              # the complete file is not superseded
    assert saved in __import__("os").listdir(slot_dir)
    assert proxy.busy_slots() == []


def test_generation_routes_fail_over_and_answer_in_openai_shape(start_backend: Any, start_proxy: Any) -> None:
    from lpcache.workloads.harness import free_port

    live = start_backend(slots=1)
    proxy = start_proxy(BackendConfig(f"http://127.0.0.1:{free_port()}", 1), live)
    r = proxy.client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2})
    assert r.status_code == 200 and mock_stats(live)["chat_requests"] == 1
    bad = proxy.client.post("/v1/completions", content=b"{not json")
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_json"   # as for chat
    assert proxy.busy_slots() == []


def test_prompt_key_is_exact() -> None:
    a = Prompt.of("m", [{"role": "user", "content": "Hello"}], 10)
    b = Prompt.of("m", [{"role": "system", "content": "Hello"}], 10)
    assert a.key != b.key


@pytest.mark.parametrize("limit", ["count", "bytes"])
def test_long_prompts_past_meta_max_are_each_written_once_and_the_slots_still_serve_theirs(
        start_backend: Any, start_proxy: Any, limit: str) -> None:
    """One-off long prompts (a batch job: code review of many files, each a request) on four slots, META_MAX 3.
    Past META_MAX an eager save could only make room by deleting the file of a cache an idle slot holds, which that
    slot writes again before it is replaced: each cache was written twice. Now it stays unsaved in its slot until
    the slot is needed (`save_deferred`): one write per cache, META_MAX files after every request, and each of the
    last prompts is served from its slot when it comes back, its file or its slot holding it."""
    import os

    backend = start_backend(slots=4, prefill_ms_per_token=PREFILL)
    # META_MAX 3, or META_MAX_GIB about three and a half of these files (the stand-in's are about 2,800 bytes)
    limits = {"meta_max": 3} if limit == "count" else {"meta_max": 0, "meta_max_gib": 3.5 * 2800 / 2**30}
    proxy = start_proxy(backend, big_threshold_words=100, **limits)
    bodies = [chats.request(500 + i, 260) for i in range(16)]
    for i, body in enumerate(bodies):
        send(proxy, body)
        metas = [f for f in os.listdir(proxy.settings.meta_dir) if f.endswith(".meta.json")]
        most = 3 if limit == "count" else 4   # 3.5 files' bytes: the sizes vary with the prompts
        assert len(proxy.pipeline.index) <= most and len(metas) <= most, (i, metas)
        assert not proxy.pipeline.index.over(), i
    stats = mock_stats(backend)
    # a restore replaces a slot's cache, written first when it is unsaved: the one save a prompt may add
    assert stats["saves"] <= len(bodies) + stats["restores"], f"{stats}: caches written twice"
    for body in bodies[-4:]:   # the last four: in their slots, or on disk
        r = send(proxy, body)
        assert r.headers["x-lpcache-cache-hit"] == "true" and r.json()["timings"]["cache_n"] > 200, r.headers
    assert proxy.pipeline.index.lost == 0


@pytest.mark.parametrize("meta_max", [6, 3], ids=["room_beside_the_slots", "slots_fill_the_limit"])
def test_where_a_prefill_is_as_quick_as_a_save_no_cache_is_written_twice_nor_on_a_later_way(
        start_backend: Any, start_proxy: Any, caplog: Any, meta_max: int) -> None:
    """The same one-off long prompts on a stand-in that computes a prompt faster than it writes it (a GPU's case): a
    file beside the slots' caches spares less than writing a slot's cache a second time. With room beside the slots
    (META_MAX 6, 4 slots), nothing waits unsaved in its slot: each cache is written once, right after its answer,
    and the limits delete another file, never a slot's. Where the slots' own files fill the limit (META_MAX 3), a
    cache waits in its slot as before, and when its slot is needed it is let go rather than written in the place
    of another slot's file (`save_dropped`): no cache is written twice, no request pays more than one save."""
    import logging

    backend = start_backend(slots=4)
    proxy = start_proxy(backend, meta_max=meta_max, big_threshold_words=100)
    bodies = [chats.request(520 + i, 260) for i in range(16)]
    caplog.set_level(logging.INFO)
    for i, body in enumerate(bodies):
        saves_before = mock_stats(backend)["saves"]
        send(proxy, body)
        proxy.settle()
        saves = mock_stats(backend)["saves"] - saves_before
        assert saves == 1 if meta_max == 6 else saves <= 1, f"request {i}: {saves} saves"
        assert len(proxy.pipeline.index) <= meta_max and not proxy.pipeline.index.over(), i
        if meta_max == 6:
            assert not [s for s in proxy.pipeline.pool.slots if s.content is not None and s.content.dirty], i
    said = [r.getMessage() for r in caplog.records]
    written = [m.split("file=")[1].split()[0] for m in said if "slot_save " in m and ": ok" in m]
    assert len(written) == len(set(written)), "a cache written twice"
    if meta_max == 6:
        assert not [m for m in said if "save_deferred" in m or "reason=in_slot" in m], said
    else:
        assert any("save_dropped" in m for m in said), said
    for body in bodies[-4:]:   # the last four still served from their slots
        r = send(proxy, body)
        assert r.headers["x-lpcache-cache-hit"] == "true" and r.json()["timings"]["cache_n"] > 200, r.headers
    assert proxy.pipeline.index.lost == 0


def test_caches_left_unsaved_in_their_slots_are_saved_at_shutdown_and_kept_for_the_restart(
        start_backend: Any, start_proxy: Any, slot_dir: str, caplog: Any) -> None:
    """Past META_MAX the last caches wait in their slots (`save_deferred`); a stop saves them, and no slot is ever
    replaced after that, so none of those files may go for its slot's sake (`in_slot`): the replacement order
    chooses among them all, and a restart restores one of them."""
    import logging
    import os

    backend = start_backend(slots=4, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend, meta_max=3, big_threshold_words=100)
    bodies = [chats.request(600 + i, 260) for i in range(8)]
    key_of: dict[str, int] = {}
    for i, body in enumerate(bodies):
        b, slot = send(proxy, body).headers["x-lpcache-slot"].split(":")
        content = next(s.content for s in proxy.pipeline.pool.slots if s.backend == int(b) and s.id == int(slot))
        assert content is not None
        key_of[content.key] = i
    waiting = {s.content.key for s in proxy.pipeline.pool.slots if s.content is not None and s.content.dirty}
    assert waiting, "past META_MAX some caches wait in their slots"
    caplog.set_level(logging.INFO)
    caplog.clear()
    proxy.stop()
    said = [r.getMessage() for r in caplog.records]
    assert sum("background_save why=shutdown" in m and "ok=true" in m for m in said) >= len(waiting), said
    assert not [m for m in said if "reason=in_slot" in m], "a file saved at shutdown deleted for its slot's sake"
    kept = {f.removesuffix(".meta.json") for f in os.listdir(proxy.settings.meta_dir) if f.endswith(".meta.json")}
    assert len(kept) == 3 and kept & waiting, (kept, waiting)
    assert all(os.path.exists(os.path.join(slot_dir, key)) for key in kept)
    again = start_proxy(backend, meta_max=3, big_threshold_words=100)
    r = send(again, bodies[key_of[sorted(kept & waiting)[0]]])
    assert r.headers["x-lpcache-restored"] == "true" and r.json()["timings"]["cache_n"] > 200, r.headers


@pytest.mark.parametrize("policy", ["eager", "evict"])
@pytest.mark.parametrize("edit", [False, True], ids=["chat", "document"])
def test_files_and_slots_together_hold_a_working_set_that_only_fits_in_both(start_backend: Any, start_proxy: Any,
                                                                           edit: bool, policy: str) -> None:
    """Three conversations take turns on two slots with META_MAX 2: the files alone cannot hold them and a restore
    needs its file and the replaced slot's (saved again) at once, but the files and the other slot can. The limits
    delete the files of what an idle slot holds first, and a slot's cache whose file was deleted is saved again
    before a restore replaces it (with SAVE_POLICY=evict: saved then, first), so after the first round every turn
    is a hit. `document`:
    each turn changes the end of the previous prompt (a task line after a growing text), so no file is a prefix of
    the next turn's: the previous turn's file must go before any conversation's latest."""
    backend = start_backend(slots=2, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend, meta_max=2, big_threshold_words=20, save_policy=policy)
    convs = [chats.Conversation(90 + i, turns=8, n_words=300) for i in range(3)]
    texts = [chats.assistant_text(100 + i) * 8 for i in range(3)]

    def body(i: int, round_: int) -> dict[str, Any]:
        if not edit:
            return convs[i].body if round_ == 0 else convs[i].advance(chats.assistant_text(round_))
        texts[i] += "\n\n" + chats.assistant_text(10 * round_ + i)
        return {"model": "m", "messages": [{"role": "system", "content": f"Editor {i}: keep the voice."},
                                           {"role": "user", "content": f"{texts[i]}\n\nRedraft part {round_}."}]}

    for i in range(3):
        send(proxy, body(i, 0))
    misses = []
    for round_ in range(1, 5):
        for i in range(3):
            r = send(proxy, body(i, round_))
            if r.headers["x-lpcache-cache-hit"] != "true" or r.json()["timings"]["cache_n"] < 50:
                misses.append((round_, i, r.json()["timings"]["cache_n"], r.headers["x-lpcache-slot"]))
        assert len(proxy.pipeline.index) <= 2
    assert misses == [], "\n".join(map(str, misses))
    assert proxy.pipeline.index.lost == 0


@pytest.mark.parametrize("foreign", ["running", "done"])
def test_an_unsaved_cache_is_saved_only_from_an_idle_slot_that_holds_it(start_backend: Any, start_proxy: Any,
                                                                        slot_dir: str, foreign: str,
                                                                        caplog: Any) -> None:
    """A client pins slot 0 directly (not through lpcache) while it holds an unsaved prefix cache (SAVE_POLICY=evict):
    the next request's save of that cache finds the slot busy (`running`) or holding the foreign request's tokens
    (`done`). Within the trust window (lpcache's last answer came less than a second ago) the save is sent without
    asking first, and the server runs it once the slot is idle; past it, the server is asked and the mark given
    back while the slot is busy. Either way nothing is kept under the cache's name, and no marker is left behind."""
    backend = start_backend(slots=1, gen_ms_per_token=10)
    proxy = start_proxy(backend, save_policy="evict")
    a = proxy.push(user(words(1, 200)), max_tokens=2)
    assert a.status_code == 200
    [held] = [s.content for s in proxy.pipeline.pool.slots]
    assert held is not None and held.dirty
    done = threading.Event()

    def direct() -> None:
        httpx.post(f"{backend.url}/v1/chat/completions", timeout=30, json={
            "messages": user("direct"), "max_tokens": 100 if foreign == "running" else 2, "id_slot": 0})
        done.set()

    thread = threading.Thread(target=direct)
    thread.start()
    if foreign == "running":
        deadline = time.monotonic() + 10
        while not any(s.get("is_processing") for s in httpx.get(f"{backend.url}/slots").json()):
            assert time.monotonic() < deadline, "the direct request never ran"
    else:
        thread.join()
    with caplog.at_level("INFO"):
        r = proxy.push(user(words(2, 200)), max_tokens=2)
    thread.join()
    proxy.run(proxy.pipeline.index._run(lambda: None))   # the marker's deletion queued on the I/O thread is done
    assert r.status_code == 200 and done.is_set()
    assert any("save_skipped_not_held" in m and held.key in m for m in caplog.messages), caplog.messages
    assert held.key not in proxy.pipeline.index and not os.path.exists(os.path.join(slot_dir, held.key))
    assert not [n for n in os.listdir(proxy.settings.meta_dir) if n.endswith(".saving")]
    assert mock_stats(backend)["saves"] <= 1   # at most the one the server ran once the slot was idle


def test_a_cache_saved_when_its_slot_is_needed_is_checked_by_the_saves_count_not_a_question_first(
        start_backend: Any, start_proxy: Any) -> None:
    """Past META_MAX a cache waits in its slot and is saved when the slot is needed (`save_deferred`). Within the
    trust window (the server answered lpcache less than a second ago) lpcache does not ask `GET /slots` first: the
    save's own token count tells whether the slot held that cache. Here a client that pinned the slot behind
    lpcache's back changed it: the file written is deleted, and no entry names it."""
    import os

    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL)
    proxy = start_proxy(backend, meta_max=1, big_threshold_words=100)
    send(proxy, chats.request(700, 260))              # saved: the index is full now
    send(proxy, chats.request(701, 260))              # waits unsaved in the slot
    [slot] = proxy.pipeline.pool.slots
    waiting = slot.content
    assert waiting is not None and waiting.dirty and waiting.key not in proxy.pipeline.index
    behind = httpx.post(f"{backend.url}/v1/chat/completions", json={**chats.request(702, 120), "id_slot": 0},
                        timeout=30)
    assert behind.status_code == 200
    asked = mock_stats(backend)["requests_by_path"].get("/slots", 0)
    r = send(proxy, chats.request(703, 260))          # needs the slot: the waiting cache is saved first
    assert r.status_code == 200
    assert mock_stats(backend)["requests_by_path"].get("/slots", 0) == asked, "no GET /slots on the way"
    assert waiting.key not in proxy.pipeline.index
    proxy.settle()
    assert not os.path.exists(os.path.join(backend.app_state.config.slot_save_path, waiting.key)), \
        "the file of another conversation's tokens is gone"


def test_a_cache_saved_on_belief_into_a_slot_busy_with_other_work_waits_no_longer_than_a_look_would(
        start_backend: Any, start_proxy: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Within the trust window the waiting cache's save is sent without asking the slot first. When a client
    behind lpcache's back keeps the slot busy, the server holds the save until the slot is idle: lpcache gives it
    up after IDLE_WAIT_SECONDS (what a look at the slot would have waited), not after REQUEST_TIMEOUT, and no entry
    names the file the server may still write."""
    from lpcache.backends import slot_truth, swap

    caplog.set_level("INFO")
    monkeypatch.setattr(swap, "IDLE_WAIT_SECONDS", 0.5)
    monkeypatch.setattr(slot_truth, "SLOTS_TRUSTED_FOR", 600.0)   # the slot is believed, whatever the test's pace
    backend = start_backend(slots=1, prefill_ms_per_token=PREFILL, n_ctx=32768)
    proxy = start_proxy(backend, meta_max=1, big_threshold_words=100)
    send(proxy, chats.request(710, 260))
    send(proxy, chats.request(711, 260))              # waits unsaved in the slot
    [slot] = proxy.pipeline.pool.slots
    waiting = slot.content
    assert waiting is not None and waiting.dirty
    foreign = threading.Thread(target=lambda: httpx.post(   # about 6 s of prefill on the stand-in
        f"{backend.url}/v1/chat/completions", json={**chats.request(712, 9000), "id_slot": 0}, timeout=60))
    foreign.start()
    deadline = time.monotonic() + 30
    while not httpx.get(f"{backend.url}/slots").json()[0]["is_processing"]:
        assert time.monotonic() < deadline, "the foreign request never took the slot"
    r = send(proxy, chats.request(713, 260))           # needs the slot: the waiting cache's save is sent on belief
    foreign.join()
    assert r.status_code == 200
    assert mock_stats(backend)["slot_actions_while_busy"] >= 1, "the save was sent while the slot was busy"
    assert any(f"file={waiting.key}" in m and "failed status=0" in m for m in caplog.messages), \
        "the save was given up before the slot was idle"
    assert waiting.key not in proxy.pipeline.index
