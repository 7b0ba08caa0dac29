"""Where lpcache 0.1's modules went when the flat package was cut into layers. The old paths keep working for a
while, each use warned about (DeprecationWarning, naming the new path); they go in a later release.

- `import lpcache.app`, `from lpcache.slots import SlotPool` (an old module path of `MOVED`): the module of the new
  path, the very same object; for a module split in several (`slots`, `index`), a module that reads each name from
  the first new module that has it (setting a name on it changes nothing: patch the new module). `python -m` of an
  old path runs the new one.
- `from lpcache.backends import Backend` (`backends`, `edge` and `fleet` were modules and are packages now): the old
  module's names, read from their new modules by the package's `__getattr__` (`old_name`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType
from typing import Any

MOVED: dict[str, tuple[str, ...]] = {
    "app": ("edge.app",), "cli": ("edge.cli",), "browser_login": ("edge.browser_login",), "metrics": ("edge.metrics",),
    "config_doc": ("edge.config_page",), "version": ("config.version",),
    "pipeline": ("flow.pipeline",), "forwarded": ("flow.forwarded",), "attempts": ("flow.attempts",),
    "relay": ("flow.relay",), "coalesce": ("flow.coalesce",), "prefiltering": ("flow.prefiltering",),
    "record": ("flow.record",), "guard": ("flow.guard",), "slot_fill": ("flow.slot_fill", "backends.placement"),
    "saving": ("flow.saving",), "shared_map": ("fleet.shared_map",), "leases": ("fleet.leases",),
    "llama": ("backends.llama",), "router_models": ("backends.router_models",),
    "slots": ("backends.slots", "backends.placement", "backends.slot_pool"),
    "slot_truth": ("backends.slot_truth",), "swap": ("backends.swap",),
    "index": ("cache.index", "cache.meta_files", "cache.index_limits"), "prefix": ("cache.prefix",),
    "identity": ("cache.identity",), "cache_files": ("cache.cache_files",), "eviction": ("cache.eviction",),
    "reuse": ("cache.reuse",), "server_cache": ("cache.server_cache",), "sessions": ("cache.sessions",),
    "session_ids": ("cache.session_ids",), "speeds": ("cache.speeds",), "worth": ("cache.worth",),
    "plugins.guard_standin": ("mock_llama.guard_model",),
    "chats": ("workloads.chats",), "agent_texts": ("workloads.agent_texts",), "agents": ("workloads.agents",),
    "workload": ("workloads.story",), "soak": ("workloads.soak",), "testing": ("workloads.harness",),
    "demo": ("workloads.demo",),
}
# The old modules that are packages now, and where their names went.
OLD_NAMES: dict[str, tuple[str, ...]] = {
    "backends": ("backends.backend", "backends.clients"),
    "edge": ("edge.http",),
    "fleet": ("fleet.replica", "fleet.publishing", "fleet.slot_state", "fleet.shared_map"),
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} is now {new}; the old path goes in a later lpcache release", DeprecationWarning,
                  stacklevel=stacklevel)


def old_name(package: str, name: str) -> Any:
    """A name of the old module `package` (`lpcache.backends`...) read from where it went; AttributeError else. A
    package's `__getattr__`: never for a submodule's name (`from lpcache.backends import swap` imports it)."""
    short = package.removeprefix("lpcache.")
    if short in OLD_NAMES and not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is None:
        for new in OLD_NAMES[short]:
            module = importlib.import_module("lpcache." + new)
            if name in vars(module):
                _warn(f"{package}.{name}", f"lpcache.{new}.{name}", stacklevel=3)
                return vars(module)[name]
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of `MOVED` (only those, and only once the package's own files did not have it: it is
    the last finder) and loads it as its new module: imported, or run by `python -m`."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("lpcache.") or name.removeprefix("lpcache.") not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        news = ["lpcache." + n for n in MOVED[spec.name.removeprefix("lpcache.")]]
        _warn(spec.name, " and ".join(news), stacklevel=2)
        modules = [importlib.import_module(n) for n in news]
        if len(modules) == 1:
            spec.loader_state = modules[0].__spec__   # the import system sets the old path's spec on it: given back
            return modules[0]
        union = ModuleType(spec.name, f"lpcache 0.1's {spec.name}, now {', '.join(news)}.")

        def read(name: str) -> Any:
            for module in modules:
                if name in vars(module):
                    return vars(module)[name]
            raise AttributeError(f"module {spec.name!r} has no attribute {name!r}")

        union.__getattr__ = read  # type: ignore[method-assign]
        return union

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        if alias is not None and alias.loader_state is not None:
            module.__spec__ = alias.loader_state

    def get_code(self, name: str) -> CodeType:
        """`python -m lpcache.demo`: runs the new path as `__main__`."""
        new = "lpcache." + MOVED[name.removeprefix("lpcache.")][0]
        said = f"{name} is now {new}; the old path goes in a later lpcache release"
        return compile(f"import runpy, warnings\nwarnings.warn({said!r}, DeprecationWarning)\n"
                       f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n", f"<{name}>", "exec")


def install() -> None:
    """Once per interpreter (a reload of lpcache does not add a second finder)."""
    if not any(type(f).__name__ == MovedModules.__name__ for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
