"""Time in the views (issue 46 item 3): each panel's time line, the training view's and the eval bar's predicted
time all come from the one answer (:func:`helpers.estimator.timing.estimate_time`) and move with the plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.estimator import calibration as calibration_module
from helpers.estimator.calibration import Calibration
from helpers.estimator.timing import approx_duration, estimate_time, view_time
from helpers.panels.state import NO_TIME, load_time_text, train_time_text
from helpers.panels.train_panel import TrainPanel
from helpers.panels.widgets import LoadPanel
from helpers.training.plan import TrainPlan
from helpers.training.view import TrainProgress

BIG = "mistralai/Mistral-7B-v0.1"  # shipped config: offline, only arithmetic
# what calibrate() might measure on a small CPU: fixed, so no probe runs in a test
FAKE_CPU = Calibration("cpu", "fp32", bandwidth=10e9, flops=50e9, op_seconds=6e-6, decode_step_seconds=1e-3,
                       threads=1, probe_seconds=0.0)  # fmt: skip


@pytest.fixture
def calibrated(monkeypatch):
    """This process's CPU as if calibrate() had run (view_time never probes: it reads the cache)."""
    monkeypatch.setattr(calibration_module, "cached_calibration", lambda device=None: FAKE_CPU)
    return FAKE_CPU


def test_the_load_panel_time_is_estimate_time_and_moves_with_the_batch_slider(tiny_llama):
    panel = LoadPanel(str(tiny_llama), device="t4", load="nf4", max_new_tokens=64, prompt_tokens=32, widgets=True)
    expected = estimate_time(panel.state.estimate, "t4", batches=(1,), cached=True)
    assert panel.state.time_text == load_time_text(expected, 1)
    assert approx_duration(expected.answers_seconds[1]) in panel.controls["time"].value
    before = panel.controls["time"].value

    panel.controls["batch_size"].value = 8  # a slider move, as a person makes it
    at_8 = estimate_time(panel.state.estimate, "t4", batches=(8,), cached=True)
    shown = panel.controls["time"].value
    assert shown != before and "at batch 8" in shown
    assert f"~{at_8.decode_tokens_per_s[8]:,.1f} tokens/s" in shown
    assert approx_duration(at_8.answers_seconds[8]) in shown
    assert panel.state.time_text in panel.summary()


def test_the_training_panel_time_is_one_step_times_accumulation_and_the_run():
    plan = TrainPlan(BIG, seq_len=128, batch_size=8, max_steps=60)
    panel = TrainPanel(plan, device="t4", widgets=True)
    expected = estimate_time(panel.state.estimate, "t4", batches=(1,), steps=60 * 8)
    assert panel.state.time_text == train_time_text(expected, 60, 8)  # "auto": micro-batch 1 x accumulation 8
    assert "60 steps: " + approx_duration(expected.steps * expected.step_seconds) in panel.state.time_text

    panel.controls["seq_len"].value = 512
    longer = estimate_time(panel.state.estimate, "t4", batches=(1,), steps=60 * 8)
    assert panel.controls["time"].value.count(approx_duration(longer.step_seconds * 8)) == 1
    assert longer.step_seconds > expected.step_seconds


def test_an_uncalibrated_cpu_panel_says_how_to_get_a_time_and_a_calibrated_one_shows_it(tiny_llama, monkeypatch):
    monkeypatch.setattr(calibration_module, "cached_calibration", lambda device=None: None)
    assert LoadPanel(str(tiny_llama), device="cpu", load="fp32", widgets=False).state.time_text == NO_TIME
    monkeypatch.setattr(calibration_module, "cached_calibration", lambda device=None: FAKE_CPU)
    panel = LoadPanel(str(tiny_llama), device="cpu", load="fp32", batch_size=2, widgets=False)
    expected = estimate_time(panel.state.estimate, calibration=FAKE_CPU, batches=(2,), cached=True)
    assert panel.state.time_text == load_time_text(expected, 2)


def test_a_bare_capacity_is_not_timed_and_never_probes(tiny_llama, monkeypatch):
    monkeypatch.setattr(calibration_module, "calibrate", lambda *a, **k: pytest.fail("a view must not probe"))
    panel = LoadPanel(str(tiny_llama), device=15 * 2**30, widgets=False)
    assert view_time(panel.state.estimate) is None and panel.state.time_text == NO_TIME


def test_the_training_view_shows_the_predicted_eta_beside_the_measured_one():
    running = TrainProgress(step=20, total=60, elapsed=30.0, steps_done=20, predicted_step=2.0)
    assert "ETA 1:00 (predicted 1:20)" in str(running)
    assert ["ETA", "1:00 (predicted 1:20)"] in running.rows()
    done = TrainProgress(step=60, total=60, elapsed=95.0, steps_done=60, predicted_step=2.0, finished=True)
    assert "wall time 1:35 for 60 steps (predicted 2:00)" in done.summary()
    assert "predicted" not in str(TrainProgress(step=20, total=60, elapsed=30.0, steps_done=20))


def test_train_predicts_the_step_from_the_plan_at_the_micro_batch_trainer_runs(tiny_llama, calibrated):
    from transformers import AutoConfig

    from helpers.training.finetune import predicted_step_seconds

    plan = TrainPlan(str(tiny_llama), seq_len=64, batch_size=8, max_steps=4)
    model = SimpleNamespace(config=AutoConfig.from_pretrained(tiny_llama))
    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    est = plan.replace(micro_batch=2).estimate("cpu", model=model.config)
    step = estimate_time(est, calibration=calibrated, batches=(1,), cached=True).step_seconds
    assert predicted_step_seconds(model, plan, args) == pytest.approx(step * 4)


def test_the_eval_bar_names_the_predicted_time(tiny_llama, calibrated, tmp_path, capsys):
    from helpers.estimator.core import estimate
    from helpers.evaluation.evaluate import predicted_seconds, safe_generate
    from helpers.loading.loader import load

    model, tok, _ = load(str(tiny_llama), load="fp32", check=False)
    pending = [({"id": str(i)}, [1] * n) for i, n in enumerate((10, 20, 30))]
    est = estimate(model, load="fp32", batch_size=2, prompt_tokens=20, max_new_tokens=8, device="cpu")
    expected = estimate_time(est, calibration=calibrated, answers=3, batches=(2,), cached=True)
    assert predicted_seconds(model, pending, 2, 8) == pytest.approx(expected.answers_seconds[2])

    torch.manual_seed(0)
    safe_generate(model, tok, ["one", "two", "three"], max_new_tokens=4, results=tmp_path / "r.jsonl", progress=True)
    assert "safe_generate (predicted ~" in capsys.readouterr().err


def test_on_an_uncalibrated_gpu_the_card_is_found_by_its_name(monkeypatch):
    from helpers.estimator.timing import card_named, time_basis

    monkeypatch.setattr(calibration_module, "cached_calibration", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    assert time_basis("current") == ("t4", None) and time_basis("cpu") is None and time_basis(2**34) is None
    assert time_basis("Tesla T4") == ("t4", None)  # an estimate's label for "current" on that GPU
    assert time_basis("Tesla T4, capped at 40%") == ("t4", None) and time_basis("15.00 GiB") is None
    monkeypatch.setattr(calibration_module, "cached_calibration", lambda device=None: FAKE_CPU)
    assert time_basis("Tesla T4") == (None, FAKE_CPU) and time_basis("current") == (None, FAKE_CPU)
    names = {"NVIDIA A100-SXM4-80GB": "a100-80", "NVIDIA A100-SXM4-40GB": "a100-40", "NVIDIA L4": "l4",
             "Tesla V100-SXM2-32GB": "v100-32", "NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA H200": "h200", "NVIDIA B200": None}  # fmt: skip
    assert {n: card_named(n) for n in names} == names
