"""The README's install section and quick start run as they are written, so they cannot drift.

Each `sh` block of "## Install" runs with bash, as a new user would paste it (a home of its own, no lpcache on PATH
before), in the checkout, and must end by printing this package's version; its container block is run by
test_image.py where a Docker daemon is. The quick start runs in front of the stand-in llama-server instead of a real
one, started with the slot count, context and slot folder that step 1's llama-server line gives; the only change to
the lines is the two ports, 8080 and 8081, replaced by free ones (other tests may hold those on this machine)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import orjson
import pytest

import lpcache
from lpcache.config import OPTIONS
from lpcache.workloads.harness import REPO, MockProcess, free_port, wait_healthy
from tests.packaging.conftest import sh, user_env
from tests.unit.test_docs import section

pytestmark = pytest.mark.packaging

README = (REPO / "README.md").read_text()
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(heading: str) -> list[str]:
    return SH_BLOCK.findall(section(README, heading))


def commands(block: str) -> list[str]:
    """The block's command lines, each with its continuation lines joined and its comment left on."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ---- ## Install ----

INSTALL = blocks("## Install")
# Each way of installing, by the command that starts its block; the container block is test_image.py's.
WAYS = {"pipx", "uv", "make"}


def test_every_install_block_is_run_by_a_test() -> None:
    starts = [commands(b)[0].split()[0] for b in INSTALL]
    assert sorted(starts) == sorted([*WAYS, "docker"]), starts


@pytest.mark.parametrize("block", [b for b in INSTALL if commands(b)[0].split()[0] in WAYS],
                         ids=lambda b: commands(b)[0].split()[0])
def test_an_install_block_runs_and_installs_the_lpcache_command(block: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = user_env(home)
    out = sh(block, env, REPO)
    assert out.splitlines()[-1] == f"lpcache {lpcache.__version__}", out
    installed = subprocess.run(["bash", "-c", "command -v lpcache"], env=env, capture_output=True, text=True)
    assert Path(installed.stdout.strip()).parent == home / ".local" / "bin"


# ---- ## Quick start with your own llama-server ----

def test_the_quick_start_runs_in_front_of_the_stand_in(tmp_path: Path) -> None:
    start_llama, install, clients = blocks("## Quick start with your own llama-server")
    home = tmp_path / "home"
    env = user_env(home)

    # 1. llama-server, explicitly -np slots and a slot folder: the folder is made as written, the stand-in takes the
    # server's place with the same slots, context per slot and folder.
    mkdir, llama = commands(start_llama)
    sh(mkdir, env, home.parent)
    argv = [word.replace("$HOME", str(home)) for word in shlex.split(llama.split("#")[0])]
    assert argv[0] == "llama-server"
    n_slots, ctx, folder = int(flag(argv, "-np")), int(flag(argv, "-c")), flag(argv, "--slot-save-path")
    assert Path(folder).is_dir()
    llama_port = flag(argv, "--port")

    # 2. lpcache installed with pip into a virtualenv of its own, in this checkout, then started with the README's
    # line (its llama-server URL pointing at the stand-in), from a folder of its own for ./kv_meta.
    *install_lines, serve = commands(install)
    for line in install_lines:
        sh(line, env, REPO)
    assert f"http://127.0.0.1:{llama_port}" in serve, "lpcache's LLAMA_URL names step 1's llama-server"
    port = {o.env: o.default for o in OPTIONS}["PORT"]
    assert port == "8081" and "0.0.0.0:8081" in README
    work = home / "work"
    work.mkdir()
    with MockProcess(folder, n_slots=n_slots, extra=["--n-ctx", str(ctx // n_slots)]) as mock:
        serve = serve.replace(f"127.0.0.1:{llama_port}", f"127.0.0.1:{mock.port}")
        lpcache_port = free_port()
        log_path = tmp_path / "lpcache.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(["bash", "-c", serve], cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                       env={**env, "PORT": str(lpcache_port), "HOST": "127.0.0.1"},
                                       start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{lpcache_port}/health", 60, process, "the quick start's lpcache")
            log_text = log_path.read_text()
            assert f"backend_slots url={mock.url} total_slots={n_slots} (from /props)" in log_text, log_text
            assert f"app_start version={lpcache.__version__} " in log_text, log_text
            assert " big_threshold_words=auto " in log_text, "the quick start's lpcache runs BIG_THRESHOLD_WORDS=auto"
            assert (work / "kv_meta").is_dir()

            # 3. the clients' lines, to lpcache's port.
            health, chat = commands(clients)
            health_out = sh(health.replace("127.0.0.1:8081", f"127.0.0.1:{lpcache_port}"), env, work)
            assert orjson.loads(health_out)["status"] == "ok"
            stream = sh(chat.replace("127.0.0.1:8081", f"127.0.0.1:{lpcache_port}"), env, work)
            events = [line[len("data: "):] for line in stream.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", stream
            chunks = [orjson.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), stream
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            status = process.wait(timeout=60)
    # a clean stop (uvicorn ends by the signal it was stopped with, after its shutdown)
    assert status in (0, -signal.SIGTERM) and "app_stop" in log_path.read_text(), log_path.read_text()
