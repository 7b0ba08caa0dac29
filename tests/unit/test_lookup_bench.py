"""bench/lookup.py still measures what it says: every timed lookup finds the entry it was built to find (the
benchmark raises otherwise), at a size small enough for the unit tests. Once the index decided by exact identity
chains, the benchmark's prompts and entries (word chains only) found nothing, and it stopped with an error."""

from __future__ import annotations

import json

import pytest

from ..conftest import load_bench


def test_the_lookup_benchmark_finds_every_entry_it_looks_up(capsys: pytest.CaptureFixture[str]) -> None:
    lookup = load_bench("lookup")
    assert lookup.main(["--sizes", "10,300", "--queries", "60", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["entries"] for r in doc["results"]] == [10, 300]
    assert all(r["chain_digests"] > r["entries"] for r in doc["results"])   # the entries are in the exact index
