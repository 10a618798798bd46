"""The "will it fit" views: time beside memory in the verdict and its fixes, one verdict everywhere, narrow tables.

Every time figure here is :func:`helpers.estimator.timing.estimate_time`'s for the same plan (issue 46 item 3),
and every verdict the placement decision's (issue 44 item 7).
"""

from __future__ import annotations

import pytest

from helpers.estimator.core import estimate
from helpers.estimator.timing import estimate_time, offload_seconds
from helpers.placement.decision import fit


@pytest.fixture(scope="module")
def qwen7b_t4():
    return fit(estimate("Qwen2.5-7B", load="fp16", device="t4"), "t4")


def _decode_seconds(est, device: str) -> float:
    batch = est.inputs["batch_size"]
    return batch / estimate_time(est, device, batches=(batch,)).decode_tokens_per_s[batch]


def test_the_verdict_shows_the_plans_speed_from_estimate_time(qwen7b_t4):
    assert qwen7b_t4.seconds == pytest.approx(_decode_seconds(qwen7b_t4.estimate, "t4"))
    rate = f"~{1 / qwen7b_t4.seconds:,.1f} tokens/s"
    assert f"time: {rate}" in str(qwen7b_t4) and rate in qwen7b_t4._repr_html_()
    assert qwen7b_t4.to_dict()["seconds"] == qwen7b_t4.seconds


def test_each_fix_shows_its_speed_and_how_it_compares(qwen7b_t4):
    by = {s.change: s for s in qwen7b_t4.suggestions}
    int8, nf4 = by["load=int8"], by["load=nf4"]
    assert int8.seconds == pytest.approx(_decode_seconds(int8.estimate, "t4"))
    assert nf4.seconds == pytest.approx(_decode_seconds(nf4.estimate, "t4"))
    assert int8.seconds > qwen7b_t4.seconds and nf4.seconds > qwen7b_t4.seconds  # bitsandbytes' kernels are slower
    slower = int8.seconds / qwen7b_t4.seconds
    assert f"~{1 / int8.seconds:,.1f} tokens/s, {slower:.1f}x slower" in str(qwen7b_t4)
    assert f"{slower:.1f}x slower" in qwen7b_t4._repr_html_()


def test_an_offload_fix_adds_the_pcie_copy_of_its_offloaded_layers(qwen7b_t4):
    off = next(s for s in qwen7b_t4.suggestions if getattr(s, "kind", "") == "offload")
    copied = offload_seconds(off.plan.offloaded("cpu"), off.plan.offloaded("disk"))
    assert copied > 0
    assert off.seconds == pytest.approx(_decode_seconds(off.estimate, "t4") + copied)
    assert f"~{copied * 1000:.0f} ms/token" in off.plan.slowdown  # the placement's own line: the same figure


def test_a_split_runs_at_one_cards_speed():
    from helpers.placement.decision import device_fixes

    est = estimate("Qwen2.5-7B", load="fp32", device="t4")
    (split,) = device_fixes(est, ["t4"] * 4)
    assert split.kind == "split" and split.seconds == pytest.approx(_decode_seconds(est, "t4"))


def test_a_training_plan_is_timed_per_lora_step():
    from helpers.estimator.training import LoraTraining

    est = estimate("Qwen2.5-7B", load="nf4", device="t4", training=LoraTraining(seq_len=4096, micro_batch=8))
    v = fit(est, "t4")
    assert v.seconds == pytest.approx(estimate_time(est, "t4").step_seconds)
    assert "per LoRA step" in v.time
    for s in v.suggestions:
        if s.seconds is not None:
            assert s.seconds == pytest.approx(estimate_time(s.estimate, "t4").step_seconds)


def test_a_byte_budget_is_not_timed():
    v = fit(estimate("Qwen2.5-0.5B", load="fp16", device="t4"), 8 << 30)
    assert v.seconds is None and "time:" not in str(v)
