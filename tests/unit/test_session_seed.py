"""What a session starting anew may start on: slots holding its own client key's sessions, or no session at all;
a seed's outcome counted only once its restore is over."""

from __future__ import annotations

import os
from pathlib import Path

from lpcache.backends.slots import Content, Slot
from lpcache.backends.swap import Folders
from lpcache.cache.sessions import SessionBook, session_filename
from lpcache.flow.session_seed import SessionSeeds


def test_only_slots_of_the_same_client_key_or_without_a_session() -> None:
    book = SessionBook()
    book.seen("mine.bin", "1" * 32, "m", [], 0.0, owner="key-a")
    book.seen("theirs.bin", "2" * 32, "m", [], 0.0, owner="key-b")
    seeds = SessionSeeds(book, [], [Folders(None)])
    mine = seeds.owned_by("key-a")

    def holding(key: str, session: str | None) -> Slot:
        return Slot(backend=0, id=0, content=Content(key, (1, 2, 3), session=session))

    assert mine(Slot(backend=0, id=0))                                   # empty
    assert mine(holding("prefix-key", None))                            # a prefix-mode cache
    assert mine(holding("mine.bin", "1" * 32))
    assert not mine(holding("theirs.bin", "2" * 32))
    assert not mine(holding("forgotten.bin", "3" * 32))                 # the book forgot it: anyone's


def test_a_seed_is_counted_once_its_restore_is_over() -> None:
    seeds = SessionSeeds(SessionBook(), [], [Folders(None), Folders(None)])
    seeds.protect("parent.bin")
    assert all(f.protected["parent.bin"] == 1 for f in seeds.folders)   # the session limits keep it
    seeds.unprotect("parent.bin")
    assert all("parent.bin" not in f.protected for f in seeds.folders)
    assert seeds.restored("parent", True) == "parent" and seeds.restored("session", False) is None
    assert seeds.seeds == {"parent": 1, "none": 1}


def test_a_session_the_book_knows_no_save_of_is_looked_for_in_the_folders_newest_copy_first(tmp_path: Path) -> None:
    """Another replica saved the session (its document not heard of yet), the book forgot it, or lpcache restarted:
    the home is the server whose folder has its newest copy (last modified: a save rewrites the file; the larger on
    a tie), whatever the sizes (a compacted history's newest copy is the smaller); a folder shared by two servers
    makes both homes; no copy anywhere, or a server whose folder lpcache cannot see (its copy may be the newest):
    no home."""
    paths = [tmp_path / "a", tmp_path / "b", tmp_path / "b", tmp_path / "c"]   # servers 1 and 2 share a folder
    for p in paths:
        p.mkdir(exist_ok=True)
    seeds = SessionSeeds(SessionBook(), [], [Folders(str(p)) for p in paths])
    name = session_filename("m", "a" * 32)
    assert seeds.found_homes(name) == frozenset()
    (paths[0] / name).write_bytes(b"x" * 900)     # an older copy, larger
    (paths[1] / name).write_bytes(b"x" * 300)     # the newest: the history was compacted since
    os.utime(paths[0] / name, (1_000, 1_000))
    os.utime(paths[1] / name, (2_000, 2_000))
    assert seeds.found_homes(name) == {1, 2}
    (paths[3] / name).write_bytes(b"x" * 600)
    os.utime(paths[3] / name, (2_000, 2_000))     # as new: the larger wins
    assert seeds.found_homes(name) == {3}
    assert seeds.found_homes("not-a-session.bin") == frozenset()
    hidden = SessionSeeds(SessionBook(), [], [Folders(str(p)) for p in paths] + [Folders(None)])
    assert hidden.found_homes(name) == frozenset()
