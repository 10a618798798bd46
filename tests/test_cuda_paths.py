"""CUDA-only branches of helpers/ that had no test (issue 21); skipped without a GPU, run by
``make gpu-check`` (stage pytest_cuda) on one."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from helpers.units import GiB, MiB

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
    from helpers.devices import DEVICES

    return min(1.0, DEVICES["t4"]["capacity"] / torch.cuda.get_device_properties(0).total_memory)


def test_gpu_readout_mem_get_info_and_nvml_agree():
    from helpers.memory import gpu_readouts

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
    from helpers.estimator import estimate

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
    from helpers.oom import explain_oom, is_oom

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
    from helpers.reclaim import cleanup

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
    from helpers.reclaim import release_after_oom

    base = torch.cuda.memory_allocated()
    assert release_after_oom(baseline=base) is False  # nothing above the baseline: no full collection
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert release_after_oom(baseline=base) is True
    del keep


def test_find_max_batch_size_on_real_cuda_ooms():
    from helpers.batch_size import find_max_batch_size

    with capped(_t4_fraction()) as cap:
        per = 256 * MiB
        true_max = (cap - torch.cuda.memory_reserved()) // per

        def step(b: int) -> None:
            torch.empty(b * per, dtype=torch.uint8, device="cuda")

        search = find_max_batch_size(step, limit=4096)
    assert search.oom_trials >= 1 and 0.9 * true_max <= search.max_ok <= true_max


def test_load_report_measures_the_cuda_allocation(tiny_llama):
    from helpers.estimator import footprint
    from helpers.loading import load

    model, _, report = load(str(tiny_llama), load="fp16", device_map={"": 0})
    assert next(model.parameters()).device.type == "cuda"
    assert report.cuda_allocated is not None and abs(report.cuda_allocated - footprint(model)) <= 64 * 1024
    del model


def test_precision_and_optimizer_follow_the_gpu():
    from helpers.finetune import TrainPlan
    from helpers.loading import auto_compute_dtype

    major = torch.cuda.get_device_capability()[0]
    assert auto_compute_dtype() == ("bf16" if major >= 8 else "fp16")
    plan = TrainPlan("m")
    assert plan.resolved_precision() == auto_compute_dtype()
    assert plan.resolved_optimizer() == "paged_adamw_8bit"
