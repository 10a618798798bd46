"""The GPU harness rehearsed on the CPU (`make gpu-check DRY=1`): every stage runs, writes only under
the state folder, claims no GPU, and a second call resumes instead of redoing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.estimator.core import estimate
from helpers.estimator.training import LoraTraining

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_dry_run_runs_every_stage_and_resumes(tmp_path, tiny_llama):
    gpu_results = sorted((REPO / "bench" / "results" / "gpu").glob("*.json"))
    export = tmp_path / "export"
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--state", str(tmp_path), "--out", str(export)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "dry"
    copied = {p.name for p in (export / "dry").iterdir()}  # --out: the small result files, no model, no jsonl
    assert {"env.json", "weights.json", "recovery.json", "summary.md"} <= copied, copied
    assert all(n.endswith((".json", ".md")) for n in copied) and not list((export / "state").rglob("*.json"))
    stages = json.loads((out / "env.json").read_text())
    assert stages["machine"]["dry_run"] is True and stages["machine"]["cuda"] is None  # never claims a GPU
    for stage in ("weights", "generate", "qlora", "context", "recovery", "reducers", "pytest_cuda", "notebooks"):
        result = json.loads((out / f"{stage}.json").read_text())
        for row in result["rows"]:
            if "estimate" in row:
                assert {"measured", "error_pct"} <= set(row), (stage, row)
    weights = json.loads((out / "weights.json").read_text())["rows"]
    assert {r["mode"] for r in weights} == {"fp32", "int8", "nf4", "nf4 (no dq)"}
    assert all(abs(r["error_pct"]) <= 0.5 for r in weights)  # exact on the tiny model, CPU too
    recovery = json.loads((out / "recovery.json").read_text())["rows"]
    assert all(r["met"] for r in recovery), recovery
    reducers = {r["cell"]: r for r in json.loads((out / "reducers.json").read_text())["rows"]}
    chunked = reducers["loss=chunked, offload=off, checkpointing=on"]
    assert chunked["saved_estimated"] >= 0 and "saved_measured" not in chunked  # priced; measured on a GPU only
    assert {"kv_cache=dynamic", "kv_cache=fp8"} <= reducers.keys() and "kv_cache=offload" not in reducers
    assert "DRY RUN" in (out / "summary.md").read_text()
    assert sorted((REPO / "bench" / "results" / "gpu").glob("*.json")) == gpu_results  # nothing written there

    again = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--state", str(tmp_path), "--stages",
                            "weights,recovery"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0 and again.stdout.count("done before") == 2, again.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU a real run starts")
def test_without_a_gpu_a_real_run_refuses_instead_of_faking():
    run = subprocess.run([sys.executable, str(SCRIPT), "--stages", "env"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--dry-run" in run.stderr and "GPU figures come only from a GPU" in run.stderr


@pytest.fixture
def harness(monkeypatch):
    """scripts/gpu_check.py imported in this process (its stages can be swapped for failing ones)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gpu_check

    return gpu_check


def test_a_failing_stage_does_not_stop_the_others_and_the_summary_covers_every_result(tmp_path, harness, monkeypatch):
    def broken(run):
        raise ValueError("a bug in this stage")

    monkeypatch.setattr(harness.gpu_stages, "stage_env", broken)
    out = tmp_path / "dry"
    out.mkdir()
    earlier = {"rows": [{"estimate": 100, "measured": 100, "error_pct": 0.0}] * 3, "stage": "weights"}
    (out / "weights.json").write_text(json.dumps(earlier))  # a stage done in an earlier call
    code = harness.main(
        ["--dry-run", "--state", str(tmp_path), "--stages", "env,context", "--out", str(tmp_path / "x")]
    )
    assert code == 3  # not 0: a stage failed
    error = json.loads((out / "env.error.json").read_text())
    assert "a bug in this stage" in error["traceback"] and error["versions"]["torch"]
    assert (out / "context.json").exists() and not (out / "env.json").exists()  # the next stage ran
    summary = (out / "summary.md").read_text()
    assert "0.00 % over 3 of 3 cells measured" in summary  # from the earlier call's JSON, not "not run"
    assert "| stage env |" in summary and "ERROR" in summary
    assert (tmp_path / "x" / "dry" / "env.error.json").exists()

    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    assert harness.main(["--dry-run", "--state", str(tmp_path), "--stages", "context"]) == 0


def test_each_row_reaches_the_out_folder_and_only_rows_of_this_card_resume(tmp_path, harness):
    import gpu_stages

    run = harness.Run(dry=True, state=tmp_path / "dry", out=tmp_path / "dry", export=tmp_path / "out")
    run.state.mkdir()
    rows = [{"name": "tiny", "mode": "fp32", **run.stamp()}, {"name": "tiny", "mode": "int8", "gpu": "NVIDIA H200"}]
    gpu_stages.save_partial(run, "weights", rows)
    assert json.loads((tmp_path / "out" / "state" / "dry" / "weights.partial.json").read_text()) == rows
    assert gpu_stages.partial_rows(run, "weights") == rows[:1]  # another card's row is never merged


def test_an_interrupted_model_build_is_never_reused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gpu_stages

    final, calls = tmp_path / "models" / "org--model", []

    def killed(folder):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")  # save_pretrained writes this first
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gpu_stages.build_once(final, killed)
    assert not final.exists() and not list(final.parent.iterdir())  # no half model left behind

    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # what an older harness, killed mid-save, left

    def save(folder):
        calls.append(folder)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_text("weights")

    assert gpu_stages.build_once(final, save) == final and len(calls) == 1
    assert (final / "model.safetensors").exists() and (final / gpu_stages.BUILT).exists()
    assert not (final / "config.json").exists()  # the stale folder was rebuilt, not reused
    gpu_stages.build_once(final, save)
    assert len(calls) == 1  # built: reused

    run = SimpleNamespace(dry=False, models_dir=tmp_path / "m")
    (tmp_path / "m" / "mistralai--Mistral-7B-v0.1").mkdir(parents=True)
    (tmp_path / "m" / "codellama--CodeLlama-7b-hf").mkdir(parents=True)
    gpu_stages.drop_model("mistral", run)
    gpu_stages.drop_model("codellama", run)  # the 7B later stages load again stays
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["codellama--CodeLlama-7b-hf"]


def test_the_gpu_pages_show_only_real_runs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import render_gpu

    assert "No GPU figure yet" in render_gpu.gpu_section({}) and render_gpu.gpu_readme_rows({}) == []
    dry = {"rows": [{"batch": 1, "prompt": 16, "new": 8, "estimate": 9, "measured": None, "error_pct": None}],
           "machine": {"dry_run": True}}  # fmt: skip
    (tmp_path / "generate.json").write_text(json.dumps(dry))
    assert render_gpu.load_gpu(tmp_path) == {}  # a rehearsal never reaches the published pages
    real = {"rows": [{"batch": 1, "prompt": 512, "new": 256, "estimate": 110, "measured": 100, "error_pct": 10.0},
                     {"batch": 8, "prompt": 2048, "new": 1024, "estimate": 900, "measured": None, "error_pct": None,
                      "note": "not run"}], "machine": {"dry_run": False}}  # fmt: skip
    (tmp_path / "generate.json").write_text(json.dumps(real))
    g = render_gpu.load_gpu(tmp_path)
    assert "worst error 10.00 % over 1 measured cells, target 10.0 %: PASS" in render_gpu.gpu_section(g)
    assert "worst error 10.0 % over 1 cells" in render_gpu.gpu_readme_rows(g)[0][1]


def test_the_budget_counts_from_the_call_not_from_an_old_process(tmp_path, harness, monkeypatch):
    import time

    monkeypatch.setattr(harness, "_process_start", lambda: time.time() - 600)  # a suite 10 minutes old
    assert harness.main(["--dry-run", "--state", str(tmp_path), "--stages", "env,context"]) == 0
    assert json.loads((tmp_path / "dry" / "context.json").read_text())["stage"] == "context"
    run = harness.Run(dry=True, state=tmp_path, out=tmp_path, budget_s=480, started=time.time() - 600)
    assert run.time_left() < 0  # an injected start is honoured: the script passes its own process start


def test_the_gpu_tables_use_todays_estimator_and_the_file_is_current(monkeypatch):
    """estimates_now.json is today's estimate of every cell a GPU measured; an estimator change that
    moves a GPU figure must rewrite it (python scripts/gpu_reestimate.py, then make docs)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gpu_reestimate

    assert gpu_reestimate.main(["--check"]) == 0, "run python scripts/gpu_reestimate.py, then make docs"


def test_qlora_activations_are_what_autograd_kept_on_cuda():
    """The no-checkpointing QLoRA cell's census on an H100 (fp16 autocast, CodeLlama-7B nf4, seq 512,
    r=16 on all linear layers, dropout 0.05): 1504 tensors, 5,394,567,180 bytes in all. The saved row
    plus the adapters' 16-bit copies, the output layer's 16-bit copy and the loss's fp32 log-softmax
    (its own rows) must come within 1 % of it."""
    census = json.loads((REPO / "bench" / "results" / "gpu" / "qlora.json").read_text())
    kept = next(r["saved_census"]["saved"] for r in census["rows"] if "by_shape" in r.get("saved_census", {}))
    tr = LoraTraining(r=16, seq_len=512, micro_batch=1, gradient_checkpointing=False)
    est = estimate("codellama/CodeLlama-7b-hf", load="nf4", compute_dtype="fp16", training=tr, device="t4")
    logsoftmax = 512 * 32016 * 4  # the loss row also counts the gradients around it, the census only this
    rows = ("activations.saved", "training.adapter_casts", "activations.lm_head_copy")
    predicted = sum(est.row(k).bytes for k in rows) + logsoftmax
    assert abs(predicted - kept) / kept < 0.01, (predicted, kept)
