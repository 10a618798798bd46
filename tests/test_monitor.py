"""MemoryMonitor (sampling thread, marks, CSV, plot, threshold warnings) and MemoryCallback."""

from __future__ import annotations

import csv
import dataclasses
import io
import time

import psutil
import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from helpers.monitor import Mark, MemoryCallback, MemoryMonitor, Sample
from helpers.units import MiB


def test_samples_in_the_background_and_marks():
    with MemoryMonitor(interval=0.01, warn=False) as mon:
        mon.mark("start")
        # 64 MiB: above glibc's largest mmap threshold (32 MiB), so fresh pages that RSS must show,
        # not memory an earlier test freed and the process kept
        big = torch.ones(64 * MiB // 4)
        rss_alive = psutil.Process().memory_info().rss
        seen = len(mon.samples)
        deadline = time.monotonic() + 10  # a loaded machine may run the thread late: wait for samples, not time
        while len(mon.samples) < seen + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        mon.mark("allocated")
        del big
    n = len(mon.samples)
    assert n >= 5 and [m.label for m in mon.marks] == ["start", "allocated"]
    assert all(b.t >= a.t for a, b in zip(mon.samples, mon.samples[1:]))
    time.sleep(0.05)
    assert len(mon.samples) == n  # stopped means stopped
    first = mon.samples[0].process_rss
    assert rss_alive >= first + 48 * MiB
    assert mon.peak()["process_rss"] >= rss_alive - 4 * MiB  # the samples saw it
    assert "samples" in str(mon) and "<table" in mon._repr_html_()


def test_csv_and_plot(tmp_path):
    mon = MemoryMonitor(interval=1, warn=False)
    for _ in range(3):
        mon.sample()
    mon.mark("step")
    text = mon.to_csv(tmp_path / "mem.csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert (tmp_path / "mem.csv").read_text() == text
    assert len(rows) == 5 and [r["mark"] for r in rows].count("step") == 1
    assert int(rows[0]["process_rss"]) == mon.samples[0].process_rss
    fig = mon.plot()
    ax = fig.axes[0]
    assert len(ax.lines) >= 3 and ax.get_ylabel() in ("GiB", "MiB")  # series + threshold + mark
    assert any("peak" in t.get_text() for t in ax.texts) and any(t.get_text() == "step" for t in ax.texts)


def test_plot_keeps_lines_readable_and_marks_apart():
    """A threshold far above the data is named in the legend, not drawn (it squashed the lines flat), and
    marks at the same moment share one label (they were printed over each other)."""
    mon = MemoryMonitor(interval=1, warn=False, capacity=1 << 50)
    for _ in range(6):
        mon.sample()
    mon.samples = [dataclasses.replace(s, t=2.0 * i) for i, s in enumerate(mon.samples)]  # a 10 s run
    mon.marks = [Mark(0.0, "train from step 0"), Mark(5.0, "checkpoint 4"), Mark(9.9, "checkpoint 8"),
                 Mark(10.0, "train end")]  # fmt: skip
    ax = mon.plot().axes[0]
    marks = [t.get_text() for t in ax.texts if "peak" not in t.get_text()]
    assert marks == ["train from step 0", "checkpoint 4", "checkpoint 8 · train end"]
    top = max(max(s.process_rss, s.ram_used) for s in mon.samples)
    unit = {"GiB": 2**30, "MiB": 2**20}[ax.get_ylabel()]
    assert top < ax.get_ylim()[1] * unit < 1.2 * top  # scaled to the data, not to the far threshold
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("above the chart" in text for text in legend)


def test_threshold_crossing_names_the_largest_tensor():
    hog = torch.zeros(8 * MiB // 4)  # noqa: F841 - the tensor the warning must name
    mon = MemoryMonitor(interval=1, capacity=1 * MiB, threshold=0.9)
    with pytest.warns(ResourceWarning, match="crossed 90%"):
        mon.sample()
    mon.sample()  # still above: no second warning
    assert len(mon.crossings) == 1
    top = mon.crossings[0].top
    assert any(b >= 8 * MiB and "(2097152,)" in desc for _, b, desc in top), top
    with pytest.raises(ValueError, match="threshold"):
        MemoryMonitor(threshold=1.5)


def test_bad_settings_say_what_to_pass():
    for bad in (0, -1, "1", None):
        with pytest.raises(ValueError, match="interval is in seconds and must be a positive number"):
            MemoryMonitor(interval=bad)
    with pytest.raises(ValueError, match=r"for 90 %, pass 0.9"):
        MemoryMonitor(threshold=90)
    for bad in (-1, "15GiB"):
        with pytest.raises(ValueError, match="capacity is a positive number of bytes"):
            MemoryMonitor(capacity=bad)


def _log(cb, step, state):
    state.global_step = step
    logs = {"loss": 1.0}
    state.log_history.append({**logs, "step": step})
    cb.on_log(TrainingArguments("unused", report_to="none"), state, TrainerControl(), logs=logs)
    return logs


def test_callback_reports_steady_growth_once():
    level = [100 * MiB]

    def grow():
        level[0] += 4 * MiB
        return level[0]

    cb = MemoryCallback(measure=grow, warmup=1, window=4)
    state = TrainerState()
    with pytest.warns(ResourceWarning, match="LEAK"):
        for step in range(1, 12):
            logs = _log(cb, step, state)
    assert len(cb.leaks) == 1 and "step 6" in cb.leaks[0]
    assert "ram_rss_mib" in logs and state.log_history[-1]["ram_rss_mib"] == logs["ram_rss_mib"]


def test_callback_is_quiet_on_flat_memory():
    cb = MemoryCallback(measure=lambda: 100 * MiB, warmup=1, window=4)
    state = TrainerState()
    for step in range(1, 12):
        _log(cb, step, state)
    assert cb.leaks == []


@pytest.mark.cuda
def test_cuda_figures():
    mon = MemoryMonitor(interval=1, warn=False)
    before = mon.sample()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    s = mon.sample()
    assert s.allocated - before.allocated >= 64 * MiB and s.reserved >= s.allocated
    assert s.device_used is None or s.device_used >= s.reserved
    cb = MemoryCallback()
    del x
    figures = cb.figures()
    assert {"mem_allocated_mib", "mem_reserved_mib", "mem_peak_mib", "ram_rss_mib"} <= set(figures)
    assert figures["mem_peak_mib"] >= 64  # the peak since the last log still sees the freed tensor


def test_storage_is_bounded_and_no_peak_is_lost():
    mon = MemoryMonitor(interval=1, warn=False, max_samples=64)
    for i in range(1000):
        mon._keep(Sample(float(i), allocated=(5 * MiB if i == 10 else i), reserved=0, device_used=None,
                         ram_used=0, process_rss=0))  # fmt: skip
    assert len(mon.samples) <= 64
    assert [s.t for s in mon.samples] == sorted(s.t for s in mon.samples)
    assert mon.peak()["allocated"] == 5 * MiB  # the early spike survives the merging
    assert mon.peak(since=999)["allocated"] == 999  # recent samples keep their own times
    assert mon.peak(since=500)["allocated"] >= 999  # a merged span is never under-reported


def test_merging_is_spread_over_many_samples():
    """The old half is merged a few hundred pairs per sample, not in one call (50,000 pairs in one
    call stalled the sampling thread, GIL held, for 0.15-0.25 s)."""
    mon = MemoryMonitor(interval=1, warn=False, max_samples=4000)
    merged_per_call = []
    for i in range(12000):
        before = len(mon.samples)
        mon._keep(Sample(float(i), i, 0, None, 0, 0))
        merged_per_call.append(before + 1 - len(mon.samples))
        assert len(mon.samples) <= 4000
    assert 0 < max(merged_per_call) <= 256  # pairs merged in any one call (the old half is 2,000)
    assert mon.peak()["allocated"] == 11999 and [s.t for s in mon.samples] == sorted(s.t for s in mon.samples)


def test_peak_since_never_misses_a_spike_while_the_sampling_thread_merges():
    """peak(since) bisects the samples; the sampling thread merges them in place: without a shared lock a
    reader could land past the spike (the reviewer saw 14 misses in 1,556 calls)."""
    import threading

    mon = MemoryMonitor(interval=1, warn=False, max_samples=2000)
    for i in range(2000):
        mon._keep(Sample(float(i), 10 * MiB if i == 1500 else 0, 0, None, 0, 0))
    stop = threading.Event()

    def writer():
        i = 2000
        while not stop.is_set() and i < 400_000:
            mon._keep(Sample(float(i), 0, 0, None, 0, 0))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        misses = sum(mon.peak(since=1499.5)["allocated"] < 10 * MiB for _ in range(3000))
    finally:
        stop.set()
        t.join()
    assert misses == 0


def test_importing_the_monitor_does_not_import_the_trainer():
    import subprocess
    import sys

    code = "import sys, helpers.monitor; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_interval_is_finite_and_not_below_the_floor():
    for bad in (float("nan"), float("inf"), 0.001):
        with pytest.raises(ValueError, match="interval"):
            MemoryMonitor(interval=bad)
