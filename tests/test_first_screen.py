"""The first screen of every notebook says what to do (a collapsed install cell, three steps, the form), and a
CPU runtime still gets what needs neither a GPU nor a download: notebook 00's estimates, notebook 05's plans;
notebook 04 offline says in one line that the model cannot be found."""

from __future__ import annotations

import nbformat
import pytest
import run_notebooks
from huggingface_hub import constants as hub_constants

from helpers.core.errors import LoadError
from helpers.environment import PreflightFailed

NOTEBOOKS = sorted(run_notebooks.NOTEBOOKS.glob("0*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_first_screen_is_title_install_three_steps_form(path):
    cells = nbformat.read(path, 4).cells
    title, install, steps, form = cells[:4]
    assert title.cell_type == "markdown" and len(title.source.splitlines()) <= 3  # the title and the Colab badge
    assert title.source.startswith("# ")
    assert install.cell_type == "code" and install.source.startswith("# @title Install oomkit")
    assert '{ display-mode: "form" }' in install.source.splitlines()[0]
    assert install.metadata.get("cellView") == "form"  # Colab shows the title, not the 25 lines
    assert install.metadata.get("jupyter", {}).get("source_hidden") is True  # JupyterLab collapses it
    lines = steps.source.splitlines()
    assert steps.cell_type == "markdown" and len(lines) == 3 and all(line.startswith("> ") for line in lines)
    assert "T4" in lines[0] and "`MODEL`" in lines[1] and "Run all" in lines[2]
    assert "parameters" in form.metadata.get("tags", [])


def code_cells(name: str) -> list[str]:
    path = run_notebooks.NOTEBOOKS / f"{name}.ipynb"
    return [c.source for c in nbformat.read(path, 4).cells if c.cell_type == "code"]


@pytest.fixture
def measured(monkeypatch):
    """The notebooks' preflight calibrates this machine (seconds); here a stand-in measurement."""
    from helpers.estimator import calibration

    cal = calibration.Calibration("cpu", "fp32", 2e10, 5e10, 1e-5, 3e-3, 2, 0.0)
    monkeypatch.setattr(calibration, "calibrate", lambda device=None, refresh=False: cal)
    return cal


def run_until_error(shell, cells: list[str]) -> tuple[int, BaseException | None]:
    """Run ``cells`` in order; the index of the first that raised and its error (``len(cells), None``)."""
    try:
        for i, source in enumerate(cells):
            result = shell.run_cell(source)
            if result.error_in_exec is not None or result.error_before_exec is not None:
                return i, result.error_in_exec or result.error_before_exec
        return len(cells), None
    finally:
        shell.run_cell("%unload_ext helpers")


@pytest.mark.slow
def test_notebook_00_on_a_cpu_runtime_shows_the_plans_of_a_7b_after_its_fail(ipython_shell, capsys, measured):
    cells = code_cells("00_preflight")  # the form's default: CodeLlama-7B, whose config ships with oomkit
    stopped, error = run_until_error(ipython_shell, cells)
    assert (stopped, error) == (len(cells), None)
    out = capsys.readouterr().out
    assert "GPU needed" in out and "The plans below need neither a GPU nor a download" in out
    assert "[FAIL] GPU needed" in ipython_shell.user_ns["report"].__str__()
    assert ipython_shell.user_ns["fit_line"] is not None  # the estimate and the fits table ran on it


@pytest.mark.slow
def test_notebook_05_on_a_cpu_runtime_plans_then_stops_before_loading(ipython_shell, capsys, measured):
    cells = code_cells("05_multi_gpu")
    load_cell = next(i for i, c in enumerate(cells) if "report.raise_for_failures()" in c)
    stopped, error = run_until_error(ipython_shell, cells[: load_cell + 1])
    assert stopped == load_cell and isinstance(error, PreflightFailed) and "GPU needed" in str(error)
    assert "plan" in ipython_shell.user_ns and "Sections 2-5" in capsys.readouterr().out


def test_notebook_04_offline_says_the_model_cannot_be_found_in_one_error(ipython_shell, monkeypatch, capfd):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    cells = code_cells("04_leak_hunting")
    cells[1] = "MODEL = 'someone/Unshipped-0.5B'\nSTEPS = 4\nBATCH = 1\nSEQ = 8"
    model_cell = next(i for i, c in enumerate(cells) if "load(LoadPlan(MODEL" in c)
    stopped, error = run_until_error(ipython_shell, cells[: model_cell + 1])
    assert stopped == model_cell and isinstance(error, LoadError)
    assert "someone/Unshipped-0.5B" in str(error) and "offline" in str(error)
    err = capfd.readouterr().err
    assert "Retrying" not in err and "huggingface_hub" not in err  # no retry boxes from the hub client
