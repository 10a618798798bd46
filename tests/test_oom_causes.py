"""The causes beyond PyTorch's allocator figures (issue 32): Intel's per-allocation limit, Windows' page
file, corrupted sizes, other processes (and this one under another PID), impossible figures, the
system-RAM deaths, and the sizes and devices of llama.cpp, vLLM, THC and NCCL messages. The real
messages are in tests/data/oom_messages.jsonl (test_oom_corpus.py); these pin each decision's edges."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.core.units import GiB, MiB
from helpers.oom.causes import CAUSES
from helpers.oom.diagnosis import explain_oom
from helpers.oom.messages import is_oom, is_oom_text

XPU_EMPTY = (
    "torch.OutOfMemoryError: XPU out of memory. Tried to allocate 4.66 GiB. GPU 0 has a total capacity of 5.65 GiB "
    "of which 5.65 GiB is free. Of the allocated memory 195.50 KiB is allocated by PyTorch, and 1.81 MiB is "
    "reserved by PyTorch but unallocated."
)  # intel/torch-xpu-ops#3011


def test_an_empty_intel_gpu_refusing_4_gib_is_the_per_allocation_limit_not_the_model():
    r = explain_oom(XPU_EMPTY)
    assert r.causes == ["xpu_allocation_limit"] and r.requested == round(4.66 * GiB)
    assert "chunks" in r.fixes[0] and not any("4-bit or 8-bit" in f for f in r.fixes)
    small = explain_oom(XPU_EMPTY.replace("4.66 GiB", "1.50 GiB"))  # under the limit: the usual causes
    assert "xpu_allocation_limit" not in small.causes


def test_a_full_intel_gpu_keeps_the_steady_state_fixes_after_the_limit():
    full = XPU_EMPTY.replace("of which 5.65 GiB is free", "of which 1.00 GiB is free")
    assert explain_oom(full).causes[:2] == ["xpu_allocation_limit", "steady_state"]


@pytest.mark.parametrize(
    "text",
    [
        "OSError: [WinError 1455] The paging file is too small for this operation to complete.",
        "OSError: [WinError 1455] Die Auslagerungsdatei ist zu klein, um diesen Vorgang durchzuführen.",
        "OSError: [WinError 1455] 页面文件太小，无法完成操作。",
    ],
)
def test_winerror_1455_in_any_language_is_the_commit_limit(text):
    r = explain_oom(text)
    assert r.cause == "page_file" and not r.not_oom
    assert "page file" in r.fixes[0] and "num_workers" in r.fixes[1]


def test_a_petabyte_request_is_a_corrupted_size_not_a_shortage():
    r = explain_oom("CUDA out of memory. Tried to allocate more than 1EB memory.")
    assert r.causes == ["corrupted_size"] and r.requested is None and r.requested_at_least == 1 << 60
    assert "more than 1 EiB" in str(r) and "NCCL" in r.fixes[0]
    cpu = explain_oom("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4000000000000000 bytes.")
    assert cpu.cause == "corrupted_size"
    big = explain_oom("DefaultCPUAllocator: can't allocate memory: you tried to allocate 132426121216 bytes.")
    assert big.cause == "system_ram"  # 123 GiB: a wrong shape maybe, but a real request


FOUR_RANKS = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 572.00 MiB. GPU 0 has a total capacity of 39.49 "
    "GiB of which 321.31 MiB is free. Process 3721648 has 414.00 MiB memory in use. Including non-PyTorch memory, "
    "this process has 37.46 GiB memory in use. Process 1374765 has 414.00 MiB memory in use. Process 1374763 has "
    "414.00 MiB memory in use. Process 1374764 has 414.00 MiB memory in use. Of the allocated memory 36.04 GiB is "
    "allocated by PyTorch, and 321.37 MiB is reserved by PyTorch but unallocated."
)  # awslabs/keys_values#92


def test_other_processes_holding_more_than_the_request_are_named_as_a_cause():
    r = explain_oom(FOUR_RANKS)
    assert r.causes[:2] == ["other_processes", "steady_state"]
    note = next(n for n in r.notes if n.startswith("other processes"))
    assert "1374765 (414.00 MiB)" in note and "1.62 GiB in all, 2.9x the failed request" in note
    assert "set_device(local_rank)" in r.fixes[1]
    fewer = FOUR_RANKS.replace("572.00 MiB", "2.00 GiB")  # they hold less than the request: not the cause
    assert "other_processes" not in explain_oom(fewer).causes


def test_a_live_error_compares_the_listed_pids_with_this_process():
    me = os.getpid()
    text = (
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.56 GiB of which 1.00 GiB "
        f"is free. Process {me} has 9.00 GiB memory in use. Process 19585 has 4.50 GiB memory in use. Of the "
        "allocated memory 8.50 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."
    )
    live = explain_oom(torch.OutOfMemoryError(text), live=False)
    assert live.processes == [(me, 9 * GiB), (19585, round(4.5 * GiB))]
    assert "other_processes" in live.causes or "held_elsewhere" in live.causes
    assert any("19585 (4.50 GiB)" in n and f"this process is {me}" in n for n in live.notes)
    assert any(n.startswith(f"process {me} (9.00 GiB) is this process (its own PID)") for n in live.notes)


def test_a_container_pid_holding_this_processs_share_is_not_another_process():
    text = (
        "CUDA out of memory. Tried to allocate 7.45 GiB. GPU 0 has a total capacity of 14.56 GiB of which 3.24 GiB is "
        "free. Process 1 has 11.32 GiB memory in use. Of the allocated memory 8.40 GiB is allocated by PyTorch, and "
        "2.80 GiB is reserved by PyTorch but unallocated."
    )  # AlphaGPU/leetgpu-challenges#52: PID 1 is the container's view of this process
    r = explain_oom(text)
    assert r.cause == "steady_state" and "other_processes" not in r.causes
    assert any("seen under a container's PID" in n for n in r.notes)


def test_figures_that_cannot_all_be_true_are_flagged_first():
    text = (
        "CUDA out of memory. Tried to allocate 160.00 MiB (GPU 0; 8.00 GiB total capacity; 14.25 GiB already "
        "allocated; 0 bytes free; 14.50 GiB reserved in total by PyTorch)"
    )  # sdbds/magic-animate-for-windows#26
    r = explain_oom(text)
    assert r.cause == "impossible_figures" and "Sysmem Fallback" in r.fixes[0]
    assert "impossible: 14.25 GiB allocated of a 8.00 GiB card" in r.notes
    assert "impossible" in r._repr_html_()


@pytest.mark.parametrize(
    "text, cause",
    [
        ("Loading checkpoint shards:  38%|███     | 3/8 [00:02<00:03,  1.28it/s]Killed", "killed_by_os"),
        ("load model begin.\nKilled\n", "killed_by_os"),
        ("./train.sh: line 3: 40213 Killed                  python train.py --bf16", "killed_by_os"),
        ("Process finished with exit code 137 (interrupted by signal 9: SIGKILL)", "killed_by_os"),
        ("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 8180)",
         "killed_by_os"),
        ("RuntimeError: DataLoader worker (pid 4024) is killed by signal: Killed.", "dataloader_worker_killed"),
        ("RuntimeError: DataLoader worker (pid 46794) is killed by signal: Bus error. It is possible that "
         "dataloader's workers are out of shared memory.", "shared_memory"),
        ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory "
         "(shm).", "shared_memory"),
        ("The kernel appears to have died. It will restart automatically.", "kernel_died"),
        ("The kernel for Untitled.ipynb appears to have died. It will restart automatically.", "kernel_died"),
    ],
)  # fmt: skip
def test_system_ram_deaths_get_their_cause_and_fix(text, cause):
    r = explain_oom(text)
    assert not r.not_oom and r.causes == [cause] and r.fixes == list(CAUSES[cause][1])
    assert r.figures() == [] and "unknown" not in str(r)  # a death states no figures: none listed as unknown


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: DataLoader worker (pid 77) is killed by signal: Segmentation fault.",
        "the job was killed by the user",
        "unkilled processes: 3",
    ],
)
def test_other_kills_are_not_out_of_memory(text):
    assert not is_oom_text(text) and explain_oom(text).not_oom


def test_text_only_deaths_do_not_make_a_live_exception_an_oom():
    """A retry loop asks is_oom: a DataLoader bus error is not a batch to halve."""
    bus = RuntimeError("DataLoader worker (pid 3002) is killed by signal: Bus error.")
    assert not is_oom(bus) and is_oom_text(str(bus))


@pytest.mark.parametrize(
    "text, requested, device",
    [
        ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9866.00 MiB on device 1: cudaMalloc failed: out of "
         "memory\nggml_gallocr_reserve_n: failed to allocate CUDA1 buffer of size 10345253120", 10345253120, 1),
        ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4480.00 MiB on device 3: cudaMalloc failed: out of "
         "memory", 4480 * MiB, 3),
    ],
)  # fmt: skip
def test_llama_cpp_messages_give_their_size_and_device(text, requested, device):
    r = explain_oom(text)
    assert (r.form, r.cause, r.requested, r.device) == ("ggml", "gguf_buffer", requested, device)
    assert "-ngl" in r.fixes[0]


def test_vllm_startup_check_reads_free_total_and_wanted():
    r = explain_oom(
        "ValueError: Free memory on device (14.2/79.19 GiB) on startup is less than desired GPU memory utilization "
        "(0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )
    assert (r.form, r.cause) == ("vllm", "vllm_reservation")
    assert (r.free, r.total, r.requested) == (round(14.2 * GiB), round(79.19 * GiB), round(71.27 * GiB))
    assert "at most gpu_memory_utilization=0.17 fits what was free" in r.notes


@pytest.mark.parametrize(
    "text",
    ["RuntimeError: CUDA error:out of memory", "THCudaCheck FAIL file=THCGeneral.cpp line=383 error=2 : out of memory"],
)
def test_driver_wordings_without_the_usual_spacing_are_read(text):
    assert explain_oom(text).form == "cuda_error"


def test_nccl_names_its_device_in_brackets():
    r = explain_oom("ng30903:3063028:3066152 [3] include/alloc.h:185 NCCL WARN Failed to CUDA calloc 6291456 bytes")
    assert (r.form, r.device, r.requested) == ("nccl", 3, 6291456)
