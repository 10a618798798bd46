"""The notebooks' install cell: the same in every notebook, quiet, skipped in under a second once oomkit is
installed, installing in Colab and on Kaggle, and naming a file that shadows the `helpers` package."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
import types
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("0*.ipynb"))


def _install_part(path: Path) -> str:
    first = next(c.source for c in nbformat.read(path, 4).cells if c.cell_type == "code")
    return first[: first.index("from helpers import configure_allocator")]


def test_every_notebook_has_the_same_quiet_install_cell():
    cells = {_install_part(p) for p in NOTEBOOKS}
    assert len(cells) == 1
    cell = cells.pop()
    assert '"pip", "install", "-q"' in cell and "%pip" not in cell and "run_line_magic" not in cell
    assert "KAGGLE_KERNEL_RUN_TYPE" in cell and "google.colab" in cell


def _run(monkeypatch, *, colab=False, kaggle=False, installed=True) -> list:
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or types.SimpleNamespace(returncode=0))
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    if kaggle:
        monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    else:
        monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)

    def version(name):
        if not installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.1"

    monkeypatch.setattr(importlib.metadata, "version", version)
    exec(compile(_install_part(NOTEBOOKS[0]), "install-cell", "exec"), {})
    return calls


def test_outside_colab_and_kaggle_nothing_is_installed(monkeypatch):
    assert _run(monkeypatch, installed=False) == []


@pytest.mark.parametrize(("colab", "kaggle"), [(True, False), (False, True)])
def test_in_colab_or_kaggle_it_installs_once(monkeypatch, colab, kaggle):
    calls = _run(monkeypatch, colab=colab, kaggle=kaggle, installed=False)
    assert len(calls) == 1 and calls[0][1:5] == ["-m", "pip", "install", "-q"]
    started = time.perf_counter()
    assert _run(monkeypatch, colab=colab, kaggle=kaggle, installed=True) == []  # installed: skipped
    assert time.perf_counter() - started < 1.0


def test_a_helpers_file_in_the_working_folder_is_named(monkeypatch, tmp_path):
    (tmp_path / "helpers.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "helpers", raising=False)
    with pytest.raises(ImportError, match=r"helpers\.py shadows oomkit's package `helpers`"):
        _run(monkeypatch)


def test_mount_drive_asks_once_and_a_refused_pop_up_goes_on_without_drive(monkeypatch, tmp_path):
    import helpers.core.sources as sources

    asked = []

    class MessageError(Exception):
        pass

    def refuse(mount_point):
        asked.append(mount_point)
        raise MessageError("Error: credential propagation was unsuccessful")

    colab = types.ModuleType("google.colab")
    colab.drive = types.SimpleNamespace(mount=refuse)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setattr(sources, "_DRIVE_ANSWERS", {})
    monkeypatch.chdir(tmp_path)
    first = sources.mount_drive(str(tmp_path / "drive"))
    assert not first.mounted and "MessageError" in str(first) and f"files go to {tmp_path}" in str(first)
    again = sources.mount_drive(str(tmp_path / "drive"))  # the cell rerun: no second pop-up
    assert asked == [str(tmp_path / "drive")] and str(again) == str(first)
    (tmp_path / "drive" / "MyDrive").mkdir(parents=True)
    assert sources.mount_drive(str(tmp_path / "drive")).mounted  # mounted meanwhile: nothing asked
    monkeypatch.delitem(sys.modules, "google.colab")
    assert str(sources.mount_drive()).startswith("not in Colab")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_parameter_is_a_colab_form_field_that_papermill_can_still_override(path):
    import re

    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(path))  # as papermill reads it
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assigned = [line for line in cell.source.splitlines() if re.match(r"[A-Z_][A-Z0-9_]* = ", line)]
    one_line = [line for line in assigned if not line.rstrip().endswith(("[", "{", "("))]
    assert one_line and all(
        re.search(r'  # @param \{type:"(string|integer|number|boolean|raw)"\}$', x) for x in one_line
    )
    name = one_line[0].split(" = ")[0]
    injected = parameterize_notebook(nb, {name: "x"})
    at = next(i for i, c in enumerate(injected.cells) if "injected-parameters" in c.metadata.get("tags", []))
    assert injected.cells[at - 1].source == cell.source and f"{name} = " in injected.cells[at].source
