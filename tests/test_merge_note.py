"""merge_adapter on a 4-bit base: peft's per-layer rounding warning becomes one oomkit note (a notebook showed a
pink warning block per merged module)."""

from __future__ import annotations

import warnings

from helpers import TrainPlan, load, merge_adapter
from helpers.training.adapters import prepare_qlora


def test_a_4bit_merge_says_it_rounds_once_as_an_oomkit_note(tiny_llama, tmp_path, capsys):
    plan = TrainPlan(str(tiny_llama), seq_len=32, micro_batch=1, max_steps=1, output_dir=str(tmp_path), r=8, alpha=16)
    model, _, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = merge_adapter(model)
    assert not any("Merge lora module" in str(w.message) for w in caught)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[oomkit] note:")]
    assert len(notes) == 1 and "4-bit" in notes[0] and "rounds" in notes[0]
    assert not hasattr(merged, "peft_config")  # the adapter is folded in
