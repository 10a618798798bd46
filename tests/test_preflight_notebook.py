"""Notebook 00's cells, run in this process, for a model whose config cannot be read (offline, not shipped)."""

from __future__ import annotations

import nbformat
import run_notebooks
from huggingface_hub import constants as hub_constants

NOTEBOOK = run_notebooks.NOTEBOOKS / "00_preflight.ipynb"


def run_cells(shell, model: str) -> None:
    """Every code cell in order, the parameters cell replaced by ``model``; fails on the first cell that raises."""
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    cells[1] = f"MODEL = {model!r}\nLOAD = 'auto'\nMAX_NEW_TOKENS = 64"
    try:
        for i, source in enumerate(cells):
            result = shell.run_cell(source)
            assert result.error_in_exec is None, f"cell {i} raised {result.error_in_exec!r}"
    finally:
        shell.run_cell("%unload_ext helpers")


def test_an_unshipped_hub_id_offline_says_how_to_give_a_config_instead_of_a_key_error(
    ipython_shell, monkeypatch, capsys
):
    # Offline, a hub id whose config does not ship gives only a WARN "model" line: preflight passes, and
    # the estimate cell read report.check("fit") -> KeyError: "no check named 'fit'".
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    run_cells(ipython_shell, "someone/Unshipped-7B")
    out = capsys.readouterr().out
    assert "No estimate for 'someone/Unshipped-7B': its config.json cannot be read here" in out
    assert "Set MODEL to a local folder holding config.json" in out
    assert "codellama/CodeLlama-7b-Instruct-hf" in out  # the configs that work offline are listed
