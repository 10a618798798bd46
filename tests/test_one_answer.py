"""One question, one answer: each question two places used to answer differently is asked in each place
here, and the answers must agree (a QLoRA budget, a machine's verdict, the next lighter load mode, a bar's
colour)."""

from __future__ import annotations

import re

import pytest

from helpers import TrainPlan, decide_placement, estimate, explain_oom, fit, training_memory
from helpers.cli import main
from helpers.core import html
from helpers.core.devices import resolve_device
from helpers.core.knobs import smaller
from helpers.core.vocab import DOES_NOT_FIT, FITS, LOAD_MODES, TIGHT, lighter_load, lighter_loads, verdict
from helpers.placement.decision import SPLIT, devices_snapshot, smaller_load_fix


def test_training_memory_and_train_plan_give_one_qlora_budget():
    model = "Qwen/Qwen2.5-7B"
    plan = TrainPlan(model).estimate("t4")
    mem = training_memory(model, strategy="single", world_size=1, qlora=True, optimizer="adamw_8bit", device="t4")
    assert abs(mem.total - plan.total) <= 0.01 * plan.total, (mem.total, plan.total)
    # what the one-GPU budget holds and the old table left out
    keys = {key for key, *_ in mem.rows}
    assert {"training.fp32_upcast", "overhead.cuda_context", "overhead.fragmentation"} <= keys


def test_sharding_divides_only_the_states_it_shards():
    model = "Qwen/Qwen2.5-7B"
    one = training_memory(model, qlora=True, optimizer="adamw_8bit", device="t4")
    two = training_memory(model, strategy="zero2", world_size=2, qlora=True, optimizer="adamw_8bit", device="t4")
    rows1, rows2 = ({k: b for k, _, b, _ in m.rows} for m in (one, two))
    assert rows2["training.optimizer"] == rows1["training.optimizer"] // 2
    assert rows2["weights.quantized"] == rows1["weights.quantized"]  # ZeRO-2 replicates the 4-bit base


def test_a_machine_gets_the_verdict_of_where_load_puts_the_model(capsys):
    est = estimate("meta-llama/Llama-3.1-8B", load="fp16")
    assert fit(est, "t4").verdict == DOES_NOT_FIT  # one card cannot hold it
    decided = decide_placement(None, est, devices_snapshot(est, [resolve_device("t4")[1]] * 2))
    assert decided.where == SPLIT
    machine = fit(est, "kaggle-2xt4")
    assert machine.verdict == decided.verdict == FITS
    assert "split over 2 GPUs" in str(machine) and machine.used < machine.capacity
    assert main(["estimate", "meta-llama/Llama-3.1-8B", "--load", "fp16", "--device", "kaggle-2xt4"]) == 0
    assert "FITS" in capsys.readouterr().out


def test_the_next_lighter_load_mode_has_one_home():
    for mode in LOAD_MODES:
        assert smaller("load", mode) == lighter_load(mode)
        expected = lighter_load(mode)
        assert smaller_load_fix(mode) == (f"load={expected!r}" if expected else "a smaller model")
    est = estimate("Qwen/Qwen2.5-7B", load="bf16", max_new_tokens=4096, batch_size=8)
    loads = [s.kwargs["load"] for s in fit(est, "a100-40").suggestions if "load" in s.kwargs]
    assert loads == [m for m in lighter_loads("bf16", bf16=True) if m in loads]
    assert "fp16" not in loads  # the same 2 bytes per weight


def test_an_oom_under_bf16_never_offers_fp16():
    msg = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.74 GiB of which 1.2 GiB is free."
    report = str(explain_oom(msg, namespace={"LOAD": "bf16"}))
    assert "LOAD = 'int8'" in report
    assert "'fp16'" not in report


@pytest.mark.parametrize("share", [0.5, 0.87, 0.899, 0.92, 0.97, 1.0, 1.3])
def test_a_bar_is_coloured_by_the_verdict(share):
    cap = 16 * 2**30
    used = int(cap * share)
    expected = {FITS: "ok", TIGHT: "warn", DOES_NOT_FIT: "fail"}[verdict(used, cap)]
    assert html.level_color(used, cap) == html.LEVEL_FILLS[expected]
    drawn = html.bar(used, cap, "model")
    assert html.LEVEL_FILLS[expected] in drawn
    assert f"({share * 100:.0f}%)" in drawn or share == 0.899  # over capacity reads over 100 %
    assert re.search(r"\((\d+)%\)", drawn).group(1) == f"{used / cap * 100:.0f}"


def test_an_estimate_says_the_budget_it_was_made_for(capsys):
    assert main(["estimate", "Qwen/Qwen2.5-7B", "--load", "nf4", "--device", "t4"]) == 0
    assert "batch 1, 512 prompt + 256 new tokens" in " ".join(
        "\n".join(capsys.readouterr().out.splitlines()[:2]).split()
    )  # 80 columns
    assert "micro-batch 1 x 512 tokens" in str(TrainPlan("Qwen/Qwen2.5-7B").estimate("t4")).splitlines()[0]


@pytest.mark.parametrize("model, load", [("Qwen/Qwen2.5-7B", "fp16"), ("Qwen/Qwen2.5-7B", "nf4"),
                                         ("meta-llama/Llama-3.1-8B", "int8"), ("meta-llama/Llama-3.1-8B", "fp16")])  # fmt: skip
def test_the_load_panel_and_fit_give_one_verdict(model, load, capsys):
    from helpers import LoadPanel

    est = estimate(model, load=load, device="t4")
    answer = fit(est, "t4", suggest=False)
    panel = LoadPanel(model, device="t4", load=load, widgets=False).state.verdict
    assert panel == answer.verdict, (model, load, panel, answer.verdict)  # Qwen2.5-7B fp16: 99.7 % spills
    code = main(["estimate", model, "--load", load, "--device", "t4"])
    assert code == (0 if answer.fits else 1)
