"""Every notebook is stored clean and paired, opens on a Colab GPU, and takes its plan from its panel
(that each runs top to bottom from the built wheel is tests/test_wheel.py)."""

import json
from pathlib import Path

import nbformat
import pytest
import run_notebooks

NOTEBOOKS = sorted(run_notebooks.NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean_and_paired(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "strip outputs"
    assert path.with_suffix(".py").exists(), "pair it with a py:percent script (make sync-notebooks)"
    assert "parameters" in code[1].get("metadata", {}).get("tags", []), "second cell is the parameters cell"
    first = "".join(code[0]["source"])
    assert '"pip", "install", "-q", "oomkit @ git+' in first, "first cell installs oomkit in Colab and Kaggle"
    compile(path.with_suffix(".py").read_text(), str(path.with_suffix(".py")), "exec")  # the pair is plain Python
    import jupytext

    paired = jupytext.read(path.with_suffix(".py"))
    assert [c.source for c in paired.cells] == [c.source for c in nbformat.read(path, 4).cells], (
        "the .ipynb and .py differ: run make sync-notebooks"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_opens_on_a_colab_gpu_with_the_oom_safety_net_on(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"].get("accelerator") == "GPU", "a Colab badge must open a GPU runtime"
    assert nb["metadata"].get("colab", {}).get("gpuType") == "T4"
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert any("%load_ext helpers" in src for src in code[:4]), "turn the OOM handler on before the first load"
    assert "configure_allocator()" in code[0], "expandable segments must be set before anything touches CUDA"


# A user's moves of the panel after it is shown, and what the cell that takes its plan must then see.
PANEL_MOVES = {
    "02_lora_finetune": (
        {"BATCH_SIZE": 4},
        "panel.set(load='int8', r=4, seq_len=128, micro_batch=2)",
        "plan = panel.plan",
        "print('SEEN', repr((plan.load, plan.r, plan.seq_len, plan.micro_batch)))",
        "('int8', 4, 128, 2)",
    ),
    "03_safe_eval": (
        {"BATCH_SIZE": 2},
        "panel.set(load='int8', max_new_tokens=8, batch_size=3)",
        "model, tokenizer, load_report = panel.load()",
        "print('SEEN', repr((load_report.plan.load, model.is_loaded_in_8bit, MAX_NEW_TOKENS, START_BATCH)))",
        "('int8', True, 8, 3)",
    ),
}


@pytest.mark.parametrize("stem", sorted(PANEL_MOVES))
def test_panel_choices_drive_the_cells_after_it(stem, tiny_models, tmp_path):
    """Notebooks 02 and 03 take their plan from the panel: values moved after it is shown are what runs."""
    import papermill

    params, move, taker, probe, expected = PANEL_MOVES[stem]
    run = next(r for r in run_notebooks.planned_runs([stem]))
    nb = nbformat.read(run.notebook, as_version=4)
    shown = next(i for i, c in enumerate(nb.cells) if c.source.rstrip().endswith("\npanel"))
    takes = next(i for i, c in enumerate(nb.cells) if taker in c.source)
    assert shown < takes, "the panel is shown before its plan is used"
    nb.cells = [*nb.cells[: shown + 1], nbformat.v4.new_code_cell(move), *nb.cells[shown + 1 : takes + 1]]
    nb.cells.append(nbformat.v4.new_code_cell(probe))
    source = tmp_path / f"{stem}.ipynb"
    nbformat.write(nb, source)
    out = tmp_path / f"{stem}.out.ipynb"
    papermill.execute_notebook(
        str(source), str(out), parameters={**run.parameters, **params}, kernel_name="python3", cwd=str(tmp_path),
        progress_bar=False, execution_timeout=300,
    )  # fmt: skip
    printed = "".join(o.get("text", "") for c in nbformat.read(out, 4).cells for o in c.get("outputs", []))
    assert f"SEEN {expected}" in printed


def test_a_load_mode_moved_after_loading_is_what_notebook_01_generates_with(tiny_models, tmp_path):
    """Notebook 01, section 5: "move the sliders and re-run this cell". A new load mode chosen after the
    model was loaded reloads there; before, the cell ran the old model (or, once unloaded, crashed).
    It is also notebook 01's int8 path (load and generate), which the planned runs leave to it."""
    import papermill

    run = next(r for r in run_notebooks.planned_runs(["01_load_quantized"]) if r.parameters["LOAD"] == "nf4")
    nb = nbformat.read(run.notebook, as_version=4)
    loaded = next(i for i, c in enumerate(nb.cells) if c.source.startswith("model, tokenizer, report = panel.load()"))
    generates = next(i for i, c in enumerate(nb.cells) if "outputs = generate_batched(" in c.source)
    assert loaded < generates
    nb.cells = [
        *nb.cells[: loaded + 1],
        nbformat.v4.new_code_cell("old = model\npanel.set(load='int8', max_new_tokens=4)"),
        nb.cells[generates],
        nbformat.v4.new_code_cell("print('SEEN', repr((model.is_loaded_in_8bit, report.plan.load, old is model)))"),
    ]
    source, out = tmp_path / "01.ipynb", tmp_path / "01.out.ipynb"
    nbformat.write(nb, source)
    papermill.execute_notebook(
        str(source), str(out), parameters=run.parameters, kernel_name="python3", cwd=str(tmp_path),
        progress_bar=False, execution_timeout=300,
    )  # fmt: skip
    printed = "".join(o.get("text", "") for c in nbformat.read(out, 4).cells for o in c.get("outputs", []))
    assert "SEEN (True, 'int8', False)" in printed


def test_make_demo_runs_what_the_wheel_test_runs():
    """`make demo` (scripts/run_notebooks.py) and the one execution per test session plan the same runs."""
    from conftest import compat_script

    wheel_runs = [(stem, name) for stem, name, _ in compat_script().notebook_runs(None, run_notebooks.REPO, Path("x"))]
    assert [(r.notebook.stem, r.name) for r in run_notebooks.planned_runs()] == wheel_runs
