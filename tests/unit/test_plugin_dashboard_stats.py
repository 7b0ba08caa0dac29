"""The dashboard's figures: which outcome a request is, the latency histogram and its percentiles, merging and
taking sums apart, and their history-file shape."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from lpcache.flow.record import RequestRecord
from lpcache.plugins.dashboard_stats import BINS, Counts, Histogram, outcome


@pytest.mark.parametrize(("status", "reason", "expected"), [
    (200, None, "served"),
    (304, None, "served"),
    (200, "client_disconnected", "served"),        # the answer was on its way: the server did its part
    (200, "save_failed", "served"),                # the client had its answer
    (200, "backend_unreachable", "server_errors"),  # a stream the backend broke after its 200
    (200, "coalesce_leader_failed", "server_errors"),
    (400, "invalid_request", "client_errors"),
    (401, None, "client_errors"),                  # lpcache refused the client's key
    (401, "provider_http_401", "server_errors"),   # the backend refused lpcache's LLAMA_API_KEY
    (403, "provider_http_403", "server_errors"),
    (400, "provider_http_400", "client_errors"),   # the backend refused the request (its context, say)
    (404, "backend_error", "client_errors"),       # the backend's own 4xx: still the request's fault
    (408, "client_timeout", "client_errors"),
    (429, None, "client_errors"),
    (499, "client_disconnected", "client_errors"),
    (None, "client_disconnected", "client_errors"),
    (None, "cancelled", "server_errors"),
    (None, None, "server_errors"),
    (500, None, "server_errors"),
    (502, "backend_unreachable", "server_errors"),
    (503, "slot_timeout", "server_errors"),
    (600, None, "server_errors"),
])
def test_each_request_is_one_outcome(status: int | None, reason: str | None, expected: str) -> None:
    assert outcome(status, reason) == expected
    c = Counts.of(RequestRecord(status=status, reason=reason))
    assert (c.served, c.client_errors, c.server_errors) == tuple(int(k == expected) for k in (
        "served", "client_errors", "server_errors"))


def test_the_success_rate_leaves_client_errors_out() -> None:
    total = Counts()
    for status in [200] * 6 + [404, 401, 422, 400] + [502, 500]:
        total.add(Counts.of(RequestRecord(status=status)))
    doc = total.to_json()
    assert doc["requests"] == 12 and doc["served"] + doc["client_errors"] + doc["server_errors"] == 12
    assert doc["success_rate"] == pytest.approx(6 / 8) and doc["server_error_rate"] == pytest.approx(2 / 8)
    assert doc["client_error_rate"] == pytest.approx(4 / 12)
    assert doc["by_status"]["4xx"] == 4 and doc["by_status"]["5xx"] == 2   # the old fields stay
    only_clients = Counts.of(RequestRecord(status=400)).to_json()
    assert only_clients["success_rate"] is None and only_clients["client_error_rate"] == 1.0


# ---- the histogram ----

def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def test_one_value_is_exact() -> None:
    h = Histogram()
    h.record(123.4)
    assert h.summary() == {"n": 1, "p50": 123.4, "p90": 123.4, "p99": 123.4, "max": 123.4}


@pytest.mark.parametrize("values", [
    [float(v) for v in range(1, 1001)],
    [random.Random(3).lognormvariate(6, 1.2) for _ in range(4000)],
    [5.0] * 50 + [4000.0] * 50,
    [0.2, 0.5, 0.9, 1.5, 3.0],                              # under a millisecond: the first bin, kept by lo
])
def test_percentiles_are_within_a_bin(values: list[float]) -> None:
    h = Histogram()
    for v in values:
        h.record(v)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        got, true = h.quantile(q), nearest_rank(values, q)
        assert got is not None and abs(got - true) <= max(0.2 * true, 0.1) + 0.05, (name, got, true)
        assert min(values) <= got + 0.05 and got <= max(values) + 0.05


def test_the_histogram_stays_small_whatever_it_is_fed() -> None:
    h = Histogram()
    rng = random.Random(1)
    for _ in range(100_000):
        h.record(rng.uniform(0, 10 ** rng.uniform(0, 9)))
    h.record(0.0)
    h.record(1e12)                                          # beyond the last bin: counted in it
    assert len(h.bins) <= BINS and h.n == 100_002 and h.quantile(0.999) is not None


def test_merging_is_the_histogram_of_all_values_and_sub_takes_them_out() -> None:
    rng = random.Random(5)
    a_values = [rng.uniform(10, 500) for _ in range(300)]
    b_values = [rng.uniform(200, 5000) for _ in range(100)]
    a, b, both = Histogram(), Histogram(), Histogram()
    for v in a_values:
        a.record(v)
        both.record(v)
    for v in b_values:
        b.record(v)
        both.record(v)
    merged = Histogram()
    merged.add(a)
    merged.add(b)
    assert merged.bins == both.bins and merged.summary() == both.summary()
    merged.sub(b)
    assert merged.bins == a.bins and merged.n == 300


def test_counts_carry_latency_only_for_generation_requests_clients_did_not_fail() -> None:
    def c(**fields: Any) -> Counts:
        return Counts.of(RequestRecord(elapsed_ms=250.0, ttft_ms=40.0, **fields))

    served = c(api="chat", status=200)
    assert served.latency is not None and served.latency.n == 1 and served.ttft is not None
    assert c(api="chat", status=502).latency is not None           # a server error is latency a client saw
    assert c(api="chat", status=400).latency is None                # a refused body says nothing of it
    assert c(api=None, status=200).latency is None                  # /health, /props...: not generation
    json_answer = Counts.of(RequestRecord(api="chat", status=200, elapsed_ms=80.0))
    assert json_answer.ttft is None and json_answer.latency is not None   # TTFT is measured on streams


def test_history_shape_round_trips() -> None:
    total = Counts()
    rng = random.Random(2)
    for i in range(200):
        total.add(Counts.of(RequestRecord(
            api="chat", status=[200, 200, 404, 503][i % 4], elapsed_ms=rng.uniform(5, 9000),
            ttft_ms=rng.uniform(1, 800) if i % 2 else None, prompt_tokens=100, cached_tokens=i % 100,
            backend=f"http://b{i % 3}:8080"), None))
    back = Counts.from_doc(total.to_doc())
    assert back.v == total.v and back.to_json() == total.to_json()
    assert back.latency is not None and total.latency is not None and back.latency.bins == total.latency.bins


@pytest.mark.parametrize("doc", [
    None, [], {"c": []}, {"c": {"requests": "1"}}, {"c": {"requests": -1}}, {"c": {"requests": float("nan")}},
    {"c": {}, "ttft": [1, 2, 3]}, {"c": {}, "latency": [1, 5, 5, [[BINS, 1]]]},
    {"c": {}, "latency": [1, 5, 4, [[3, 1]]]}, {"c": {}, "backends": {"x": [1]}}, {"c": {}, "backends": []},
])
def test_history_shape_refuses_what_it_did_not_write(doc: Any) -> None:
    with pytest.raises(ValueError):
        Counts.from_doc(doc)


def test_history_shape_skips_counters_it_does_not_know() -> None:
    c = Counts.from_doc({"c": {"requests": 3, "from_a_newer_lpcache": 7}})
    assert c.requests == 3 and c.served == 0
