"""What the packaging tests share: the environment of a user with a home of their own (so pipx, uv and the README's
`$HOME/...` lines write only into the test's folder, and no lpcache but the one just installed is on `PATH`), and
commands run the way a shell runs them, with their output in the failure message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lpcache.config import OPTIONS

# Variables that would send a user's install elsewhere or change what lpcache starts with; a user who follows the
# README has none of them set.
_DROPPED_PREFIXES = ("XDG_", "PIPX_", "UV_", "VIRTUAL_ENV", "PYTHONPATH", "MAKE", "MFLAGS")
_LPCACHE_SETTINGS = {o.env for o in OPTIONS}


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def user_env(home: Path) -> dict[str, str]:
    """The environment of a user whose home is `home`: `~/.local/bin` (where pipx and uv put commands) first on
    PATH, then pipx and uv, then the PATH of this run without any folder that holds an `lpcache` (the development
    virtualenv's). The download caches stay the machine's, so nothing is fetched twice."""
    tools = home / ".tools"
    tools.mkdir(parents=True, exist_ok=True)
    for name in ("pipx", "uv"):
        link = tools / name
        if not link.exists():
            link.symlink_to(Path(sys.executable).parent / name)
    path = [str(home / ".local" / "bin"), str(tools)]
    path += [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "lpcache").exists()]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_DROPPED_PREFIXES) and k not in _LPCACHE_SETTINGS}
    env.update({
        "HOME": str(home),
        "PATH": os.pathsep.join(path),
        "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR") or str(_cache_home() / "pip"),
        "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR") or str(_cache_home() / "uv"),
        "UV_PYTHON_DOWNLOADS": "never",   # the machine's Python 3.11, never one uv would fetch
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })
    return env


def sh(script: str, env: dict[str, str], cwd: Path, timeout: float = 600) -> str:
    """Run `script` with bash, stopping at the first failing command; its standard output, or a failure that shows
    what it printed."""
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"`{script}` exited {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    return r.stdout
