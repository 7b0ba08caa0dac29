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
from lpcache import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_with_a_deprecation_warning(old: str) -> None:
    sys.modules.pop(f"lpcache.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"lpcache.{old} is now lpcache.{MOVED[old]}"):
        module = importlib.import_module(f"lpcache.{old}")
    new = importlib.import_module(f"lpcache.{MOVED[old]}")
    assert module is new
    assert new.__spec__ is not None and new.__spec__.name == f"lpcache.{MOVED[old]}"   # not the old path's spec


def test_from_an_old_path_import_a_name_gives_the_same_object() -> None:
    sys.modules.pop("lpcache.slots", None)
    with pytest.warns(DeprecationWarning):
        from lpcache.slots import Slot  # type: ignore[import-not-found]
    from lpcache.backends.slots import Slot as new
    assert Slot is new


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


def test_the_stand_in_still_runs_with_python_dash_m() -> None:
    done = subprocess.run([sys.executable, "-m", "lpcache.mock_llama", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr
