"""The package's shape: imports only go downward, no circle, no private name crosses a module, and
no function grows past what one reading holds. Reads the source; imports nothing of helpers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "helpers"

# Lowest first: the rooms of the house, one sub-package per task. A module may import from its own
# package or any package below, never above.
LAYERS = [
    {"core"},
    {"estimator"},
    {"leaks"},
    {"oom"},
    {"monitoring"},
    {"placement"},
    {"loading"},
    {"training"},
    {"evaluation"},
    {"panels"},
    {"environment", "testing"},
    {"cli", "__main__", "__init__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    """Dotted name inside helpers (``estimator.core``) -> file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _top(dotted: str) -> str:
    return dotted.split(".", 1)[0]


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported helpers module, names taken from it, line) for every import, module level or not."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if not target:  # from . import x
                out += [(a.name, [], node.lineno) for a in node.names]
            else:
                out.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("helpers."):
            out.append((node.module.removeprefix("helpers."), [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [
                (a.name.removeprefix("helpers."), [], node.lineno) for a in node.names if a.name.startswith("helpers.")
            ]
    return out


def test_every_module_has_a_layer():
    missing = sorted({_top(m) for m in _modules()} - set(RANK))
    assert not missing, f"add these modules to LAYERS in tests/test_layers.py: {missing}"


def test_imports_only_go_downward():
    upward = []
    for name, path in _modules().items():
        for target, _, line in _imports(name, path):
            if _top(target) != _top(name) and RANK.get(_top(target), -1) > RANK[_top(name)]:
                upward.append(f"helpers/{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    modules = _modules()
    for name, path in modules.items():
        graph[name] = {t for t, _, _ in _imports(name, path) if t in modules and t != name}
    # a package imports its own modules to re-export them: only the other direction can make a circle
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name == _top(t) and "." in t)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_no_private_name_crosses_modules():
    crossing = []
    for name, path in _modules().items():
        for target, names, line in _imports(name, path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                crossing.append(f"helpers/{path.relative_to(PACKAGE)}:{line} imports {private} from {target}")
    assert not crossing, "\n".join(crossing)


# IPython finds an extension's hooks by these names in each module it loads (%load_ext helpers.oom.hook)
PROTOCOL_NAMES = {"load_ipython_extension", "unload_ipython_extension"}


def test_no_public_name_is_defined_twice():
    homes: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not node.name.startswith("_") and node.name not in PROTOCOL_NAMES:
                    homes.setdefault(node.name, []).append(name)
    twice = {n: where for n, where in homes.items() if len(where) > 1}
    assert not twice, f"one home per public name (rename one, or import it from the other): {twice}"


def test_no_function_is_longer_than_one_reading():
    long = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"helpers/{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_the_checker_sees_a_planted_upward_import_and_cycle(tmp_path):
    pkg = tmp_path / "helpers"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "units.py").write_text("from ..cli import main\nfrom .html import _private\n")
    (pkg / "cli.py").write_text("from .core.units import x\n")
    (pkg / "core" / "html.py").write_text("_private = 1\n")
    globals()["PACKAGE"], saved = pkg, PACKAGE
    try:
        with pytest.raises(AssertionError, match="units.py:1 imports cli"):
            test_imports_only_go_downward()
        with pytest.raises(pytest.fail.Exception, match="import cycle"):
            test_no_import_cycle()
        with pytest.raises(AssertionError, match="_private"):
            test_no_private_name_crosses_modules()
    finally:
        globals()["PACKAGE"] = saved


def test_the_architecture_page_lists_every_module():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = sorted(m for m in RANK if f"`{m}`" not in page and f"`{m}/`" not in page)
    assert not missing, f"docs/architecture.md does not mention {missing}"
