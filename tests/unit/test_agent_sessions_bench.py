"""The pure parts of bench/agent_sessions.py: a part not run keeps its last figures in the docs section, named as
an earlier run's. No server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..conftest import load_bench

ag = load_bench("agent_sessions")

SESSIONS = {"harness_tokens": 2497, "requests": 60,
            "modes": {"none": {"computed": 15684, "ideal": 13803, "x_ideal": 1.136, "seconds": 108.1, "seeds": {}}}}


def admission_run(label: str, latency: float, mean: float, wait: float) -> dict[str, Any]:
    return {"label": label, "b_wait_p50_ms": wait, "b_latency_p50_s": latency, "b_latency_mean_s": mean,
            "b_requests": 24, "a_requests": 72, "urgent": {}, "statuses": ["200"], "status_counts": {"200": 24},
            "retry_after": [], "refusals_without_retry_after": 0}


ADMISSION = {"alone": admission_run("key b alone", 6.0, 5.0, 3000.0),
             "burst": admission_run("key b beside key a's burst", 12.0, 9.0, 9000.0),
             "queue_max": admission_run("QUEUE_MAX=6", 5.0, 5.0, 100.0)}


def test_a_part_not_run_keeps_the_last_run_s_figures_named_as_such(tmp_path: Path) -> None:
    results = tmp_path / "agent_sessions.json"
    results.write_text(json.dumps({"machine": "Machine: 2 cores (AMD EPYC)", "sessions": SESSIONS,
                                   "admission": ADMISSION}))
    report: dict[str, Any] = {"machine": "Machine: 2 cores (Intel Xeon)", "admission": ADMISSION}
    ag.keep_parts_not_run(report, results)
    assert report["sessions"]["modes"] == SESSIONS["modes"]
    assert report["sessions"]["kept_from"] == "2 cores (AMD EPYC)"
    assert "kept_from" not in report["admission"], "the part run this time is this run's"
    text = ag.markdown(report)
    assert "Figures of an earlier run, on 2 cores (AMD EPYC)." in text
    assert "2.00x its wait alone (target 2x; its mean: 1.80x)" in text


def test_without_an_earlier_result_nothing_is_added(tmp_path: Path) -> None:
    report: dict[str, Any] = {"machine": "Machine: x", "admission": ADMISSION}
    ag.keep_parts_not_run(report, tmp_path / "missing.json")
    assert "sessions" not in report
    (tmp_path / "broken.json").write_text("{not json")
    ag.keep_parts_not_run(report, tmp_path / "broken.json")
    assert "sessions" not in report


def test_the_high_priority_request_is_described_as_it_was_sent() -> None:
    sent = {"queue_ms": 900.0, "longest_hold_ms": 9000.0}
    assert ag.urgent_when({**sent, "sent_while_the_burst_held_every_slot": True}) == \
        "while the burst held every slot with requests waiting"
    assert ag.urgent_when({**sent, "sent_while_the_burst_held_every_slot": False}) == \
        "without seeing the burst hold every slot"
    assert ag.urgent_when(sent) == "while the burst waited", "a run from before the field: as it was described then"
