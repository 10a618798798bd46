"""Time estimates (helpers.estimator.timing) and the calibration probe: the model of time, term by term."""

from __future__ import annotations

import pytest

from helpers.core.devices import DEVICE_SETS, DEVICES
from helpers.estimator import calibration as cal_mod
from helpers.estimator.calibration import Calibration
from helpers.estimator.core import estimate
from helpers.estimator.rows import EstimateError
from helpers.estimator.timing import (
    CARDS,
    KERNEL_EFFICIENCY,
    ModelShape,
    Speed,
    answers_seconds,
    approx_duration,
    decode_step_seconds,
    estimate_time,
    lora_step_flops,
    lora_step_seconds,
    speed_for,
)
from helpers.estimator.training import LoraTraining

MISTRAL = "mistralai/Mistral-7B-v0.1"  # a shipped config: offline


def _shape(**kw) -> ModelShape:
    base = dict(matmul_params=1000, weight_bytes=10_000, kv_bytes_per_token=100, layers=2, attn_width=8, lora_params=10)
    return ModelShape(**{**base, **kw})


def test_every_gpu_preset_and_set_has_cited_card_figures():
    assert set(DEVICES) <= set(CARDS)
    for name, card in CARDS.items():
        assert card.bandwidth > 1e11 and card.fp16_flops > card.fp32_flops and card.source, name
    assert CARDS["t4"].bandwidth == 320e9 and CARDS["t4"].fp16_flops == 65e12  # the T4 datasheet
    for name, cards in DEVICE_SETS.items():
        assert speed_for(name).bandwidth == speed_for(cards[0]).bandwidth  # layers run one card after another


def test_unknown_device_says_how_to_time_it():
    with pytest.raises(EstimateError, match="calibrate"):
        speed_for("tpu-v9")


def test_decode_is_bandwidth_bound_with_the_kernel_efficiency():
    speed = Speed("x", bandwidth=1e6, flops=1e15, op_seconds=0.0, overlap=True, basis="")
    shape = _shape()
    assert decode_step_seconds(shape, speed, load="fp16") == pytest.approx(10_000 / 1e6)
    # bitsandbytes' kernels read fewer bytes more slowly: the efficiency divides the bandwidth
    assert decode_step_seconds(shape, speed, load="nf4") == pytest.approx(10_000 / (1e6 * KERNEL_EFFICIENCY["nf4"]))
    # each sequence's KV cache is read and copied on append too (3 passes), the weights once per step
    assert decode_step_seconds(shape, speed, batch=4, context=50) == pytest.approx((10_000 + 3 * 4 * 50 * 100) / 1e6)


def test_cpu_overhead_adds_gpu_overhead_overlaps():
    gpu = Speed("g", bandwidth=1e6, flops=1e15, op_seconds=1e-3, overlap=True, basis="", decode_step_seconds=0.0)
    cpu = Speed("c", bandwidth=1e6, flops=1e15, op_seconds=1e-3, overlap=False, basis="", decode_step_seconds=0.0)
    shape = _shape(weight_bytes=100)  # 0.1 ms of reads, 2 layers x 72 ops x 1 ms of Python
    assert decode_step_seconds(shape, gpu) == pytest.approx(0.144)
    assert decode_step_seconds(shape, cpu) == pytest.approx(0.144 + 1e-4)


def test_lora_step_flops_are_explicit_not_6_x_params():
    shape = _shape(attn_width=0, lora_params=0)
    # frozen weights: forward 2 + input gradient 2 per parameter per token; checkpointing adds a forward
    assert lora_step_flops(shape, batch=1, tokens=10, checkpointing=False) == 4 * 1000 * 10
    assert lora_step_flops(shape, batch=1, tokens=10, checkpointing=True) == 6 * 1000 * 10
    adapters = _shape(matmul_params=0, attn_width=0, lora_params=10)
    assert lora_step_flops(adapters, batch=2, tokens=5, checkpointing=False) == 6 * 10 * 10  # trained: 6 x params


def test_int8_slower_than_nf4_and_batching_cuts_an_evaluation_on_a_t4():
    t4 = estimate_time(estimate(MISTRAL, load="nf4", device="t4", prompt_tokens=256, max_new_tokens=256))
    int8 = estimate_time(estimate(MISTRAL, load="int8", device="t4", prompt_tokens=256, max_new_tokens=256))
    assert int8.decode_tokens_per_s[1] < t4.decode_tokens_per_s[1]
    assert t4.answers_seconds[8] < t4.answers_seconds[1] / 3  # batch 8 reads the weights once for 8 tokens
    a100 = estimate_time(estimate(MISTRAL, load="nf4", device="a100-80", prompt_tokens=256, max_new_tokens=256))
    assert a100.decode_tokens_per_s[1] > 3 * t4.decode_tokens_per_s[1]
    text = str(t4)
    assert "500 answers of 256 tokens" in text and "at batch 8" in text and "NVIDIA T4 datasheet" in text
    assert "quantize" in text and "download" in t4._repr_html_()


def test_a_lora_plan_gets_its_steps_timed():
    plan = estimate(MISTRAL, load="nf4", device="t4", training=LoraTraining(r=16, micro_batch=2, seq_len=512))
    t = estimate_time(plan, steps=60)
    assert t.step_seconds and t.step_shape == (2, 512)
    assert "60 LoRA steps (2 x 512 tokens)" in str(t)
    bigger = estimate_time(plan.replace(training=LoraTraining(r=16, micro_batch=4, seq_len=512)))
    # twice the tokens: the compute doubles, the weights' dequantizing reads (once per pass) do not
    assert 1.5 * t.step_seconds < bigger.step_seconds < 2 * t.step_seconds


def test_totals_are_batches_of_prefill_and_decode():
    speed = Speed("x", bandwidth=1e6, flops=1e9, op_seconds=0.0, overlap=True, basis="")
    shape = _shape()
    one = answers_seconds(shape, speed, answers=3, prompt_tokens=4, new_tokens=2, batch=1)
    two = answers_seconds(shape, speed, answers=3, prompt_tokens=4, new_tokens=2, batch=2)
    assert two < one  # 2 batches instead of 3, each step barely slower


def test_approx_duration_rounds_to_an_estimates_precision():
    assert [approx_duration(s) for s in (0.02, 5.25, 40, 12 * 60, 3 * 3600)] == ["~20 ms", "~5.2 s", "~40 s",
                                                                              "~12 min", "~3.0 h"]  # fmt: skip


def test_a_calibration_replaces_the_card_and_cpu_adds_overhead():
    cal = Calibration("cpu", "fp32", bandwidth=1e10, flops=1e11, op_seconds=5e-6, decode_step_seconds=1e-3,
                      threads=1, probe_seconds=1.0)  # fmt: skip
    speed = speed_for("t4", cal)
    assert speed.bandwidth == 1e10 and not speed.overlap and "calibrated" in speed.basis
    plan = estimate("data/tiny/llama", load="fp32", device="cpu", prompt_tokens=16, max_new_tokens=32)
    t = estimate_time(plan, calibration=cal)
    # tiny model on CPU: per-op overhead (4 layers x 72 ops x 5 us + 1 ms per generate() step) dominates
    assert t.decode_tokens_per_s[1] == pytest.approx(1 / (4 * 72 * 5e-6 + 1e-3 + 3_412_608 / 1e10), rel=0.05)
    assert "calibration on cpu" in str(t) and t.load_parts.get("download", 0) == 0


def test_calibrate_measures_once_per_process(monkeypatch):
    monkeypatch.setattr(cal_mod, "_CACHE", {})
    monkeypatch.setitem(cal_mod.COPY_BYTES, "cpu", 8 * 2**20)  # small probes: the test checks the plumbing
    monkeypatch.setitem(cal_mod.MATMUL_N, "cpu", 128)
    assert cal_mod.cached_calibration("cpu") is None
    first = cal_mod.calibrate("cpu")
    assert first.device == "cpu" and first.dtype == "fp32"
    # measured, so only plausible: a loaded machine may be many times slower (the speed is bench/time_estimate.py's)
    assert first.bandwidth > 0 and first.flops > 0 and 0 < first.op_seconds < 1
    assert 0 <= first.decode_step_seconds < 10
    assert cal_mod.calibrate("cpu") is first and cal_mod.cached_calibration("cpu") is first
    assert "GB/s" in str(first) and "us per op" in str(first)


def test_count_ops_counts_aten_calls():
    import torch

    x = torch.ones(3)
    assert cal_mod.count_ops(lambda: (x + 1) * 2) == 2


def test_an_estimate_shows_its_time_in_html_and_times_itself():
    plan = estimate(MISTRAL, load="nf4", device="t4", batch_size=2, prompt_tokens=256, max_new_tokens=128)
    html = plan._repr_html_()
    assert "time on t4:" in html and "tokens/s decoding at batch 2" in html
    assert plan.time().decode_tokens_per_s == estimate_time(plan).decode_tokens_per_s
    assert plan.time("a100-80").device == "a100-80"
    assert "time on" not in estimate(MISTRAL, load="nf4", device="24GiB")._repr_html_()  # no card: no guess


def test_an_estimate_prints_its_time_on_a_carded_gpu_only():
    plan = estimate(MISTRAL, load="nf4", device="t4", prompt_tokens=256, max_new_tokens=128)
    assert any(line.startswith("  time on t4: ~") for line in str(plan).splitlines())  # the short form too
    assert "time on" not in str(estimate(MISTRAL, load="nf4", device="24GiB"))
    assert "time on" not in str(estimate("data/tiny/llama", load="fp32", device="cpu"))  # no probe behind a print


def test_a_gpu_calibrated_in_this_process_times_its_own_preset(monkeypatch):
    measured = Calibration("cuda:Tesla T4", "fp16", bandwidth=2.5e11, flops=2e13, op_seconds=1e-5,
                           decode_step_seconds=1e-3, threads=2, probe_seconds=3.0)  # fmt: skip
    monkeypatch.setattr(cal_mod, "_CACHE", {"cuda": measured})
    plan = estimate(MISTRAL, load="nf4", device="t4")
    assert "calibrated" in estimate_time(plan).basis  # the T4 it runs on, measured
    assert "datasheet" in estimate_time(plan, "a100-80").basis  # another card: its datasheet


def test_qlora_pays_for_dequantizing_the_weights_every_pass():
    speed = Speed("x", bandwidth=1e6, flops=1e9, op_seconds=0.0, overlap=True, basis="")
    shape = _shape(weight_bytes=1000)
    plain = lora_step_seconds(shape, speed, batch=1, tokens=10, checkpointing=True, load="fp16")
    qlora = lora_step_seconds(shape, speed, batch=1, tokens=10, checkpointing=True, load="nf4")
    compute = lora_step_flops(shape, batch=1, tokens=10, checkpointing=True) / 1e9
    assert plain == pytest.approx(max(compute, 3 * 1000 / 1e6))  # three passes read 16-bit weights, overlapped
    assert qlora == pytest.approx(compute + 3 * 1000 / (1e6 * KERNEL_EFFICIENCY["nf4"]))
