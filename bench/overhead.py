"""lpcache's added latency per request, against calling a zero-latency stand-in llama-server directly.

The stand-ins run in threads of this process (`start_mock`): one that lpcache fronts, and one, configured alike,
that the direct calls go to (so they never change the slots lpcache believes it knows). lpcache runs as a separate
process, started as a user starts it (`python -m lpcache`, settings in its environment), so the client and the
proxy never share an event loop.
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

With `--redis`, a second lpcache runs beside the first with REDIS_URL set (one replica, a fresh redis-server on a
free port, from Debian's package: `make redis`), in front of a stand-in of its own configured as the first, and
every round goes to the stand-in directly, through lpcache alone and through lpcache with Redis, in turn. It prints
the added p50 and p90 of both and their difference, against the target for Redis (added p50 at most 1 ms over the
single process), with the Redis round trips and the time spent claiming slot leases per request (that replica's
/metrics).

With `--tracing`, another lpcache runs beside the first with OpenTelemetry tracing on
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set to an OTLP/HTTP receiver in this process that decodes every batch,
`lpcache.workloads.otlp_receiver`), in front of a stand-in of its own, in turn with the others: the added p50 and p90
of tracing over the single process (TRACING=off), and the spans received.

Run: python bench/overhead.py [--n 500] [--runs 3] [--warmup 50] [--slots 4] [--tmp-dir DIR] [--redis] [--tracing]
     [--json]
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
from lpcache.workloads.harness import LpcacheProcess, RedisServer, remove_tree, story
from lpcache.workloads.otlp_receiver import OtlpReceiver

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, machine_line, median, percentile, redis_commands, table  # noqa: E402
from replay import metric  # noqa: E402

TARGET_ADDED_P50_MS = 2.0
TARGET_REDIS_OVER_SINGLE_P50_MS = 1.0
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


def measure(kind: Kind, n: int, warmup: int, ways: dict[str, Client], healths: dict[str, Client],
            seeds: dict[str, int]) -> dict[str, list[float]]:
    """n timed requests each way, in turn by rounds of ROUND requests, after `warmup` untimed ones each way. `ways`
    maps a way to its client ("direct" first); `healths` the lpcache ways to a client for their /health."""
    times: dict[str, list[float]] = {way: [] for way in ways}

    def send(way: str, count: int, keep: bool) -> None:
        check = checker(kind, way in healths)
        for _ in range(count):
            if kind.paced and way in healths:
                wait_idle(healths[way])
            if kind.paced:
                time.sleep(PACE_S)  # pacing the load, not synchronisation
            seeds[way] += 1
            t = ways[way].post(kind.body(seeds[way]), check)
            if keep:
                times[way].append(t)
        if way in healths:
            wait_idle(healths[way])

    for way in ways:
        send(way, warmup, keep=False)
    done = 0
    while done < n:
        count = min(ROUND, n - done)
        for way in ways:
            send(way, count, keep=True)
        done += count
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    """Each way's p50, p90 and p99 in ms, and for each way but the direct one what it adds to the direct call."""
    out = {}
    for way, seconds in times.items():
        ms = [t * 1000.0 for t in seconds]
        for q in (50, 90, 99):
            out[f"{way}_p{q}"] = percentile(ms, q)
    for way in times:
        if way != "direct":
            prefix = "added" if way == "proxy" else f"{way}_added"
            for q in (50, 90, 99):
                out[f"{prefix}_p{q}"] = out[f"{way}_p{q}"] - out[f"direct_p{q}"]
    for lane in ("redis", "tracing"):
        if lane in times:
            for q in (50, 90):
                out[f"{lane}_over_single_p{q}"] = out[f"{lane}_added_p{q}"] - out[f"added_p{q}"]
    return out


def fleet_counts(client: Client) -> dict[str, float | None]:
    """The Redis figures of a replica's /metrics (None when this lpcache does not expose them)."""
    client.conn.request("GET", "/metrics")
    text = client.conn.getresponse().read().decode()
    return {"redis_calls": metric(text, "lpcache_redis_calls_total"),
            "claim_seconds": metric(text, "lpcache_redis_claim_seconds_total"),
            "claims_refused": metric(text, "lpcache_slot_claims_total", {"outcome": "refused"}),
            "claims_local": metric(text, "lpcache_slot_claims_total", {"outcome": "local"}),
            "redis_up": metric(text, "lpcache_redis_up"),
            "requests": metric(text, "lpcache_requests_total")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="timed requests per kind and way, per run (default 500)")
    parser.add_argument("--runs", type=int, default=3, help="runs; the figures are medians over runs (default 3)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed requests per kind and way first (default 50)")
    parser.add_argument("--slots", type=int, default=4, help="slots of the stand-in (default 4)")
    parser.add_argument("--tmp-dir", default=None,
                        help="where the slot-save and meta folders are made (default: the system temp dir); "
                             "e.g. /dev/shm to take the disk's fsync out of the figures")
    parser.add_argument("--redis", action="store_true",
                        help="also through a second lpcache with REDIS_URL set (one replica, its own stand-in and "
                             "redis-server): added latency with Redis against the single process")
    parser.add_argument("--tracing", action="store_true",
                        help="also through an lpcache with OpenTelemetry tracing on, exporting to an OTLP/HTTP "
                             "receiver in this process: added latency with tracing against the single process")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="lpcache-bench-overhead-", dir=args.tmp_dir)
    lanes = ["proxy", *(["redis"] if args.redis else []), *(["tracing"] if args.tracing else [])]
    folders = {lane: (os.path.join(tmp, f"slots-{lane}"), os.path.join(tmp, f"meta-{lane}")) for lane in lanes}
    for save_dir, _ in folders.values():
        os.makedirs(save_dir)
    started = time.monotonic()
    info = machine()
    mocks: dict[str, Any] = {}
    proxies: dict[str, LpcacheProcess] = {}
    redis: RedisServer | None = None
    receiver = OtlpReceiver().__enter__() if args.tracing else None
    log_texts: dict[str, str] = {}
    clients: list[Client] = []
    fleet: dict[str, float | None] = {}
    try:
        for lane in lanes:
            mocks[lane] = start_mock(MockConfig(slots=args.slots, slot_save_path=folders[lane][0]))
        mocks["direct"] = start_mock(MockConfig(slots=args.slots))
        settings: dict[str, dict[str, str]] = {lane: {
            "BACKENDS": orjson.dumps([{"url": mocks[lane].url, "slot_save_path": folders[lane][0]}]).decode(),
            "META_DIR": folders[lane][1], "LOG_LEVEL": "WARNING",
            "TRACING": "on" if lane == "tracing" else "off"} for lane in lanes}
        if args.redis:
            redis = RedisServer()
            settings["redis"] |= {"REDIS_URL": redis.url, "REPLICA_ID": "bench"}
        if receiver is not None:
            settings["tracing"] |= {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint}
        for lane in lanes:
            proxies[lane] = LpcacheProcess(settings[lane])
        ways = {"direct": Client(mocks["direct"].port), **{lane: Client(proxies[lane].port) for lane in lanes}}
        healths = {lane: Client(proxies[lane].port) for lane in lanes}
        clients = [*ways.values(), *healths.values()]
        seeds = {way: 1_000_000 * i for i, way in enumerate(ways)}
        runs: dict[str, list[dict[str, float]]] = {k.name: [] for k in KINDS}
        big_sent = dict.fromkeys(lanes, 0)
        fleet_before = fleet_counts(healths["redis"]) if args.redis else {}
        commands_before = redis_commands(redis.url) if redis is not None else {}
        for _ in range(args.runs):
            for kind in KINDS:
                before = dict(seeds)
                times = measure(kind, args.n, args.warmup, ways, healths, seeds)
                runs[kind.name].append(summarize(times))
                if kind.distinct:
                    for lane in lanes:
                        big_sent[lane] += seeds[lane] - before[lane]
        checks: dict[str, Any] = {}
        for lane in lanes:
            wait_idle(healths[lane])
            name = "" if lane == "proxy" else f"{lane}_"
            save_dir, meta_dir = folders[lane]
            checks |= {
                f"{name}big_requests_via_proxy": big_sent[lane],
                f"{name}saves_on_stand_in": mocks[lane].app_state.stats.saves,
                f"{name}meta_files_left": len([f for f in os.listdir(meta_dir) if f.endswith(".meta.json")]),
                f"{name}kv_files_left": len(os.listdir(save_dir)),
                f"{name}cached_entries": healths[lane].get_json("/health")["cached_entries"],
            }
        if args.redis:
            after = fleet_counts(healths["redis"])
            fleet = {key: None if value is None else value - (fleet_before.get(key) or 0)   # no sample yet: 0
                     for key, value in after.items()}
            fleet["redis_up"] = after["redis_up"]
            if redis is not None:
                commands = redis_commands(redis.url)
                fleet |= {f"redis_{k}": v - commands_before[k] for k, v in commands.items()}
    finally:
        for c in clients:
            c.close()
        for lane, proxy in proxies.items():
            proxy.stop()
            log_texts[lane] = proxy.log_tail(20)
            proxy.log_path.unlink(missing_ok=True)
        for mock in mocks.values():
            mock.stop()
        if redis is not None:
            redis.remove()
        if receiver is not None:
            receiver.__exit__()
        remove_tree(tmp)

    results = {}
    for kind in KINDS:
        per_run = runs[kind.name]
        fig: dict[str, Any] = {key: median([r[key] for r in per_run]) for key in per_run[0]}
        fig["added_p50_runs"] = [round(r["added_p50"], 3) for r in per_run]
        fig["target_added_p50"] = kind.target
        fig["met"] = None if kind.target is None else fig["added_p50"] <= kind.target
        if args.tracing:
            fig["tracing_over_single_p50_runs"] = [round(r["tracing_over_single_p50"], 3) for r in per_run]
        if args.redis:
            fig["redis_added_p50_runs"] = [round(r["redis_added_p50"], 3) for r in per_run]
            fig["redis_over_single_p50_runs"] = [round(r["redis_over_single_p50"], 3) for r in per_run]
            fig["target_redis_over_single_p50"] = TARGET_REDIS_OVER_SINGLE_P50_MS
            fig["redis_met"] = fig["redis_over_single_p50"] <= TARGET_REDIS_OVER_SINGLE_P50_MS
        results[kind.name] = fig
    per_request = {}
    if args.redis:
        requests = fleet.get("requests")
        if requests:
            for key in ("redis_calls", "claim_seconds", "redis_commands", "redis_scripts"):
                value = fleet.get(key)
                per_request[key] = None if value is None else value / requests
    doc = {"benchmark": "overhead", "n": args.n, "runs": args.runs, "warmup": args.warmup, "slots": args.slots,
           "redis": args.redis, "tracing": args.tracing,
           "spans_received": None if receiver is None else len(receiver.spans),
           "tmp_dir": tmp, "machine": info, "seconds": round(time.monotonic() - started, 1),
           "results": results, "checks": checks, "fleet": fleet, "fleet_per_request": per_request}
    if args.json:
        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        print_tables(doc, args)
    for lane in lanes:
        name = "" if lane == "proxy" else f"{lane}_"
        # past META_MAX the last caches may still be unsaved in their slots (`save_deferred`): one per slot at most
        if checks[f"{name}saves_on_stand_in"] < checks[f"{name}big_requests_via_proxy"] - args.slots:
            print(f"warning: fewer saves than big requests ({lane}); lpcache log tail:\n{log_texts[lane]}",
                  file=sys.stderr)
    return 0


def print_tables(doc: dict[str, Any], args: argparse.Namespace) -> None:
    results = doc["results"]
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
    if doc["redis"]:
        print(f"\nwith REDIS_URL set (one replica, its own stand-in), against the single process; added = via "
              f"lpcache - direct; target: added p50 with Redis <= {TARGET_REDIS_OVER_SINGLE_P50_MS:g} ms over the "
              "single process\n")
        rows = []
        for kind in KINDS:
            r = results[kind.name]
            rows.append([kind.name, r["added_p50"], r["redis_added_p50"], r["redis_over_single_p50"],
                         r["added_p90"], r["redis_added_p90"], r["redis_over_single_p90"],
                         "met" if r["redis_met"] else "NOT met"])
        print(table(["request", "added p50", "added p50 Redis", "Redis - single p50", "added p90",
                     "added p90 Redis", "Redis - single p90", "target"], rows))
        print("\nRedis - single p50 per run (ms): " + "; ".join(
            f"{k.name} {', '.join(f'{x:.3f}' for x in results[k.name]['redis_over_single_p50_runs'])}"
            for k in KINDS))
        fleet, per = doc["fleet"], doc["fleet_per_request"]
        if fleet.get("redis_commands") is not None and fleet.get("requests"):
            print(f"Redis processed {fleet['redis_commands']:,} commands and {fleet['redis_scripts']:,} script calls "
                  f"for {fleet['requests']:,.0f} requests: {per['redis_commands']:.2f} and {per['redis_scripts']:.2f} "
                  "a request (its INFO; commands inside scripts and the replica's background work included)")
        if fleet.get("redis_calls") is None:
            print("this lpcache's /metrics has no lpcache_redis_calls_total: Redis round trips not counted")
        else:
            claim = per.get("claim_seconds")
            print(f"Redis replica: {fleet['requests']:.0f} requests, {fleet['redis_calls']:.0f} Redis round trips "
                  f"({per.get('redis_calls', 0):.2f} a request), claims "
                  + ("-" if claim is None else f"{claim * 1000:.3f} ms a request")
                  + f", claims refused {fleet['claims_refused']}, local {fleet['claims_local']}, "
                  f"lpcache_redis_up {fleet['redis_up']}")
    if doc["tracing"]:
        print("\nwith OpenTelemetry tracing on (OTLP/HTTP to a receiver in the benchmark's process), against the "
              "single process (tracing off); added = via lpcache - direct\n")
        rows = [[k.name, results[k.name]["added_p50"], results[k.name]["tracing_added_p50"],
                 results[k.name]["tracing_over_single_p50"], results[k.name]["added_p90"],
                 results[k.name]["tracing_added_p90"], results[k.name]["tracing_over_single_p90"]] for k in KINDS]
        print(table(["request", "added p50", "added p50 tracing", "tracing - off p50", "added p90",
                     "added p90 tracing", "tracing - off p90"], rows))
        print("\ntracing - off p50 per run (ms): " + "; ".join(
            f"{k.name} {', '.join(f'{x:.3f}' for x in results[k.name]['tracing_over_single_p50_runs'])}"
            for k in KINDS) + f"; spans received: {doc['spans_received']:,}")
    print("checks: " + ", ".join(f"{k}={v}" for k, v in doc["checks"].items()))
    print(f"slot-save and meta folders under {os.path.dirname(doc['tmp_dir'])}")
    print(f"took {doc['seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
