"""TrainPlan's budget is the estimator's: one QLoRA budget whichever way the question is asked."""

from __future__ import annotations

import json

import pytest

from helpers import LoraTraining, TrainPlan, estimate
from helpers.cli import main as cli_main


@pytest.mark.parametrize(("model", "load"), [("Qwen/Qwen2.5-7B", "nf4"), ("codellama/CodeLlama-7b-hf", "nf4"),
                                             ("Qwen/Qwen2.5-1.5B", "int8"), ("codellama/CodeLlama-7b-hf", "fp16")])  # fmt: skip
def test_train_plan_estimate_and_the_cli_give_one_qlora_budget(model, load, capsys):
    plan = TrainPlan(model, load=load)
    planned = plan.estimate("t4")
    asked = estimate(model, load=load, training=LoraTraining(seq_len=plan.seq_len, micro_batch=1), device="t4")
    assert [(r.key, r.bytes) for r in planned.rows] == [(r.key, r.bytes) for r in asked.rows]
    assert cli_main(["estimate", model, "--load", load, "--lora", f"seq_len={plan.seq_len}", "--json"]) in (0, 1)
    printed = json.loads(capsys.readouterr().out)
    assert printed["total"] == planned.total
    upcast = [r for r in asked.rows if r.key == "training.fp32_upcast"]
    if load == "fp16":
        assert upcast == []  # nothing is quantized, nothing upcast
    else:  # peft's prepare_model_for_kbit_training casts the 16-bit weights to fp32: 2.03 GiB on Qwen2.5-7B
        assert upcast[0].bytes == asked.row("weights.unquantized").bytes > 0
