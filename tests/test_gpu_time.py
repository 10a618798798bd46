"""The GPU check registers time (issue 46 via 45): each generate row carries decode tokens/s and the prefill,
each QLoRA row a step's seconds, predicted (estimate_time on the card's figures) beside measured, with ratios."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.estimator.core import estimate
from helpers.estimator.timing import CARDS, card_named, estimate_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_stages  # noqa: E402

TINY = "data/tiny/llama"


def test_a_generate_row_puts_predicted_beside_measured():
    est = estimate(TINY, load="fp32", batch_size=2, prompt_tokens=16, max_new_tokens=9, device="t4")
    decode, prefill = gpu_stages.predicted_generate(est, "t4", 2, 9)
    assert decode == estimate_time(est, "t4", batches=(2,)).decode_tokens_per_s[2] and prefill > 0
    row = gpu_stages.generate_time(est, "t4", 2, 16, 9, prefill_s=0.5, total_s=2.1)
    assert row["decode_tok_s_measured"] == pytest.approx(2 * 8 / 1.6, abs=0.1)  # 8 steps after generate(1)
    assert row["decode_ratio"] == round(row["decode_tok_s_predicted"] / row["decode_tok_s_measured"], 2)
    assert row["prefill_s_measured"] == 0.5 and row["time_card"] == "t4"
    unmeasured = gpu_stages.generate_time(est, "t4", 2, 16, 9)
    assert unmeasured["decode_tok_s_measured"] is None and unmeasured["decode_ratio"] is None


def test_a_qlora_row_predicts_the_step_and_times_the_last_one():
    from helpers.estimator.training import LoraTraining

    est = estimate(TINY, load="fp32", device="t4", training=LoraTraining(micro_batch=2, seq_len=64))
    assert gpu_stages.predicted_step(est, "t4") == estimate_time(est, "t4").step_seconds > 0
    timer = gpu_stages.step_timer()
    for _ in range(2):
        timer.on_step_begin(None, None, None)
        timer.on_step_end(None, None, None)
    assert len(timer.seconds) == 2 and all(s >= 0 for s in timer.seconds)


def test_the_lent_card_has_figures_and_the_dry_run_predicts_for_a_t4():
    assert card_named("NVIDIA H200") == "h200" and CARDS["h200"].bandwidth == 4800e9
    assert gpu_stages.time_card(SimpleNamespace(dry=True)) == "t4"
    assert set(gpu_stages.TIME_CARDS) <= set(CARDS)
