"""bench/replay.py against the stand-in llama-server, directly and through lpcache: rows, the ideal, streaming,
concurrency, the between hook, the session header, bytes written, and the command line."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lpcache.mock_llama import MockHandle
from lpcache.workloads.story import Turn, ideal, ideal_of, shared, turns

from .conftest import Proxy, mock_stats

REPLAY_PY = Path(__file__).resolve().parents[2] / "bench" / "replay.py"


def load_replay() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_replay", REPLAY_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


rp = load_replay()


def small(rounds: int = 2) -> list[Turn]:
    return turns(users=2, kinds=("generate", "annotate"), rounds=rounds, first_words=60, part_words=20)


def chats(proxy: Proxy) -> list[Any]:
    """lpcache's records of chat requests (it records the forwarded /apply-template and /tokenize too)."""
    return [r for r in proxy.records if r.path.endswith("/chat/completions")]


def folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def test_direct_json_rows_and_ideal(backend: MockHandle) -> None:
    workload = small()
    report = rp.replay(backend.url + "/v1/", workload)
    s, rows = report.summary, report.rows
    assert [(r.user, r.kind, r.round, r.session) for r in rows] == [(t.user, t.kind, t.turn, t.session)
                                                                    for t in workload]
    assert all(r.status == 200 and r.error is None for r in rows)
    assert s["requests"] == 8 and s["errors"] == 0
    assert (s["users"], s["kinds"], s["rounds"]) == (2, 2, 2)
    assert s["computed"] == sum(r.prompt_n for r in rows) == mock_stats(backend)["prompt_tokens_computed"]
    assert s["computed_source"] == "timings"
    assert all(r.prompt_tokens == r.prompt_n + r.cache_n == r.tokens for r in rows)
    assert s["prompt_tokens"] == s["tokenized"] == sum(r.tokens for r in rows)
    # the ideal: one tokenisation pass gives what lpcache.workloads.story.ideal gives, globally and per session
    assert [r.ideal for r in rows] == ideal(backend.url, workload, per_session=False)
    assert [r.ideal_session for r in rows] == ideal(backend.url, workload)
    assert all(r.ideal <= r.ideal_session <= r.tokens for r in rows)
    assert s["ideal"] <= s["ideal_session"] <= s["prompt_tokens"]
    assert all(r.ideal < r.tokens for r in rows[1:])          # every later prompt shares at least the template start
    assert s["computed_over_ideal"] == round(s["computed"] / s["ideal"], 4)
    assert all(r.ttft_s == r.total_s for r in rows)           # JSON: the first token comes with the whole answer
    assert s["ttft_p50"] is not None and s["ttft_p50"] <= s["ttft_p90"]
    assert s["bytes_written"] == 0 and s["folder_bytes"] == 0  # llama-server alone writes no slot files
    assert s["llama_computed"] is None


def test_stream_concurrency_and_between(start_backend: Callable[..., MockHandle]) -> None:
    backend = start_backend(slots=2)
    workload = small(rounds=3)
    served_at_call: list[int] = []

    def between() -> None:
        served_at_call.append(mock_stats(backend)["chat_requests"])

    report = rp.replay(backend.url, workload, stream=True, concurrency=2, between=between, max_tokens=4)
    assert served_at_call == [4, 8]                           # after each round but the last, never inside one
    assert report.summary["errors"] == 0 and report.summary["between_s"] >= 0
    assert [(r.user, r.kind, r.round) for r in report.rows] == [(t.user, t.kind, t.turn) for t in workload]
    for r in report.rows:
        assert r.prompt_n is not None and r.cache_n is not None   # timings from the stream's last chunk
        assert 0 < r.ttft_s <= r.total_s
    assert report.summary["computed"] == sum(r.prompt_n for r in report.rows)
    assert report.summary["computed"] == mock_stats(backend)["prompt_tokens_computed"]


def test_through_lpcache_sessions_and_bytes(start_backend: Callable[..., MockHandle],
                                            start_proxy: Callable[..., Proxy], slot_dir: str) -> None:
    backend = start_backend(slots=2)
    proxy = start_proxy(backend)
    workload = small()
    calls = []
    report = rp.replay(proxy.url, workload, session_header=True, stream=True, slot_dirs=[slot_dir],
                       between=lambda: calls.append(len(chats(proxy))))
    proxy.settle()
    s = report.summary
    assert calls == [4]                                       # the replay waited for the round's saves
    assert s["errors"] == 0
    assert sorted(r.session for r in chats(proxy)) == sorted(t.session for t in workload)
    assert s["computed"] == sum(r.prompt_n for r in report.rows) == mock_stats(backend)["prompt_tokens_computed"]
    assert s["ideal"] <= s["ideal_session"] <= s["prompt_tokens"]
    # bytes written: lpcache's /metrics, which count what its records say the server wrote
    written = sum((r.save_bytes or 0) + (r.swap_save_bytes or 0) for r in chats(proxy))
    assert s["bytes_written"] == written > 0
    assert s["folder_bytes"] == folder_size(slot_dir) > 0


def test_targets_spread_the_requests_and_every_lpcache_is_counted(start_backend: Any, start_proxy: Any,
                                                                  tmp_path: Any) -> None:
    dirs = [os.path.join(tmp_path, f"slots{i}") for i in range(2)]
    for d in dirs:
        os.makedirs(d)
    backends = [start_backend(slots=2, slot_save_path=d) for d in dirs]
    proxies = [start_proxy(b, meta_dir=os.path.join(tmp_path, f"meta{i}")) for i, b in enumerate(backends)]
    workload = small(rounds=3)
    sent = [proxies[int(i % 3 == 0)].url for i in range(len(workload))]   # uneven: 4 to one, 8 to the other
    report = rp.replay(proxies[0].url + "/v1", workload, targets=sent, concurrency=2, slot_dirs=dirs,
                       tokenize_url=backends[0].url)
    for proxy in proxies:
        proxy.settle()
    s = report.summary
    assert s["errors"] == 0
    assert [len(chats(p)) for p in proxies] == [sent.count(p.url) for p in proxies] == [8, 4]
    assert [mock_stats(b)["chat_requests"] for b in backends] == [8, 4]
    # the rows keep the workload's order; each answer came from the stand-in behind the replica it was sent to
    assert [(r.user, r.kind, r.round) for r in report.rows] == [(t.user, t.kind, t.turn) for t in workload]
    assert s["computed"] == sum(mock_stats(b)["prompt_tokens_computed"] for b in backends)
    # bytes written: both replicas' /metrics, summed
    written = sum((r.save_bytes or 0) + (r.swap_save_bytes or 0) for p in proxies for r in chats(p))
    assert s["bytes_written"] == written > 0
    assert min(len(chats(p)) for p in proxies) > 0 and all(any(r.saved for r in chats(p)) for p in proxies)
    with pytest.raises(rp.ReplayError, match="3 targets for 12 requests"):
        rp.replay(proxies[0].url, workload, targets=sent[:3])


def test_lpcache_without_session_header_is_prefix_mode(start_backend: Any, start_proxy: Any) -> None:
    # a prefill that costs something: the second turn then waits for the slot of the first (being saved)
    backend = start_backend(prefill_ms_per_token=2.0)
    proxy = start_proxy(backend)
    workload = turns(users=1, kinds=("summary",), rounds=2, first_words=60, part_words=20)
    report = rp.replay(proxy.url, workload, tokenize_url=backend.url)
    proxy.settle()
    assert report.summary["errors"] == 0
    assert [r.session for r in chats(proxy)] == [None, None]
    assert report.rows[1].cache_n > 0                         # the second turn extends the first one's prompt


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_cli_json_and_between_command(backend: MockHandle, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out, marks = tmp_path / "replay.json", tmp_path / "marks"
    code = rp.main(["--url", backend.url, "--users", "1", "--kinds", "generate,summary", "--rounds", "3",
                    "--first-words", "60", "--part-words", "20", "--stream", "--json", str(out),
                    "--between", f"echo $REPLAY_ROUND >> {marks}"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["requests"] == len(doc["rows"]) == 6
    assert marks.read_text().split() == ["1", "2"]
    printed = capsys.readouterr()
    assert "computed / ideal" in printed.out and "round 3/3" in printed.err


def test_cli_expected_failures_are_one_line(backend: MockHandle, capsys: pytest.CaptureFixture[str]) -> None:
    assert rp.main(["--url", closed_port_url(), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replay: ") and "does not answer" in err and err.count("\n") == 1
    assert rp.main(["--url", backend.url, "--users", "1", "--kinds", "generate", "--rounds", "2",
                    "--first-words", "60", "--between", "exit 3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "between command exited with status 3" in err and err.count("\n") == 1
    assert rp.main(["--url", backend.url, "--llama-metrics", backend.url, "--quiet"]) == 2
    assert "--metrics" in capsys.readouterr().err


def test_metric_reads_lpcache_and_llama_server_text() -> None:
    text = "\n".join([
        "# HELP lpcache_slot_file_bytes_total Bytes of slot files",
        "# TYPE lpcache_slot_file_bytes_total counter",
        'lpcache_slot_file_bytes_total{action="save"} 1234.0',
        'lpcache_slot_file_bytes_total{action="restore"} 99.0',
        "lpcache_slot_file_bytes_created 1.7e9",
        "lpcache_background_save_bytes_total 10.0",
        'lpcache_slots_busy{backend="http://a:1"} 1.0',
        'lpcache_slots_busy{backend="http://b:2"} 0.0',
        "llamacpp:prompt_tokens_total 4321 1700000000000",
    ])
    assert rp.metric(text, "lpcache_slot_file_bytes_total", {"action": "save"}) == 1234
    assert rp.metric(text, "lpcache_slot_file_bytes_total") == 1333
    assert rp.metric(text, "lpcache_background_save_bytes_total") == 10
    assert rp.metric(text, "lpcache_slots_busy") == 1
    assert rp.metric(text, "llamacpp:prompt_tokens_total") == 4321
    assert rp.metric(text, "lpcache_slot_file_bytes") is None


def test_ideal_of_matches_a_pass_over_every_earlier_prompt() -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(0, 8))] for _ in range(300)]
    groups = [rng.choice("ab") for _ in prompts]

    def brute(group_of: Callable[[int], str]) -> list[int]:
        return [len(p) - max((shared(p, prompts[j]) for j in range(i) if group_of(j) == group_of(i)), default=0)
                for i, p in enumerate(prompts)]

    assert ideal_of(prompts) == brute(lambda _: "")
    assert ideal_of(prompts, groups) == brute(lambda i: groups[i])
