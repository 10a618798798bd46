"""Every notebook runs top to bottom on the tiny model, and is stored clean and paired."""

import json

import nbformat
import pytest
import run_notebooks

RUNS = run_notebooks.planned_runs()


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[r.label for r in RUNS])
def test_notebook_executes(run, tiny_models):
    run_notebooks.execute(run)
    executed = nbformat.read(run.output, as_version=4)
    errors = [
        o
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors


NOTEBOOKS = sorted(run_notebooks.NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean_and_paired(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "strip outputs"
    assert path.with_suffix(".py").exists(), "pair it with a py:percent script (make sync-notebooks)"
    assert "parameters" in code[1].get("metadata", {}).get("tags", []), "second cell is the parameters cell"
    first = "".join(code[0]["source"])
    assert 'run_line_magic("pip", \'install -q "oomkit' in first, "first cell installs oomkit in Colab"
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
