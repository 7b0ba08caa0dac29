"""The package's shape, as the trust issue asked for it: no import cycle, a short pipeline, and every `/slots` call
made in one module (`swap`), so a slot call is built the same way everywhere (on a router: naming the model)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lpcache"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """The lpcache modules a module imports, inside functions too (a cycle hidden in a function body is a cycle all
    the same); only `if TYPE_CHECKING:` blocks are left out (annotations, never run). `make lint`'s import-linter
    contracts (pyproject.toml) check the same and more."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in _run_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("lpcache"):
                submodules = {f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")}
                if node.module and len(submodules) < len(node.names):   # `from pkg import submodule` needs only
                    found.add(target)                                    # the submodule (and the package's name)
                found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lpcache"))
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _run_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of the module but those under `if TYPE_CHECKING:`."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def test_no_import_cycle_in_the_package() -> None:
    mods = modules()
    graph = {m: {i for i in imports(m, p) if i in mods and i != m} for m, p in mods.items()}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(m):], m]))
        if m in done:
            return
        for n in sorted(graph[m]):
            if n == "lpcache" or m == "lpcache":   # the package root re-exports; submodules never import it
                continue
            visit(n, [*stack, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_attempts_does_not_import_the_pipeline() -> None:
    assert "lpcache.flow.pipeline" not in imports("lpcache.flow.attempts", PACKAGE / "flow" / "attempts.py")


def test_the_pipeline_reads_in_one_short_file() -> None:
    assert len((PACKAGE / "flow" / "pipeline.py").read_text().splitlines()) < 250


def test_every_slots_call_is_made_in_swap() -> None:
    """llama.py knows the URLs; swap.py is the only module that calls them (save, restore, erase, GET /slots)."""
    calls = re.compile(r"client\.(slot_action|slot_busy|slots)\(")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name not in ("swap.py", "llama.py") and "mock_llama" not in p.parts
                 and calls.search(p.read_text())]
    assert offenders == []


PROXY = ("edge", "integrations", "plugins", "flow", "fleet", "backends", "apis", "cache", "config")


def test_no_module_of_the_proxy_holds_more_than_600_lines() -> None:
    """A module past 600 lines holds two ideas (issue 22): split it by idea. The stand-in and the workloads are not
    the proxy."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if p.relative_to(PACKAGE).parts[0] in (*PROXY, p.name) and (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_the_package_root_lists_its_layers() -> None:
    """The root shows the layers: subpackages, and beside them only the errors (and the package's own files)."""
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert modules == ["__init__.py", "__main__.py", "errors.py"]
    assert packages == sorted([*PROXY, "mock_llama", "workloads"])


def test_the_proxy_imports_no_old_path_and_not_the_package_root() -> None:
    """import-linter reads `from lpcache import testing` and `import lpcache.demo` as imports of the package root,
    which is in no layer: such an import (an old path of `config.moved`, loading the workloads or the edge at run
    time) must not hide in the proxy."""
    from lpcache.config.moved import MOVED, OLD_NAMES

    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] not in (*PROXY, "errors.py", "__main__.py"):
            continue
        for node in _run_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path.name, a.name) for a in node.names
                          if a.name.removeprefix("lpcache.") in MOVED or a.name == "lpcache"]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                short = node.module.removeprefix("lpcache.")
                if node.module == "lpcache" or short in MOVED:
                    found.append((path.name, node.module))
                elif short in OLD_NAMES:
                    found += [(path.name, f"{node.module}.{a.name}") for a in node.names
                              if not _is_module(f"{node.module}.{a.name}")]
    assert found == []
