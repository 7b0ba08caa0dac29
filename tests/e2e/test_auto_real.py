"""BIG_THRESHOLD_WORDS=auto against a real llama-server (-np 2 --cache-ram 0): chat conversations of short turns
(realistic text, the server's own answers fed back), more conversations than slots, taking turns. With the default
threshold none of them is saved, and lpcache says what that costs; with auto every turn whose cache a later turn
needs is saved, and each later turn computes little more than its own new message."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from lpcache.cache.server_cache import RAM_BET_SECONDS, RAM_TRUST
from lpcache.config import BackendConfig, Settings
from lpcache.workloads import chats
from lpcache.workloads.harness import LlamaServer

from ..conftest import RAM_SERVED_TOKENS, Proxy, figures

pytestmark = pytest.mark.e2e

CONVERSATIONS, TURNS = 4, 3


def play(url: str, session_ids: bool = False, turns: int = TURNS,
         before_turn: Callable[[int], None] | None = None,
         openings: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Conversations taking turns, user turns of 20-60 words of real-looking text (prose, code, lists, Unicode),
    answers of at most 16 tokens fed back; returns each request's timings, conversation and turn. `before_turn(n)`
    is called before each round of turns; `openings`: each conversation's first message, as given."""
    rng = random.Random(21)
    history: list[list[dict[str, Any]]] = [[] for _ in range(CONVERSATIONS)]
    out = []
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            if before_turn is not None:
                before_turn(turn)
            for c in range(CONVERSATIONS):
                said = openings[c] if openings is not None and turn == 0 else chats.text(rng, rng.randint(20, 60))
                history[c].append({"role": "user", "content": said})
                r = client.post(f"{url}/v1/chat/completions",
                                headers={"X-Session-ID": f"conversation-{c}"} if session_ids else None,
                                json={"model": "smollm2", "messages": history[c], "max_tokens": 16,
                                      "temperature": 0})
                assert r.status_code == 200, r.text
                doc = r.json()
                history[c].append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
                out.append({"turn": turn, "conversation": c, "restored": r.headers.get("x-lpcache-restored"),
                            **doc["timings"], "prompt_tokens": doc["usage"]["prompt_tokens"]})
    return out


@contextmanager
def behind_lpcache(tmp_path: Any, cache_ram: int | None, **settings: Any) -> Iterator[Proxy]:
    """lpcache with `settings` in front of a real llama-server (-np 2, `cache_ram`: 0 off, None its default)."""
    slots = str(tmp_path / "slots")
    with LlamaServer(slots, n_slots=2, cache_ram=cache_ram, ctx=8192) as server:
        proxy = Proxy(Settings(backends=(BackendConfig(server.url, None, slots),), meta_dir=str(tmp_path / "meta"),
                               host="127.0.0.1", **settings))
        try:
            yield proxy
        finally:
            proxy.stop()


def answered(client: httpx.Client, proxy: Proxy, messages: list[dict[str, Any]]) -> httpx.Response:
    """One chat request through lpcache (16 tokens, greedy), answered with a 200, and lpcache settled after it."""
    r = client.post(f"{proxy.url}/v1/chat/completions",
                    json={"model": "smollm2", "messages": messages, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    proxy.settle()
    return r


def metric(proxy: Proxy, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in proxy.client.get("/metrics").text.splitlines()
               if line.startswith(name))


@pytest.mark.parametrize("session_ids", [False, True], ids=["prefix", "sessions"])
def test_auto_saves_short_turns_on_a_cpu_and_later_turns_compute_only_their_new_message(
        tmp_path: Any, session_ids: bool) -> None:
    with behind_lpcache(tmp_path, 0, big_threshold_words=None, meta_max=0) as proxy:
        rows = play(proxy.url, session_ids)
        proxy.settle()
        worth = metric(proxy, 'lpcache_save_decisions_total{decision="worth"}')
        probes = metric(proxy, 'lpcache_save_decisions_total{decision="probe"}')
        ram = proxy.pipeline.backends[0].ram
        present, ram_probes = ram.present, ram.probes
    later = [r for r in rows if r["turn"] > 0]
    restored = [r for r in later if r["restored"] == "true"]
    # The turns before a later one: its conversation's previous prompt and answer, which the restore brought back.
    previous = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in rows}
    figures(f"auto ({'sessions' if session_ids else 'prefix'}): {len(restored)} of {len(later)} later turns "
            f"restored; computed {sum(r['prompt_n'] for r in rows)} of {sum(r['prompt_tokens'] for r in rows)} "
            f"prompt tokens; save decisions worth={worth:.0f} probe={probes:.0f}")
    assert worth + probes >= CONVERSATIONS * (TURNS - 1)
    assert present is False and ram_probes == 0   # asked: --cache-ram 0 keeps nothing, so no return is left to it
    assert len(restored) >= len(later) - 1, rows
    for r in restored:
        assert r["cache_n"] >= previous[(r["conversation"], r["turn"] - 1)], r   # the whole previous prompt


def test_the_default_threshold_saves_none_of_them_and_says_what_it_costs(tmp_path: Any, caplog) -> None:
    with behind_lpcache(tmp_path, 0) as proxy:
        with caplog.at_level("WARNING", logger="lpcache.worth"):
            rows = play(proxy.url)
            proxy.settle()
        missed = metric(proxy, 'lpcache_prefill_missed_tokens_total{kind="threshold"}')
        seconds = metric(proxy, 'lpcache_prefill_missed_seconds_total{kind="threshold"}')
        saves = metric(proxy, 'lpcache_saves_total{result="ok"}')
    computed_again = sum(r["prompt_n"] for r in rows if r["turn"] > 0)
    figures(f"defaults: 0 saves; {missed:.0f} tokens ({seconds:.1f} s of prefill) computed again that a file would "
            f"have spared, of {computed_again} computed by later turns")
    assert saves == 0
    assert 0 < missed <= computed_again and seconds > 0
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings_cost")]
    assert len(told) == 1 and "BIG_THRESHOLD_WORDS=500" in told[0]


@pytest.mark.parametrize("auto", [True, False], ids=["auto", "defaults"])
def test_behind_the_default_ram_cache_every_return_finds_its_history_in_ram_or_a_file(tmp_path: Any,
                                                                                       auto: bool) -> None:
    """llama-server's default --cache-ram holds these conversations. A return with no file worth restoring goes to
    a slot of the server that held it, whose RAM serves it, and lpcache takes that for a RAM hit (not a miss of the
    slot's); with auto, which asked the server whether it has a RAM cache, the returns are left to it the same way
    rather than restored from their files, and every later turn finds its whole history."""
    with behind_lpcache(tmp_path, None, big_threshold_words=None if auto else 500, meta_max=0) as proxy:
        rows = play(proxy.url)
        proxy.settle()
        left_to_ram = [r for r in proxy.records if r.ram_expected]
        ram = proxy.pipeline.backends[0].ram
        served, outcomes = ram.served, [hit for _, hit in ram.outcomes]
    later = [r for r in rows if r["turn"] > 0]
    previous = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in rows}
    restored = [r for r in later if r["restored"] == "true"]
    figures(f"default --cache-ram, {'auto' if auto else 'defaults'}: {len(left_to_ram)} of {len(later)} later turns "
            f"left to the server's RAM, {len(restored)} restored from disk; computed "
            f"{sum(r['prompt_n'] for r in rows)} of {sum(r['prompt_tokens'] for r in rows)} prompt tokens")
    assert len(left_to_ram) + len(restored) >= len(later) - 1, (len(left_to_ram), len(restored))
    # the fixed threshold saves nothing here, so the RAM is all there is; auto asked the server, which said it has
    # a RAM cache: relied on from the first return, it serves them all and no file is restored
    assert not restored and len(left_to_ram) >= len(later) - 1 and served and all(outcomes), outcomes
    for r in later:
        assert r["cache_n"] >= previous[(r["conversation"], r["turn"] - 1)], r   # the RAM (or a file) had it all


def test_sessions_behind_the_default_ram_cache_find_that_it_serves_without_losing_a_turn(
        tmp_path: Any) -> None:
    """With session ids every return has its session's file, whose restore beats a RAM never seen on this CPU; but the
    server said it has a RAM cache (`backends.ram_check`), so that RAM is relied on from the first return and, since
    it serves every return, kept relied on: the returns it holds are left to it, and no later turn computes its
    history again."""
    with behind_lpcache(tmp_path, None, big_threshold_words=None, meta_max=0) as proxy:
        rows = play(proxy.url, session_ids=True, turns=12)
        proxy.settle()
        ram = proxy.pipeline.backends[0].ram
        probes, outcomes, present = ram.probes, [hit for _, hit in ram.outcomes], ram.present
        left_to_ram = [r for r in proxy.records if r.ram_expected]
        not_worth = metric(proxy, 'lpcache_save_decisions_total{decision="not_worth"}')
    later = [r for r in rows if r["turn"] > 0]
    previous = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in rows}
    restored = [r for r in later if r["restored"] == "true"]
    figures(f"default --cache-ram, auto, sessions: {probes} probes, RAM outcomes {outcomes.count(True)} hits "
            f"{outcomes.count(False)} misses; {len(left_to_ram)} of {len(later)} later turns left to the RAM, "
            f"{len(restored)} restored; {not_worth:.0f} caches not saved; computed {sum(r['prompt_n'] for r in rows)} "
            f"of {sum(r['prompt_tokens'] for r in rows)} prompt tokens")
    # asked as lpcache started, the server said it has a RAM cache: from the first return it likely holds, while the
    # RAM serves, every such return is left to it (no probe needed)
    assert present is True and probes == 0
    assert outcomes and all(outcomes), outcomes
    assert len(left_to_ram) >= len(later) // 2, len(left_to_ram)
    for r in later:
        assert r["cache_n"] >= previous[(r["conversation"], r["turn"] - 1)], r   # the RAM (or a file) had it all


MISS_AT = 5   # the round of turns before which one RAM miss is recorded


def test_after_a_ram_miss_a_session_s_older_file_is_not_restored_over_the_turn_its_ram_holds(tmp_path: Any) -> None:
    """Once the RAM is relied on, a session's turns are not saved (the RAM serves the returns); then one miss (any
    prompt the RAM did not hold) stops the probes for a while, and each return is weighed: the RAM's expected cost
    against the restore of the session's file, which holds only an older turn, plus the prefill of what it lacks.
    The RAM, which holds the last turn, is left to serve it: no later turn computes its history again. (The RAM is
    taken as seen serving RAM_TRUST prompts from turn 1, as it would be after enough probes; this small model's
    conversations all fit in it.)"""
    with behind_lpcache(tmp_path, None, big_threshold_words=None, meta_max=0) as proxy:
        ram = proxy.pipeline.backends[0].ram

        def seen(hits: list[bool]) -> None:
            proxy.settle()

            async def record() -> None:
                for hit in hits:
                    ram.seen(hit, time.monotonic(), RAM_SERVED_TOKENS)
            proxy.run(record())

        def before_turn(turn: int) -> None:
            if turn == 1:
                seen([True] * RAM_TRUST)
            if turn == MISS_AT:
                seen([False])

        rows = play(proxy.url, session_ids=True, turns=MISS_AT + 4, before_turn=before_turn)
        proxy.settle()
        outcomes = [hit for _, hit in ram.outcomes]
        left_to_ram = [r for r in proxy.records if r.ram_expected]
    previous = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in rows}
    after = [r for r in rows if r["turn"] >= MISS_AT]
    computed = sum(r["prompt_n"] for r in after)
    figures(f"default --cache-ram, RAM relied on from turn 1, one miss recorded at turn {MISS_AT}: outcomes "
            f"{outcomes.count(True)} hits {outcomes.count(False)} misses, {len(left_to_ram)} turns left to the RAM; "
            f"turns {MISS_AT}+ computed {computed} of {sum(r['prompt_tokens'] for r in after)} prompt tokens, "
            f"restored {[r['restored'] for r in after]}")
    for r in after:
        assert r["cache_n"] >= previous[(r["conversation"], r["turn"] - 1)], r   # the RAM (or a file) had it all


OPENINGS = ("hi", "Hello!", "¿Qué tal?", "hey, quick one")   # what real chats open with: shorter than a block


def test_a_session_s_few_word_opening_is_not_restored_over_the_later_turn_the_ram_holds(tmp_path: Any) -> None:
    """A chat opening of a few words ("hi") is shorter than one identity block: the file saved for it has an empty
    chain, which says nothing of what it holds. Once the RAM is relied on, the later turns are not saved; a return
    whose only file is that opening, while the server's RAM holds its last turn, is weighed like any older file
    (by the tokens the file holds), not restored blindly over it: on a ShareGPT run that threw away 539 of a
    609-token history. (The RAM is taken as seen serving RAM_TRUST prompts from turn 1, as after enough probes.
    The openings are saved because on this CPU a file of their tokens pays; a machine where it would not does
    not have the case, and fails the precondition.)"""
    with behind_lpcache(tmp_path, None, big_threshold_words=None, meta_max=0) as proxy:
        ram = proxy.pipeline.backends[0].ram
        book = proxy.pipeline.sessions
        empty_files: list[str] = []

        def before_turn(turn: int) -> None:
            proxy.settle()
            if turn == 1:
                empty_files.extend(i.file for i in book.all_owners() if i.saves and not i.saved_chain)

                async def record() -> None:
                    for _ in range(RAM_TRUST):
                        ram.seen(True, time.monotonic(), RAM_SERVED_TOKENS)
                proxy.run(record())

        rows = play(proxy.url, session_ids=True, turns=4, before_turn=before_turn, openings=OPENINGS)
        proxy.settle()
        left_to_ram = [r for r in proxy.records if r.ram_expected]
        weighed = [r.route for r in proxy.records[2 * CONVERSATIONS:]]   # turns 2+, whose file is the opening
    previous = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in rows}
    later = [r for r in rows if r["turn"] >= 2]
    figures(f"few-word openings saved with an empty chain: {len(empty_files)} of {CONVERSATIONS}; "
            f"{len(left_to_ram)} turns left to the RAM; turns 2+ computed {sum(r['prompt_n'] for r in later)} of "
            f"{sum(r['prompt_tokens'] for r in later)} prompt tokens, restored {[r['restored'] for r in later]}")
    assert len(empty_files) >= 2, empty_files          # the case this is about: openings filed under no chain
    assert weighed.count("session_server_ram") >= CONVERSATIONS, weighed   # left to the RAM, not restored blindly
    for r in later:
        assert r["cache_n"] >= previous[(r["conversation"], r["turn"] - 1)], r   # the RAM (or a file) had it all


def test_a_ram_too_small_for_a_long_return_is_not_bet_on_and_its_file_is_restored(tmp_path: Any) -> None:
    """The check finds a RAM cache (its prompts are a few tokens), but this one (`--cache-ram 2`, about 90 tokens of
    SmolLM2's KV) cannot keep a long conversation. Relied on from its first return without a bound, it left that
    conversation's return to be computed again; bounded by what it has served (`RamWatch.bets`: nothing yet, and a
    miss costing more than RAM_BET_SECONDS of prefill on this CPU), the return is restored from its file."""
    rng = random.Random(5)
    with behind_lpcache(tmp_path, 2, big_threshold_words=None, meta_max=0) as proxy:
        with httpx.Client(timeout=600) as client:
            def ask(messages: list[dict[str, Any]]) -> httpx.Response:
                return answered(client, proxy, messages)

            long_chat = [{"role": "user", "content": chats.text(rng, 450)}]
            first = ask(long_chat)
            for _ in range(2):   # two other chats: the long one's slot is taken over (its cache copied to RAM)
                ask([{"role": "user", "content": chats.text(rng, 30)}])
            long_chat += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "And the same for *Ω* — in one line, please?"}]
            back = ask(long_chat)
            present, speeds = proxy.pipeline.backends[0].ram.present, proxy.pipeline.speeds.items()
    held = first.json()["usage"]["prompt_tokens"]
    timings = back.json()["timings"]
    figures(f"--cache-ram 2, auto: the RAM check said present={present}; a {held}-token conversation's return: "
            f"restored={back.headers.get('x-lpcache-restored')}, cache_n={timings['cache_n']} prompt_n="
            f"{timings['prompt_n']}; prefill {speeds[0][1].prefill.ms_per_token if speeds else None} ms a token")
    assert present is True   # the preconditions: the check found the RAM, and a miss would cost more than the bet
    prefill = speeds[0][1].prefill.seconds(held) if speeds else None
    assert prefill is not None and prefill > RAM_BET_SECONDS, f"a {held}-token prefill learnt at {prefill} s"
    assert back.headers.get("x-lpcache-restored") == "true"
    assert timings["cache_n"] >= held, timings


def test_a_ram_that_kept_other_chats_beside_a_short_return_is_bet_on_for_a_long_one(tmp_path: Any) -> None:
    """llama-server's default RAM keeps everything here, but the only return it has served is a short chat's. That
    return came after the server had held chats of growing sizes, the long one among them, each no longer than all
    before it: its RAM (oldest out first) had room for each and kept them all beside it (`ServerCaches.since`), so
    the long conversation's return is left to it rather than restored from its file. Bounded by the short prompt's
    size alone, it was restored, and where short returns were few the requests never went unpinned (a ShareGPT
    seed's time to first token over the server alone's)."""
    rng = random.Random(11)
    with behind_lpcache(tmp_path, None, big_threshold_words=None, meta_max=0) as proxy:
        with httpx.Client(timeout=600) as client:
            def ask(messages: list[dict[str, Any]]) -> httpx.Response:
                return answered(client, proxy, messages)

            def again(chat: list[dict[str, Any]], answer: httpx.Response, text: str) -> list[dict[str, Any]]:
                return chat + [{"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
                               {"role": "user", "content": text}]

            # short enough for its prefill to stay under RAM_BET_SECONDS on a slow CPU (10 ms a token), the long one
            # long enough for its prefill to pass it on a fast one (2 ms a token)
            short_chat = [{"role": "user", "content": chats.text(rng, 30)}]
            short_answer = ask(short_chat)
            # chats of growing sizes, each clearly no longer than all before it (so the RAM had room to store each;
            # the second one takes the short chat's slot, which goes to RAM)
            for words in (20, 30, 45, 60, 90, 130):
                ask([{"role": "user", "content": chats.text(rng, words)}])
            long_chat = [{"role": "user", "content": chats.text(rng, 240)}]
            long_answer = ask(long_chat)
            for _ in range(2):   # two more chats take both slots over: the long one goes to RAM too
                ask([{"role": "user", "content": chats.text(rng, 20)}])
            short_back = ask(again(short_chat, short_answer, "And `git stash apply`? Danke!"))
            ram = proxy.pipeline.backends[0].ram
            shown = max((n for _, n in ram.kept_shown), default=0.0)
            in_slots = max((s.content.tokens or 0) for s in proxy.pipeline.pool.slots if s.content is not None)
            long_back = ask(again(long_chat, long_answer, "Now the same for *Ω* — in one line, please?"))
            speeds = proxy.pipeline.speeds.items()
    held = long_answer.json()["usage"]["prompt_tokens"]
    timings = long_back.json()["timings"]
    prefill = speeds[0][1].prefill.seconds(held) if speeds else None
    figures(f"default RAM, auto: a short return served with cache_n={short_back.json()['timings']['cache_n']} of "
            f"{short_back.json()['usage']['prompt_tokens']}, showing {shown:.0f} tokens kept; the {held}-token "
            f"conversation's return: restored={long_back.headers.get('x-lpcache-restored')}, cache_n="
            f"{timings['cache_n']}; its prefill {prefill} s")
    # the preconditions: the short return was the RAM's (a hit seen), twice it does not cover the long one, no slot
    # holds the long one any more (its return can only come from the RAM or its file), and a miss of it would cost
    # more than the bet a prompt's size alone allows
    assert ram.present is True and shown > 0 and held > 2 * short_back.json()["timings"]["cache_n"], (shown, held)
    assert in_slots < held / 2, (in_slots, held)
    assert prefill is not None and prefill > RAM_BET_SECONDS, f"a {held}-token prefill learnt at {prefill} s"
    assert long_back.headers.get("x-lpcache-restored") != "true"
    assert timings["cache_n"] >= 0.9 * held, timings
