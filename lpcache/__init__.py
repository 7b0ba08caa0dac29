"""lpcache: a KV-cache-aware, OpenAI-compatible proxy in front of llama.cpp llama-server instances.

The package by layer, each importing only those below it (pyproject.toml's import-linter contracts check it;
docs/architecture.md draws it): `edge` (HTTP server, CLI, metrics) and `integrations` (the LiteLLM hook) on top,
then `plugins`, the request `flow`, the `fleet` of replicas, `backends` (llama-server, its slots) and `apis` (the
generation APIs' shapes), the `cache` (what is saved and where), and `config` and `errors` under all. The stand-in
llama-server (`mock_llama`) and the workload generators (`workloads`) sit beside the proxy, which never imports them.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import CodeType, ModuleType

from lpcache.config import BackendConfig, Settings, __version__, load_settings
from lpcache.edge.app import create_app
from lpcache.errors import ConfigError, LpcacheError, ProxyError

__all__ = ["BackendConfig", "ConfigError", "LpcacheError", "ProxyError", "Settings", "__version__", "create_app",
           "load_settings"]

# Where the modules of lpcache 0.1's flat package went. `import lpcache.app` (and the like) still works, with a
# DeprecationWarning naming the new path, and gives the very module of the new path; so does `python -m lpcache.demo`.
# These names go in a later release. (`lpcache.edge`, `lpcache.fleet` and `lpcache.backends` are packages now.)
MOVED = {
    "app": "edge.app", "cli": "edge.cli", "browser_login": "edge.browser_login", "metrics": "edge.metrics",
    "config_doc": "edge.config_page", "version": "config.version",
    "pipeline": "flow.pipeline", "forwarded": "flow.forwarded", "attempts": "flow.attempts", "relay": "flow.relay",
    "coalesce": "flow.coalesce", "prefiltering": "flow.prefiltering", "record": "flow.record", "guard": "flow.guard",
    "slot_fill": "flow.slot_fill", "saving": "flow.saving", "shared_map": "fleet.shared_map", "leases": "fleet.leases",
    "llama": "backends.llama", "router_models": "backends.router_models", "slots": "backends.slots",
    "slot_truth": "backends.slot_truth", "swap": "backends.swap",
    "index": "cache.index", "prefix": "cache.prefix", "identity": "cache.identity", "cache_files": "cache.cache_files",
    "eviction": "cache.eviction", "reuse": "cache.reuse", "server_cache": "cache.server_cache",
    "sessions": "cache.sessions", "session_ids": "cache.session_ids", "speeds": "cache.speeds", "worth": "cache.worth",
    "plugins.guard_standin": "mock_llama.guard_model",
    "chats": "workloads.chats", "agent_texts": "workloads.agent_texts", "agents": "workloads.agents",
    "workload": "workloads.story", "soak": "workloads.soak", "testing": "workloads.harness", "demo": "workloads.demo",
}


def _new_path(name: str) -> str:
    return "lpcache." + MOVED[name.removeprefix("lpcache.")]


def _moved(name: str) -> str:
    return f"{name} is now {_new_path(name)}; the old path goes in a later lpcache release"


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of `MOVED` (only those, and only once the package's own files did not have it) and
    loads it as the module of its new path: imported, or run by `python -m`."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("lpcache.") or name.removeprefix("lpcache.") not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(_moved(spec.name), DeprecationWarning, stacklevel=2)
        module = importlib.import_module(_new_path(spec.name))
        spec.loader_state = module.__spec__   # the import system sets the old path's spec on it: given back below
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        if alias is not None and alias.loader_state is not None:
            module.__spec__ = alias.loader_state

    def get_code(self, name: str) -> CodeType:
        """`python -m lpcache.demo`: runs the new path as `__main__`."""
        return compile(f"import runpy, warnings\nwarnings.warn({_moved(name)!r}, DeprecationWarning)\n"
                       f"runpy.run_module({_new_path(name)!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{name}>", "exec")


sys.meta_path.append(_MovedModules())
