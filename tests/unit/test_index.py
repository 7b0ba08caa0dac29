"""MetaIndex: meta files, LRU pruning, longest-prefix lookups."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

import orjson
import pytest

from lpcache.cache.index import MetaIndex
from lpcache.cache.meta_files import Candidate, MetaEntry, entry_from_document, write_atomic
from lpcache.cache.prefix import Prompt

URL = "http://backend:8000"
FP = "fingerprint"


class Index(MetaIndex):
    """The index as these tests drive it: every cache saved under its prompt's key by one model (FP)."""

    async def add(self, p: Prompt, backend, path, *more) -> list[MetaEntry]:  # type: ignore[override]
        if more:
            return await super().add(p, backend, path, *more)
        return await super().add(p, p.key, backend, path, FP)

    def find(self, p: Prompt, usable=lambda e: True, threshold: float = 0.0):  # type: ignore[override]
        return super().find(p, {FP}, usable, threshold)


def meta_document(p: Prompt, wpb: int, timestamp: float, backend, path) -> dict:
    """A meta file as the Rust lpcache (or an older lpcache) writes it: words only, no identity."""
    return {"key": p.key, "model_id": p.model, "wpb": wpb, "blocks": list(p.blocks), "n_words": p.n_words,
            "timestamp": timestamp, "backend": backend, "slot_save_path": path}


def text(n: int, start: int = 0, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(start, start + n))


def prompt(content: str, wpb: int = 2, model: str = "m") -> Prompt:
    """Identity blocks stand for word blocks here, so the tests count in words."""
    p = Prompt.of(model, [{"role": "user", "content": content}], wpb)
    return replace(p, exact=p.chain)


def read_meta(index: MetaIndex, key: str) -> dict:
    with open(os.path.join(index.meta_dir, key + ".meta.json"), "rb") as f:
        return orjson.loads(f.read())


def meta_exists(index: MetaIndex, key: str) -> bool:
    return os.path.exists(os.path.join(index.meta_dir, key + ".meta.json"))


def exists(path: str) -> bool:
    return os.path.exists(path)


def kv_file(folder, key: str) -> str:
    path = os.path.join(str(folder), key)
    with open(path, "wb") as f:
        f.write(b"kv")
    return path


@pytest.fixture
def make_index(tmp_path):
    made: list[MetaIndex] = []

    def make(wpb: int = 2, meta_max: int = 0, slot_save_paths=(), meta_dir=None) -> MetaIndex:
        idx = Index(str(meta_dir or tmp_path / "meta"), wpb, meta_max, [str(p) for p in slot_save_paths])
        made.append(idx)
        return idx

    yield make
    for idx in made:
        idx._io.shutdown(wait=True)


@pytest.fixture
def folders(tmp_path):
    a, b = tmp_path / "kvA", tmp_path / "kvB"
    a.mkdir()
    b.mkdir()
    return str(a), str(b)


# ---- add / load ----

async def test_add_writes_meta_file(make_index) -> None:
    idx = make_index(wpb=2)
    idx.load()
    p = prompt(text(7))
    before = time.time()
    removed = await idx.add(p, URL, "/kv")
    after = time.time()
    assert removed == []
    assert p.key in idx and len(idx) == 1
    doc = read_meta(idx, p.key)
    assert doc["blocks"] == list(p.blocks) and len(doc["blocks"]) == 3
    assert doc["model_id"] == "m"
    assert doc["wpb"] == 2
    assert before <= doc["timestamp"] <= after
    assert doc["n_words"] == 7
    assert doc["backend"] == URL and doc["slot_save_path"] == "/kv"
    assert doc["key"] == p.key
    entry = idx.get(p.key)
    assert entry is not None
    assert (entry.model, entry.wpb, entry.chain, entry.n_words) == ("m", 2, p.chain, 7)
    assert entry.timestamp == doc["timestamp"]


async def test_add_is_atomic_no_temp_file_left(make_index) -> None:
    idx = make_index()
    p1, p2 = prompt(text(4)), prompt(text(4, tag="x"))
    await idx.add(p1, URL, None)
    await idx.add(p2, URL, None)
    await idx.add(p1, URL, None)  # overwrite
    names = sorted(os.listdir(idx.meta_dir))
    assert names == sorted([p1.key + ".meta.json", p2.key + ".meta.json"])
    assert not any(".tmp-" in n for n in names)


def test_write_atomic_replaces_content(tmp_path) -> None:
    path = str(tmp_path / "f.meta.json")
    write_atomic(path, b"one")
    write_atomic(path, b"two")
    assert open(path, "rb").read() == b"two"
    assert os.listdir(tmp_path) == ["f.meta.json"]


async def test_load_round_trips(make_index, tmp_path) -> None:
    first = make_index(wpb=2)
    first.load()
    pa, pb = prompt(text(6)), prompt(text(8, tag="y"), model="other")
    await first.add(pa, URL, "/kv/a")
    await first.add(pb, None, None)
    await first.close()

    second = make_index(wpb=2)
    assert second.load() == 2
    assert len(second) == 2
    for p in (pa, pb):
        old, new = first.get(p.key), second.get(p.key)
        assert new is not None
        assert (new.key, new.model, new.wpb, new.chain, new.timestamp, new.n_words, new.backend,
                new.slot_save_path) == (old.key, old.model, old.wpb, old.chain, old.timestamp, old.n_words,
                                        old.backend, old.slot_save_path)
    found = second.find(prompt(text(10)))
    assert found is not None and found.entry.key == pa.key and found.shared == 3


async def test_load_keeps_each_entrys_history_for_the_replacement_order(make_index, tmp_path) -> None:
    """A conversation on its rhythm (used every 100 s, last 90 s ago: due any moment) outlives one used once, across
    a restart: the history is in the meta file."""
    meta = tmp_path / "meta"
    meta.mkdir()
    once, rhythm = prompt(text(4)), prompt(text(4, tag="x"))
    now = time.time()
    (meta / f"{rhythm.key}.meta.json").write_bytes(orjson.dumps(
        {**meta_document(rhythm, 2, now - 90, URL, None), "uses": 5, "interval": 100.0}))
    (meta / f"{once.key}.meta.json").write_bytes(orjson.dumps(meta_document(once, 2, now - 50, URL, None)))
    idx = make_index(wpb=2, meta_max=2)
    assert idx.load() == 2
    assert idx.get(rhythm.key).uses == 5 and idx.get(rhythm.key).interval == 100.0
    third = prompt(text(4, tag="z"))
    removed = await idx.add(third, URL, None)
    assert [e.key for e in removed] == [once.key]
    assert rhythm.key in idx and third.key in idx and once.key not in idx


def test_load_creates_missing_meta_dir(make_index, tmp_path) -> None:
    idx = make_index(meta_dir=tmp_path / "deep" / "meta")
    assert idx.load() == 0
    assert os.path.isdir(tmp_path / "deep" / "meta")


def test_load_skips_corrupt_and_foreign_files_and_removes_leftovers(make_index, tmp_path) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    good = prompt(text(4))
    (meta / f"{good.key}.meta.json").write_bytes(orjson.dumps(meta_document(good, 2, 1.0, URL, None)))
    (meta / "corrupt.meta.json").write_bytes(b"{not json at all")
    (meta / "binary.meta.json").write_bytes(b"\xff\xfe\x00garbage")
    (meta / "empty.meta.json").write_bytes(b"")
    (meta / "array.meta.json").write_bytes(b"[1, 2, 3]")
    (meta / "null.meta.json").write_bytes(b"null")
    (meta / "foreign.meta.json").write_bytes(b'{"hello": "world"}')
    (meta / "types.meta.json").write_bytes(b'{"model_id": 5, "wpb": "2", "blocks": "abc", "timestamp": "x"}')
    (meta / "noblocks.meta.json").write_bytes(b'{"model_id": "m", "wpb": 2}')
    (meta / "badwpb.meta.json").write_bytes(orjson.dumps({"model_id": "m", "wpb": 0, "blocks": []}))
    (meta / "shortblocks.meta.json").write_bytes(orjson.dumps({"model_id": "m", "wpb": 2, "blocks": ["ab"]}))
    (meta / "badtime.meta.json").write_bytes(
        orjson.dumps({"model_id": "m", "wpb": 2, "blocks": list(good.blocks), "timestamp": "yesterday"}))
    (meta / "nothex.meta.json").write_bytes(orjson.dumps({"model_id": "m", "wpb": 2, "blocks": ["z" * 64]}))
    (meta / "dir.meta.json").mkdir()
    leftover = meta / f"{good.key}.meta.json.tmp-123"
    leftover.write_bytes(b'{"partial')
    (meta / "notes.txt").write_bytes(b"not a meta file")

    idx = make_index(wpb=2)
    assert idx.load() == 1
    assert len(idx) == 1 and good.key in idx
    assert not leftover.exists()
    assert (meta / "notes.txt").exists()
    assert idx.find(prompt(text(6))).entry.key == good.key


def test_load_skips_meta_with_wrong_type_n_words(make_index, tmp_path) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    good = prompt(text(4))
    (meta / f"{good.key}.meta.json").write_bytes(orjson.dumps(meta_document(good, 2, 1.0, URL, None)))
    doc = meta_document(prompt(text(4, tag="x")), 2, 1.0, URL, None)
    doc["n_words"] = [1, 2]
    (meta / "foreign.meta.json").write_bytes(orjson.dumps(doc))
    idx = make_index(wpb=2)
    assert idx.load() == 1
    assert good.key in idx and "foreign" not in idx


def test_entry_from_document_accepts_legacy_model_field() -> None:
    p = prompt(text(4))
    entry = entry_from_document("0" * 64, {"model": "m", "wpb": 2, "blocks": list(p.blocks)})
    assert entry.model == "m" and entry.chain == p.chain and entry.timestamp == 0.0
    assert entry.backend is None and entry.slot_save_path is None


# ---- find ----

async def test_find_prefers_longest_shared_prefix_over_ratio(make_index) -> None:
    idx = make_index(wpb=2)
    query = prompt(text(16))                              # 8 blocks
    long_conv = prompt(text(12) + " " + text(4, tag="z"))  # 8 blocks, shares 6
    system = prompt(text(4))                               # 2 blocks, all shared (its own ratio 1.0)
    await idx.add(long_conv, URL, None)
    await idx.add(system, URL, None)  # newer, and does not make long_conv redundant
    assert len(idx) == 2
    c = idx.find(query)
    assert isinstance(c, Candidate)
    assert c.entry.key == long_conv.key
    assert c.shared == 6
    assert c.ratio == pytest.approx(6 / 8)

    c2 = idx.find(query, usable=lambda e: e.key != long_conv.key)
    assert c2 is not None and c2.entry.key == system.key
    assert c2.shared == 2 and c2.ratio == pytest.approx(2 / 8)
    assert idx.find(query, usable=lambda e: False) is None


async def test_find_longest_wins_whatever_the_insertion_order(make_index) -> None:
    idx = make_index(wpb=2)
    short = prompt(text(4) + " " + text(2, tag="s"))  # shares 2 blocks with the query
    long_ = prompt(text(10) + " " + text(2, tag="l"))  # shares 5
    await idx.add(short, URL, None)
    await idx.add(long_, URL, None)
    c = idx.find(prompt(text(20)))
    assert c is not None and c.entry.key == long_.key and c.shared == 5
    assert c.ratio == pytest.approx(0.5)


async def test_find_exact_and_extended_prompt(make_index) -> None:
    idx = make_index(wpb=5)
    p = prompt(text(50), wpb=5)
    await idx.add(p, URL, None)
    same = idx.find(p)
    assert same is not None and same.shared == 10 and same.ratio == 1.0
    longer = idx.find(prompt(text(53), wpb=5))
    assert longer is not None and longer.ratio == 1.0  # the partial trailing block is not counted
    longer2 = idx.find(prompt(text(55), wpb=5))
    assert longer2 is not None and longer2.shared == 10 and longer2.ratio == pytest.approx(10 / 11)


async def test_find_threshold(make_index) -> None:
    idx = make_index(wpb=2)
    entry = prompt(text(2) + " x y")  # shares 1 block
    await idx.add(entry, URL, None)
    query = prompt(text(20))  # 10 blocks
    c = idx.find(query, threshold=0.1)
    assert c is not None and c.shared == 1 and c.ratio == pytest.approx(0.1)
    assert idx.find(query, threshold=0.11) is None
    assert idx.find(query, threshold=1.0) is None
    assert idx.find(query, threshold=0.0) is not None


async def test_find_threshold_applies_to_the_usable_entry(make_index) -> None:
    idx = make_index(wpb=2)
    deep = prompt(text(12) + " x y")  # shares 6 of 10
    shallow = prompt(text(2) + " q r")  # shares 1 of 10
    await idx.add(deep, URL, None)
    await idx.add(shallow, URL, None)
    query = prompt(text(20))
    assert idx.find(query, threshold=0.5).entry.key == deep.key
    assert idx.find(query, usable=lambda e: e.key != deep.key, threshold=0.5) is None
    assert idx.find(query, usable=lambda e: e.key != deep.key, threshold=0.1).entry.key == shallow.key


async def test_find_no_shared_block(make_index) -> None:
    idx = make_index(wpb=2)
    await idx.add(prompt(text(10)), URL, None)
    assert idx.find(prompt(text(10, tag="other"))) is None
    assert idx.find(prompt("one")) is None  # no whole block at all


async def test_find_is_by_model_identity_not_by_the_clients_model_name(make_index) -> None:
    """A single-model server runs one model whatever name a client gives it: the fingerprint of the model that made
    a file decides, and a file of another model is never offered."""
    idx = make_index(wpb=2)
    await idx.add(prompt(text(10), model="m1"), URL, None)
    assert idx.find(prompt(text(10), model="m2")) is not None          # same model behind another name
    assert MetaIndex.find(idx, prompt(text(10)), {"another-model"}) is None
    assert MetaIndex.find(idx, prompt(text(10)), set()) is None
    p = prompt(text(10, tag="g"))
    await idx.add(p, "other-key", URL, None, "another-model")
    assert MetaIndex.find(idx, p, {"another-model"}).entry.key == "other-key"
    assert idx.find(p) is None


async def test_foreign_entries_are_found_by_words_and_model_name(make_index, tmp_path) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    p = prompt(text(10), model="m1")
    (meta / f"{p.key}.meta.json").write_bytes(orjson.dumps(meta_document(p, 2, 1.0, None, None)))
    idx = make_index(wpb=2)
    assert idx.load() == 1 and idx.get(p.key).foreign
    found = idx.find(prompt(text(12), model="m1"))
    assert found is not None and not found.exact and found.entry.key == p.key and found.shared == 5
    assert idx.find(prompt(text(12), model="m2")) is None


async def test_a_protected_entry_survives_redundancy_and_limits(make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2, meta_max=1)
    first = prompt(text(4))
    await idx.add(first, URL, a_dir)
    idx.protect(first.key)
    removed = await idx.add(prompt(text(8)), URL, a_dir)       # supersedes it and is over META_MAX
    assert removed == [] and first.key in idx
    idx.unprotect(first.key)
    removed = await idx.add(prompt(text(8, tag="n")), URL, a_dir)
    assert first.key in [r.key for r in removed]


async def test_byte_budget_prunes_besides_the_count(make_index) -> None:
    idx = make_index(wpb=2)
    idx.max_bytes = 250
    for i in range(3):
        p = prompt(text(4, tag=f"b{i}"))
        await MetaIndex.add(idx, p, p.key, URL, None, FP, 40, 100)
    assert len(idx) == 2 and idx.total_bytes == 200 and idx.evicted == 1


async def test_a_new_turn_inherits_the_rhythm_of_the_file_it_supersedes(make_index) -> None:
    idx = make_index(wpb=2)
    await idx.add(prompt(text(4)), URL, None)
    idx.note_use(prompt(text(4)).key)      # the next turn continued it (resident or restored) ...
    await idx.add(prompt(text(8)), URL, None)   # ... and was saved: a new file that supersedes the old one
    new = idx.get(prompt(text(8)).key)
    assert prompt(text(4)).key not in idx
    assert new.uses == 2 and new.interval is not None


async def test_find_ignores_entries_of_another_wpb(make_index, tmp_path) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    p = prompt(text(10), wpb=2)
    # Same blocks as the prompt, but written by an instance using another WORDS_PER_BLOCK.
    (meta / f"{p.key}.meta.json").write_bytes(orjson.dumps(meta_document(p, 5, 1.0, URL, None)))
    idx = make_index(wpb=2)
    assert idx.load() == 1
    assert p.key in idx and idx.get(p.key).wpb == 5
    assert idx.find(p) is None
    # A new save of the same key with the right wpb is found.
    await idx.add(p, URL, None)
    assert idx.get(p.key).wpb == 2
    assert idx.find(p).entry.key == p.key


async def test_find_tie_goes_to_most_recent(make_index) -> None:
    idx = make_index(wpb=2)
    a = prompt(text(4) + " a1 a2")
    b = prompt(text(4) + " b1 b2")
    await idx.add(a, URL, None)
    await idx.add(b, URL, None)
    idx.get(a.key).timestamp = idx.get(b.key).timestamp + 10
    c = idx.find(prompt(text(8)))
    assert c.entry.key == a.key and c.shared == 2


# ---- pruning ----

async def test_meta_max_prunes_least_recently_used_with_kv_files(make_index, folders, tmp_path) -> None:
    a_dir, b_dir = folders
    idx = make_index(wpb=2, meta_max=2, slot_save_paths=[a_dir, b_dir])
    p1, p2, p3 = (prompt(text(4, tag=t)) for t in "abc")
    await idx.add(p1, URL, a_dir)
    await idx.add(p2, URL, a_dir)
    kv1 = [kv_file(a_dir, p1.key), kv_file(b_dir, p1.key)]
    kv2 = kv_file(a_dir, p2.key)
    other = kv_file(a_dir, "unrelated")
    removed = await idx.add(p3, URL, a_dir)
    assert [e.key for e in removed] == [p1.key]
    assert p1.key not in idx and p2.key in idx and p3.key in idx
    assert not meta_exists(idx, p1.key)
    assert meta_exists(idx, p2.key) and meta_exists(idx, p3.key)
    assert not any(exists(k) for k in kv1)
    assert exists(kv2) and exists(other)
    assert idx.find(prompt(text(4, tag="a"))) is None


async def test_prune_removes_kv_file_from_the_entry_folder(make_index, tmp_path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    idx = make_index(wpb=2, meta_max=1)  # no configured folders: the entry's own folder is used
    p1, p2 = prompt(text(4, tag="a")), prompt(text(4, tag="b"))
    await idx.add(p1, URL, str(own))
    kv = kv_file(own, p1.key)
    await idx.add(p2, URL, str(own))
    assert not exists(kv)
    assert list(idx._entries) == [p2.key]


async def test_meta_max_prunes_several(make_index) -> None:
    idx = make_index(wpb=2, meta_max=3)
    ps = [prompt(text(4, tag=f"t{i}_")) for i in range(6)]
    for p in ps:
        await idx.add(p, URL, None)
    assert len(idx) == 3 and ps[-1].key in idx    # the one just saved is never the one deleted
    kept = [p for p in ps if p.key in idx]
    assert sorted(os.listdir(idx.meta_dir)) == sorted(p.key + ".meta.json" for p in kept)


async def test_meta_max_zero_is_unlimited(make_index) -> None:
    idx = make_index(wpb=2, meta_max=0)
    ps = [prompt(text(4, tag=f"t{i}_")) for i in range(15)]
    for p in ps:
        assert await idx.add(p, URL, None) == []
    assert len(idx) == 15
    assert len(os.listdir(idx.meta_dir)) == 15


async def test_touch_makes_entry_most_recent(make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2, meta_max=2, slot_save_paths=[a_dir])
    p1, p2, p3 = (prompt(text(4, tag=t)) for t in "abc")
    await idx.add(p1, URL, a_dir)
    await idx.add(p2, URL, a_dir)
    kv1, kv2 = kv_file(a_dir, p1.key), kv_file(a_dir, p2.key)
    await idx.touch(p1.key)
    removed = await idx.add(p3, URL, a_dir)
    assert [e.key for e in removed] == [p2.key]
    assert p1.key in idx and p2.key not in idx
    assert exists(kv1) and not exists(kv2)


async def test_touch_rewrites_timestamp(make_index, tmp_path) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    p = prompt(text(6))
    (meta / f"{p.key}.meta.json").write_bytes(orjson.dumps(meta_document(p, 2, 1.0, URL, "/kv")))
    idx = make_index(wpb=2)
    idx.load()
    assert idx.get(p.key).timestamp == 1.0
    before = time.time()
    await idx.touch(p.key)
    entry = idx.get(p.key)
    assert entry.timestamp >= before
    doc = read_meta(idx, p.key)
    assert doc["timestamp"] == entry.timestamp
    assert doc["blocks"] == list(p.blocks) and doc["slot_save_path"] == "/kv" and doc["wpb"] == 2
    assert not any(".tmp-" in n for n in os.listdir(meta))


async def test_touch_unknown_key_is_harmless(make_index) -> None:
    idx = make_index()
    await idx.touch("nope")
    assert len(idx) == 0


async def test_touched_order_survives_reload(make_index, tmp_path) -> None:
    first = make_index(wpb=2, meta_max=2)
    p1, p2, p3 = (prompt(text(4, tag=t)) for t in "abc")
    await first.add(p1, URL, None)
    await first.add(p2, URL, None)
    await first.touch(p1.key)
    await first.close()
    second = make_index(wpb=2, meta_max=2)
    second.load()
    removed = await second.add(p3, URL, None)
    assert [e.key for e in removed] == [p2.key]


# ---- redundant entries ----

async def test_add_extending_chain_removes_older_entry(make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir])
    old = prompt(text(6))
    new = prompt(text(10))
    await idx.add(old, URL, a_dir)
    kv_old = kv_file(a_dir, old.key)
    removed = await idx.add(new, URL, a_dir)
    assert [e.key for e in removed] == [old.key]
    assert old.key not in idx and new.key in idx
    assert not meta_exists(idx, old.key) and not exists(kv_old)
    assert idx.find(prompt(text(6))).entry.key == new.key


async def test_add_extending_chain_keeps_older_entry_in_another_folder_or_backend(make_index, folders) -> None:
    a_dir, b_dir = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir, b_dir])
    old_a = prompt(text(6))
    old_b = prompt(text(6) + " !")  # same words, another key
    await idx.add(old_a, URL, a_dir)
    await idx.add(old_b, "http://other:1", None)
    kv_a = kv_file(a_dir, old_a.key)
    removed = await idx.add(prompt(text(10)), URL, b_dir)
    assert removed == []
    assert old_a.key in idx and old_b.key in idx and len(idx) == 3
    assert exists(kv_a)


async def test_add_diverging_chain_keeps_older_entry(make_index) -> None:
    idx = make_index(wpb=2)
    old = prompt(text(6))
    await idx.add(old, URL, None)
    removed = await idx.add(prompt(text(4) + " x y z q"), URL, None)  # shares 2 of old's 3 blocks
    assert removed == []
    assert old.key in idx


async def test_add_shorter_prefix_keeps_longer_entry(make_index) -> None:
    idx = make_index(wpb=2)
    long_ = prompt(text(10))
    await idx.add(long_, URL, None)
    short = prompt(text(4))
    assert await idx.add(short, URL, None) == []
    assert long_.key in idx and short.key in idx


async def test_add_same_key_replaces_entry(make_index) -> None:
    idx = make_index(wpb=2, meta_max=2)
    p1, p2 = prompt(text(4, tag="a")), prompt(text(4, tag="b"))
    await idx.add(p1, URL, None)
    await idx.add(p2, URL, None)
    assert await idx.add(p1, "http://new:1", "/new") == []
    assert len(idx) == 2
    assert idx.get(p1.key).backend == "http://new:1"
    assert read_meta(idx, p1.key)["slot_save_path"] == "/new"
    third = prompt(text(4, tag="c"))
    removed = await idx.add(third, URL, None)
    assert len(removed) == 1 and len(idx) == 2 and third.key in idx


# ---- stale entries and failed saves ----

async def test_discard_if_stale_removes_meta_when_kv_file_missing(make_index, folders) -> None:
    a_dir, b_dir = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir, b_dir])
    p = prompt(text(6))
    await idx.add(p, URL, a_dir)
    assert await idx.discard_if_stale(p.key) is True
    assert p.key not in idx and not meta_exists(idx, p.key)
    assert idx.find(p) is None
    assert await idx.discard_if_stale(p.key) is False


async def test_discard_if_stale_keeps_meta_when_kv_file_exists(make_index, folders) -> None:
    a_dir, b_dir = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir, b_dir])
    p = prompt(text(6))
    await idx.add(p, URL, a_dir)
    kv_file(b_dir, p.key)  # visible in another known folder
    assert await idx.discard_if_stale(p.key) is False
    assert p.key in idx and meta_exists(idx, p.key)
    os.unlink(os.path.join(b_dir, p.key))
    kv = kv_file(a_dir, p.key)
    assert await idx.discard_if_stale(p.key) is False
    assert p.key in idx and exists(kv)


async def test_discard_if_stale_deletes_a_file_not_the_size_its_save_wrote(make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir])
    p, q = prompt(text(6)), prompt(text(8, start=50))
    await idx.add(p, p.key, URL, a_dir, FP, 3, 1000)
    await idx.add(q, q.key, URL, a_dir, FP, 3, 2)
    damaged, whole = kv_file(a_dir, p.key), kv_file(a_dir, q.key)   # 2 bytes each
    assert await idx.discard_if_stale(p.key) is True
    assert p.key not in idx and not meta_exists(idx, p.key) and not exists(damaged)
    assert await idx.discard_if_stale(q.key) is False   # the size its save wrote: kept (refused for another cause)
    assert q.key in idx and exists(whole)
    await idx.add(p, p.key, URL, a_dir, FP, 3, 1000)
    damaged = kv_file(a_dir, p.key)
    await idx.saving(p.key, a_dir)   # written again right now: its size says nothing
    assert await idx.discard_if_stale(p.key) is False and exists(damaged)


async def test_discard_if_stale_keeps_meta_when_folder_not_visible(make_index, tmp_path) -> None:
    remote = str(tmp_path / "remote-only")
    idx = make_index(wpb=2, slot_save_paths=[remote])
    p = prompt(text(6))
    await idx.add(p, URL, remote)
    assert await idx.discard_if_stale(p.key) is False
    assert p.key in idx and meta_exists(idx, p.key)


async def test_discard_if_stale_keeps_meta_without_any_folder(make_index) -> None:
    idx = make_index(wpb=2)
    p = prompt(text(6))
    await idx.add(p, URL, None)
    assert await idx.discard_if_stale(p.key) is False
    assert p.key in idx


async def test_discard_if_stale_uses_configured_folders_for_entry_without_path(make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir])
    p = prompt(text(6))
    await idx.add(p, URL, None)
    assert await idx.discard_if_stale(p.key) is True
    assert p.key not in idx


async def test_forget_deletes_meta_and_kv_file(make_index, folders) -> None:
    a_dir, b_dir = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir, b_dir])
    p = prompt(text(6))
    await idx.add(p, URL, a_dir)
    kv = kv_file(a_dir, p.key)
    await idx.forget(p.key, a_dir)
    assert p.key not in idx and not meta_exists(idx, p.key) and not exists(kv)
    assert idx.find(p) is None


async def test_a_failed_save_in_another_servers_folder_leaves_the_entry_of_the_name_here(make_index, folders) -> None:
    """Server B's save of a name failed (its partial file goes); server A's file of that name, and its entry, stand."""
    a_dir, b_dir = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir, b_dir])
    p = prompt(text(6))
    await idx.add(p, URL, a_dir)
    kv_a, kv_b = kv_file(a_dir, p.key), kv_file(b_dir, p.key)
    await idx.forget(p.key, b_dir)
    assert p.key in idx and meta_exists(idx, p.key) and exists(kv_a) and not exists(kv_b)
    assert idx.find(p) is not None


async def test_a_failed_save_on_a_server_whose_folder_is_not_seen_leaves_the_entry_of_the_name_here(
        make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir])
    p = prompt(text(6))
    await idx.add(p, URL, a_dir)
    kv_a = kv_file(a_dir, p.key)
    await idx.forget(p.key, None)
    assert p.key in idx and meta_exists(idx, p.key) and exists(kv_a)


async def test_forget_unknown_key_deletes_partial_kv_file(make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2)
    idx.load()
    kv = kv_file(a_dir, "partial")
    await idx.forget("partial", a_dir)
    await idx.forget("partial", None)
    assert not exists(kv)
    assert len(idx) == 0


async def test_close_waits_for_queued_writes(make_index) -> None:
    idx = make_index(wpb=2)
    p = prompt(text(4))
    await idx.add(p, URL, None)
    await idx.close()
    assert meta_exists(idx, p.key)


def test_readable_by() -> None:
    e = MetaEntry("k", "m", 2, (), 0.0, backend="http://a:1", slot_save_path="/kv")
    assert e.readable_by("http://b:1", "/kv")
    assert not e.readable_by("http://a:1", "/other")
    assert e.readable_by("http://a:1", None)
    assert not e.readable_by("http://b:1", None)
    no_path = MetaEntry("k", "m", 2, (), 0.0, backend="http://a:1")
    assert no_path.readable_by("http://a:1", "/kv") and not no_path.readable_by("http://b:1", "/kv")


def test_meta_without_location_is_tried_anywhere() -> None:
    """The Rust lpcache and proxycache wrote meta files without backend or folder: they had one folder."""
    legacy = MetaEntry("k", "m", 2, (), 0.0)
    assert legacy.readable_by("http://a:1", "/kv") and legacy.readable_by("http://b:1", None)


# ---- what goes first when the limits bite ----

async def test_a_file_the_next_turn_moved_on_from_goes_first_and_hands_over_its_rhythm(make_index) -> None:
    """The next turn changes only the end of the previous prompt (a task after a growing text): the old file is no
    prefix of the new one, but all it holds beyond it is a short end."""
    idx = make_index(wpb=2, meta_max=3)
    old = prompt(text(40) + " redraft it")
    await idx.add(old, URL, None)
    idx.note_use(old.key)
    others = [prompt(text(30, tag=t)) for t in ("a", "b")]
    for p in others:
        await idx.add(p, URL, None)
    new = prompt(text(44) + " redraft it")
    removed = await idx.add(new, URL, None)
    assert [e.key for e in removed] == [old.key]
    assert all(p.key in idx for p in others)
    assert idx.get(new.key).uses == 2


async def test_a_file_that_differs_early_has_not_moved_on(make_index) -> None:
    idx = make_index(wpb=2)
    old = prompt(text(40))
    await idx.add(old, URL, None)
    await idx.add(prompt(text(20) + " " + text(30, tag="z")), URL, None)   # shares half of it
    assert idx._moved_on == {}


async def test_files_an_idle_slot_holds_go_before_the_others(make_index) -> None:
    idx = make_index(wpb=2, meta_max=2)
    a, b, c = (prompt(text(10, tag=t)) for t in ("a", "b", "c"))
    await idx.add(a, URL, None)
    await idx.add(b, URL, None)
    idx.held = lambda: [b.key]
    removed = await idx.add(c, URL, None)
    assert [e.key for e in removed] == [b.key] and a.key in idx and c.key in idx
    d = prompt(text(10, tag="d"))
    idx.held = lambda: [d.key]            # the entry just saved goes too when its slot holds it
    removed = await idx.add(d, URL, None)
    assert [e.key for e in removed] == [d.key] and a.key in idx and c.key in idx


async def test_the_replacement_order_takes_an_idle_slots_file_only_when_nothing_else_is_left(make_index) -> None:
    """Where a file beside the slots does not pay for a second write (`held` leaves the slots' own files out), the
    replacement order deletes any other file first: a slot's would be written again before its slot is replaced."""
    idx = make_index(wpb=2, meta_max=2)
    a, b, c, d = (prompt(text(10, tag=t)) for t in ("a", "b", "c", "d"))
    for p in (a, b):
        await idx.add(p, URL, None)
    idx.in_slots = lambda: [a.key]
    assert [e.key for e in await idx.add(c, URL, None)] == [b.key]
    idx.in_slots = lambda: [c.key]
    assert [e.key for e in await idx.add(d, URL, None)] == [a.key]
    idx.in_slots = lambda: [p.key for p in (a, b, c, d) if p.key in idx]   # every file a slot's: one still goes
    last = prompt(text(10, tag="e"))
    removed = await idx.add(last, URL, None)
    assert len(removed) == 1 and last.key in idx and len(idx) == 2


# ---- keys confined to their folder, start-up on a hostile META_DIR, reconciliation of the folders ----

def write_meta(meta_dir, name: str, doc: dict) -> str:
    os.makedirs(meta_dir, exist_ok=True)
    path = os.path.join(str(meta_dir), name)
    with open(path, "wb") as f:
        f.write(orjson.dumps(doc))
    return path


async def test_a_stray_meta_file_with_a_non_hex_key_is_skipped_and_never_deletes_a_file(make_index, folders, tmp_path,
                                                                                       caplog) -> None:
    a_dir, _ = folders
    stray = prompt(text(6, tag="s"))
    write_meta(tmp_path / "meta", "important.txt.meta.json", meta_document(stray, 2, 1.0, None, a_dir))
    victim = kv_file(a_dir, "important.txt")
    idx = make_index(wpb=2, meta_max=1, slot_save_paths=[a_dir])
    with caplog.at_level("WARNING", logger="lpcache.index"):
        assert idx.load() == 0
    assert [r.message for r in caplog.records if "important.txt" in r.message][0].startswith("meta_skipped")
    await idx.add(prompt(text(6)), URL, a_dir)
    await idx.add(prompt(text(6, tag="x")), URL, a_dir)    # prunes: the stray one is not an entry to prune
    assert exists(victim)


async def test_a_meta_file_naming_another_folder_never_deletes_outside_the_slot_folders(make_index, folders,
                                                                                      tmp_path) -> None:
    """A meta file's `slot_save_path` says where lpcache once saved; deletions only ever happen in the folders
    lpcache was given."""
    a_dir, _ = folders
    outside = tmp_path / "home"
    outside.mkdir()
    old = prompt(text(6, tag="o"))
    write_meta(tmp_path / "meta", old.key + ".meta.json", meta_document(old, 2, 1.0, None, str(outside)))
    victim = kv_file(outside, old.key)
    ours = kv_file(a_dir, old.key)
    idx = make_index(wpb=2, meta_max=1, slot_save_paths=[a_dir])
    assert idx.load() == 1
    await idx.add(prompt(text(6)), URL, a_dir)     # over META_MAX: the old entry goes
    assert old.key not in idx and not meta_exists(idx, old.key)
    assert exists(victim) and not exists(ours)


def test_inside_keeps_every_name_in_its_folder() -> None:
    from lpcache.cache.meta_files import inside, valid_key

    assert inside("/kv", "a" * 64) == "/kv/" + "a" * 64
    for name in ("", ".", "..", "../x", "/etc/passwd", "a/b", "a\\b", "a\0b"):
        assert inside("/kv", name) is None
    assert valid_key("0123456789abcdef" * 4)
    for key in ("A" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, "g" * 64, None, 3):
        assert not valid_key(key)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_a_meta_file_is_skipped_without_opening_it(make_index, tmp_path, caplog) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    os.mkfifo(meta / ("f" * 64 + ".meta.json"))   # opening it for reading would wait for a writer forever
    os.mkdir(meta / ("d" * 64 + ".meta.json"))
    good = prompt(text(6))
    write_meta(meta, good.key + ".meta.json", meta_document(good, 2, 1.0, None, None))
    idx = make_index(wpb=2)
    with caplog.at_level("WARNING", logger="lpcache.index"):
        assert idx.load() == 1
    assert sum("not a regular file" in r.message for r in caplog.records) == 2


def test_meta_skipped_lines_are_bounded(make_index, tmp_path, caplog) -> None:
    meta = tmp_path / "meta"
    meta.mkdir()
    for i in range(50):
        (meta / f"{i:064x}.meta.json").write_bytes(b"not json")
    idx = make_index(wpb=2)
    with caplog.at_level("WARNING", logger="lpcache.index"):
        assert idx.load() == 0
    lines = [r.message for r in caplog.records if r.message.startswith("meta_skipped")]
    assert len(lines) == 21 and lines[-1].startswith("meta_skipped count=50")


def test_check_meta_dir_says_what_is_wrong_in_one_line(tmp_path) -> None:
    from lpcache.cache.meta_files import check_meta_dir
    from lpcache.errors import ConfigError

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for bad, said in ((a_file, "is not a folder"), (a_file / "sub", "cannot create")):
        with pytest.raises(ConfigError) as e:
            check_meta_dir(str(bad))
        assert said in str(e.value) and "\n" not in str(e.value) and e.value.variable == "META_DIR"
    check_meta_dir(str(tmp_path / "new" / "meta"))
    assert (tmp_path / "new" / "meta").is_dir()


async def test_a_save_is_marked_until_its_meta_file_is_written(make_index, folders) -> None:
    a_dir, _ = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir])
    idx.load()
    p, q = prompt(text(6)), prompt(text(6, tag="q"))
    marker = os.path.join(idx.meta_dir, p.key + ".saving")
    await idx.saving(p.key, a_dir)
    assert exists(marker)
    await idx.add(p, URL, a_dir)
    assert not exists(marker) and meta_exists(idx, p.key)
    await idx.saving(q.key, a_dir)
    await idx.forget(q.key, a_dir)                  # a failed save: the marker goes with it
    assert not exists(os.path.join(idx.meta_dir, q.key + ".saving"))
    await idx.saving("not-a-key", a_dir)            # never a file named by something else than a key
    assert not exists(os.path.join(idx.meta_dir, "not-a-key.saving"))


async def test_start_reconciles_the_folders_by_the_stated_rule(make_index, folders, tmp_path, caplog) -> None:
    """A file lpcache marked and never recorded is deleted; a marked file whose meta exists is kept; a session
    file, a 64-hex file without marker (the Rust lpcache's naming), proxycache's and the user's own files are
    left alone."""
    a_dir, b_dir = folders
    meta = tmp_path / "meta"
    kept, lost = prompt(text(6, tag="k")), prompt(text(6, tag="l"))
    write_meta(meta, kept.key + ".meta.json", meta_document(kept, 2, 1.0, URL, a_dir))
    (meta / (kept.key + ".saving")).write_bytes(b"")       # a re-save of a recorded cache, interrupted
    (meta / (lost.key + ".saving")).write_bytes(b"")       # a save whose meta file was never written
    (meta / ("e" * 64 + ".meta.json.tmp-123")).write_bytes(b"{")
    kv_kept, kv_lost, kv_lost_b = kv_file(a_dir, kept.key), kv_file(a_dir, lost.key), kv_file(b_dir, lost.key)
    others = [kv_file(a_dir, "c" * 64), kv_file(a_dir, "Qwen3-1a2b3c4d_" + "0" * 32 + ".bin"),
              kv_file(a_dir, "slotcache_" + "1" * 64 + ".bin"), kv_file(a_dir, "notes.txt")]
    idx = make_index(wpb=2, slot_save_paths=[a_dir, b_dir])
    with caplog.at_level("INFO", logger="lpcache.index"):
        assert idx.load() == 1
    assert exists(kv_kept) and not exists(kv_lost) and not exists(kv_lost_b)
    assert all(exists(p) for p in others)
    assert sorted(os.listdir(meta)) == [kept.key + ".meta.json"]
    messages = [r.message for r in caplog.records]
    assert sum(m.startswith(f"kv_file_removed key={lost.key}") and "reason=unrecorded" in m for m in messages) == 2
    assert any(m.startswith(f"kv_files_unknown folder={a_dir} count=1 ") for m in messages)


async def test_a_file_chosen_for_a_restore_is_not_counted_until_restored(make_index, caplog) -> None:
    """The restore replaces a slot's cache, saved again first: for a moment both files are needed, and the limit
    must not delete a third conversation's file for it."""
    idx = make_index(wpb=2, meta_max=2)
    a, b, c, d = (prompt(text(10, tag=t)) for t in ("a", "b", "c", "d"))
    await idx.add(a, URL, None)
    await idx.add(b, URL, None)
    idx.protect(a.key)
    assert await idx.add(c, URL, None) == [] and len(idx) == 3
    idx.unprotect(a.key)
    with caplog.at_level("INFO", logger="lpcache.index"):
        removed = await idx.add(d, URL, None)
    assert len(removed) == 2 and len(idx) == 2 and d.key in idx
    assert all(f"meta_removed key={e.key} reason=limit" in caplog.text for e in removed)


async def test_the_limits_never_delete_a_file_while_it_is_being_saved_again(make_index, folders) -> None:
    """A recorded cache being saved again (marked `saving`, the server writing it) is spared by the limits until
    its new meta file is written: a deletion queued meanwhile would unlink the file the server just wrote."""
    a_dir, _ = folders
    idx = make_index(wpb=2, meta_max=1, slot_save_paths=[a_dir])
    idx.load()
    p, q = prompt(text(6)), prompt(text(6, tag="q"))
    kv_file(a_dir, p.key)
    await idx.add(p, URL, a_dir)
    await idx.saving(p.key, a_dir)          # p is saved again: the server rewrites its file
    kv_file(a_dir, q.key)
    await idx.add(q, URL, a_dir)            # over META_MAX meanwhile: p is not the one to go
    assert exists(os.path.join(a_dir, p.key)) and p.key in idx
    await idx.add(p, URL, a_dir)            # p's save is recorded: now the limits hold again
    assert exists(os.path.join(a_dir, p.key)) and meta_exists(idx, p.key)
    assert len(idx) == 1 and not exists(os.path.join(a_dir, q.key))


async def test_a_save_given_up_no_longer_shields_its_file_from_the_limits(make_index) -> None:
    idx = make_index(wpb=2, meta_max=1)
    a, b = prompt(text(10, tag="a")), prompt(text(10, tag="b"))
    await idx.add(a, URL, None)
    await idx.saving(a.key, None)           # saved again, and the save is cancelled (a shutdown)
    idx.unmark(a.key)
    removed = await idx.add(b, URL, None)
    assert [e.key for e in removed] == [a.key]
    assert exists(idx._marker_path(a.key))   # left for the next start


async def test_a_save_is_marked_at_once_unless_a_queued_job_deletes_its_very_name(make_index, folders) -> None:
    """The marker of a save goes ahead of the meta files being written (an fsync each, on the one I/O thread):
    only a save of a name whose deletion is queued waits for that deletion (the server would write into a file
    being unlinked)."""
    a, _ = folders
    idx = make_index(wpb=2, meta_max=1, slot_save_paths=[a])
    idx.load()
    first, second = prompt(text(7)), prompt(text(7, start=50))
    kv_file(a, first.key)
    await idx.add(first, URL, a)
    gate = threading.Event()
    blocker = asyncio.get_running_loop().run_in_executor(idx._io, gate.wait)   # the I/O thread is busy
    kv_file(a, second.key)
    adding = asyncio.create_task(idx.add(second, URL, a))   # META_MAX 1: deletes first's files, behind the blocker
    await asyncio.sleep(0)
    assert first.key not in idx and not adding.done()
    other = "c" * 64
    await asyncio.wait_for(idx.saving(other, a), 5)          # another name: marked at once
    assert exists(os.path.join(idx.meta_dir, other + ".saving"))
    again = asyncio.create_task(idx.saving(first.key, a))   # the name being deleted: after its deletion
    await asyncio.sleep(0)
    assert not again.done() and exists(os.path.join(a, first.key))
    gate.set()
    await asyncio.wait_for(asyncio.gather(blocker, adding, again), 5)
    assert not exists(os.path.join(a, first.key))   # deleted, then marked for the new save
    assert exists(os.path.join(idx.meta_dir, first.key + ".saving"))


async def test_files_no_entry_names_go_once_untouched_for_the_grace_period(make_index, folders, caplog) -> None:
    """A crash leaves a KV file no meta file names: the sweep deletes it once nothing wrote it for the grace
    period. A file an entry names, one whose save is under way, one another replica's request uses, a fresh one,
    session files and other names stay."""
    a_dir, b_dir = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir, b_dir])
    named, saving, elsewhere = (prompt(text(6, tag=t)) for t in ("n", "s", "e"))
    await idx.add(named, URL, a_dir)
    old = time.time() - 3600
    paths = {name: kv_file(folder, name) for folder, name in (
        (a_dir, named.key), (a_dir, saving.key), (a_dir, elsewhere.key), (a_dir, "a" * 64), (b_dir, "b" * 64),
        (a_dir, "Qwen3-1a2b3c4d_" + "0" * 32 + ".bin"), (a_dir, "notes.txt"))}
    for path in paths.values():
        os.utime(path, (old, old))
    fresh = kv_file(a_dir, "f" * 64)   # just written: within the grace period
    await idx.saving(saving.key, a_dir)
    idx.in_use_elsewhere = lambda: {elsewhere.key}
    with caplog.at_level("INFO", logger="lpcache.orphans"):
        assert await idx.sweep_orphans(600.0) == 2
    assert not exists(paths["a" * 64]) and not exists(paths["b" * 64])
    assert all(exists(p) for name, p in paths.items() if name not in ("a" * 64, "b" * 64)) and exists(fresh)
    assert idx.orphans_removed == 2
    assert sum("reason=orphan" in r.message for r in caplog.records) == 2
    assert await idx.sweep_orphans(600.0) == 0


async def test_the_sweep_judges_only_files_written_before_its_horizon(make_index, folders) -> None:
    """`before`: up to when every replica's entries are known (`fleet.synced`); a later file may be named only in
    a replica cut off from Redis. The sweeper does not sweep when its horizon says not now."""
    from lpcache.cache.orphans import OrphanSweeper

    a_dir, _ = folders
    idx = make_index(wpb=2, slot_save_paths=[a_dir])
    now = time.time()
    early, late = kv_file(a_dir, "a" * 64), kv_file(a_dir, "b" * 64)
    os.utime(early, (now - 3600, now - 3600))
    os.utime(late, (now - 1800, now - 1800))
    horizons: list[float | None] = [None, now - 2000]

    async def horizon(grace: float) -> float | None:
        return horizons.pop(0)

    sweeper = OrphanSweeper(idx.sweep_orphans, 600.0, horizon)
    assert not await sweeper.once() and exists(early) and exists(late)
    assert await sweeper.once() and not exists(early) and exists(late)
