import logging
import os
from pathlib import Path

import pytest

from lpcache.cache.cache_files import GIB, CacheFolder, Limits
from lpcache.cache.sessions import route_tag, session_filename

ROUTE = "qwen3"
TAG = route_tag(ROUTE)


def make(folder: Path, name: str, size: int, age: float) -> str:
    path = folder / name
    path.write_bytes(b"x" * size)
    os.utime(path, (1_000_000 + age, 1_000_000 + age))
    return name


def sessions(n: int) -> list[str]:
    return [session_filename(ROUTE, f"{i:032x}") for i in range(n)]


def test_limits_of() -> None:
    assert Limits.of(3, 1.5) == Limits(3, int(1.5 * GIB))
    assert not Limits() and Limits(1)


def test_oldest_go_first_and_keep_is_spared(tmp_path: Path) -> None:
    a, b, c, d = sessions(4)
    for age, name in enumerate((a, b, c, d)):
        make(tmp_path, name, 10, age)
    folder = CacheFolder(str(tmp_path), TAG, Limits(max_files=2))
    assert folder.enforce({a}) == [b, c]        # a is kept (about to be restored): the next oldest go
    assert sorted(os.listdir(tmp_path)) == sorted([a, d])


def test_other_routes_and_foreign_files_are_never_touched(tmp_path: Path) -> None:
    mine = sessions(3)
    other = session_filename("gemma", "f" * 32)
    for age, name in enumerate([other, "notes.txt", "a" * 64, TAG + "_short.bin", *mine]):
        make(tmp_path, name, 10, age)
    folder = CacheFolder(str(tmp_path), TAG, Limits(max_files=1))
    assert folder.enforce() == mine[:2]
    assert sorted(os.listdir(tmp_path)) == sorted([other, "notes.txt", "a" * 64, TAG + "_short.bin", mine[2]])


def test_size_limit_and_a_single_cache_over_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b = sessions(2)
    make(tmp_path, a, 100, 0)
    make(tmp_path, b, 300, 1)
    folder = CacheFolder(str(tmp_path), TAG, Limits(max_bytes=250))
    with caplog.at_level(logging.WARNING, logger="lpcache.cache_files"):
        assert folder.enforce({b}) == [a]
    assert os.listdir(tmp_path) == [b]          # alone over the limit: it stays, with a warning
    assert any("cache_over_limit" in r.getMessage() for r in caplog.records)


def test_touch_renews_the_age_and_has_size(tmp_path: Path) -> None:
    a, b = sessions(2)
    make(tmp_path, a, 10, 0)
    make(tmp_path, b, 20, 1)
    folder = CacheFolder(str(tmp_path), TAG, Limits(max_files=1))
    folder.touch(a)                              # a restore is a use: a is now the youngest
    assert folder.enforce() == [b]
    assert folder.has(a) is True and folder.has(b) is False and folder.size(a) == 10


def test_invisible_folder_does_nothing(tmp_path: Path) -> None:
    folder = CacheFolder(None, TAG, Limits(max_files=1))
    assert folder.has("x") is None and folder.files() == [] and folder.enforce() == []
    missing = CacheFolder(str(tmp_path / "gone"), TAG, Limits(max_files=1))
    assert missing.files() == [] and missing.enforce() == []
