"""The source package and the wheel, as `python -m build` makes them (the wheel built from the sdist, so the sdist is
proven complete): twine accepts both, they hold the license, the wheel holds every module and data file of the
package, their metadata say what pyproject.toml says, and the wheel installed alone in a fresh virtualenv starts and
serves in front of the stand-in llama-server, its dashboard page included, with the version it was built as."""

from __future__ import annotations

import email
import email.message
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import lpcache
from lpcache.workloads.harness import REPO, LpcacheProcess, MockProcess
from tests.packaging.conftest import user_env

pytestmark = pytest.mark.packaging

NAME = f"lpcache-{lpcache.__version__}"
SOURCE_FILES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "lpcache").rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    assert r.returncode == 0, f"{argv} exited {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)])
    built = {p.name: p for p in out.iterdir()}
    assert sorted(built) == [f"{NAME}-py3-none-any.whl", f"{NAME}.tar.gz"]
    yield {"wheel": built[f"{NAME}-py3-none-any.whl"], "sdist": built[f"{NAME}.tar.gz"]}


def test_twine_accepts_both(dist: dict[str, Path]) -> None:
    r = run([sys.executable, "-m", "twine", "check", "--strict", str(dist["sdist"]), str(dist["wheel"])])
    assert r.stdout.count("PASSED") == 2, r.stdout


def test_the_wheel_holds_the_package_and_the_license(dist: dict[str, Path]) -> None:
    names = zipfile.ZipFile(dist["wheel"]).namelist()
    package = sorted(n for n in names if n.startswith("lpcache/"))
    assert package == SOURCE_FILES       # every module and data file (dashboard_page.html), nothing else
    assert "lpcache/plugins/dashboard_page.html" in package
    info = f"lpcache-{lpcache.__version__}.dist-info"
    assert zipfile.ZipFile(dist["wheel"]).read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
    assert b"lpcache = lpcache.edge.cli:main" in zipfile.ZipFile(dist["wheel"]).read(f"{info}/entry_points.txt")


def test_the_sdist_holds_the_source_the_license_and_the_tests(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as tar:
        names = {n.removeprefix(f"{NAME}/") for n in tar.getnames()}
        license_file = tar.extractfile(f"{NAME}/LICENSE")
        assert license_file is not None and license_file.read() == (REPO / "LICENSE").read_bytes()
    assert {"pyproject.toml", "README.md", "LICENSE", "Makefile", "deploy/Dockerfile"} <= names
    assert set(SOURCE_FILES) <= names
    assert "tests/packaging/test_dist.py" in names


def metadata(dist: dict[str, Path]) -> email.message.Message:
    text = zipfile.ZipFile(dist["wheel"]).read(f"lpcache-{lpcache.__version__}.dist-info/METADATA")
    return email.message_from_bytes(text)


def test_the_metadata_say_what_pyproject_says(dist: dict[str, Path]) -> None:
    meta = metadata(dist)
    assert meta["Name"] == "lpcache" and meta["Version"] == lpcache.__version__
    assert meta["License-Expression"] == "MIT" and meta["License-File"] == "LICENSE"
    assert meta["Requires-Python"] == ">=3.11"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL", []))
    assert set(urls) == {"Homepage", "Repository", "Documentation", "Issues"}
    assert all(u.startswith("https://github.com/lpcache/lpcache") for u in urls.values())
    assert "Programming Language :: Python :: 3.11" in meta.get_all("Classifier", [])
    assert meta["Keywords"] and "llama.cpp" in meta["Keywords"].split(",")


def healthcheck_argv() -> list[str]:
    """deploy/Dockerfile's HEALTHCHECK command (exec form)."""
    text = (REPO / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    match = re.search(r"^HEALTHCHECK .*? CMD (\[.*\])$", text, re.MULTILINE)
    assert match, "deploy/Dockerfile has no HEALTHCHECK in exec form"
    argv: list[str] = json.loads(match.group(1))
    return argv


def test_the_wheel_alone_in_a_fresh_virtualenv_serves(dist: dict[str, Path], tmp_path: Path) -> None:
    env = user_env(tmp_path / "home")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], env=env)
    run([str(venv / "bin" / "pip"), "install", "--quiet", str(dist["wheel"])], env=env)
    # the package comes from the virtualenv, not from this checkout
    where = run([str(venv / "bin" / "python"), "-c", "import lpcache; print(lpcache.__file__)"], cwd=tmp_path, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv)
    assert run([str(venv / "bin" / "lpcache"), "-V"], env=env).stdout == f"lpcache {lpcache.__version__}\n"

    slots = tmp_path / "slots"
    slots.mkdir()
    with MockProcess(str(slots)) as mock, LpcacheProcess(
            {"LLAMA_URL": mock.url, "SLOT_SAVE_PATH": str(slots), "META_DIR": str(tmp_path / "meta"),
             "PLUGINS": '[{"name": "dashboard"}]'}, command=[str(venv / "bin" / "lpcache")]) as proxy:
        health = httpx.get(f"{proxy.url}/health").json()
        assert health["status"] == "ok" and health["version"] == lpcache.__version__
        assert f"app_start version={lpcache.__version__} " in proxy.log_text()
        page = httpx.get(f"{proxy.url}/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<html" in page.text and '"dashboard/api/stats"' in page.text   # the packaged page, filled in
        assert httpx.get(f"{proxy.url}/dashboard/api/stats").status_code == 200
        chat = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]

        # the image's health check, with the wheel's Python: 0 while lpcache serves...
        check = healthcheck_argv()
        assert check[0] == "python"
        check[0] = str(venv / "bin" / "python")
        assert subprocess.run(check, env={**env, "PORT": str(proxy.port)}, capture_output=True).returncode == 0
        proxy.stop()
        # ... and not once it is gone
        assert subprocess.run(check, env={**env, "PORT": str(proxy.port)}, capture_output=True).returncode == 1
