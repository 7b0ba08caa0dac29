"""lpcache's added latency per request, against calling a zero-latency stand-in llama-server directly.

The stand-in runs in a thread of this process (`start_mock`); lpcache runs as a separate process, started as a user
starts it (`python -m lpcache`, settings in its environment), so the client and the proxy never share an event loop.
The client is `http.client` on one keep-alive connection per server, sending requests one after the other and timing
each from the first byte sent to the last byte received.

Three kinds of request, each sent N times directly and N times through lpcache, in alternating rounds:

- small:  20 words, max_tokens 1, JSON answer;
- big:    600 words (above BIG_THRESHOLD_WORDS=500), max_tokens 1, JSON answer, different content every time, so
          lpcache saves every one's KV cache after the answer and prunes beyond META_MAX=10; the client's time is
          measured, the save runs after it (and overlaps the next request, as in real use);
- big-paced: the same, 10 ms apart and each sent only once lpcache is idle again (its save done), so the figure is
          the request's own path, without the previous save overlapping it;
- stream: 20 words, max_tokens 16, streamed (SSE), time to the last byte.

Run: python bench/overhead.py [--n 500] [--runs 3] [--warmup 50] [--slots 4] [--tmp-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from lpcache.mock_llama import MockConfig, start_mock
from lpcache.testing import LpcacheProcess, remove_tree, story

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, machine_line, median, percentile, table  # noqa: E402

TARGET_ADDED_P50_MS = 2.0
PACE_S = 0.010
ROUND = 50  # requests per target before switching to the other one
CHAT = "/v1/chat/completions"
HEADERS = {"Content-Type": "application/json"}


@dataclass
class Kind:
    name: str
    words: int
    max_tokens: int
    stream: bool
    distinct: bool  # every request a different prompt (so every big one is saved)
    target: float | None  # target for the added p50 in ms, when there is one
    paced: bool = False  # 10 ms apart, and only once lpcache is idle again

    def body(self, seed: int) -> bytes:
        text = story(seed if self.distinct else 7, self.words)
        return orjson.dumps({"model": "llama.cpp", "messages": [{"role": "user", "content": text}],
                             "max_tokens": self.max_tokens, "temperature": 0, "stream": self.stream})


KINDS = (
    Kind("small", 20, 1, False, False, TARGET_ADDED_P50_MS),
    Kind("big", 600, 1, False, True, TARGET_ADDED_P50_MS),
    Kind("big-paced", 600, 1, False, True, None, paced=True),
    Kind("stream", 20, 16, True, False, None),
)


class Client:
    """One keep-alive HTTP/1.1 connection; `post` returns the seconds from sending to the last byte."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, body: bytes, check: Callable[[http.client.HTTPResponse, bytes], None]) -> float:
        started = time.perf_counter()
        self.conn.request("POST", CHAT, body=body, headers=HEADERS)
        resp = self.conn.getresponse()
        data = resp.read()
        seconds = time.perf_counter() - started
        check(resp, data)
        return seconds

    def get_json(self, path: str) -> Any:
        self.conn.request("GET", path)
        resp = self.conn.getresponse()
        return orjson.loads(resp.read())

    def close(self) -> None:
        self.conn.close()


def checker(kind: Kind, via_proxy: bool) -> Callable[[http.client.HTTPResponse, bytes], None]:
    def check(resp: http.client.HTTPResponse, data: bytes) -> None:
        if resp.status != 200:
            raise RuntimeError(f"{kind.name}: HTTP {resp.status}: {data[:300]!r}")
        if via_proxy and resp.getheader("x-lpcache-slot") is None:
            raise RuntimeError(f"{kind.name}: answer did not come through lpcache")
        if kind.stream and b"data: [DONE]" not in data:
            raise RuntimeError(f"{kind.name}: stream did not end with [DONE]")
    return check


def wait_idle(health: Client, timeout: float = 30.0) -> None:
    """Until lpcache holds no slot: every save of the last round done (a slot is released after its save)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = health.get_json("/health")
        if all(b["busy_slots"] == 0 for b in doc["backends"]) and doc["waiting"] == 0:
            return
        time.sleep(0.002)  # polling lpcache's own state, not synchronising on a guess
    raise TimeoutError("lpcache still busy after the round")


def measure(kind: Kind, n: int, warmup: int, direct: Client, proxy: Client, health: Client,
            seeds: dict[str, int]) -> dict[str, list[float]]:
    """n timed requests each way, alternating rounds of ROUND requests, after `warmup` untimed ones each way."""
    times: dict[str, list[float]] = {"direct": [], "proxy": []}
    clients = {"direct": direct, "proxy": proxy}

    def send(way: str, count: int, keep: bool) -> None:
        check = checker(kind, way == "proxy")
        for _ in range(count):
            if kind.paced:
                wait_idle(health)
                time.sleep(PACE_S)  # pacing the load, not synchronisation
            seeds[way] += 1
            t = clients[way].post(kind.body(seeds[way]), check)
            if keep:
                times[way].append(t)
        if way == "proxy":
            wait_idle(health)

    for way in ("direct", "proxy"):
        send(way, warmup, keep=False)
    done = 0
    while done < n:
        count = min(ROUND, n - done)
        for way in ("direct", "proxy"):
            send(way, count, keep=True)
        done += count
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for way in ("direct", "proxy"):
        ms = [t * 1000.0 for t in times[way]]
        out[f"{way}_p50"], out[f"{way}_p99"] = percentile(ms, 50), percentile(ms, 99)
    out["added_p50"] = out["proxy_p50"] - out["direct_p50"]
    out["added_p99"] = out["proxy_p99"] - out["direct_p99"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="timed requests per kind and way, per run (default 500)")
    parser.add_argument("--runs", type=int, default=3, help="runs; the figures are medians over runs (default 3)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed requests per kind and way first (default 50)")
    parser.add_argument("--slots", type=int, default=4, help="slots of the stand-in (default 4)")
    parser.add_argument("--tmp-dir", default=None,
                        help="where the slot-save and meta folders are made (default: the system temp dir); "
                             "e.g. /dev/shm to take the disk's fsync out of the figures")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="lpcache-bench-overhead-", dir=args.tmp_dir)
    save_dir, meta_dir = os.path.join(tmp, "slots"), os.path.join(tmp, "meta")
    os.makedirs(save_dir)
    started = time.monotonic()
    info = machine()
    mock = start_mock(MockConfig(slots=args.slots, slot_save_path=save_dir))
    proxy: LpcacheProcess | None = None
    log_text = ""
    clients: list[Client] = []
    try:
        proxy = LpcacheProcess({
            "BACKENDS": orjson.dumps([{"url": mock.url, "slot_save_path": save_dir}]).decode(),
            "META_DIR": meta_dir, "LOG_LEVEL": "WARNING",
        })
        direct, via, health = Client(mock.port), Client(proxy.port), Client(proxy.port)
        clients = [direct, via, health]
        seeds = {"direct": 1_000_000, "proxy": 0}
        runs: dict[str, list[dict[str, float]]] = {k.name: [] for k in KINDS}
        big_sent = 0
        for _ in range(args.runs):
            for kind in KINDS:
                before = seeds["proxy"]
                times = measure(kind, args.n, args.warmup, direct, via, health, seeds)
                runs[kind.name].append(summarize(times))
                if kind.distinct:
                    big_sent += seeds["proxy"] - before
        wait_idle(health)
        stats = mock.app_state.stats
        checks = {
            "big_requests_via_proxy": big_sent,
            "saves_on_stand_in": stats.saves,
            "meta_files_left": len([f for f in os.listdir(meta_dir) if f.endswith(".meta.json")]),
            "kv_files_left": len(os.listdir(save_dir)),
            "cached_entries": health.get_json("/health")["cached_entries"],
        }
    finally:
        for c in clients:
            c.close()
        if proxy is not None:
            proxy.stop()
            log_text = proxy.log_tail(20)
            proxy.log_path.unlink(missing_ok=True)
        mock.stop()
        remove_tree(tmp)

    results = {}
    for kind in KINDS:
        per_run = runs[kind.name]
        fig = {key: median([r[key] for r in per_run]) for key in per_run[0]}
        fig["added_p50_runs"] = [round(r["added_p50"], 3) for r in per_run]
        fig["target_added_p50"] = kind.target
        fig["met"] = None if kind.target is None else fig["added_p50"] <= kind.target
        results[kind.name] = fig
    doc = {"benchmark": "overhead", "n": args.n, "runs": args.runs, "warmup": args.warmup, "slots": args.slots,
           "tmp_dir": tmp, "machine": info, "seconds": round(time.monotonic() - started, 1), "results": results,
           "checks": checks}
    if args.json:
        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        print(f"lpcache overhead vs direct: {args.n} sequential requests per kind and way, keep-alive, "
              f"median of {args.runs} runs ({machine_line()})")
        print("times in ms; added = via lpcache - direct, per percentile\n")
        rows = []
        for kind in KINDS:
            r = results[kind.name]
            target = "-" if kind.target is None else f"<= {kind.target:g} ({'met' if r['met'] else 'NOT met'})"
            rows.append([kind.name, r["direct_p50"], r["proxy_p50"], r["added_p50"], r["direct_p99"],
                         r["proxy_p99"], r["added_p99"], target])
        print(table(["request", "direct p50", "lpcache p50", "added p50", "direct p99", "lpcache p99", "added p99",
                     "target added p50"], rows))
        print("\nadded p50 per run (ms): " + "; ".join(
            f"{k.name} {', '.join(f'{x:.3f}' for x in results[k.name]['added_p50_runs'])}" for k in KINDS))
        print("checks: " + ", ".join(f"{k}={v}" for k, v in checks.items()))
        print(f"slot-save and meta folders under {os.path.dirname(tmp)}")
        print(f"took {doc['seconds']} s")
    if checks["saves_on_stand_in"] < checks["big_requests_via_proxy"]:
        print(f"warning: fewer saves than big requests; lpcache log tail:\n{log_text}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
