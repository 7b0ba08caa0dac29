"""Whether a backend keeps a RAM prompt cache, asked under BIG_THRESHOLD_WORDS=auto (`flow.ram_presence`,
`backends.ram_check`), against the stand-in, which has none (as llama-server started with `--cache-ram 0`): the
check's answer, what it leaves behind, and a restart making lpcache forget what the RAM held and ask again. The
answer of a server that has one is tested against the real llama-server (tests/e2e/test_auto_real.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ..conftest import user
from .conftest import mock_stats

TEXT = ("Could you review this function? `def mean(xs): return sum(xs) / len(xs)` — it fails on []. "
        "Merci d'avance 🙂, and keep the answer short.")


def test_auto_asks_whether_the_server_keeps_a_ram_cache_and_leaves_no_slot_taken(start_backend: Any,
                                                                                start_proxy: Any) -> None:
    backend = start_backend(slots=2)
    proxy = start_proxy(backend, big_threshold_words=None)
    r = proxy.chat(user(TEXT), max_tokens=4)
    assert r.status_code == 200, r.text
    proxy.settle()
    ram = proxy.pipeline.backends[0].ram
    assert ram.present is False                         # the stand-in gave the check's prompt back from nowhere
    assert not proxy.busy_slots()
    stats = mock_stats(backend)
    assert stats["chat_requests"] >= 4                       # the check's three, and the client's own
    # the answer is kept: a server without a RAM cache is never left a return to serve, however cheap its miss
    assert not ram.probe(0.001, now=1e9) and not ram.rely(0.001, 10.0, now=1e9)


def test_the_fixed_thresholds_never_ask(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(slots=2)
    proxy = start_proxy(backend)                        # BIG_THRESHOLD_WORDS=50 here: nothing changes for it
    assert proxy.chat(user(TEXT), max_tokens=4).status_code == 200
    proxy.settle()
    assert proxy.pipeline.backends[0].ram.present is None
    assert mock_stats(backend)["chat_requests"] == 1


def test_a_restarted_server_is_asked_again_and_what_its_ram_held_is_forgotten(
        start_backend: Any, start_proxy: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    import lpcache.backends.slot_truth

    monkeypatch.setattr(lpcache.backends.slot_truth, "SLOTS_TRUSTED_FOR", 0.0)   # check before every request
    backend = start_backend(slots=2)
    proxy = start_proxy(backend, big_threshold_words=None)
    history = user(TEXT)
    r = proxy.chat(history, max_tokens=4)
    assert r.status_code == 200, r.text
    proxy.settle()
    server = proxy.pipeline.backends[0]
    caches = proxy.pipeline.saver.server_caches
    assert any(s.content is not None for s in proxy.pipeline.pool.slots)   # a belief the restarted server contradicts

    async def as_if_a_ram_served() -> None:             # what a real server's RAM would have shown by now
        server.ram.present = True
        caches.held(0, (1, 2, 3))
    proxy.run(as_if_a_ram_served())
    port = int(backend.url.rsplit(":", 1)[1])
    backend.stop()
    restarted = start_backend(slots=2, port=port)       # the same server, empty
    with caplog.at_level("INFO", logger="lpcache.ram_presence"):
        r = proxy.chat([*history, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "And with `statistics.fmean`?"}], max_tokens=4)
        assert r.status_code == 200, r.text
        proxy.settle()
    assert any(rec.getMessage().startswith("ram_forgotten") for rec in caplog.records)
    assert caches.find((1, 2, 3)) is None               # what the RAM held before is gone
    assert server.ram.present is False                  # asked again: the restarted stand-in has no RAM cache
    assert mock_stats(restarted)["chat_requests"] >= 4       # the check's three, and the client's turn


def test_a_restart_is_seen_in_the_slots_task_numbers_too() -> None:
    """A server that ran tasks since it restarted (another client, another replica's check) still shows it: its slots'
    task numbers went back below what lpcache saw before (they count from 0 at each start)."""
    from types import SimpleNamespace

    from lpcache.backends.slot_truth import SlotTruth

    seen: list[Any] = []
    truth = SlotTruth([], None, on_restart=seen.append)  # type: ignore[arg-type]
    server: Any = SimpleNamespace(task_marks={})
    truth.restart_seen(server, [{"id": 0, "id_task": 40}, {"id": 1, "id_task": 57}, {"id": 2}])
    truth.restart_seen(server, [{"id": 0, "id_task": 61}, {"id": 1, "id_task": 57}, {"id": 2}])
    assert seen == [] and server.task_marks[None] == 61
    truth.restart_seen(server, [{"id": 0, "id_task": 5}], model="other")           # a router's other instance
    assert seen == []                                   # numbers its tasks on its own: no restart of the first
    truth.restart_seen(server, [{"id": 0, "id_task": 3}, {"id": 1}, {"id": 2}])   # restarted, 4 tasks run since
    assert seen == [server] and server.task_marks[None] == 3
    truth.restart_seen(server, [{"id": 0}, {"id": 1}, {"id": 2}])                  # restarted, nothing run since
    assert seen == [server, server]
