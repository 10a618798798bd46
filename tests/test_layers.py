"""The package's shape: imports only go downward, no circle, no private name crosses a module, and
no function grows past what one reading holds. Reads the source; imports nothing of helpers."""

from __future__ import annotations

import ast
import re
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


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _all_names(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return list(ast.literal_eval(node.value))
    return None


def test_a_module_exports_only_what_it_defines():
    """One import path per name: ``__all__`` lists the module's own names (a lazily built class, made by the
    module's ``__getattr__``, counts as its own); the notebook API's door, ``helpers/__init__.py``, is the
    one module that hands names on."""
    re_exported = []
    for name, path in _modules().items():
        if name == "__init__":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = _top_level_names(tree)
        lazy = "__getattr__" in own
        for exported in _all_names(tree) or []:
            if exported not in own and not lazy:
                re_exported.append(f"helpers/{path.relative_to(PACKAGE)} exports {exported}, defined elsewhere")
    assert not re_exported, "\n".join(re_exported)


def test_a_package_face_holds_only_its_docstring():
    faces = [p for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE]
    assert faces, "no sub-packages found"
    busy = [str(p.relative_to(PACKAGE)) for p in faces
            if [type(n) for n in ast.parse(p.read_text(encoding="utf-8")).body] not in ([], [ast.Expr])]  # fmt: skip
    assert not busy, f"a sub-package's __init__.py holds a docstring only (import from the module itself): {busy}"


def test_the_notebook_api_names_each_home():
    """``helpers.__all__`` maps each name to the module that defines it, never to one that hands it on."""
    src = (PACKAGE / "__init__.py").read_text(encoding="utf-8")
    entries = re.findall(r"dict\.fromkeys\(\s*\[([^\]]*)\],\s*\"([\w.]+)\"\)", src)
    assert len(entries) > 20
    modules = _modules()
    for names, module in entries:
        own = _top_level_names(ast.parse(modules[module].read_text(encoding="utf-8")))
        missing = [n for n in re.findall(r'"(\w+)"', names) if n not in own and "__getattr__" not in own]
        assert not missing, f"{module} does not define {missing}"


WORDS = {"fp32", "fp16", "bf16", "int8", "nf4", "fp4", "float16", "bfloat16", "float32"}


def test_load_mode_and_dtype_words_are_compared_through_the_vocabulary():
    """``x == "bf16"`` outside ``core/vocab.py`` retypes a word the vocabulary owns: compare with its
    constants (``BF16``, ``FP16``, ``FP32``) or ask its rules (``half_dtype``, ``lighter_load``, ``MODES``)."""
    found = []
    for name, path in _modules().items():
        if name == "core.vocab":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                if any(isinstance(i, ast.Constant) and i.value in WORDS for i in items):
                    found.append(f"helpers/{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)


# Figures with one home: (value, the module that owns it). A share of the card such as 0.9 may stand only as
# a module-level constant with a name (TIGHT_FRACTION, BNB_MARGIN...), never as a bare default or operand.
OWNED = {15828320256: "core.devices", 12.7: "core.devices", 768: None}
SHARES = {0.85, 0.9, 0.95}


def test_a_rule_s_figure_is_not_retyped():
    found = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = {id(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and all(isinstance(t, ast.Name) and t.id.isupper() for t in n.targets)}  # fmt: skip
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or type(node.value) not in (int, float):
                continue
            if node.value in OWNED and OWNED[node.value] != name:
                found.append(f"helpers/{path.relative_to(PACKAGE)}:{node.lineno} {node.value}")
            elif node.value in SHARES and id(node) not in named and "cutoff" not in _line(path, node.lineno):
                found.append(f"helpers/{path.relative_to(PACKAGE)}:{node.lineno} bare {node.value}")
    assert not found, "use the named constant of the rule's home:\n" + "\n".join(found)


def _line(path: Path, lineno: int) -> str:
    return path.read_text(encoding="utf-8").splitlines()[lineno - 1]
