"""A decode step's batch dependence (issue 46): the per-sequence work (KV cache passes, logits over the
vocabulary, FLOPs) and, on the CPU, reads and FLOPs adding up and the GEMM's packed weights. Counts only."""

from __future__ import annotations

import pytest

from helpers.estimator.core import estimate
from helpers.estimator.timing import (
    CPU_GEMM_WEIGHT_PASSES,
    KV_CACHE_PASSES,
    LOGITS_PASSES,
    ModelShape,
    Speed,
    decode_step_seconds,
    decode_step_work,
    estimate_time,
    model_shape,
)

SHAPE = ModelShape(matmul_params=1000, weight_bytes=4000, kv_bytes_per_token=100, layers=2, attn_width=8, vocab=50)
CPU = Speed("c", bandwidth=1e6, flops=1e6, op_seconds=0.0, overlap=False, basis="", decode_step_seconds=0.0)
GPU = Speed("g", bandwidth=1e6, flops=1e6, op_seconds=0.0, overlap=True, basis="", decode_step_seconds=0.0)


def test_per_sequence_work_is_counted_kv_logits_flops():
    one, eight = decode_step_work(SHAPE, batch=1, context=10), decode_step_work(SHAPE, batch=8, context=10)
    assert one.kv_bytes == KV_CACHE_PASSES * 10 * 100  # read by attention, read and written by torch.cat
    assert eight.kv_bytes == 8 * one.kv_bytes
    assert eight.logits_bytes == 8 * LOGITS_PASSES * 50 * 4  # fp32 logits per sequence
    assert eight.flops == 8 * one.flops == 8 * (2 * 1000 + 4 * 10 * 8 * 2)
    assert eight.weight_bytes == one.weight_bytes == 4000  # a GPU reads the weights once for the whole batch
    assert decode_step_work(SHAPE, batch=8, cpu=True).weight_bytes == CPU_GEMM_WEIGHT_PASSES * 4000
    assert decode_step_work(SHAPE, batch=1, cpu=True).weight_bytes == 4000  # one row: a matrix-vector product
    assert "KV cache" in str(eight)


def test_kv_term_grows_with_context_and_batch():
    base = decode_step_seconds(SHAPE, GPU, batch=8, context=0)
    longer = decode_step_seconds(SHAPE, GPU, batch=8, context=100)
    assert longer - base == pytest.approx(KV_CACHE_PASSES * 8 * 100 * 100 / 1e6, rel=0.05)


def test_cpu_adds_reads_and_flops_gpu_takes_the_larger():
    work = decode_step_work(SHAPE, batch=8, context=10, cpu=True)
    reads = (work.weight_bytes + work.kv_bytes + work.logits_bytes) / 1e6
    assert decode_step_seconds(SHAPE, CPU, batch=8, context=10, load="fp32") == pytest.approx(reads + work.flops / 1e6)
    gpu = decode_step_work(SHAPE, batch=8, context=10)
    gpu_reads = (gpu.weight_bytes + gpu.kv_bytes + gpu.logits_bytes) / 1e6
    assert decode_step_seconds(SHAPE, GPU, batch=8, context=10) == pytest.approx(max(gpu_reads, gpu.flops / 1e6))


def test_batch_8_step_is_slower_than_batch_1_but_more_tokens_per_second():
    for speed in (CPU, GPU):
        one = decode_step_seconds(SHAPE, speed, batch=1, context=32)
        eight = decode_step_seconds(SHAPE, speed, batch=8, context=32)
        assert one < eight < 8 * one


def test_tiny_llama_shape_carries_vocab_and_the_estimate_keeps_batch_1():
    est = estimate("data/tiny/llama", load="fp32", device="cpu")
    from helpers.estimator.configs import resolve_config
    from helpers.estimator.layout import layout

    config = resolve_config("data/tiny/llama")[0]
    shape = model_shape(config, layout(config), est.weights, 4)
    assert shape.vocab == 1024 and shape.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4  # k+v, 4 layers, 2 heads x 32
    t = estimate_time(est, "t4", batches=(1, 8))
    assert t.decode_tokens_per_s[8] > t.decode_tokens_per_s[1]
