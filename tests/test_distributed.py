"""training_memory against the ZeRO paper's and DeepSpeed's formulas; a real 2-process gloo DDP QLoRA run."""

from __future__ import annotations

import pytest

from helpers.distributed import DistributedError, largest_layer_params, run_ddp_qlora, training_memory
from helpers.estimator import resolve_config

MODEL = "meta-llama/Llama-2-7b-hf"
PSI = 6_738_415_616  # Llama-2-7b's published parameter count (the hub's safetensors metadata)


def _err(got: int, want: float) -> float:
    return abs(got - want) / want


@pytest.mark.parametrize("n", [2, 4, 8])
def test_model_states_follow_the_zero_paper(n):
    """Rajbhandari et al. 2020, mixed-precision Adam (K=12): DDP 16Ψ, ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N,
    ZeRO-3/FSDP 16Ψ/N (+ the gathered largest layer)."""
    largest = largest_layer_params(resolve_config(MODEL)[0])
    want = {"ddp": 16 * PSI, "zero1": 4 * PSI + 12 * PSI / n, "zero2": 2 * PSI + 14 * PSI / n,
            "zero3": 16 * PSI / n, "fsdp": 16 * PSI / n}  # fmt: skip
    for strategy, formula in want.items():
        mem = training_memory(MODEL, strategy=strategy, world_size=n)
        assert mem.params == PSI
        assert _err(mem.model_states, formula) < 0.01, strategy
        if strategy in ("zero3", "fsdp"):
            assert mem.bytes("working") == 4 * largest


@pytest.mark.parametrize("n", [2, 8])
def test_deepspeed_estimators(n):
    """deepspeed.runtime.zero's estimate_zero2/zero3_model_states_mem_needs (cpu_offload=False), as published."""
    largest = largest_layer_params(resolve_config(MODEL)[0])
    z2 = training_memory(MODEL, strategy="zero2", world_size=n)
    z3 = training_memory(MODEL, strategy="zero3", world_size=n)
    assert _err(z2.deepspeed_gpu_bytes, 2 * PSI + 18 * PSI / n) < 0.01
    assert _err(z3.deepspeed_gpu_bytes, 4 * largest + 18 * PSI / n) < 0.01
    # our rows differ from DeepSpeed's by its fp32 gradient partition only (4Ψ/N)
    assert _err(z2.deepspeed_gpu_bytes - z2.model_states, 4 * PSI / n) < 0.01
    deepspeed = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    _, gpu = deepspeed.estimate_zero2_model_states_mem_needs(PSI, num_gpus_per_node=n, cpu_offload=False)
    assert _err(z2.deepspeed_gpu_bytes, gpu) < 0.01


def test_qlora_replicates_the_4bit_base_under_ddp():
    one = training_memory(MODEL, strategy="single", qlora=True)
    ddp = training_memory(MODEL, strategy="ddp", world_size=2, qlora=True)
    fsdp = training_memory(MODEL, strategy="fsdp", world_size=2, qlora=True, quant_storage_sharded=True)
    assert ddp.bytes("base") == one.bytes("base") and fsdp.bytes("base") == one.bytes("base") // 2
    assert ddp.trainable < ddp.params // 100 and "replicated" in ddp.notes[0]
    assert ddp.bytes("comm") == ddp.bytes("states.grads")


def test_bad_inputs():
    with pytest.raises(DistributedError, match="unknown strategy"):
        training_memory(MODEL, strategy="zero4", world_size=2)
    with pytest.raises(DistributedError, match="one GPU"):
        training_memory(MODEL, strategy="single", world_size=2)


@pytest.mark.slow
def test_ddp_qlora_on_two_cpu_processes(tiny_llama, tmp_path):
    run = run_ddp_qlora(str(tiny_llama), tmp_path, num_processes=2, steps=6, seq_len=32)
    assert [r.rank for r in run.ranks] == [0, 1] and {r.backend for r in run.ranks} == {"gloo"}
    assert run.loss_fell and run.in_sync, str(run)
    assert all(r.peak_rss > 0 and len(r.rss) == 6 for r in run.ranks)
    assert "rank 1/2" in str(run) and "<table" in run._repr_html_()


@pytest.mark.slow
def test_ddp_through_torchrun(tiny_llama, tmp_path):
    """The launcher a notebook falls back to once CUDA is initialised: torchrun on python -m helpers.distributed."""
    run = run_ddp_qlora(str(tiny_llama), tmp_path, num_processes=2, via="subprocess", steps=3, seq_len=32)
    assert len(run.ranks) == 2 and run.in_sync and run.loss_fell
