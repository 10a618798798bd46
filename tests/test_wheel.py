"""The package as Colab installs it: the built wheel, away from the repository.

- it holds the package data the notebooks read (``importlib.resources``);
- installed in a fresh virtualenv, it runs every notebook from an empty directory, once per session
  (the ``wheel_notebooks`` fixture), and each planned run ends without an error (slow);
- installing it beside a torch of another version leaves that torch alone (``pip --dry-run --report``, slow;
  started before the notebooks run, as it mostly waits on the package index).

The slow ones (marked ``wheel``: the notebooks and the dry run, ~2.5 minutes) run in ``make test-wheel``, a part
of CI of its own, so that ``make test`` stays a quick loop; the package-data check runs in both.
Every test of the wheel lives in this one module: under pytest-xdist (``--dist loadscope``) a module
runs on one worker, so the wheel is built and the notebooks run once, not once per worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import run_notebooks
from conftest import compat_script

REPO = Path(__file__).resolve().parents[1]


def test_wheel_holds_the_package_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "helpers/core/compat.py" in names and "helpers/core/runtime.py" in names
    assert any(n.startswith("helpers/data/configs/") and n.endswith(".json") for n in names)
    assert {"helpers/data/instructions.jsonl", "helpers/data/eval_prompts.jsonl"} <= set(names)


@pytest.mark.wheel
@pytest.mark.slow
def test_wheel_runs_every_notebook_from_an_empty_directory(install_beside_colab_torch, wheel_notebooks):
    """The way Colab runs them (the session's one notebook execution, shared with test_notebook_executes).
    The pip dry run beside Colab's torch is started first: it waits on the index meanwhile."""
    runs = compat_script().notebook_runs(None, REPO, wheel_notebooks.work)
    assert len(wheel_notebooks.lines) == len(runs), wheel_notebooks.output
    assert all(ln.startswith("ok ") and f"helpers from {wheel_notebooks.target}" in ln
               for ln in wheel_notebooks.lines.values()), wheel_notebooks.output  # fmt: skip
    assert sorted(
        p.name for p in wheel_notebooks.work.glob("[!.]*.ipynb") if not p.name.endswith(".out.ipynb")
    ) == sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))


def _fake_torch_wheel(directory: Path, version: str) -> Path:
    """A wheel named torch with no code: stands for the torch a Colab runtime already has."""
    dist = f"torch-{version}.dist-info"
    path = directory / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: oomkit-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}/RECORD", f"{dist}/METADATA,,\n{dist}/WHEEL,,\n{dist}/RECORD,,\n")
    return path


COLAB_TORCH = "2.5.1"


@dataclass
class DryRun:
    """``pip install --dry-run --report`` of the wheel, running in the background until :meth:`wait`."""

    process: subprocess.Popen
    report: Path

    def wait(self) -> subprocess.CompletedProcess:
        out, err = self.process.communicate(timeout=600)
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, out, err)


@pytest.fixture(scope="session")
def install_beside_colab_torch(wheel, tmp_path_factory):
    """The wheel's install (a dry run) into a virtualenv holding Colab's torch, started now and left
    running: the resolver mostly waits on the package index (about a minute), so it waits while the
    notebooks run (test_wheel_runs_every_notebook_from_an_empty_directory starts it first)."""
    tmp = tmp_path_factory.mktemp("colab-torch")
    venv_dir = tmp / "colab"
    # no pip of its own (ensurepip costs seconds): this environment's pip acts on it (``pip --python``)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv_dir], check=True)
    pip = [sys.executable, "-m", "pip", "--python", venv_dir / "bin" / "python"]
    subprocess.run([*pip, "install", "-q", "--no-deps", _fake_torch_wheel(tmp, COLAB_TORCH)], check=True)
    report = tmp / "report.json"
    cmd = [str(c) for c in [*pip, "install", "--dry-run", "--quiet", "--report", report, wheel]]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield DryRun(process, report)
    if process.poll() is None:  # its test was deselected or failed first
        process.kill()
        process.communicate()


@pytest.mark.wheel
@pytest.mark.slow
def test_installing_beside_another_torch_leaves_it_alone(install_beside_colab_torch):
    colab_torch, report = COLAB_TORCH, install_beside_colab_torch.report
    done = install_beside_colab_torch.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    installs = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert "transformers" in installs, "the resolver did not run over oomkit's dependencies"
    assert "torch" not in installs, f"pip would replace Colab's torch {colab_torch} with {installs.get('torch')}"
    assert not any(n.startswith("nvidia-") and n != "nvidia-ml-py" for n in installs), "pip would pull CUDA wheels"


RUNS = run_notebooks.planned_runs()


@pytest.mark.wheel
@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[r.label for r in RUNS])
def test_notebook_executes(run, wheel_notebooks):
    """Each planned run (what `make demo` runs), executed once per session from the installed wheel."""
    key = f"{run.notebook.stem}[{run.name}]"
    line = wheel_notebooks.lines.get(key)
    assert line is not None, f"{key} did not run: {wheel_notebooks.output}"
    assert line.startswith("ok "), line
    executed = nbformat.read(wheel_notebooks.work / f"{run.notebook.stem}-{run.name}.out.ipynb", as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]  # fmt: skip
    assert not errors


@pytest.mark.wheel
@pytest.mark.slow
def test_notebook_05s_ddp_runs_trained_in_step_on_two_gloo_processes(wheel_notebooks):
    """Notebook 05's two DDP QLoRA runs on the tiny model (2 CPU processes, gloo), checked from the reports
    its ranks wrote: the launcher a notebook starts (run_ddp_qlora) and the accelerate config it writes
    (write_launch_config + launch_qlora). One run each serves the notebook and these assertions."""
    from helpers.training.distributed import collect_ranks

    steps = next(r for r in RUNS if r.notebook.stem == "05_multi_gpu").parameters["DDP_STEPS"]
    run = collect_ranks(wheel_notebooks.work / "05_multi_gpu", 2)
    assert [r.rank for r in run.ranks] == [0, 1] and {r.backend for r in run.ranks} == {"gloo"}
    assert run.loss_fell and run.in_sync, str(run)
    assert all(r.peak_rss > 0 and len(r.rss) == steps for r in run.ranks)
    assert "rank 1/2" in str(run) and "<table" in run._repr_html_()
    ranks = collect_ranks(wheel_notebooks.work / "05_multi_gpu" / "accelerate", 2).ranks
    assert [r.rank for r in ranks] == [0, 1] and {r.backend for r in ranks} == {"gloo"}
    assert {r.distributed_type for r in ranks} == {"MULTI_CPU"}  # DDP on CPU processes, from the written config
    assert all(r.losses[-1] < r.losses[0] and r.peak_rss > 0 for r in ranks)
    assert abs(ranks[0].checksum - ranks[1].checksum) < 1e-6 * ranks[0].checksum  # gradients averaged
