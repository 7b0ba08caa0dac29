"""lpcache.eviction: the predicted-next-use replacement policy against LRU, limits, keep, inheritance, cost."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from lpcache.cache import eviction
from lpcache.cache.eviction import ABANDON, SAMPLE, Usage, UsageTable, key_hash, lru_victims, victims

Choose = Callable[[UsageTable, float, int, int, set[str]], list[str]]


def predicted(tbl: UsageTable, now: float, mc: int, mb: int, keep: set[str]) -> list[str]:
    return victims(tbl, now, mc, mb, keep)


def table_choice(tbl: UsageTable, now: float, mc: int, mb: int, keep: set[str]) -> list[str]:
    return tbl.victims(now, mc, mb, keep)


def lru(tbl: UsageTable, now: float, mc: int, mb: int, keep: set[str]) -> list[str]:
    return lru_victims(tbl, now, mc, mb, keep)


def simulate(trace: list[tuple[float, str]], choose: Choose, max_count: int,
             max_bytes: int = 0, size: int = 0, start: int = 0) -> dict[str, int]:
    """Each use restores the conversation's file if still kept (a hit), then saves its next file, which supersedes
    the old one; then the policy deletes what is over the limit, never the file just saved. Hits per conversation,
    counted from the use `start` on."""
    tbl = UsageTable()
    current: dict[str, str] = {}
    hits: dict[str, int] = {}
    for turn, (t, name) in enumerate(trace):
        old = current.get(name)
        if old is not None and old in tbl:
            if turn >= start:
                hits[name] = hits.get(name, 0) + 1
            tbl.use(old, t)
        key = f"{name}/{turn}"
        tbl.add(key, size, t, supersedes=[old] if old else [])
        current[name] = key
        for victim in choose(tbl, t, max_count, max_bytes, {key}):
            assert victim != key
            tbl.remove(victim)
        assert not max_count or len(tbl) <= max_count
    return hits


def cyclic(n: int, rounds: int = 20) -> list[tuple[float, str]]:
    return [((r * n + c) * 10.0, f"c{c:02d}") for r in range(rounds) for c in range(n)]


def hot_and_cold(rounds: int = 20, cold: int = 12, seed: int = 2) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    out, t, fresh = [], 0.0, 0
    for _ in range(rounds):
        names = ["hot0", "hot1", "hot2"] + [f"one{fresh + i:04d}" for i in range(cold)]
        fresh += cold
        rng.shuffle(names)
        for name in names:
            t += rng.uniform(5.0, 15.0)
            out.append((t, name))
    return out


def u(key: str, last: float, interval: float | None = None, size: int = 0, uses: int = 1) -> Usage:
    return Usage(key, size, last, interval, uses if interval is None else max(uses, 2))


# ---- the workloads ----

@pytest.mark.parametrize("choose", [predicted, table_choice])
def test_cyclic_12_over_10_mostly_hits_where_lru_gets_none(choose: Choose) -> None:
    trace = cyclic(12)
    assert sum(simulate(trace, lru, 10).values()) == 0
    assert sum(simulate(trace, choose, 10).values()) >= 0.6 * len(trace)


@pytest.mark.parametrize("n", [11, 20])
def test_other_cycles_beat_lru(n: int) -> None:
    trace = cyclic(n)
    assert sum(simulate(trace, lru, 10).values()) == 0
    assert sum(simulate(trace, table_choice, 10).values()) >= 0.35 * len(trace)


@pytest.mark.parametrize("choose", [predicted, table_choice])
def test_hot_conversations_survive_a_stream_of_one_offs(choose: Choose) -> None:
    trace = hot_and_cold()
    hits = simulate(trace, choose, 10)
    assert all(hits.get(f"hot{h}", 0) >= 17 for h in range(3))  # of 19 uses after the first
    late = simulate(trace, choose, 10, start=len(trace) // 2)
    assert all(late.get(f"hot{h}", 0) == 10 for h in range(3))  # every use, once the rhythm is known
    lru_hits = simulate(trace, lru, 10)
    assert sum(lru_hits.get(f"hot{h}", 0) for h in range(3)) < 19


def test_the_table_chooses_as_the_full_ranking_on_a_cycle() -> None:
    a, b = UsageTable(), UsageTable()
    current: dict[str, str] = {}
    for turn, (t, name) in enumerate(cyclic(12, 8)):
        old = current.get(name)
        for tbl in (a, b):
            if old is not None:
                tbl.use(old, t)
            tbl.add(f"{name}/{turn}", 0, t, supersedes=[old] if old else [])
        current[name] = f"{name}/{turn}"
        keep = {current[name]}
        chosen = a.victims(t, 10, 0, keep)
        assert chosen == victims(b, t, 10, 0, keep)
        for k in chosen:
            a.remove(k)
            b.remove(k)


# ---- the rule ----

def test_an_entry_just_used_on_its_rhythm_goes_before_one_due_soon() -> None:
    entries = [u("due-soon", 0.0, 100.0), u("just-used", 90.0, 100.0)]
    assert victims(entries, 95.0, 1, 0) == ["just-used"]


def test_an_abandoned_entry_goes_first_and_a_late_one_is_kept() -> None:
    now = 1000.0
    late = u("late", now - 150.0, 100.0)                 # due 50 s ago, not yet abandoned
    gone = u("gone", now - ABANDON * 100.0 - 1.0, 100.0)  # unused for more than ABANDON intervals
    fresh = u("fresh", now - 1.0, 100.0)
    assert victims([late, gone, fresh], now, 2, 0) == ["gone"]
    assert victims([late, fresh], now, 1, 0) == ["fresh"]


def test_entries_used_once_go_before_rhythms_and_stale_ones_first() -> None:
    now = 1000.0
    rhythm = [u(f"r{i}", now - i, 60.0) for i in range(3)]
    once = [u("once-a", now - 5.0), u("once-b", now - 6.0)]
    stale = u("stale", now - 10 * 60.0)
    order = victims([*rhythm, *once, stale], now, 5, 0)
    assert order == ["stale"]
    chosen = victims([*rhythm, *once], now, 3, 0)
    assert set(chosen) == {"once-a", "once-b"}
    assert chosen == sorted(chosen, key=lambda k: -key_hash(k))


def test_nothing_known_ranks_by_the_key_hash() -> None:
    entries = [u(f"k{i}", float(i)) for i in range(10)]
    chosen = victims(entries, 100.0, 7, 0)
    assert chosen == sorted((e.key for e in entries), key=lambda k: -key_hash(k))[:3]


def test_ties_break_by_key_and_input_order_does_not_matter() -> None:
    entries = [u(f"k{i}", 50.0, 100.0) for i in range(8)]
    assert victims(entries, 60.0, 5, 0) == ["k0", "k1", "k2"]
    rng = random.Random(1)
    mixed = [u(f"m{i}", rng.uniform(0, 1000), rng.choice([None, 30.0, 300.0]), rng.randrange(1, 100))
             for i in range(200)]
    first = victims(mixed, 1000.0, 50, 3000, {"m3", "m7"})
    for _ in range(5):
        rng.shuffle(mixed)
        assert victims(mixed, 1000.0, 50, 3000, {"m3", "m7"}) == first


# ---- limits and keep ----

def test_keep_is_never_deleted() -> None:
    rng = random.Random(3)
    for _ in range(200):
        entries = [u(f"k{i}", rng.uniform(0, 100), rng.choice([None, 5.0, 50.0]), rng.randrange(0, 50))
                   for i in range(rng.randrange(0, 30))]
        keep = {e.key for e in entries if rng.random() < 0.3}
        mc, mb = rng.randrange(0, 10), rng.randrange(0, 300)
        for fn in (victims, lru_victims):
            chosen = fn(entries, 100.0, mc, mb, keep)
            assert not keep & set(chosen)
            assert len(chosen) == len(set(chosen))
            left = [e for e in entries if e.key not in chosen]
            within = (not mc or len(left) <= mc) and (not mb or sum(e.size for e in left) <= mb)
            assert within or all(e.key in keep for e in left)  # over only when nothing else is left


def test_a_candidate_chosen_for_a_restore_is_kept_even_as_the_best_victim() -> None:
    entries = [u("chosen", 0.0), u("other", 50.0, 10.0)]
    assert victims(entries, 60.0, 1, 0) == ["chosen"]
    assert victims(entries, 60.0, 1, 0, keep={"chosen"}) == ["other"]


def test_byte_and_count_limits_are_both_enforced() -> None:
    entries = [u(f"k{i}", float(i), 100.0, size=100) for i in range(10)]
    assert len(victims(entries, 10.0, 8, 0)) == 2                      # the count
    assert len(victims(entries, 10.0, 0, 550)) == 5                    # the bytes: 1000 -> 500
    assert len(victims(entries, 10.0, 8, 550)) == 5                    # the stricter wins
    assert len(victims(entries, 10.0, 3, 950)) == 7
    tbl = UsageTable()
    for e in entries:
        tbl.add(e.key, e.size, e.last_use)
    assert tbl.total_bytes == 1000
    chosen = tbl.victims(10.0, 8, 550)
    assert len(chosen) == 5
    for k in chosen:
        tbl.remove(k)
    assert tbl.total_bytes == 500 and len(tbl) == 5


def test_a_byte_budget_deletes_in_rank_order_until_it_holds() -> None:
    entries = [u("big", 0.0, 100.0, size=1000), u("small", 1.0, 100.0, size=10), u("new", 2.0, None, size=500)]
    assert victims(entries, 3.0, 0, 1500, keep={"new"}) == ["small"]
    assert victims(entries, 3.0, 0, 1200, keep={"new"}) == ["small", "big"]


def test_when_the_kept_entries_alone_are_over_everything_else_goes() -> None:
    entries = [u("a", 0.0, size=500), u("b", 1.0, size=500), u("c", 2.0, size=10)]
    assert sorted(victims(entries, 3.0, 0, 100, keep={"a", "b"})) == ["c"]
    assert sorted(victims(entries, 3.0, 1, 0, keep={"a", "b"})) == ["c"]
    assert victims(entries, 3.0, 1, 0, keep={"a", "b", "c"}) == []


def test_empty_and_no_limits() -> None:
    assert victims([], 0.0, 10, 100) == []
    assert lru_victims([], 0.0, 10, 100) == []
    entries = [u(f"k{i}", float(i), size=100) for i in range(5)]
    assert victims(entries, 10.0, 0, 0) == []
    assert victims(entries, 10.0, -1, -1) == []
    assert victims(entries, 10.0, 5, 500) == []
    assert UsageTable().victims(0.0, 1, 1) == []


def test_unknown_sizes_count_as_nothing() -> None:
    entries = [u(f"k{i}", float(i)) for i in range(5)]  # size 0
    assert victims(entries, 10.0, 0, 1) == []
    assert len(victims(entries, 10.0, 3, 1)) == 2
    tbl = UsageTable()
    tbl.add("x", -5, 0.0)
    assert tbl.total_bytes == 0


def test_lru_deletes_the_least_recently_used() -> None:
    entries = [u("b", 1.0), u("a", 1.0), u("c", 0.5), u("d", 3.0, 1.0)]
    assert lru_victims(entries, 10.0, 2, 0) == ["c", "a"]
    assert lru_victims(entries, 10.0, 2, 0, keep={"c"}) == ["a", "b"]


# ---- usage records ----

def test_use_learns_the_interval() -> None:
    rec = Usage("k", 0, 0.0)
    assert rec.interval is None and rec.uses == 1
    rec.use(100.0)
    assert rec.interval == 100.0 and rec.uses == 2 and rec.last_use == 100.0
    rec.use(300.0)
    assert rec.interval == pytest.approx(eviction.ALPHA * 200.0 + (1 - eviction.ALPHA) * 100.0)
    rec.use(250.0)  # out of order: counted, no interval
    assert rec.uses == 4 and rec.last_use == 300.0


def test_a_new_file_inherits_the_rhythm_of_the_one_it_supersedes() -> None:
    old = Usage("turn1", 10, 0.0)
    old.use(60.0)
    new = Usage("turn2", 20, 65.0)
    new.inherit(old)
    assert (new.interval, new.uses, new.last_use, new.size) == (60.0, 2, 65.0, 20)

    tbl = UsageTable()
    tbl.add("turn1", 10, 0.0)
    tbl.use("turn1", 60.0)
    rec = tbl.add("turn2", 20, 65.0, supersedes=["turn1", "absent"])
    assert "turn1" not in tbl and len(tbl) == 1 and tbl.total_bytes == 20
    assert rec.interval == 60.0 and rec.uses == 2
    tbl.add("one-off", 5, 66.0)
    assert tbl.victims(70.0, 1, 0) == ["one-off"]  # the conversation's new file is not mistaken for a new one


def test_a_re_save_under_the_same_key_keeps_its_history() -> None:
    tbl = UsageTable()
    tbl.add("k", 10, 0.0)
    tbl.use("k", 30.0)
    rec = tbl.add("k", 15, 31.0)
    assert rec.interval == 30.0 and tbl.total_bytes == 15 and len(tbl) == 1


def test_the_table_is_deterministic() -> None:
    def run() -> list[list[str]]:
        rng = random.Random(9)
        tbl, out = UsageTable(), []
        for i in range(500):
            t = i * 7.0
            if len(tbl) and rng.random() < 0.6:
                tbl.use(rng.choice([r.key for r in tbl]), t)
            tbl.add(f"k{i}", rng.randrange(100), t)
            chosen = tbl.victims(t, 40, 2500, {f"k{i}"})
            out.append(chosen)
            for k in chosen:
                tbl.remove(k)
        return out

    assert run() == run()


# ---- cost ----

def test_the_table_ranks_a_bounded_number_of_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    tbl = UsageTable()
    n = 20_000
    for i in range(n):
        tbl.add(f"k{i:05d}", 100, float(i))
        if i % 2:
            tbl.use(f"k{i:05d}", float(i) + 30.0 + i % 7)
    calls = 0
    real = Usage.predicted

    def counting(self: Usage, now: float, typical: float | None) -> float:
        nonlocal calls
        calls += 1
        return real(self, now, typical)

    monkeypatch.setattr(Usage, "predicted", counting)
    tbl.add("new", 100, float(n) + 100.0)
    chosen = tbl.victims(float(n) + 100.0, n, 0, {"new"})
    assert len(chosen) == 1 and chosen != ["new"]
    assert calls <= 3 * SAMPLE
    calls = 0
    assert victims(tbl, float(n) + 100.0, n, 0, {"new"}) == chosen  # the full ranking agrees
    assert calls >= n


def test_a_table_of_at_most_sample_entries_ranks_them_all_without_walking_its_heaps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no more entries than SAMPLE, every entry is a candidate: the heaps' tops are not walked (they could add
    none), their stale roots go all the same, and the choice is the full ranking's at the table's typical interval
    and worth. META_MAX=10 with files coming and going: most of the heaps' items are stale."""
    rng = random.Random(5)
    tbl = UsageTable()
    walks = 0
    real = UsageTable._top

    def counting(self: UsageTable, *args: object) -> list[Usage]:
        nonlocal walks
        walks += 1
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(UsageTable, "_top", counting)
    for i in range(3000):
        t = i * 3.0
        if len(tbl) and rng.random() < 0.5:
            tbl.use(rng.choice([u.key for u in tbl]), t + rng.random())
        tbl.add(f"k{i}", rng.randrange(1, 100), t, worth=rng.choice([0.0, 1.0, 2.0]))
        keep = {f"k{i}", *rng.sample([u.key for u in tbl], 1)}
        over = len(tbl) > 10
        expected = eviction._victims([u for u in tbl if u.key not in keep], t, 10, 0, keep, tbl.typical(),
                                     tbl.typical_worth(), len(tbl), tbl.total_bytes)
        chosen = tbl.victims(t, 10, 0, keep)
        assert chosen == expected
        if over:
            assert all(tbl._is_due(h[0]) is not None for h in (tbl._due,) if h)
            assert all(tbl._is_once(h[0]) is not None for h in (tbl._once,) if h)
        for k in chosen:
            tbl.remove(k)
    assert len(tbl._once) > 100   # stale items, left in the heap as before
    assert walks == 0


def test_the_table_falls_back_to_the_full_ranking_when_the_candidates_are_not_enough() -> None:
    tbl = UsageTable(sample=2)
    for i in range(50):
        tbl.add(f"k{i:02d}", 10, float(i))
    chosen = tbl.victims(60.0, 0, 100)  # 500 bytes -> 100: 40 deletions
    assert len(chosen) == 40
    assert chosen == victims(tbl, 60.0, 0, 100)


def test_the_table_heaps_stay_bounded() -> None:
    tbl = UsageTable()
    for i in range(20_000):
        tbl.add(f"k{i}", 1, float(i), supersedes=[f"k{i - 1}"])
        tbl.use(f"k{i}", float(i) + 0.5)
        tbl.add(f"once{i}", 1, float(i))
        tbl.remove(f"once{i - 1}")
    assert len(tbl) == 2
    assert len(tbl._due) <= 2 * len(tbl) + 1025 and len(tbl._once) <= 2 * len(tbl) + 1025


@pytest.mark.parametrize("choose", [predicted, table_choice], ids=["victims", "table"])
def test_a_file_worth_less_per_byte_goes_before_one_worth_more_with_the_same_rhythm(choose: Choose) -> None:
    """Two models' conversations on one rhythm: the files of the model whose prefill is quick (or whose cache weighs
    more per token) spare less per byte and go first; with equal worths the order is the rhythm's."""
    tbl = UsageTable()
    for name, worth in (("slow-model", 4.0), ("quick-model", 0.5), ("typical", 1.0), ("typical2", 1.0)):
        tbl.add(name, 100, 0.0, worth=worth)
        tbl.use(name, 10.0)
        tbl.use(name, 20.0)   # every one due at 30 s
    assert choose(tbl, 25.0, 0, 300, set()) == ["quick-model"]
    assert choose(tbl, 25.0, 0, 200, set())[:2] == ["quick-model", "typical"]
    assert "slow-model" not in choose(tbl, 25.0, 0, 100, set())


def test_worth_only_reorders_entries_whose_worth_differs_from_the_typical_one() -> None:
    same = UsageTable()
    unknown = UsageTable()
    for i, due in enumerate((30.0, 50.0, 40.0)):
        for tbl, worth in ((same, 2.0), (unknown, 0.0)):
            tbl.add(f"c{i}", 100, 0.0, worth=worth)
            tbl.use(f"c{i}", due / 2)
            tbl.use(f"c{i}", due)
    assert same.victims(55.0, 0, 200, set()) == unknown.victims(55.0, 0, 200, set())
    assert same.typical_worth() == 2.0 and unknown.typical_worth() is None


def test_a_new_turn_keeps_the_worth_of_the_file_it_supersedes_when_its_own_is_unknown() -> None:
    tbl = UsageTable()
    tbl.add("turn1", 100, 0.0, worth=3.0)
    usage = tbl.add("turn2", 120, 5.0, supersedes=["turn1"])
    assert usage.worth == 3.0
