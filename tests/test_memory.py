import sys

import psutil
import pytest
import torch

from helpers.core.memory import GPUProcess, GPUReadout, MemorySnapshot, RAMReadout, snapshot
from helpers.core.units import GiB, MiB


def test_snapshot_on_cpu_says_there_is_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    snap = snapshot()
    assert snap.backend in ("cpu", "mps") and snap.gpus == [] and snap.gpu is None
    assert "no CUDA" in str(snap) or "MPS" in str(snap)


def test_snapshot_ram_matches_psutil(monkeypatch):
    """The readout is psutil's (a fixed reading: other processes on a busy machine move the real one
    between two reads); this process's RSS lies between two reads of its own, taken around the snapshot."""
    real = psutil.virtual_memory()
    fixed = real._replace(total=64 * GiB, available=10 * GiB + 123)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fixed)
    low = psutil.Process().memory_info().rss
    snap = snapshot()
    high = psutil.Process().memory_info().rss
    assert snap.ram.total == 64 * GiB and snap.ram.available == 10 * GiB + 123
    assert min(low, high) - 64 * MiB <= snap.ram.process_rss <= max(low, high) + 64 * MiB


def test_snapshot_disks_cover_hf_cache_and_working_dir():
    labels = {d.label for d in snapshot().disks}
    assert labels == {"HF cache", "working dir"}
    assert all(0 < d.free <= d.total for d in snapshot().disks)


def t4(allocated=0, reserved=0, free=None, processes=None) -> GPUReadout:
    total = int(14.74 * GiB)
    return GPUReadout(
        0,
        "Tesla T4",
        (7, 5),
        total,
        free if free is not None else total - reserved - 300 * MiB,
        allocated,
        reserved,
        allocated,
        reserved,
        processes,
    )


def test_gpu_readout_derived_figures():
    g = t4(allocated=2 * GiB, reserved=3 * GiB, free=int(14.74 * GiB) - 3 * GiB - 5 * GiB)
    assert g.reserved_unallocated == 1 * GiB
    assert g.non_pytorch == 5 * GiB  # total - free - reserved
    assert g.used == 8 * GiB
    assert not g.supports_bf16


def test_snapshot_str_and_html_show_gpu_figures():
    snap = MemorySnapshot(
        "cuda",
        [t4(1 * GiB, 2 * GiB, processes=[GPUProcess(42, 3 * GiB, "python")])],
        RAMReadout(12 * GiB, 10 * GiB, 2 * GiB, 1 * GiB),
    )
    text = str(snap)
    assert "Tesla T4" in text and "1.00 GiB allocated" in text and "process 42 python: 3.00 GiB" in text
    html = snap._repr_html_()
    assert "Tesla T4" in html and "System RAM" in html
    assert len(text.splitlines()) < 25  # fits one screen
    assert snap.to_dict()["gpus"][0]["reserved_unallocated"] == 1 * GiB


def test_a_two_gpu_machine_gets_one_bar_and_one_row_per_card(fake_gpus):
    """Kaggle's 2xT4: each card read on its own (a model split over both fills them unevenly)."""
    cuda = fake_gpus(2, 15 * GiB)
    cuda.set(0, 9 * GiB, 10 * GiB)
    cuda.set(1, 2 * GiB, 3 * GiB)
    snap = snapshot(processes=False)
    assert [(g.index, g.allocated, g.reserved) for g in snap.gpus] == [(0, 9 * GiB, 10 * GiB), (1, 2 * GiB, 3 * GiB)]
    text, html = str(snap), snap._repr_html_()
    assert "GPU 0: Tesla T4" in text and "GPU 1: Tesla T4" in text
    assert "9.00 GiB allocated" in text and "2.00 GiB allocated" in text
    assert html.count("GPU 0 Tesla T4") == 1 and html.count("GPU 1 Tesla T4") == 1


@pytest.mark.cuda
def test_snapshot_on_cuda_tracks_an_allocation():
    before = snapshot().gpu.allocated
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    after = snapshot()
    assert after.gpu.allocated - before >= 256 * MiB
    assert after.gpu.free <= after.gpu.total
    del x


def test_nvml_handle_matches_the_torch_device_by_uuid(monkeypatch):
    """NVML counts devices in PCI order and ignores CUDA_VISIBLE_DEVICES: torch's device 0 may be NVML's 1."""
    import types

    from helpers.core.memory import nvml_handle

    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(("uuid", uuid)) or "by-uuid",
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("index", i)) or "by-index",
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(uuid="5f1c2d3e-0000-1111-2222-333344445555"),
    )
    assert nvml_handle(0) == (fake, "by-uuid")
    assert calls == [("uuid", b"GPU-5f1c2d3e-0000-1111-2222-333344445555")]

    def no_uuid(i):
        raise RuntimeError("no such device")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_uuid)
    calls.clear()
    assert nvml_handle(1) == (fake, "by-index") and calls == [("index", 1)]


def test_all_sums_every_gpu_for_the_readouts_a_split_model_needs(monkeypatch):
    """A model split over two cards: cleanup's report, the cell accounting and the load report add
    both cards up (they read GPU 0 alone before, so half of an unload went unreported)."""
    from helpers.core import memory
    from helpers.monitoring.cellstats import CellStats
    from helpers.oom import reclaim

    per_gpu = {"alloc": {0: 5 * MiB, 1: 7 * MiB}, "res": {0: 8 * MiB, 1: 9 * MiB}, "peak": {0: 6 * MiB, 1: 7 * MiB}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: per_gpu["alloc"][d or 0])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: per_gpu["res"][d or 0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: per_gpu["peak"][d or 0])
    assert memory.allocated() == 5 * MiB and memory.allocated(1) == 7 * MiB
    assert memory.allocated("all") == 12 * MiB and memory.reserved("all") == 17 * MiB
    assert memory.peak_allocated("all") == 13 * MiB
    assert reclaim.counters()[:2] == (12 * MiB, 17 * MiB)
    assert CellStats._gpu() == (12 * MiB, 13 * MiB)
