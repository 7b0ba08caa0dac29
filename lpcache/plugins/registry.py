"""From PLUGINS specs to ready plugins: built-ins by name, third-party ones by the `lpcache.plugins` entry-point
group (a package declares `[project.entry-points."lpcache.plugins"] my_filter = "my_pkg:MyFilter"`, where the
object is a Plugin subclass or any callable taking the params dict and returning a Plugin).

`chain` is a prefilter spec whose `params.plugins` lists further specs, run in order. An unknown name, a bad
parameter or a second `dashboard` raises PluginError, which stops start-up naming it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from lpcache.plugins.base import Factory, Observer, Plugin, PluginError, Prefilter, Routes

ENTRY_POINT_GROUP = "lpcache.plugins"

BUILTINS = {
    "keyword": "lpcache.plugins.keyword:KeywordPrefilter",
    "qwen_guard": "lpcache.plugins.qwen_guard:QwenGuardPrefilter",
    "result_cache": "lpcache.plugins.result_cache:ResultCachePrefilter",
    "request_log": "lpcache.plugins.request_log:RequestLog",
    "dashboard": "lpcache.plugins.dashboard:Dashboard",
}
SINGLE = ("dashboard", "request_log")   # at most one of each


@dataclass
class Loaded:
    """The plugins of a run, by role; `all` in spec order (for start and stop)."""

    all: list[Plugin] = field(default_factory=list)
    prefilters: list[Prefilter] = field(default_factory=list)
    observers: list[Observer] = field(default_factory=list)
    routes: list[Routes] = field(default_factory=list)


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def factories() -> dict[str, Factory]:
    """Every plugin name lpcache can build: the built-ins, then installed entry points (which may not shadow a
    built-in)."""
    found: dict[str, Any] = {name: target for name, target in BUILTINS.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found and ep.name != "chain":
            found[ep.name] = ep
    return found


def build(specs: Sequence[Mapping[str, Any]], available: Mapping[str, Any] | None = None) -> Loaded:
    """Instantiate every spec (params checked by each plugin's constructor)."""
    available = factories() if available is None else available
    names = [spec.get("name") for spec in _walk(specs)]
    for name in SINGLE:
        if names.count(name) > 1:
            raise PluginError(f"plugin {name!r} may be listed only once")
    loaded = Loaded()
    for plugin in _flatten(specs, available):
        loaded.all.append(plugin)
        if isinstance(plugin, Prefilter):
            loaded.prefilters.append(plugin)
        if isinstance(plugin, Observer):
            loaded.observers.append(plugin)
        if isinstance(plugin, Routes):
            loaded.routes.append(plugin)
    return loaded


def _walk(specs: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    """Every spec, chains opened (shapes are checked later, by `_flatten`)."""
    for spec in specs:
        params = spec.get("params") if isinstance(spec, Mapping) else None
        if isinstance(spec, Mapping) and spec.get("name") == "chain" and isinstance(params, Mapping) \
                and isinstance(params.get("plugins"), list):
            yield from _walk(s for s in params["plugins"] if isinstance(s, Mapping))
        elif isinstance(spec, Mapping):
            yield spec


def _flatten(specs: Iterable[Mapping[str, Any]], available: Mapping[str, Any]) -> Iterable[Plugin]:
    for spec in specs:
        name, params = spec.get("name"), spec.get("params") or {}
        if not isinstance(name, str) or not isinstance(params, Mapping):
            raise PluginError(f'a plugin spec needs a "name" string and a "params" object: {dict(spec)!r}')
        if name == "chain":
            inner = params.get("plugins", [])
            if not isinstance(inner, list) or not all(isinstance(s, Mapping) for s in inner):
                raise PluginError('plugin "chain": parameter "plugins" must be an array of plugin specs')
            yield from _flatten(inner, available)
            continue
        if name not in available:
            raise PluginError(f"unknown plugin {name!r} (known: {', '.join(sorted([*available, 'chain']))})")
        target = available[name]
        try:
            factory = _load(target) if isinstance(target, str) else target.load() if hasattr(target, "load") \
                else target
            plugin = factory(dict(params))
        except PluginError:
            raise
        except (ImportError, AttributeError) as e:
            raise PluginError(f"plugin {name!r} cannot be loaded: {e}") from e
        except (TypeError, ValueError) as e:
            raise PluginError(f"plugin {name!r}: {e}") from e
        if not isinstance(plugin, Plugin):
            raise PluginError(f"plugin {name!r} did not build a lpcache Plugin (got {type(plugin).__name__})")
        if not plugin.name:
            plugin.name = name  # type: ignore[misc]
        yield plugin
