"""A real LiteLLM proxy for the tests of lpcache's LiteLLM hook.

`LiteLLMProxy` writes a `config.yaml` (a `model_list`, the `callbacks`) into a folder of its own, starts
`litellm --config ... --port P` from the virtualenv of scripts/get-litellm.sh (outside the checkout, built once),
with the checkout and the given module folder on PYTHONPATH so `lpcache` and a test's own callback module import,
and waits for `/health/readiness`. What LiteLLM needs to start here, found with litellm 1.108.7:

- a master key: without one it refuses to start (`UnsafeMasterKeyError`). The rig makes a random `sk-...` key;
  requests must send `Authorization: Bearer <key>` (`proxy.headers`). No database is needed: the master key is
  checked without one, and `/health/readiness` answers `{"status": "healthy", "db": "Not connected"}`.
- `LITELLM_LOCAL_MODEL_COST_MAP=True`: the model cost map is read from the package instead of fetched from the
  internet at import time (traced with strace: with it, start-up opens no connection at all).
- `LITELLM_MODE=PRODUCTION`: no `.env` file is loaded from the folders above litellm's package or the cwd.

Start-up takes about 20-30 s on 2 cores (importing `litellm.proxy.proxy_server` alone is ~20 s of CPU), so
tests share one proxy per module.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lpcache.workloads.harness import REPO, _Process, remove_tree, scratch_dir, script_paths, wait_healthy

GET_LITELLM = REPO / "scripts" / "get-litellm.sh"

# Inherited variables that would change what the proxy does (a database, another key, a config of its own).
_DROPPED_ENV = ("DATABASE_URL", "DIRECT_URL", "STORE_MODEL_IN_DB", "CONFIG_FILE_PATH", "WORKER_CONFIG", "PYTHONPATH")


def litellm_paths() -> tuple[str, str]:
    """(litellm executable, its Python): from LITELLM_BIN / LITELLM_PYTHON, else from scripts/get-litellm.sh,
    which makes and caches the virtualenv outside the checkout on first use (about a minute)."""
    binary, python = script_paths(GET_LITELLM, "LITELLM_BIN", "LITELLM_PYTHON")
    return binary, python


class LiteLLMProxy(_Process):
    """`litellm --config <folder>/config.yaml` on a free port of 127.0.0.1, started on construction.

    - `model_list`: the entries of LiteLLM's `model_list` (model_name, litellm_params, model_info).
    - `callbacks`: `litellm_settings.callbacks`, e.g. "lpcache.integrations.litellm.proxy_handler_instance".
    - `modules`: {module name: source} written to `<folder>/modules`, which is on PYTHONPATH (before the checkout).
    - `env`: added to (and overriding) the environment the rig gives the proxy.
    - `folder`: where config, modules and the proxy's cwd go; a fresh one (removed by `stop()`) if not given.
    """

    name = "litellm"
    health_path = "/health/readiness"  # public: no key, no database

    def __init__(self, model_list: Sequence[Mapping[str, Any]], *, callbacks: str | Sequence[str] | None = None,
                 modules: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
                 litellm_settings: Mapping[str, Any] | None = None,
                 general_settings: Mapping[str, Any] | None = None, router_settings: Mapping[str, Any] | None = None,
                 folder: str | os.PathLike[str] | None = None, timeout: float = 240.0) -> None:
        super().__init__()
        self.owns_folder = folder is None
        self.folder = Path(folder if folder is not None else scratch_dir("litellm-"))
        self.module_dir = self.folder / "modules"
        self.module_dir.mkdir(parents=True, exist_ok=True)
        for module, source in (modules or {}).items():
            (self.module_dir / f"{module}.py").write_text(source)
        self.master_key = "sk-" + secrets.token_hex(32)
        self.headers = {"Authorization": f"Bearer {self.master_key}"}

        settings = dict(litellm_settings or {})
        if callbacks is not None:
            settings["callbacks"] = callbacks if isinstance(callbacks, str) else list(callbacks)
        config: dict[str, Any] = {"model_list": [dict(m) for m in model_list]}
        if settings:
            config["litellm_settings"] = settings
        if general_settings:
            config["general_settings"] = dict(general_settings)
        if router_settings:
            config["router_settings"] = dict(router_settings)
        self.config = config
        self.config_path = self.folder / "config.yaml"
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML

        binary, self.python = litellm_paths()
        proxy_env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV and not k.startswith("LITELLM_")}
        proxy_env.update({
            "PYTHONPATH": os.pathsep.join([str(self.module_dir), str(REPO)]),
            "LITELLM_MASTER_KEY": self.master_key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_MODE": "PRODUCTION",
            "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        })
        self.env = proxy_env
        argv = [binary, "--config", str(self.config_path), "--host", "127.0.0.1", "--port", str(self.port)]
        started = time.monotonic()
        self._start_in(argv, proxy_env, timeout)
        self.startup_seconds = time.monotonic() - started

    def _start_in(self, argv: Sequence[str], env: Mapping[str, str], timeout: float) -> None:
        """`_Process._start` with the folder as the working directory."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                                            cwd=self.folder)
        try:
            wait_healthy(self.url + self.health_path, timeout, self.process, self.name)
        except BaseException:
            self.stop()
            raise RuntimeError(f"{self.name} failed to start; its log:\n{self.log_tail(60)}") from None

    def log_lines(self, containing: str) -> list[str]:
        return [line for line in self.log_text().splitlines() if containing in line]

    def stop(self) -> None:
        super().stop()
        if self.owns_folder:
            remove_tree(str(self.folder))


def route(model_name: str, model: str, api_base: str, *, api_key: str = "none",
          model_info: Mapping[str, Any] | None = None, **params: Any) -> dict[str, Any]:
    """One `model_list` entry, e.g. route("*", "openai/*", mock.url + "/v1", model_info={"slot_cache": True})."""
    entry: dict[str, Any] = {"model_name": model_name,
                             "litellm_params": {"model": model, "api_base": api_base, "api_key": api_key, **params}}
    if model_info is not None:
        entry["model_info"] = dict(model_info)
    return entry


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []

