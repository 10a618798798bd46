"""The GPU harness rehearsed on the CPU (`make gpu-check DRY=1`): every stage runs, writes only under
the state folder, claims no GPU, and a second call resumes instead of redoing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_dry_run_runs_every_stage_and_resumes(tmp_path, tiny_llama):
    gpu_results = sorted((REPO / "bench" / "results" / "gpu").glob("*.json"))
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--state", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "dry"
    stages = json.loads((out / "env.json").read_text())
    assert stages["machine"]["dry_run"] is True and stages["machine"]["cuda"] is None  # never claims a GPU
    for stage in ("weights", "generate", "qlora", "context", "recovery", "pytest_cuda", "notebooks"):
        result = json.loads((out / f"{stage}.json").read_text())
        for row in result["rows"]:
            if "estimate" in row:
                assert {"measured", "error_pct"} <= set(row), (stage, row)
    weights = json.loads((out / "weights.json").read_text())["rows"]
    assert {r["mode"] for r in weights} == {"fp32", "int8", "nf4", "nf4 (no dq)"}
    assert all(abs(r["error_pct"]) <= 0.5 for r in weights)  # exact on the tiny model, CPU too
    recovery = json.loads((out / "recovery.json").read_text())["rows"]
    assert all(r["met"] for r in recovery), recovery
    assert "DRY RUN" in (out / "summary.md").read_text()
    assert sorted((REPO / "bench" / "results" / "gpu").glob("*.json")) == gpu_results  # nothing written there

    again = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--state", str(tmp_path), "--stages",
                            "weights,recovery"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0 and again.stdout.count("done before") == 2, again.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU a real run starts")
def test_without_a_gpu_a_real_run_refuses_instead_of_faking():
    run = subprocess.run([sys.executable, str(SCRIPT), "--stages", "env"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--dry-run" in run.stderr and "GPU figures come only from a GPU" in run.stderr
