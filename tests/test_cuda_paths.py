"""CUDA-only branches of helpers/ that had no test (issue 21); skipped without a GPU, run by
``make gpu-check`` (stage pytest_cuda) on one."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from helpers.core.units import GiB, MiB

pytestmark = pytest.mark.cuda


@contextlib.contextmanager
def capped(fraction: float):
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        yield int(torch.cuda.get_device_properties(0).total_memory * fraction)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _t4_fraction() -> float:
    from helpers.core.devices import DEVICES

    return min(1.0, DEVICES["t4"]["capacity"] / torch.cuda.get_device_properties(0).total_memory)


def test_gpu_readout_mem_get_info_and_nvml_agree():
    from helpers.core.memory import gpu_readouts

    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    g = gpu_readouts(processes=True)[0]
    free, total = torch.cuda.mem_get_info(0)
    assert g.total == total and abs(g.free - free) < 256 * MiB
    assert g.allocated >= 64 * MiB and g.reserved >= g.allocated and g.peak_reserved >= g.reserved
    assert g.used >= g.reserved and g.non_pytorch >= 0
    if g.processes:  # NVML sees this process (unless a container hides its PID)
        mine = [p for p in g.processes if p.pid == os.getpid()]
        assert not mine or mine[0].used is None or mine[0].used >= g.reserved
    del x


def test_estimate_current_device_reads_the_per_process_cap():
    from helpers.estimator.core import estimate

    with capped(_t4_fraction()) as cap:
        est = estimate("TinyLlama/TinyLlama-1.1B-Chat-v1.0", load="nf4", device="current")
        assert abs(est.capacity - cap) <= 1 and "capped" in est.device
    uncapped = estimate("TinyLlama/TinyLlama-1.1B-Chat-v1.0", load="nf4", device="current")
    assert uncapped.capacity == torch.cuda.get_device_properties(0).total_memory


def _oom_under_cap(cap: int):
    hold = torch.empty(max(0, cap - torch.cuda.memory_reserved() - GiB), dtype=torch.uint8, device="cuda")
    torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    del hold


def test_explain_oom_on_a_live_cuda_oom_under_a_cap():
    from helpers.oom.diagnosis import explain_oom
    from helpers.oom.messages import is_oom

    with capped(_t4_fraction()) as cap:
        with pytest.raises(torch.OutOfMemoryError) as info:
            _oom_under_cap(cap)
        assert is_oom(info.value)
        report = explain_oom(info.value)
    assert report.form.startswith("cuda") and report.cause == "process_cap", report
    assert report.requested == 2 * GiB and report.total and report.process_cap
    assert report.unknown == [], report.unknown
    assert report.snapshot is not None and report.snapshot.gpu is not None
    del info


def test_cleanup_regains_what_an_oom_traceback_pinned():
    from helpers.oom.reclaim import cleanup

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    with capped(_t4_fraction()) as cap:
        try:
            _oom_under_cap(cap)
        except torch.OutOfMemoryError as e:
            sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        pinned = torch.cuda.memory_allocated() - base
        reserved_before = torch.cuda.memory_reserved()
        report = cleanup()
    assert pinned > GiB, "the traceback should pin the held block"
    assert report.gpu_allocated_freed >= 0.95 * pinned
    assert torch.cuda.memory_reserved() < reserved_before and report.gpu_reserved_freed >= 0.95 * pinned
    assert sys.last_value is None


def test_release_after_oom_collects_only_when_the_failed_call_is_pinned():
    from helpers.oom.reclaim import release_after_oom

    base = torch.cuda.memory_allocated()
    assert release_after_oom(baseline=base) is False  # nothing above the baseline: no full collection
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert release_after_oom(baseline=base) is True
    del keep


def test_find_max_batch_size_on_real_cuda_ooms():
    from helpers.oom.batch_size import find_max_batch_size

    with capped(_t4_fraction()) as cap:
        per = 256 * MiB
        true_max = (cap - torch.cuda.memory_reserved()) // per

        def step(b: int) -> None:
            torch.empty(b * per, dtype=torch.uint8, device="cuda")

        search = find_max_batch_size(step, limit=4096)
    assert search.oom_trials >= 1 and 0.9 * true_max <= search.max_ok <= true_max


def test_load_report_measures_the_cuda_allocation(tiny_llama):
    from helpers.estimator.footprint import footprint
    from helpers.loading.loader import load

    model, _, report = load(str(tiny_llama), load="fp16", device_map={"": 0})
    assert next(model.parameters()).device.type == "cuda"
    assert report.cuda_allocated is not None and abs(report.cuda_allocated - footprint(model)) <= 64 * 1024
    del model


def test_precision_and_optimizer_follow_the_gpu():
    from helpers.loading.plan import auto_compute_dtype
    from helpers.training.plan import TrainPlan

    major = torch.cuda.get_device_capability()[0]
    assert auto_compute_dtype() == ("bf16" if major >= 8 else "fp16")
    plan = TrainPlan("m")
    assert plan.resolved_precision() == auto_compute_dtype()
    assert plan.resolved_optimizer() == "paged_adamw_8bit"


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_a_bitsandbytes_layer_offloaded_along_a_device_map_stays_unquantized_and_runs(tiny_llama, mode):
    """The path an accepted one-card offload loads (its checked device map with the CPU, and
    llm_int8_enable_fp32_cpu_offload): the CPU layer is a plain Linear in the compute dtype, as the RAM
    check sized it, and generation runs through accelerate's offload hook. Read from transformers'
    and accelerate's code and tried on CPU; this is the GPU proof (issue 21)."""
    from helpers.loading.loader import load
    from helpers.loading.plan import LoadPlan

    layout = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
              "model.layers.2": "cpu", "model.layers.3": 0, "model.norm": 0, "lm_head": 0}  # fmt: skip
    plan = LoadPlan(str(tiny_llama), load=mode, compute_dtype="fp16", device_map=layout, allow_offload=True)
    model, tok, report = load(plan)
    offloaded = model.model.layers[2].self_attn.q_proj
    assert type(offloaded) is torch.nn.Linear and offloaded.weight.dtype == torch.float16
    assert type(model.model.layers[0].self_attn.q_proj).__module__.startswith("bitsandbytes")  # quantized on the GPU
    assert report.placement.get("cpu", 0) > 0
    ids = tok(["hello"], return_tensors="pt").to("cuda:0")
    assert model.generate(**ids, max_new_tokens=4).shape[1] == ids["input_ids"].shape[1] + 4
    del model
