"""swap.written_whole: a save answered 200 whose file is shorter than the bytes the server says it wrote."""

from __future__ import annotations

import os

from lpcache.backends.llama import SlotAction
from lpcache.backends.swap import written_whole

NAME = "a" * 64


def answer(n_written: object = 10) -> SlotAction:
    return SlotAction(True, 200, {"id_slot": 0, "n_saved": 3, "n_written": n_written}, 5.0)


def kv(folder: str, size: int) -> str:
    path = os.path.join(folder, NAME)
    with open(path, "wb") as f:
        f.write(b"k" * size)
    return path


def test_a_file_shorter_than_written_fails_the_save_and_is_deleted(tmp_path) -> None:
    path = kv(str(tmp_path), 6)
    result = written_whole(str(tmp_path), NAME, answer(10))
    assert not result.ok and result.status == 200   # 200: the caller takes it for a save that may have written
    assert "6 of the 10 bytes" in result.error and result.count("n_saved") == 3
    assert not os.path.exists(path)


def test_a_whole_file_is_a_good_save(tmp_path) -> None:
    path = kv(str(tmp_path), 10)
    good = answer(10)
    assert written_whole(str(tmp_path), NAME, good) is good and os.path.exists(path)


def test_without_the_file_or_a_byte_count_nothing_is_judged(tmp_path) -> None:
    good = answer(10)
    assert written_whole(str(tmp_path), NAME, good) is good   # not there: another host's folder of the same path
    path = kv(str(tmp_path), 6)
    for unknown in (None, "10", True):
        result = answer(unknown)
        assert written_whole(str(tmp_path), NAME, result) is result and os.path.exists(path)
    assert written_whole(str(tmp_path), "../" + NAME, answer(10)).ok   # never a path outside the folder
