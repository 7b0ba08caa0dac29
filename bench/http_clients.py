"""Why aiohttp: per-request cost of httpx.AsyncClient vs aiohttp.ClientSession against a zero-latency stand-in.

The stand-in llama-server runs as a separate process (`python -m lpcache.mock_llama`, 16 slots), so the client's
event loop has this process to itself, as lpcache's has. Each client is used as lpcache uses aiohttp: one shared
session/client with a keep-alive pool, a pre-serialised JSON body, the answer read as bytes.

  json:   POST /v1/chat/completions, 20 words, max_tokens 1, the body read whole;
  sse:    the same with stream true and max_tokens 16, the stream read chunk by chunk
          (aiohttp `content.iter_any()`, as lpcache's relay does; httpx `aiter_raw()`).

Each is run sequentially (one request at a time) and at concurrency 16 (16 tasks sharing the client), N requests
each, after a warm-up; runs alternate between the two clients, and the figures are medians over runs. Latency is per
request (first byte sent to last byte read); requests/s is N over the wall time; CPU µs/request is this process's
CPU time (user + system: the client alone, the stand-in runs elsewhere) over N.

Run: python bench/http_clients.py [--n 1000] [--runs 3] [--loop uvloop|asyncio] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import orjson

from lpcache.workloads.harness import free_port, story, wait_healthy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, machine_line, median, percentile, table  # noqa: E402

CHAT = "/v1/chat/completions"
HEADERS = {"Content-Type": "application/json"}
CONCURRENCY = (1, 16)
WARMUP = 100


def body(stream: bool) -> bytes:
    return orjson.dumps({"model": "llama.cpp", "messages": [{"role": "user", "content": story(3, 20)}],
                         "max_tokens": 16 if stream else 1, "temperature": 0, "stream": stream})


Request = Callable[[], Awaitable[int]]  # one request; returns the bytes read


def aiohttp_requests(session: aiohttp.ClientSession, url: str) -> dict[str, Request]:
    json_body, sse_body = body(False), body(True)

    async def json_req() -> int:
        async with session.request("POST", url + CHAT, data=json_body, headers=HEADERS) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"aiohttp json: HTTP {resp.status}")
            return len(raw)

    async def sse_req() -> int:
        n = 0
        async with session.request("POST", url + CHAT, data=sse_body, headers=HEADERS) as resp:
            if resp.status != 200:
                raise RuntimeError(f"aiohttp sse: HTTP {resp.status}")
            async for chunk in resp.content.iter_any():
                n += len(chunk)
        return n

    return {"json": json_req, "sse": sse_req}


def httpx_requests(client: httpx.AsyncClient, url: str) -> dict[str, Request]:
    json_body, sse_body = body(False), body(True)

    async def json_req() -> int:
        resp = await client.post(url + CHAT, content=json_body, headers=HEADERS)
        if resp.status_code != 200:
            raise RuntimeError(f"httpx json: HTTP {resp.status_code}")
        return len(resp.content)

    async def sse_req() -> int:
        n = 0
        async with client.stream("POST", url + CHAT, content=sse_body, headers=HEADERS) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"httpx sse: HTTP {resp.status_code}")
            async for chunk in resp.aiter_raw():
                n += len(chunk)
        return n

    return {"json": json_req, "sse": sse_req}


async def drive(request: Request, n: int, concurrency: int) -> dict[str, float]:
    """n requests from `concurrency` tasks; per-request latency and the throughput."""
    for _ in range(WARMUP):
        await request()
    latencies: list[float] = []
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            nbytes = await request()
            latencies.append(time.perf_counter() - t0)
            if nbytes <= 0:
                raise RuntimeError("empty answer")

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    us = [x * 1e6 for x in latencies]
    return {"median_us": median(us), "p99_us": percentile(us, 99), "rps": n / wall, "cpu_us": cpu / n * 1e6}


async def one_run(url: str, n: int, client_name: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    if client_name == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                        timeout=aiohttp.ClientTimeout(total=60))
        try:
            requests = aiohttp_requests(session, url)
            for kind, request in requests.items():
                for c in CONCURRENCY:
                    out[f"{kind}/c{c}"] = await drive(request, n, c)
        finally:
            await session.close()
    else:
        client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            requests = httpx_requests(client, url)
            for kind, request in requests.items():
                for c in CONCURRENCY:
                    out[f"{kind}/c{c}"] = await drive(request, n, c)
        finally:
            await client.aclose()
    return out


def run_loop(coro_fn: Callable[[], Awaitable[dict]], loop_name: str) -> dict:
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro_fn())  # type: ignore[arg-type]
    return asyncio.run(coro_fn())  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="timed requests per client, kind and concurrency")
    parser.add_argument("--runs", type=int, default=3, help="runs per client, alternating; medians reported")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="event loop of the clients (default uvloop, as lpcache runs under uvicorn)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    args = parser.parse_args(argv)
    started = time.monotonic()
    info = machine()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mock = subprocess.Popen([sys.executable, "-m", "lpcache.mock_llama", str(port), "mock-model", "--slots", "16"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"httpx": [], "aiohttp": []}
    try:
        wait_healthy(url + "/health", 30, mock, "stand-in llama-server")
        for r in range(args.runs):
            order = ("httpx", "aiohttp") if r % 2 == 0 else ("aiohttp", "httpx")
            for name in order:
                runs[name].append(run_loop(lambda name=name: one_run(url, args.n, name), args.loop))
    finally:
        mock.terminate()
        try:
            mock.wait(timeout=15)
        except subprocess.TimeoutExpired:
            mock.kill()
            mock.wait()

    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, per_run in runs.items():
        results[name] = {}
        for combo in per_run[0]:
            results[name][combo] = {m: median([run[combo][m] for run in per_run]) for m in per_run[0][combo]}
    doc = {"benchmark": "http_clients", "n": args.n, "runs": args.runs, "loop": args.loop, "machine": info,
           "versions": {"httpx": httpx.__version__, "aiohttp": aiohttp.__version__}, "results": results,
           "seconds": round(time.monotonic() - started, 1)}
    if args.json:
        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"httpx {httpx.__version__} vs aiohttp {aiohttp.__version__}, {args.loop} loop, {args.n} requests per "
          f"cell, median of {args.runs} runs ({machine_line()})\n")
    rows = []
    for combo in results["httpx"]:
        kind, conc = combo.split("/c")
        h, a = results["httpx"][combo], results["aiohttp"][combo]
        rows.append([kind, conc, f"{h['median_us']:.0f}", f"{a['median_us']:.0f}", f"{h['p99_us']:.0f}",
                     f"{a['p99_us']:.0f}", f"{h['rps']:.0f}", f"{a['rps']:.0f}", f"{h['cpu_us']:.0f}",
                     f"{a['cpu_us']:.0f}"])
    print(table(["request", "concurrency", "httpx med µs", "aiohttp med µs", "httpx p99 µs", "aiohttp p99 µs",
                 "httpx req/s", "aiohttp req/s", "httpx CPU µs/req", "aiohttp CPU µs/req"], rows))
    print(f"\ntook {doc['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
