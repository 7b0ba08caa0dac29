"""Import paths users rely on keep working after the package was cut into layers (issue 22): the public ones as they
are, the flat package's old module paths with a DeprecationWarning, as the very module of the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from importlib.metadata import entry_points

import pytest

import lpcache
from lpcache.config.moved import MOVED, MovedModules


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_gives_its_new_module_with_a_deprecation_warning(old: str) -> None:
    sys.modules.pop(f"lpcache.{old}", None)
    news = [importlib.import_module(f"lpcache.{new}") for new in MOVED[old]]
    with pytest.warns(DeprecationWarning, match=f"lpcache.{old} is now lpcache.{MOVED[old][0]}"):
        module = importlib.import_module(f"lpcache.{old}")
    if len(news) == 1:
        assert module is news[0]
        assert module.__spec__ is not None and module.__spec__.name == f"lpcache.{MOVED[old][0]}"   # not the old's
    # every public name of every part, read through the old path from the first part that has it
    public = {name for new in news for name in vars(new) if not name.startswith("_")}
    for name in public:
        first = next(new for new in news if name in vars(new))
        assert getattr(module, name) is vars(first)[name], name


def test_names_of_a_split_module_are_read_through_its_old_path() -> None:
    from lpcache.backends.placement import Want, choose
    from lpcache.backends.slot_pool import SlotPool
    from lpcache.backends.slots import Slot
    from lpcache.cache.index_limits import GHOSTS_MIN
    from lpcache.cache.meta_files import write_atomic
    for name in ("lpcache.slots", "lpcache.index"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning):
        from lpcache.index import GHOSTS_MIN as old_ghosts  # type: ignore[import-not-found]
        from lpcache.index import write_atomic as old_write  # type: ignore[import-not-found]
        from lpcache.slots import Slot as old_slot  # type: ignore[import-not-found]
        from lpcache.slots import SlotPool as old_pool  # type: ignore[import-not-found]
        from lpcache.slots import Want as old_want  # type: ignore[import-not-found]
        from lpcache.slots import choose as old_choose  # type: ignore[import-not-found]
    assert (old_slot, old_pool, old_want, old_choose) == (Slot, SlotPool, Want, choose)
    assert (old_ghosts, old_write) == (GHOSTS_MIN, write_atomic)
    with pytest.raises(ImportError):
        from lpcache.slots import no_such_name  # type: ignore[import-not-found]  # noqa: F401


def test_a_module_that_became_a_package_still_gives_its_old_names() -> None:
    from lpcache.backends.backend import Backend
    from lpcache.edge.http import server_options
    from lpcache.fleet.replica import Fleet
    from lpcache.fleet.shared_map import CALL_TIMEOUT
    from lpcache.fleet.slot_state import content_doc
    with pytest.warns(DeprecationWarning, match="lpcache.backends.Backend is now lpcache.backends.backend.Backend"):
        from lpcache.backends import Backend as old_backend
    with pytest.warns(DeprecationWarning):
        from lpcache.edge import server_options as old_options
    with pytest.warns(DeprecationWarning):
        from lpcache.fleet import CALL_TIMEOUT as old_timeout
        from lpcache.fleet import Fleet as old_fleet
        from lpcache.fleet import content_doc as old_doc
    assert (old_backend, old_options, old_fleet, old_timeout, old_doc) == (Backend, server_options, Fleet,
                                                                           CALL_TIMEOUT, content_doc)
    with warnings.catch_warnings():   # a submodule is imported as such, unwarned
        warnings.simplefilter("error")
        from lpcache.backends import swap
    assert swap.__name__ == "lpcache.backends.swap"
    with pytest.raises(ImportError):
        from lpcache.fleet import no_such_name  # noqa: F401


def test_a_reload_of_the_package_adds_no_second_finder() -> None:
    importlib.reload(lpcache)
    assert sum(type(f).__name__ == MovedModules.__name__ for f in sys.meta_path) == 1


def test_the_public_paths_import_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from lpcache.flow import plugin_api
        from lpcache.integrations.litellm import proxy_handler_instance
        from lpcache.plugins import Prefilter, base
    assert base.Prefilter is Prefilter is plugin_api.Prefilter
    assert all(getattr(base, name) is getattr(plugin_api, name) for name in base.__all__)
    assert proxy_handler_instance is not None
    assert lpcache.create_app.__module__ == "lpcache.edge.app"


def test_the_console_script_names_the_cli() -> None:
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "lpcache"]
    from lpcache.edge.cli import main
    assert script.load() is main


def test_an_old_path_still_runs_with_python_dash_m() -> None:
    old = subprocess.run([sys.executable, "-m", "lpcache.config_doc"], capture_output=True, text=True, timeout=60)
    new = subprocess.run([sys.executable, "-m", "lpcache.edge.config_page"], capture_output=True, text=True,
                         timeout=60)
    assert old.returncode == new.returncode == 0, old.stderr
    assert old.stdout == new.stdout and new.stdout.startswith("# Configuration")
    assert "lpcache.config_doc is now lpcache.edge.config_page" in old.stderr
    assert "DeprecationWarning" not in new.stderr


def test_the_harness_finds_the_checkout() -> None:
    from lpcache.workloads.harness import GET_LLAMA, REPO
    assert (REPO / "pyproject.toml").is_file() and GET_LLAMA.is_file()


def test_the_stand_in_still_runs_with_python_dash_m() -> None:
    done = subprocess.run([sys.executable, "-m", "lpcache.mock_llama", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr
