"""The cost model of BIG_THRESHOLD_WORDS=auto (`worth`): which prompts come back, whether a file pays at the speeds
a backend showed, and what a fixed setting costs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from lpcache.cache.server_cache import RamWatch
from lpcache.cache.speeds import Speeds
from lpcache.cache.worth import HORIZON_MIN, NEED_PRIOR, PROBE_SECONDS, ReturnWatch, Seen, Worth
from lpcache.config import Settings
from lpcache.flow.saving import Saver


def seen(depth: int, tokens: int = 500, why: str = "", at: float = 0.0, key: str = "k", words: int = 80) -> Seen:
    return Seen(depth, tokens, tokens - 32, words, key, why, at)


def speeds(prefill: float | None, save: float | None = None, restore: float | None = None) -> Speeds:
    """Rates in ms per token, as a backend would have shown them."""
    s = Speeds.new()
    for rate, ms in ((s.prefill, prefill), (s.save, save), (s.restore, restore)):
        if ms is not None:
            rate.add(ms * 1000, 1000)
    return s


# ---- which prompts come back ----

def test_a_later_turn_continues_the_deepest_earlier_prompt_it_contains() -> None:
    watch = ReturnWatch()
    system = (1, 2)
    turn1 = (*system, 3, 4)
    turn2 = (*turn1, 5, 6, 7)
    watch.seen("m", system, seen(2, key="system"))
    watch.seen("m", turn1, seen(4, key="turn1"))
    found = watch.continued("m", turn2, now=5.0)
    assert found is not None and found.key == "turn1"
    assert watch.continued("m", turn2, now=6.0).key == "system"   # taken once; the shorter one is next
    assert watch.continued("m", turn2, now=7.0) is None


def test_a_prompt_of_another_model_or_one_that_only_shares_a_start_is_no_continuation() -> None:
    watch = ReturnWatch()
    watch.seen("m", (1, 2, 3), seen(3))
    assert watch.continued("other", (1, 2, 3, 4), now=1.0) is None
    assert watch.continued("m", (1, 2, 9, 4), now=1.0) is None   # shares two blocks, not the whole prompt
    assert watch.continued("m", (1, 2, 3, 4), now=1.0) is not None


def test_the_need_rate_counts_returns_no_slot_held_against_all_resolved_with_a_weak_prior() -> None:
    watch = ReturnWatch()
    a, b = NEED_PRIOR
    assert watch.rate() == pytest.approx(a / (a + b))
    for _ in range(6):
        watch.resolve(True)
    for _ in range(2):
        watch.resolve(False)
    assert watch.rate() == pytest.approx((6 + a) / (8 + a + b))


def test_prompts_not_continued_within_the_horizon_or_beyond_the_bound_count_as_gone() -> None:
    watch = ReturnWatch(limit=3)
    watch.seen("m", (1,), seen(1, at=0.0))
    watch.seen("m", (2,), seen(1, at=HORIZON_MIN + 1.0))   # the first is past the horizon now
    assert watch.gone == 1 and len(watch) == 1
    for digest in (3, 4, 5):
        watch.seen("m", (digest,), seen(1, at=HORIZON_MIN + 2.0))
    assert watch.gone == 2 and len(watch) == 3               # the bound forgets the oldest
    assert watch.rate() < NEED_PRIOR[0] / sum(NEED_PRIOR)


def test_the_horizon_follows_the_typical_gap_between_a_prompt_and_its_continuation() -> None:
    watch = ReturnWatch()
    for i in range(5):
        watch.seen("m", (i, 100 + i), seen(2, at=0.0))
        watch.continued("m", (i, 100 + i, 7), now=1000.0)
    assert watch.horizon() == pytest.approx(4000.0)


# ---- whether a file pays ----

def test_on_a_cpu_a_short_turn_is_worth_a_file_and_on_a_gpu_nothing_is() -> None:
    cpu = speeds(prefill=4.0, save=0.02, restore=0.015)      # SmolLM2 on 2 cores; a file in the page cache
    gpu = speeds(prefill=0.04, save=0.015, restore=0.012)    # a prefill 100 times faster, the same disk
    worth = Worth(auto=True, threshold=None, meta_max=0)
    assert worth.decide(cpu, 90, None, None) == (True, "worth")
    assert worth.decide(gpu, 5000, None, None) == (False, "not_worth")
    assert worth.decisions["worth"] == 1 and worth.decisions["not_worth"] == 1


def test_where_the_server_s_ram_serves_every_return_nothing_is_saved_and_its_misses_bring_saves_back() -> None:
    cpu = speeds(prefill=4.0, save=0.02, restore=0.015)
    worth = Worth(auto=True, threshold=None, meta_max=0)
    assert worth.decide(cpu, 500, None, None, ram_miss=1.0) == (True, "worth")    # the RAM not known: every return
    assert worth.decide(cpu, 500, None, None, ram_miss=0.0) == (False, "not_worth")   # it served all: none needed
    assert worth.decide(cpu, 500, None, None, ram_miss=0.25)[0]                     # it misses a quarter: a file pays


def test_the_need_rate_decides_where_the_prefill_is_only_a_few_times_the_disk() -> None:
    middle = speeds(prefill=1.0, save=0.1, restore=0.1)
    worth = Worth(auto=True, threshold=None, meta_max=0)
    assert worth.decide(middle, 1000, None, None)[0]         # needed half the time: 0.5 x 0.9 > 2 x 0.1
    for _ in range(20):
        worth.watch.resolve(False)                           # needed 1 time in 22: 0.045 x 0.9 < 2 x 0.1
    assert not worth.decide(middle, 1000, None, None)[0]


def test_a_cache_worth_a_file_is_left_to_a_ram_that_keeps_it_while_requests_wait() -> None:
    worth = Worth(auto=True, threshold=None, meta_max=0)
    middle = speeds(prefill=1.0, save=0.1, restore=0.1)
    assert worth.decide(middle, 1000, None, None, ram_keeps=True) == (False, "left_to_ram")
    assert worth.decide(middle, 1000, None, None) == (True, "worth")
    for _ in range(20):
        worth.watch.resolve(False)
    assert worth.decide(middle, 1000, None, None, ram_keeps=True) == (False, "not_worth")   # not worth one anyway
    assert worth.decisions["left_to_ram"] == 1


def test_the_ram_keeps_a_cache_only_where_the_check_found_it_it_missed_nothing_its_miss_is_cheap_and_one_waits(
) -> None:
    backend = SimpleNamespace(ram=RamWatch())
    saver = SimpleNamespace(pool=SimpleNamespace(waiting=1), folders=["/slots"], settings=Settings())
    cpu = speeds(prefill=4.0)                 # 250 tokens: a second of prefill

    def keeps(tokens: int, now: float = 100.0) -> bool:
        return Saver.ram_keeps(saver, backend, tokens, cpu, now)  # type: ignore[arg-type]

    assert not keeps(200)                     # not asked whether it has a RAM
    backend.ram.present = True
    assert keeps(200) and keeps(250) and not keeps(260)   # a second's miss at most
    backend.ram.seen(True, 90.0, 600)         # a hit of 600 tokens: the bet grows, this rule does not
    assert not keeps(600)                     # (many such caches together may be more than the RAM holds)
    saver.pool.waiting = 0
    assert not keeps(200)                     # no request waits: a save costs none of them anything
    saver.pool.waiting = 2
    saver.folders = ["/slots", "/other"]
    assert not keeps(200)                     # another backend may get the return: a file serves it there
    saver.folders = ["/slots"]
    saver.settings = Settings(redis_url="redis://r:6379")
    assert not keeps(200)                     # another replica may: it would compute it
    saver.settings = Settings()
    backend.ram.seen(False, 95.0, 0)          # a miss lately: files may pay again
    assert not keeps(200)
    backend.ram.present = False
    backend.ram.outcomes.clear()
    assert not keeps(200) and not keeps(0)


def test_before_a_save_is_measured_only_a_long_prefill_is_saved_to_learn_the_cost() -> None:
    worth = Worth(auto=True, threshold=None, meta_max=0)
    cpu = speeds(prefill=4.0)
    long_enough = int(PROBE_SECONDS * 1000 / 4.0) + 1
    assert worth.decide(cpu, long_enough, None, None) == (True, "probe")
    assert worth.decide(cpu, long_enough // 4, None, None) == (False, "probe_too_short")
    assert worth.decide(speeds(prefill=0.04), 2_000, None, None) == (False, "probe_too_short")   # a GPU


def test_without_a_learnt_prefill_rate_the_request_s_own_prefill_is_the_measure() -> None:
    worth = Worth(auto=True, threshold=None, meta_max=0)
    assert worth.decide(Speeds.new(), 200, prefill_ms=900.0, prompt_n=20) == (True, "probe")   # 45 ms a token
    assert worth.decide(Speeds.new(), 200, None, None) == (False, "no_speed")
    assert worth.decide(Speeds.new(), 0, 900.0, 20) == (False, "no_speed")


# ---- what a setting costs ----

def test_a_prompt_computed_again_after_an_unsaved_earlier_one_is_counted_and_logged_once(caplog) -> None:
    worth = Worth(auto=False, threshold=500, meta_max=10)
    cpu = speeds(prefill=4.0)
    earlier = seen(6, tokens=400, why="threshold", words=120)
    with caplog.at_level(logging.WARNING, logger="lpcache.worth"):
        missed = worth.came_back(earlier, held=False, restored=False, prompt_tokens=460, cache_n=30,
                                 file_kept=False, speeds=cpu)
        assert missed == ("threshold", 370, pytest.approx(1.48))
        worth.came_back(earlier, False, False, 460, 30, False, cpu)
    lines = [r.getMessage() for r in caplog.records if "settings_cost" in r.getMessage()]
    assert len(lines) == 1
    assert "BIG_THRESHOLD_WORDS=500" in lines[0] and "auto" in lines[0] and "below 120 words" in lines[0]
    assert worth.watch.needed == 2


def test_nothing_is_missed_when_a_slot_the_server_s_ram_or_a_file_served_the_return() -> None:
    worth = Worth(auto=False, threshold=500, meta_max=10)
    cpu = speeds(prefill=4.0)
    earlier = seen(6, tokens=400, why="threshold")
    assert worth.came_back(earlier, True, False, 460, 0, False, cpu) is None      # its slot held it
    assert worth.came_back(earlier, False, False, 460, 380, False, cpu) is None   # the server's RAM cache had it
    assert worth.came_back(earlier, False, True, 460, 395, False, cpu) is None    # a file was restored
    assert (worth.watch.held, worth.watch.needed) == (2, 1)


def test_a_saved_cache_whose_file_the_limits_deleted_is_a_limit_cost() -> None:
    worth = Worth(auto=False, threshold=50, meta_max=10)
    missed = worth.came_back(seen(6, tokens=400), False, False, 460, 30, file_kept=False, speeds=speeds(4.0))
    assert missed is not None and missed[0] == "limit" and worth.setting("limit") == "META_MAX=10"
    assert worth.came_back(seen(6, tokens=400), False, False, 460, 30, file_kept=True, speeds=speeds(4.0)) is None


def test_a_file_s_worth_per_byte_is_the_prefill_it_spares_over_its_size() -> None:
    cpu = speeds(prefill=4.0, save=0.02, restore=0.01)
    assert Worth.per_byte(cpu, 1000, 23_040_000) == pytest.approx(3.99 / 23_040)
    assert Worth.per_byte(speeds(prefill=4.0, save=0.02), 1000, 1000) == pytest.approx(3.98)   # restore as a save
    assert Worth.per_byte(speeds(prefill=None, save=0.02), 1000, 1000) is None
    assert Worth.per_byte(cpu, 1000, 0) is None
    assert Worth.per_byte(speeds(prefill=0.01, save=0.02, restore=0.02), 1000, 1000) is None   # spares nothing


def test_a_short_prompt_is_not_worth_a_file_whose_restore_waits_longer_than_its_prefill() -> None:
    """Each /slots call waits for the server's batch under way: a fixed cost the returning request pays for the
    restore. The save's wait is nobody's: the server goes on meanwhile, the client has its answer."""
    busy = speeds(prefill=4.0, save=0.02, restore=0.015)
    busy.learn_wait(call_ms=402.0, work_ms=2.0)            # a call that waited 400 ms for another slot's prefill
    worth = Worth(auto=True, threshold=None, meta_max=0)
    assert not worth.decide(busy, 80, None, None)[0]       # 0.32 s of prefill: less than the restore's wait
    assert worth.decide(busy, 150, None, None)[0]          # 0.6 s: more, and the save's wait is not weighed
    assert worth.decide(busy, 2000, None, None)[0]
