"""The lease's local view: who may hold one, and how long its holder believes it."""

from __future__ import annotations

import time

import pytest

from lpcache.fleet.leases import Holder, Lease, drift


def test_a_replica_id_is_one_word_because_the_stored_value_is_split_on_spaces() -> None:
    assert str(Holder("replica-a", "req 1")) == "replica-a req 1"
    for bad in ("", "replica a"):
        with pytest.raises(ValueError, match="one word"):
            Holder(bad, "req-1")


def test_a_holder_gives_up_a_little_before_its_ttl() -> None:
    assert drift(100) == pytest.approx(0.003)
    assert drift(10_000) == pytest.approx(0.102)


def test_a_lease_is_valid_until_its_deadline_or_until_it_is_lost() -> None:
    now = time.monotonic()
    lease = Lease("http://b:8080#0", Holder("r", "q"), 7, 1000, now + 60)
    assert lease.valid() and lease.value == "7 r q"
    lease.lost.set()
    assert not lease.valid()
    assert not Lease("http://b:8080#0", Holder("r", "q"), 7, 1000, now - 0.001).valid()
