"""The circuit breaker: a pure state machine driven by the caller's clock."""

from lpcache.backends.backend import Breaker


def test_first_failure_opens_for_the_base_cooldown() -> None:
    b = Breaker(base_cooldown=1.0, max_cooldown=8.0)
    assert b.available(0.0)
    b.failure(10.0)
    assert b.state == "open" and b.cooldown == 1.0
    assert not b.available(10.5) and b.available(11.0)


def test_cooldown_doubles_up_to_the_maximum() -> None:
    b = Breaker(base_cooldown=1.0, max_cooldown=8.0)
    cooldowns = []
    for i in range(6):
        b.failure(float(i))
        cooldowns.append(b.cooldown)
    assert cooldowns == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_half_open_lets_one_probe_through_and_success_closes() -> None:
    b = Breaker(base_cooldown=1.0)
    b.failure(0.0)
    b.claim(1.5)
    assert b.state == "half_open" and not b.available(1.6)   # the one probe is out
    b.success()
    assert b.state == "closed" and b.failures == 0 and b.available(1.7)


def test_a_failed_probe_reopens_for_longer() -> None:
    b = Breaker(base_cooldown=1.0)
    b.failure(0.0)
    b.claim(1.0)
    b.failure(1.1)
    assert b.state == "open" and b.cooldown == 2.0 and not b.available(2.0) and b.available(3.1)


def test_an_unsent_probe_is_given_back() -> None:
    b = Breaker(base_cooldown=1.0)
    b.failure(0.0)
    b.claim(1.0)
    assert not b.available(1.0)
    b.unclaim()
    assert b.available(1.0)


def test_claim_on_a_closed_breaker_changes_nothing() -> None:
    b = Breaker()
    b.claim(0.0)
    assert b.state == "closed" and b.available(0.0)
