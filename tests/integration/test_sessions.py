"""Session mode against the stand-in: X-Session-ID keys a slot's cache by route and session; lpcache swaps the
session's file into a slot, saving what was there under its own name first. Save policies, limits per route, the
idle check, the prompt comparison and /lpcache/sessions."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import httpx
import pytest

from lpcache.cache.meta_files import prefix_file
from lpcache.cache.sessions import route_tag, session_filename

from ..conftest import figures, user, words
from .conftest import STAND_IN_FP, mock_stats, until

BIG = 200    # words: big with the test threshold of 50
SMALL = 20
S1, S2, S3 = "1" * 32, "2" * 32, "3" * 32
ROUTE = "llama.cpp"   # the model of a request without one


def sid(session: str) -> dict[str, str]:
    return {"X-Session-ID": session}


def files(slot_dir: str) -> list[str]:
    return sorted(os.listdir(slot_dir))


def name(session: str, route: str = ROUTE) -> str:
    return session_filename(route, session, STAND_IN_FP)


@pytest.fixture
def one_slot(start_backend: Any) -> Any:
    return start_backend(slots=1)


def test_session_request_saves_under_route_and_session(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot)
    r = proxy.push(user(words(1, BIG)), sid(S1))
    assert r.status_code == 200
    assert files(slot_dir) == [name(S1)]
    assert name(S1).startswith("llama_cpp-" + route_tag(ROUTE, STAND_IN_FP)[-8:])
    assert os.listdir(proxy.settings.meta_dir) == [] if os.path.isdir(proxy.settings.meta_dir) else True
    assert proxy.records[-1].session == S1 and proxy.records[-1].saved is True


def test_sessions_take_turns_on_one_slot(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot)
    a, b = words(1, BIG), words(2, BIG)
    proxy.push(user(a), sid(S1))
    proxy.push(user(b), sid(S2))                    # S1's file is on disk already (eager): no save before
    before = mock_stats(one_slot)
    r = proxy.push(user(a + " and then"), sid(S1))
    after = mock_stats(one_slot)
    assert r.headers["x-lpcache-restored"] == "true" and r.headers["x-lpcache-cache-hit"] == "true"
    assert after["restores"] - before["restores"] == 1
    assert r.json()["timings"]["cache_n"] >= BIG      # the story came from the file, not a prefill
    assert proxy.records[-1].swap_saved is None      # S2 was saved right after its request
    assert files(slot_dir) == sorted([name(S1), name(S2)])


def test_session_in_its_idle_slot_needs_no_slot_action(start_proxy: Any, start_backend: Any) -> None:
    backend = start_backend(slots=2)
    proxy = start_proxy(backend)
    a = words(1, BIG)
    proxy.push(user(a), sid(S1))
    proxy.push(user(words(2, BIG)), sid(S2))
    before = mock_stats(backend)
    r = proxy.push(user(a + " more"), sid(S1))
    after = mock_stats(backend)
    assert r.headers["x-lpcache-restored"] == "false" and r.headers["x-lpcache-cache-hit"] == "true"
    assert after["restores"] == before["restores"] and after["erases"] == before["erases"]
    assert after["saves"] == before["saves"] + 1          # only the eager save after the request
    assert r.json()["timings"]["cache_n"] >= BIG


def test_small_session_cache_is_saved_when_swapped_out(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot)
    a = words(1, SMALL)
    proxy.push(user(a), sid(S1))
    assert files(slot_dir) == []                          # small: not saved after the request
    proxy.push(user(words(2, SMALL)), sid(S2))
    assert proxy.records[-1].swap_saved is True           # S1 saved under its name before S2 took the slot
    assert files(slot_dir) == [name(S1)]
    r = proxy.push(user(a + " again"), sid(S1))
    assert r.headers["x-lpcache-restored"] == "true"
    assert files(slot_dir) == sorted([name(S1), name(S2)])


def test_unknown_slot_is_never_saved_over_a_good_file(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    first = start_proxy(one_slot)
    a = words(1, BIG)
    first.push(user(a), sid(S1))
    size = os.path.getsize(os.path.join(slot_dir, name(S1)))
    first.stop()
    # A new lpcache does not know what the slot holds: it saves nothing, it restores S1's file over the slot.
    proxy = start_proxy(one_slot)
    before = mock_stats(one_slot)
    r = proxy.push(user(a + " after a restart"), sid(S1))
    after = mock_stats(one_slot)
    assert r.headers["x-lpcache-restored"] == "true"
    assert after["saves"] - before["saves"] == 1          # the eager save after the request, nothing before it
    assert proxy.records[-1].swap_saved is None
    assert os.path.getsize(os.path.join(slot_dir, name(S1))) >= size


@pytest.mark.parametrize("header", ["", "../etc\t" + "1" * 24, "1" * 300, b"..%2F\xff" + b"1" * 27])
def test_bad_session_header_falls_back_to_prefix_mode(start_proxy: Any, one_slot: Any, slot_dir: str,
                                                      header: str) -> None:
    proxy = start_proxy(one_slot)
    r = proxy.push(user(words(1, BIG)), {"X-Session-ID": header})
    assert r.status_code == 200 and "x-lpcache-session" not in r.headers
    assert proxy.records[-1].session is None
    [saved] = files(slot_dir)
    assert saved == prefix_file(proxy.records[-1].key, STAND_IN_FP)   # the prefix-mode name, nothing from the header
    assert proxy.client.get("/lpcache/sessions").json()["data"] == []


@pytest.mark.parametrize("header", ["../" * 10 + "etc", "A" * 32, "1" * 31 + "/", "..%2F" + "1" * 27])
def test_a_header_that_looks_like_a_path_is_hashed_never_used(start_proxy: Any, one_slot: Any, slot_dir: str,
                                                              header: str) -> None:
    proxy = start_proxy(one_slot)
    r = proxy.push(user(words(1, BIG)), {"X-Session-ID": header})
    sid = hashlib.sha256(header.encode()).hexdigest()[:32]
    assert r.headers["x-lpcache-session"] == sid and proxy.records[-1].session == sid
    assert files(slot_dir) == [name(sid)]


def test_evict_policy_saves_only_when_the_slot_is_needed(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot, save_policy="evict")
    a = words(1, BIG)
    proxy.push(user(a), sid(S1))
    assert files(slot_dir) == [] and mock_stats(one_slot)["saves"] == 0
    proxy.push(user(a + " next"), sid(S1))                # same session: still no save
    assert files(slot_dir) == []
    proxy.push(user(words(2, BIG)), sid(S2))               # S2 needs the slot: S1 is saved first
    assert files(slot_dir) == [name(S1)] and proxy.records[-1].swap_saved is True
    r = proxy.push(user(a + " next and more"), sid(S1))
    assert r.headers["x-lpcache-restored"] == "true"
    assert files(slot_dir) == sorted([name(S1), name(S2)])
    assert mock_stats(one_slot)["saves"] == 2


def test_evict_policy_in_prefix_mode(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot, save_policy="evict")
    a = words(1, BIG)
    proxy.push(user(a))
    assert files(slot_dir) == []
    proxy.push(user(a + " grows"))                         # extends what the slot holds: nothing to save
    assert files(slot_dir) == []
    proxy.push(user(words(2, BIG)))                        # would overwrite it: saved first, with its meta file
    assert len(files(slot_dir)) == 1 and proxy.records[-1].swap_saved is True
    assert len(proxy.pipeline.index) == 1
    r = proxy.push(user(a + " grows again"))
    assert r.headers["x-lpcache-restored"] == "true"       # B was saved before the restore replaced it
    assert len(files(slot_dir)) == 2


def test_evict_policy_saves_on_idle_and_a_request_restarts_the_wait(start_proxy: Any, one_slot: Any,
                                                                    slot_dir: str) -> None:
    proxy = start_proxy(one_slot, save_policy="evict", save_idle_seconds=0.3)
    a = words(1, BIG)
    proxy.push(user(a), sid(S1))
    [slot] = proxy.pipeline.pool.slots
    first = proxy.pipeline.saver.idle_saves[slot]
    proxy.push(user(a + " more"), sid(S1))                 # a request cancels the pending idle save
    assert first.cancelled() or first.done() and files(slot_dir) == []
    second = proxy.pipeline.saver.idle_saves[slot]
    assert second is not first
    proxy.run(_wait(second))
    assert files(slot_dir) == [name(S1)]
    assert proxy.pipeline.saver.background.saves_ok == 1 and slot.content is not None and slot.content.saved
    assert not slot.busy
    # Already on disk: the next swap does not write it again.
    saves = mock_stats(one_slot)["saves"]
    proxy.push(user(words(2, BIG)), sid(S2))
    assert mock_stats(one_slot)["saves"] == saves and proxy.records[-1].swap_saved is None


async def _wait(task: Any) -> None:
    import asyncio

    await asyncio.wait([task])


def test_evict_policy_saves_at_shutdown(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot, save_policy="evict")
    proxy.push(user(words(1, BIG)), sid(S1))
    assert files(slot_dir) == []
    proxy.stop()
    assert files(slot_dir) == [name(S1)]


def test_eager_and_evict_compute_the_same_tokens_and_evict_writes_less(start_proxy: Any, start_backend: Any,
                                                                       tmp_path: Any) -> None:
    written = {}
    computed = {}
    for policy in ("eager", "evict"):
        folder = os.path.join(tmp_path, policy)
        os.makedirs(folder)
        backend = start_backend(slots=1, slot_save_path=folder)
        proxy = start_proxy(backend, save_policy=policy)
        stories = {s: words(i, BIG) for i, s in enumerate((S1, S2, S3))}
        for turn in range(3):
            for s, text in stories.items():
                stories[s] = text + " " + words(100 + turn, 15)
                proxy.push(user(stories[s]), sid(s))
        written[policy] = sum((r.save_bytes or 0) + (r.swap_save_bytes or 0) for r in proxy.records)
        computed[policy] = mock_stats(backend)["prompt_tokens_computed"]
        proxy.stop()
        backend.stop()
    figures(f"\nsession workload, 3 sessions x 3 turns on one slot: bytes written eager={written['eager']} "
          f"evict={written['evict']}; tokens computed eager={computed['eager']} evict={computed['evict']}")
    assert computed["eager"] == computed["evict"]
    assert 0 < written["evict"] < written["eager"]


def test_limits_keep_two_files_per_route_and_spare_the_rest(start_proxy: Any, one_slot: Any,
                                                           slot_dir: str) -> None:
    other = session_filename("other-model", S1, STAND_IN_FP)
    for foreign in (other, "notes.txt", "a" * 64):
        with open(os.path.join(slot_dir, foreign), "wb") as f:
            f.write(b"x" * 10)
    proxy = start_proxy(one_slot, max_files=2)
    stories = {s: words(i, BIG) for i, s in enumerate((S1, S2, S3))}
    for turn in range(2):
        for s, text in stories.items():
            stories[s] = text + f" turn {turn}"
            r = proxy.push(user(stories[s]), sid(s))
            assert r.status_code == 200
            mine = [f for f in files(slot_dir) if f.startswith(route_tag(ROUTE, STAND_IN_FP))]
            assert len(mine) <= 2
            assert name(s) in mine                            # never the one just saved
            if turn == 1:
                assert r.headers["x-lpcache-restored"] in ("true", "false")
    assert sorted(f for f in files(slot_dir) if not f.startswith(route_tag(ROUTE, STAND_IN_FP))) == sorted(
        [other, "notes.txt", "a" * 64])


def test_limits_never_delete_the_file_being_restored(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot, max_files=1)
    a, b = words(1, SMALL), words(2, SMALL)                 # small: saved only when swapped out
    proxy.push(user(a), sid(S1))
    proxy.push(user(b), sid(S2))                          # saves S1 (S2 has no file yet)
    assert files(slot_dir) == [name(S1)]
    r = proxy.push(user(a + " back"), sid(S1))            # saves S2: over the limit, but S1 is about to be restored
    assert r.headers["x-lpcache-restored"] == "true"
    assert proxy.records[-1].swap_saved is True
    assert files(slot_dir) == sorted([name(S1), name(S2)])  # two sessions in turn keep two files, whatever the limit
    proxy.push(user(words(3, SMALL)), sid(S3))            # saves S1; S2 (used longest ago, not wanted) goes
    assert files(slot_dir) == [name(S1)]


def test_prompt_comparison_is_logged_and_served(start_proxy: Any, one_slot: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    proxy = start_proxy(one_slot)
    system = {"role": "system", "content": "You write stories."}
    story = words(1, BIG)
    first = [system, {"role": "user", "content": story}]
    proxy.push(first, sid(S1))
    assert proxy.client.get(f"/lpcache/sessions/{S1}/compare").status_code == 404   # one request: nothing yet
    second = [system, {"role": "user", "content": story[:300] + " a changed ending"}]
    with caplog.at_level("INFO", logger="lpcache.pipeline"):
        proxy.push(second, sid(S1))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("session_prompt")]
    assert name(S1) in line and "2 messages, the previous prompt had 2: the first 1 are the same" in line
    assert "message 1 (role user) is the same for its first 300 of 317 characters" in line
    doc = proxy.client.get(f"/lpcache/sessions/{S1}/compare").json()
    assert doc["session"] == S1 and doc["route"] == ROUTE and doc["requests"] == 2
    c = doc["comparison"]
    assert (c["message"], c["role"], c["same"]) == (1, "user", False)
    assert c["shared_chars"] == len(system["content"]) + 300
    assert c["last_shared_chars"] == 300 and c["message_shared_chars"] == 300 and c["message_chars"] == 317
    listing = proxy.client.get("/lpcache/sessions").json()["data"]
    [entry] = listing
    assert entry["session"] == S1 and entry["route"] == ROUTE and entry["file"] == name(S1)
    assert entry["requests"] == 2 and entry["cache_hits"] == 1 and entry["file_bytes"] > 0
    assert entry["slot"]["id"] == 0 and entry["slot"]["busy"] is False


def test_session_endpoints_errors_and_keys(start_proxy: Any, one_slot: Any) -> None:
    proxy = start_proxy(one_slot, api_keys=("k1",))
    assert proxy.client.get("/lpcache/sessions").status_code == 401
    ok = {"Authorization": "Bearer k1"}
    assert proxy.client.get("/lpcache/sessions", headers=ok).json() == {"object": "list", "data": []}
    bad = proxy.client.get("/lpcache/sessions/..%2F..%2Fetc/compare", headers=ok)
    assert bad.status_code in (400, 404) and "error" in bad.json()
    long = proxy.client.get(f"/lpcache/sessions/{'A' * 257}/compare", headers=ok)
    assert long.status_code == 400 and long.json()["error"]["code"] == "invalid_session_id"
    missing = proxy.client.get(f"/lpcache/sessions/{S2}/compare", headers=ok)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"


def test_two_models_never_share_a_file(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot)
    text = words(1, BIG)
    proxy.push(user(text), sid(S1), model="qwen")
    r = proxy.push(user(text), sid(S1), model="openai/org/gemma")
    assert r.headers["x-lpcache-restored"] == "false"     # the other model's file is not this one's
    assert files(slot_dir) == sorted([name(S1, "qwen"), name(S1, "org/gemma")])


def test_failed_restore_only_costs_a_prefill(start_proxy: Any, one_slot: Any, slot_dir: str) -> None:
    proxy = start_proxy(one_slot)
    a = words(1, BIG)
    proxy.push(user(a), sid(S1))
    proxy.push(user(words(2, BIG)), sid(S2))
    with open(os.path.join(slot_dir, name(S1)), "wb") as f:
        f.write(b"not a slot file")
    r = proxy.push(user(a + " more"), sid(S1))
    assert r.status_code == 200 and r.headers["x-lpcache-restored"] == "false"
    assert r.json()["timings"]["cache_n"] == 0                # the server emptied the slot: a full prefill
    assert proxy.records[-1].restored is False
    assert proxy.busy_slots() == []


def _busy_directly(backend: Any) -> tuple[threading.Thread, threading.Event]:
    """Another client uses the server directly: slot 0 generates for about a second (returned once it is busy)."""
    done = threading.Event()

    def foreign() -> None:
        httpx.post(f"{backend.url}/v1/chat/completions", timeout=30, json={
            "messages": user("direct"), "max_tokens": 50, "id_slot": 0})
        done.set()

    thread = threading.Thread(target=foreign)
    thread.start()
    until(lambda: any(s.get("is_processing") for s in httpx.get(f"{backend.url}/slots").json()))
    return thread, done


def test_slot_busy_with_a_foreign_request_is_waited_for(start_proxy: Any, start_backend: Any, caplog: Any) -> None:
    """A client pins slot 0 directly (not through lpcache) while it holds session S1's unsaved cache: the swap for S2
    waits until the slot is idle, and then does not save the slot under S1's name: it holds the foreign request's
    tokens now, and S1's file would get another conversation."""
    backend = start_backend(slots=1, gen_ms_per_token=20)
    proxy = start_proxy(backend)
    proxy.push(user(words(1, SMALL)), sid(S1))
    thread, done = _busy_directly(backend)
    r = proxy.push(user(words(2, SMALL)), sid(S2))        # a swap: S1 changed (small) would be saved, then S2's
    thread.join()
    assert r.status_code == 200 and done.is_set()
    assert proxy.records[-1].swap_saved is None, "the slot holds the foreign request's cache, not S1's"
    assert any("save_skipped_not_held" in m and S1 in m for m in caplog.messages), caplog.messages
    assert mock_stats(backend)["slot_actions_while_busy"] == 0   # nothing was sent while the slot was busy


def test_a_prefix_cache_a_session_could_not_save_is_not_left_marked(start_proxy: Any, start_backend: Any) -> None:
    """A prefix cache left unsaved in slot 0 (SAVE_POLICY=evict) is marked as being saved when a session request
    takes the slot; a client using slot 0 directly meanwhile leaves other tokens there, so nothing is saved: the
    mark goes (the limits may delete that name again, and no `.saving` marker is left for the next start)."""
    backend = start_backend(slots=1, gen_ms_per_token=20)
    proxy = start_proxy(backend, save_policy="evict")
    proxy.push(user(words(1, BIG)))
    held = proxy.pipeline.pool.slots[0].content
    assert held is not None and held.session is None and held.dirty
    thread, done = _busy_directly(backend)
    r = proxy.push(user(words(2, SMALL)), sid(S2))
    thread.join()
    assert r.status_code == 200 and done.is_set()
    assert proxy.records[-1].swap_saved is None and mock_stats(backend)["saves"] == 0
    index = proxy.pipeline.index
    until(lambda: not os.path.exists(os.path.join(proxy.settings.meta_dir, held.key + ".saving")))
    assert held.key not in index._saving


def test_a_turn_sent_while_another_request_saves_its_session_restores_that_file(start_proxy: Any,
                                                                                 start_backend: Any) -> None:
    """S1's last turn (small: not saved after its answer) is in slot 0, the least recently used; S3 takes slot 0
    and saves S1's cache there first, slowly. S1's next turn, sent meanwhile, takes slot 1: it waits for that save
    and restores S1's file, rather than finding no file yet and computing its whole prompt."""
    backend = start_backend(slots=2)
    proxy = start_proxy(backend)
    a = words(1, 40)
    proxy.push(user(a), sid(S1))                            # slot 0
    proxy.push(user(words(2, SMALL)), sid(S2))              # slot 1
    slot0 = proxy.pipeline.pool.slots[0]
    assert slot0.content is not None and slot0.content.session == S1 and slot0.content.dirty
    httpx.post(f"{backend.url}/mock/faults", json={"latency_ms": 1500, "paths": ["/slots/0"]}).raise_for_status()
    third = threading.Thread(target=proxy.chat, args=(user(words(3, SMALL)), sid(S3)))
    third.start()
    until(lambda: slot0.busy)                               # S3 has slot 0 and is saving S1 there
    r = proxy.chat(user(a + " and one more question"), sid(S1))
    third.join()
    proxy.wait_finished(4)
    mine = next(rec for rec in proxy.records if rec.session == S1 and rec.slot == 1)
    assert r.status_code == 200 and mine.restored is True, "S1's file, written meanwhile, was restored"
    assert r.json()["timings"]["cache_n"] >= 40


@pytest.mark.parametrize(("prefill_ms_per_token", "restored"), [(0.0001, False), (5.0, True)])
def test_restore_only_when_it_beats_the_prefill(start_proxy: Any, start_backend: Any, prefill_ms_per_token: float,
                                                restored: bool) -> None:
    # Files as heavy as a small real model's (23 KB a token for SmolLM2-135M): a restore reads megabytes, so the
    # near-free prefill is the quicker one however the machine's load skews a measure (with tiny files both took
    # about a millisecond, and a loaded run once read the prefill slower)
    backend = start_backend(slots=1, prefill_ms_per_token=prefill_ms_per_token, kv_bytes_per_token=20_000)
    proxy = start_proxy(backend)
    stories = {s: words(i, BIG) for i, s in enumerate((S1, S2))}
    for turn in range(3):
        for s in (S1, S2):
            stories[s] += f" turn {turn}"
            proxy.push(user(stories[s]), sid(s))
    later = proxy.records[2:]                           # each had a file to restore
    assert proxy.records[2].restored is True            # the first restore: speeds not known yet
    speeds = proxy.pipeline.speeds.of(0, "")
    assert speeds.prefill.ms_per_token is not None and speeds.restore.ms_per_token is not None
    assert all(bool(r.restored) == restored for r in later[1:])
    assert all(bool(r.restore_skipped) != restored for r in later[1:])


def test_a_big_session_prompt_is_summarized_and_compared_off_the_event_loop(start_proxy: Any, start_backend: Any,
                                                                           monkeypatch: Any) -> None:
    """The session book's work grows with the prompt (a 16 MiB one: about 0.15 s): above OFF_LOOP_BYTES it runs
    in a worker thread, like parsing and hashing, so other streams do not stall meanwhile."""
    from lpcache.apis.base import OFF_LOOP_BYTES
    from lpcache.cache.sessions import Summary

    proxy = start_proxy(start_backend(slots=1, n_ctx=100_000))
    loop_thread = proxy.run(_ident())
    threads: list[int] = []
    real = Summary.of.__func__  # type: ignore[attr-defined]

    def of(cls: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(cls, messages, *args, **kwargs)

    monkeypatch.setattr(Summary, "of", classmethod(of))
    text = words(7, OFF_LOOP_BYTES // 4)
    for more in ("", " and one more line"):
        r = proxy.chat(user(text + more), {"X-Session-ID": S1}, max_tokens=2)
        assert r.status_code == 200
    assert len(threads) == 2 and loop_thread not in threads
    assert proxy.client.get(f"/lpcache/sessions/{S1}/compare").json()["comparison"]["same"] is False


async def _ident() -> int:
    return threading.get_ident()


def test_a_session_saved_by_another_lpcache_is_restored_where_its_file_is(start_proxy: Any, start_backend: Any,
                                                                           tmp_path: Any) -> None:
    """A replica that has not heard of a session's save (Redis slow, or lpcache restarted with another META_DIR)
    finds the server whose folder has the session's file, and continues there instead of computing the prompt on
    the first free slot of another server."""
    for path in ("first", "second"):
        os.makedirs(tmp_path / path)
    first = start_backend(slots=1, slot_save_path=str(tmp_path / "first"))
    second = start_backend(slots=1, slot_save_path=str(tmp_path / "second"))
    story = words(7, BIG)
    earlier = start_proxy(second, meta_dir=str(tmp_path / "meta-a"))
    earlier.push(user(story), sid(S1))
    earlier.stop()
    assert os.listdir(tmp_path / "second") == [name(S1)]
    proxy = start_proxy(first, second, meta_dir=str(tmp_path / "meta-b"))
    restores = mock_stats(second)["restores"]
    r = proxy.push(user(story + " and then the rain stopped."), sid(S1))
    assert r.status_code == 200, r.text
    assert proxy.records[-1].backend == second.url, "continued where the session's file is"
    assert r.headers["x-lpcache-restored"] == "true" and mock_stats(second)["restores"] == restores + 1
    assert r.json()["timings"]["cache_n"] >= BIG, "its history came from the file"
