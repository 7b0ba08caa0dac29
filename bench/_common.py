"""Small helpers shared by the benchmarks: percentiles, a plain-text table, a note on the machine, llama-servers
restarted on their ports, Redis's own count of commands."""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from lpcache.config import OPTIONS
from lpcache.workloads.harness import LlamaServer


def sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of a server-sent event stream, split where the SSE format says (CR LF, LF or CR) and nowhere else.
    Not httpx's `iter_lines`: it splits with `str.splitlines`, also at U+2028, U+2029 and U+0085, which a model's
    answer may hold raw inside an event's JSON (llama-server does not escape them), cutting that event in two."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        held = buf.endswith(b"\r")   # maybe the first half of a CR LF
        *lines, rest = _LINE_END.split(buf[:-1] if held else buf)
        buf = rest + (b"\r" if held else b"")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if buf:
        yield buf.removesuffix(b"\r").decode("utf-8", "replace")


_LINE_END = re.compile(rb"\r\n|\r|\n")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown-compatible table, columns padded (numbers right-aligned)."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str], head: bool = False) -> str:
        parts = []
        for i, text in enumerate(row):
            numeric = not head and _is_number(text)
            parts.append(text.rjust(widths[i]) if numeric else text.ljust(widths[i]))
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0], head=True), sep, *(line(r) for r in cells[1:])])


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        return False


def machine() -> dict[str, object]:
    """What the figures were taken on."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
    }


def machine_line() -> str:
    m = machine()
    load = m["loadavg_1_5_15"]
    return (f"Python {m['python']} ({m['implementation']}), {m['cpus']} CPUs, {m['platform']}, "
            f"load average {load} at start")


def llama_machine_text(binary: str, gguf: str) -> str:
    """The machine line of a benchmark page: cores and CPU model, Python, the llama-server build and the model."""
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             env={**os.environ, "LD_LIBRARY_PATH": os.path.dirname(binary)}).stderr.strip()
    build = re.search(r"version: (\S+.*)", version)
    return (f"Machine: {os.cpu_count()} cores ({model or platform.machine()}), Python {platform.python_version()}; "
            f"llama.cpp build 11434 ({build.group(1) if build else 'version unknown'}); model "
            f"{os.path.basename(gguf)}{lpcache_env_text()}")


def lpcache_env_text() -> str:
    """The lpcache settings this benchmark's environment gives every lpcache it starts (`make bench` runs the
    scenarios with BIG_THRESHOLD_WORDS=auto), for the page's machine line; "" when none."""
    given = [f"{o.env}={os.environ[o.env]}" for o in OPTIONS
             if o.env in os.environ and o.env not in ("BACKENDS", "LLAMA_URL", "META_DIR")]
    return f"; lpcache settings from the environment: {', '.join(given)}" if given else ""


def replace_section(doc: Path, start: str, end: str, section: str) -> None:
    """Put `section` between its markers in a page (at its end when the markers are not there yet)."""
    text = doc.read_text()
    if start in text and end in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text)


class _Stoppable(Protocol):
    def stop(self) -> None: ...


def stop_run(work: Path, *started: _Stoppable | None) -> None:
    """The end of a benchmark run, however it ended: what it started stopped in order (lpcache before its
    llama-server), then its scratch folder removed (copied first into `BENCH_KEEP` when that is set, slot files left
    out)."""
    for process in started:
        if process is not None:
            process.stop()
    keep = os.environ.get("BENCH_KEEP")
    if keep:
        try:
            shutil.copytree(work, Path(keep) / work.name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("slots*"))
        except OSError as e:   # a debugging aid: never the reason a run fails
            print(f"BENCH_KEEP: {work} not kept: {e}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)


def shared_cores(servers: int, concurrency: int) -> int | None:
    """Each server's `-t` when several servers on this machine compute at the same time: its share of the cores.

    llama-server's threads wait for each other at every step of a batch by spinning; two servers with a thread per
    core each, both busy, leave each waiting for threads the other has descheduled (`two-12`'s first round, nothing
    cached yet: 67 s through lpcache against the server alone's 24 on 2 cores; 24 with a core each). Two servers
    sharing one machine are given a share of its cores each, as they would be run. One request at a time (`two`)
    keeps the default: one server computes while the other waits."""
    if servers < 2 or concurrency < 2:
        return None
    return max(1, (os.cpu_count() or 1) // servers)


class Servers:
    """n llama-servers with their slot folders; `restart()` stops and starts each on its port (empty; with
    `erase`, their slot-save folders emptied too, so the next run starts as the first did). `threads` is each
    server's `-t` (llama-server's default, the machine's cores, when None)."""

    def __init__(self, work: Path, n: int, n_slots: int, cache_ram: int | None, threads: int | None = None) -> None:
        extra = ["--metrics", *(["-t", str(threads)] if threads else [])]
        self.args = {"n_slots": n_slots, "cache_ram": cache_ram, "extra": extra}
        self.dirs = [str(work / f"slots{i}") for i in range(n)]
        self.servers = [LlamaServer(d, **self.args) for d in self.dirs]  # type: ignore[arg-type]

    def restart(self, erase: bool = False) -> None:
        for i, server in enumerate(self.servers):
            port = server.port
            server.stop()
            if erase:
                shutil.rmtree(self.dirs[i], ignore_errors=True)
            self.servers[i] = LlamaServer(self.dirs[i], port=port, **self.args)  # type: ignore[arg-type]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def redis_commands(url: str) -> dict[str, int]:
    """What the Redis at `url` has processed since it started, every client's, background work included:
    `commands` (`INFO stats`; each command a script runs counts too) and `scripts` (EVALSHA calls, `INFO
    commandstats`: lpcache's lease claims and releases are one script call each)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        return {"commands": int(client.info("stats")["total_commands_processed"]),
                "scripts": int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
                + int(stats.get("cmdstat_eval", {}).get("calls", 0))}
    finally:
        client.close()
