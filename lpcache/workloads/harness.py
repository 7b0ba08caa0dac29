"""A small harness for tests, benchmarks and the demo: servers on free ports that always stop.

- `ServerThread` serves any ASGI app (lpcache, the stand-in) with uvicorn in a thread of its own.
- `LlamaServer` starts a real llama-server process (build and model from `scripts/get-llama-server.sh`).
- `LpcacheProcess` starts lpcache as a user would, `python -m lpcache`, with settings in its environment.
- `RedisServer` starts a real redis-server on a free port (the scale-out tests).
Readiness is awaited by polling a health URL with a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvicorn

REPO = Path(__file__).resolve().parents[2]   # the checkout: lpcache/workloads/harness.py
GET_LLAMA = REPO / "scripts" / "get-llama-server.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(ready: Callable[[], bool], where: str, timeout: float, process: subprocess.Popen | None = None,
               what: str = "server") -> None:
    """Poll `ready()` (an OSError counts as not yet) until it says yes; fail early if the process died."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before it was ready")
        try:
            if ready():
                return
        except OSError as e:   # urllib's URLError included
            last = e
        time.sleep(0.05)  # polling interval of a readiness check, not synchronisation
    raise TimeoutError(f"{what} at {where} not ready after {timeout}s ({last})")


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None, what: str = "server") -> None:
    """Poll `url` until it answers 200; fail early if the process died."""

    def answers() -> bool:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)

    wait_ready(answers, url, timeout, process, what)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread with its own event loop."""

    def __init__(self, app: Any, port: int | None = None, **config: Any) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="on", **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"uvicorn-{self.port}")

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)  # readiness polling
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def script_paths(script: Path, *names: str) -> tuple[str, ...]:
    """The paths a set-up script prints as NAME=value lines, each taken from the environment when it is set there
    (the script fetches, builds and caches what it prints outside the checkout, on first use)."""
    if all(os.environ.get(n) for n in names):
        return tuple(os.environ[n] for n in names)
    out = subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return tuple(os.environ.get(n) or found[n] for n in names)


def llama_paths() -> tuple[str, str]:
    """(llama-server binary, SmolLM2 GGUF), from scripts/get-llama-server.sh (or LLAMA_SERVER_BIN, SMOLLM2_GGUF)."""
    binary, model = script_paths(GET_LLAMA, "LLAMA_SERVER_BIN", "SMOLLM2_GGUF")
    return binary, model


def gemma_path() -> str:
    """The Gemma 3 270M GGUF (a sliding-window model), from the same script (or GEMMA3_GGUF). Run it with
    `LlamaServer(..., extra=["-m", gemma_path()])`."""
    return script_paths(GET_LLAMA, "GEMMA3_GGUF")[0]


def fim_model_path() -> str:
    """SmolLM2 with fill-in-the-middle tokens named (three of its unused control tokens), so that llama-server serves
    /infill with it: its answers mean nothing, its cache behaves as any model's. Made once with the `gguf` package
    next to the SmolLM2 file (about 15 s). Run it with `LlamaServer(..., extra=["-m", fim_model_path()])`."""
    source = llama_paths()[1]
    target = os.path.join(os.path.dirname(source), "SmolLM2-135M-fim.gguf")
    if not os.path.exists(target):
        partial = f"{target}.{os.getpid()}.part"
        subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force",
                        "--special-token-by-id", "fim_pre", "7", "--special-token-by-id", "fim_suf", "8",
                        "--special-token-by-id", "fim_mid", "9", source, partial], check=True, capture_output=True)
        os.replace(partial, target)
    return target


class _Process:
    """A child process with its log in a file, stopped with SIGTERM (then SIGKILL)."""

    name = "process"
    health_path = "/health"

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")[1])

    def _start(self, argv: Sequence[str], env: Mapping[str, str] | None, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                            env=dict(env) if env is not None else None)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise RuntimeError(f"{self.name} failed to start; its log:\n{self.log_tail()}") from None

    def _wait_ready(self, timeout: float) -> None:
        wait_healthy(self.url + self.health_path, timeout, self.process, self.name)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LlamaServer(_Process):
    """A real llama-server: `-np` slots, a slot-save folder, and the RAM prompt cache off (`cache_ram=0`) or at its
    default (`cache_ram=None`)."""

    name = "llama-server"

    def __init__(self, slot_save_path: str | None = None, *, n_slots: int = 2, ctx: int = 16384,
                 cache_ram: int | None = 0, extra: Sequence[str] = (), timeout: float = 120.0,
                 port: int | None = None) -> None:
        super().__init__(port)
        binary, model = llama_paths()
        self.slot_save_path = slot_save_path
        argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(n_slots),
                "-c", str(ctx), "--no-webui", *extra]
        if slot_save_path:
            os.makedirs(slot_save_path, exist_ok=True)
            argv += ["--slot-save-path", slot_save_path]
        if cache_ram is not None:
            argv += ["--cache-ram", str(cache_ram)]
        libs = [os.path.dirname(binary), os.environ.get("LD_LIBRARY_PATH", "")]
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in libs if p)}
        self._start(argv, env, timeout)


class MockProcess(_Process):
    """The stand-in llama-server in a process of its own, as a real llama-server would be (benchmarks)."""

    name = "mock-llama"

    def __init__(self, slot_save_path: str | None = None, *, n_slots: int = 2, extra: Sequence[str] = (),
                 timeout: float = 30.0) -> None:
        super().__init__()
        self.slot_save_path = slot_save_path
        argv = [sys.executable, "-m", "lpcache.mock_llama", str(self.port), "mock-model", "--slots", str(n_slots),
                *(["--slot-save-path", slot_save_path] if slot_save_path else []), *extra]
        self._start(argv, None, timeout)


class LpcacheProcess(_Process):
    """lpcache started as a user starts it, with its settings as environment variables: `python -m lpcache` of this
    interpreter, or `command` (the `lpcache` of another installation, such as a wheel's virtualenv); on `port` (a
    free one by default; a replica started again where its clients reach it)."""

    name = "lpcache"

    def __init__(self, settings: Mapping[str, str], timeout: float = 30.0,
                 command: Sequence[str] | None = None, port: int | None = None) -> None:
        super().__init__(port)
        env = {k: v for k, v in os.environ.items() if k not in ("BACKENDS", "LLAMA_URL", "META_DIR")}
        env.update({"HOST": "127.0.0.1", "PORT": str(self.port), **settings})
        self._start(list(command) if command else [sys.executable, "-m", "lpcache"], env, timeout)


class RedisServer(_Process):
    """A real redis-server (Debian's package; `.ci/run` installs it) on a free loopback port, with its data in a
    folder of its own, for the scale-out tests. `restart()` starts it again on the same port: with `persist`, from
    what it saved at shutdown (a Redis restart); without, empty (a Redis that lost its data)."""

    name = "redis-server"

    def __init__(self, *, persist: bool = False, timeout: float = 30.0) -> None:
        super().__init__()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(binary):
            raise RuntimeError("redis-server is not installed: apt-get install redis-server (Debian's package)")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.folder = tempfile.mkdtemp(prefix="redis-")
        self.argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.folder,
                     "--save", "3600 1" if persist else "", "--appendonly", "no", "--protected-mode", "no"]
        self.timeout = timeout
        self._start(self.argv, None, timeout)

    def _wait_ready(self, timeout: float) -> None:
        """Until it answers PING (Redis speaks no HTTP); fail early if it died."""

        def pong() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")

        wait_ready(pong, f"port {self.port}", timeout, self.process, self.name)

    def restart(self) -> None:
        self.stop()
        self._start(self.argv, None, self.timeout)

    def kill(self) -> None:
        """Gone at once, as a crash (SIGKILL): nothing saved."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def scratch_dir(prefix: str) -> str:
    """A fresh folder under the system temp dir (the caller removes it with `remove_tree`)."""
    return tempfile.mkdtemp(prefix=prefix)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


_WORDS = (
    "the a an old young quiet bright dark river mountain city village road forest garden tower bridge harbor "
    "lantern letter map key door window stone fire rain wind snow morning evening night winter summer "
    "captain merchant teacher doctor painter sailor farmer child sister brother friend stranger king queen "
    "walked waited listened carried opened closed found lost remembered wrote watched followed crossed built "
    "slowly carefully softly suddenly again together alone before after beyond under across through "
    "and but because while when until although so then yet"
).split()


def story(seed: int, n_words: int) -> str:
    """Deterministic filler prose of `n_words` words: the same seed gives the same text on every machine."""
    state = seed * 2654435761 % 2**32 or 1
    out = []
    for i in range(n_words):
        state = (1103515245 * state + 12345) % 2**31
        out.append(_WORDS[state % len(_WORDS)])
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


@dataclass
class ChatResult:
    """One chat completion as a client saw it: status, headers, answer text, usage, timings, time to first token
    (streams), and the raw bytes."""

    status: int
    headers: dict[str, str]
    raw: bytes
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    ttft: float | None = None
    seconds: float = 0.0

    @property
    def cache_n(self) -> int:
        return int(self.timings.get("cache_n", -1))

    @property
    def prompt_n(self) -> int:
        return int(self.timings.get("prompt_n", -1))

    def json(self) -> Any:
        return orjson.loads(self.raw)


def chat(url: str, messages: list[dict[str, Any]], *, stream: bool = False, max_tokens: int = 32,
         timeout: float = 600.0, headers: Mapping[str, str] | None = None, **extra: Any) -> ChatResult:
    """POST /v1/chat/completions at temperature 0 with the standard library only (no client of lpcache's own)."""
    body = {"model": "llama.cpp", "messages": messages, "stream": stream, "max_tokens": max_tokens,
            "temperature": 0, **extra}
    request = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    started = time.perf_counter()
    try:
        resp = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        return ChatResult(e.code, dict(e.headers.items()), e.read(), seconds=time.perf_counter() - started)
    with resp:
        result = ChatResult(resp.status, dict(resp.headers.items()), b"")
        if not stream:
            result.raw = resp.read()
            doc = orjson.loads(result.raw)
            result.text = doc["choices"][0]["message"].get("content") or ""
            result.usage, result.timings = doc.get("usage") or {}, doc.get("timings") or {}
        else:
            buf = bytearray()
            parts: list[str] = []
            for line in resp:
                buf += line
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                doc = orjson.loads(line[6:])
                for choice in doc.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - started
                        parts.append(piece)
                result.usage = doc.get("usage") or result.usage
                result.timings = doc.get("timings") or result.timings
            result.raw, result.text = bytes(buf), "".join(parts)
    result.seconds = time.perf_counter() - started
    return result
