"""The verdict that a model cannot reuse restored caches: only from exact restores of several distinct files."""

from __future__ import annotations

import logging

import pytest

from lpcache.cache.reuse import REUSE_EVIDENCE, REUSE_MIN_TOKENS, ReuseWatch


def test_one_file_falling_short_again_and_again_is_not_a_verdict() -> None:
    watch = ReuseWatch(retry_seconds=100)
    for _ in range(10):
        assert watch.judge(0, "", "same-file", 800, 0, now=1.0) is False
    assert watch.enabled(0, "", now=2.0) and watch.turned_off == 0


def test_distinct_files_falling_short_in_a_row_turn_it_off_then_on_again(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    watch = ReuseWatch(retry_seconds=100)
    for i in range(REUSE_EVIDENCE - 1):
        watch.judge(0, "m", f"f{i}", 800, 3, now=10.0)
        assert watch.enabled(0, "m", now=10.0)
    watch.judge(0, "m", "last", 800, 3, now=10.0)
    assert not watch.enabled(0, "m", now=50.0) and watch.turned_off == 1
    assert watch.enabled(1, "m", now=50.0) and watch.enabled(0, "other", now=50.0)   # that backend and model only
    [line] = [r.getMessage() for r in caplog.records]
    assert "restore_not_reused" in line and "--swa-full" in line and "expected 800 cache_n 3" in line
    assert watch.enabled(0, "m", now=110.1)                     # tried again after a while


def test_a_restore_that_worked_clears_the_evidence() -> None:
    watch = ReuseWatch()
    watch.judge(0, "", "a", 800, 0, now=1.0)
    watch.judge(0, "", "b", 800, 0, now=1.0)
    assert watch.judge(0, "", "c", 800, 700, now=1.0) is True
    watch.judge(0, "", "d", 800, 0, now=1.0)
    watch.judge(0, "", "e", 800, 0, now=1.0)
    assert watch.enabled(0, "", now=2.0)


def test_small_or_unmeasured_restores_say_nothing() -> None:
    watch = ReuseWatch()
    assert watch.judge(0, "", "a", REUSE_MIN_TOKENS - 1, 0) is None
    assert watch.judge(0, "", "a", 800, None) is None
    assert watch.turned_off == 0
