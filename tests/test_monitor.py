"""MemoryMonitor (sampling thread, marks, CSV, plot, threshold warnings) and MemoryCallback."""

from __future__ import annotations

import csv
import dataclasses
import io
import subprocess
import sys
import time

import psutil
import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from helpers.core.units import MiB
from helpers.monitoring.memory_callback import MemoryCallback
from helpers.monitoring.monitor import Mark, MemoryMonitor, MemoryWarning, Sample


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
    with pytest.warns(MemoryWarning, match="crossed 90%"):
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
    with pytest.warns(MemoryWarning, match="LEAK"):
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

    code = "import sys, helpers.monitoring.monitor; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_interval_is_finite_and_not_below_the_floor():
    for bad in (float("nan"), float("inf"), 0.001):
        with pytest.raises(ValueError, match="interval"):
            MemoryMonitor(interval=bad)


def _two_cards(fake_gpus, monkeypatch):
    import helpers.monitoring.monitor

    monkeypatch.setattr(helpers.monitoring.monitor, "nvml_handle", lambda index: (None, None))  # no driver view here
    return fake_gpus(2, 15 * 2**30)


def test_a_split_model_filling_the_second_card_is_caught_on_that_card(fake_gpus, monkeypatch):
    """A model split over Kaggle's 2×T4: GPU 1 reaches 95 % while GPU 0 holds 2 GiB. Watching GPU 0
    (the old default) saw nothing; the totals (17 GiB) against one card would have cried wolf at 57 %
    on GPU 1 alone. Each card is judged on its own and the warning names the card."""
    cuda = _two_cards(fake_gpus, monkeypatch)
    mon = MemoryMonitor(interval=1, warn=False, top=1)
    assert mon.devices == (0, 1) and mon.capacities == {0: 15 * 2**30, 1: 15 * 2**30}
    cuda.set(0, 2 * 2**30, 2 * 2**30)
    cuda.set(1, 8 * 2**30, 8 * 2**30)
    mon.sample()
    assert mon.crossings == []  # 13 % and 53 %
    cuda.set(1, 14 * 2**30, int(14.3 * 2**30))
    s = mon.sample()
    assert [(c.device, c.what) for c in mon.crossings] == [(1, "GPU 1 memory crossed 90%")]
    assert "GPU 1 memory" in str(mon.crossings[0])
    assert (s.allocated, s.reserved) == (16 * 2**30, int(16.3 * 2**30))  # the totals add the cards up
    assert [(g.index, g.allocated) for g in s.gpus] == [(0, 2 * 2**30), (1, 14 * 2**30)]
    mon.sample()
    assert len(mon.crossings) == 1  # once per crossing, per card
    cuda.set(0, int(13.8 * 2**30), int(13.8 * 2**30))
    mon.sample()
    assert [c.device for c in mon.crossings] == [1, 0]  # GPU 0 crosses in its own right

    assert mon.peak_by_gpu() == {
        0: {"allocated": int(13.8 * 2**30), "reserved": int(13.8 * 2**30), "device_used": 0},
        1: {"allocated": 14 * 2**30, "reserved": int(14.3 * 2**30), "device_used": 0},
    }
    assert "GPU 0 allocated 13.80 GiB" in str(mon) and "GPU 1 allocated 14.00 GiB" in str(mon)
    assert "GPU 1 reserved" in mon._repr_html_()


def test_each_card_has_its_csv_columns_and_plot_lines(fake_gpus, monkeypatch):
    cuda = _two_cards(fake_gpus, monkeypatch)
    mon = MemoryMonitor(interval=1, warn=False)
    for gib in (1, 3, 2):
        cuda.set(0, gib * 2**30)
        cuda.set(1, 2 * gib * 2**30)
        mon.sample()
    mon.mark("step")
    rows = list(csv.DictReader(io.StringIO(mon.to_csv())))
    samples, marks = [r for r in rows if not r["mark"]], [r for r in rows if r["mark"]]
    assert [int(r["gpu1_allocated"]) for r in samples[:3]] == [2 * 2**30, 6 * 2**30, 4 * 2**30]
    assert [int(r["allocated"]) for r in samples[:3]] == [3 * 2**30, 9 * 2**30, 6 * 2**30]
    assert [(r["mark"], r["gpu1_allocated"]) for r in marks] == [("step", "")]
    labels = [line.get_label() for line in mon.plot().axes[0].lines]
    assert labels[:4] == ["GPU 0 allocated", "GPU 0 reserved", "GPU 1 allocated", "GPU 1 reserved"]
    assert any("(GPU 0, 1)" in label for label in labels)  # one threshold line for two equal cards


def test_merging_keeps_each_cards_peak(fake_gpus, monkeypatch):
    cuda = _two_cards(fake_gpus, monkeypatch)
    mon = MemoryMonitor(interval=1, warn=False, max_samples=8)
    for i in range(40):
        cuda.set(0, (100 + (i == 3) * 50) * MiB)  # one spike per card, long merged away in time
        cuda.set(1, (200 + (i == 5) * 70) * MiB)
        cuda.peak = dict.fromkeys(cuda.peak, 0)
        mon.sample()
    assert len(mon.samples) <= 16
    assert max(s.gpus[0].allocated for s in mon.samples) == 150 * MiB
    assert max(s.gpus[1].allocated for s in mon.samples) == 270 * MiB
    assert mon.peak_by_gpu(since=0.001)[1]["allocated"] >= 200 * MiB


def test_watching_one_card_or_a_card_that_is_not_there(fake_gpus, monkeypatch):
    cuda = _two_cards(fake_gpus, monkeypatch)
    cuda.set(1, 5 * 2**30)
    mon = MemoryMonitor(interval=1, warn=False, device=1)
    s = mon.sample()
    assert mon.devices == (1,) and s.allocated == 5 * 2**30 and s.gpus == ()  # one card: the totals are its own
    assert mon.peak_by_gpu() == {1: {"allocated": 5 * 2**30, "reserved": 5 * 2**30, "device_used": 0}}
    assert MemoryMonitor(device=torch.device("cuda:1"), warn=False).devices == (1,)
    with pytest.raises(ValueError, match="has 2 GPU"):
        MemoryMonitor(device=2)


def test_callback_on_two_cards_logs_each_cards_peak_and_resets_both(fake_gpus, monkeypatch):
    cuda = _two_cards(fake_gpus, monkeypatch)
    cb = MemoryCallback(warmup=1, window=4)
    cuda.set(0, 3 * 2**30)
    cuda.set(1, 5 * 2**30)
    cuda.peak[1] = 6 * 2**30  # a spike between two logs
    logs = {"loss": 1.0}
    cb.on_log(None, TrainerState(), TrainerControl(), logs=logs)  # (TrainingArguments would look for the GPU)
    assert logs["mem_allocated_mib"] == 8 * 1024 and logs["mem_peak_mib"] == 9 * 1024
    assert logs["mem_gpu0_peak_mib"] == 3 * 1024 and logs["mem_gpu1_peak_mib"] == 6 * 1024
    assert sorted(cuda.resets) == [0, 1] and cuda.peak[1] == 5 * 2**30  # both cards' peaks start over
    assert cb.measure() == 8 * 2**30  # growth is watched on every card


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (Kaggle's 2×T4)")
def test_on_two_real_gpus_the_second_cards_memory_is_seen_as_its_own():
    mon = MemoryMonitor(interval=1, warn=False)
    before = mon.sample()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:1")
    s = mon.sample()
    assert s.gpus[1].allocated - before.gpus[1].allocated >= 64 * MiB
    assert s.gpus[0].allocated == before.gpus[0].allocated
    del x


def _driver_view(monkeypatch, used: dict[int, int]):
    """NVML as the driver reports each card (``used[i]``: every process on card i, context included)."""
    import types

    import helpers.monitoring.monitor

    nvml = types.SimpleNamespace(nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=used[handle]))
    monkeypatch.setattr(helpers.monitoring.monitor, "nvml_handle", lambda index: (nvml, index))


def test_each_card_is_judged_on_the_drivers_view_and_plotted_with_it(fake_gpus, monkeypatch):
    """The threshold reads what the driver says a card holds (the context and other processes count):
    GPU 1 at 12.6 GiB reserved but 13.77 GiB used crosses 90 % of 15 GiB, and its plot shows that line."""
    cuda = fake_gpus(2, 15 * 2**30)
    used = {0: 1 * 2**30, 1: int(13.77 * 2**30)}
    _driver_view(monkeypatch, used)
    cuda.set(1, 12 * 2**30, int(12.6 * 2**30))
    mon = MemoryMonitor(interval=1, warn=False)
    s = mon.sample()
    assert [c.device for c in mon.crossings] == [1] and mon.crossings[0].used == used[1]
    assert s.device_used == used[0] + used[1] and s.gpus[1].device_used == used[1]
    labels = [line.get_label() for line in mon.plot().axes[0].lines]
    assert "GPU 1 used (NVML)" in labels and "GPU 0 used (NVML)" in labels
    assert "GPU 1 device used" in mon._repr_html_() and "GPU 0 allocated" in mon._repr_html_()  # idle card shown too
    assert mon.capacity == 30 * 2**30 and mon.used(s) == s.device_used  # the totals against every card's total


def test_peak_since_counts_only_the_samples_after_it(fake_gpus, monkeypatch):
    cuda = _two_cards(fake_gpus, monkeypatch)
    mon = MemoryMonitor(interval=1, warn=False)
    cuda.set(1, 9 * 2**30)
    mon.sample()  # a spike before the window
    cuda.set(1, 1 * 2**30)
    cuda.peak = dict.fromkeys(cuda.peak, 0)
    since = mon.sample().t
    cuda.set(1, 2 * 2**30)
    mon.sample()
    assert mon.peak_by_gpu(since)[1]["allocated"] == 2 * 2**30
    assert mon.peak_by_gpu()[1]["allocated"] == 9 * 2**30


def test_devices_are_taken_as_torch_names_them(fake_gpus, monkeypatch):
    import numpy as np

    _two_cards(fake_gpus, monkeypatch)
    for device in ("cuda:1", torch.device("cuda:1"), np.int64(1), [1], (1, 1)):
        assert MemoryMonitor(device=device, warn=False).devices == (1,), device
    assert MemoryMonitor(device="cuda", warn=False).devices == (0,)  # the current card
    assert MemoryMonitor(device=[1, "cuda:0"], warn=False).devices == (1, 0)
    for bad in ([], "cpu", 2, -1, True, "cuda:7"):
        with pytest.raises(ValueError, match="device="):
            MemoryMonitor(device=bad)


def test_a_single_card_that_is_not_gpu_0_is_named(fake_gpus, monkeypatch):
    cuda = _two_cards(fake_gpus, monkeypatch)
    mon = MemoryMonitor(interval=1, warn=False, device=1)
    cuda.set(1, 14 * 2**30)
    mon.sample()
    assert [(c.device, c.what) for c in mon.crossings] == [(1, "GPU 1 memory crossed 90%")]


def test_the_callback_watches_every_card_whatever_its_monitor_watches(fake_gpus, monkeypatch):
    cuda = _two_cards(fake_gpus, monkeypatch)
    cb = MemoryCallback(MemoryMonitor(interval=1, warn=False, device=1))
    cuda.set(0, 5 * 2**30)  # training on GPU 0, the monitor watching GPU 1
    assert cb.devices == (0, 1) and cb.measure() == 5 * 2**30


def test_memory_warnings_are_shown_under_pythons_default_filters():
    """ResourceWarning is ignored by default (Colab, Kaggle, scripts): a crossing would go unseen."""
    code = "import warnings\nfrom helpers.monitoring.monitor import MemoryWarning\nwarnings.warn('GPU 1 memory crossed', MemoryWarning)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "MemoryWarning: GPU 1 memory crossed" in done.stderr


# -- phases ------------------------------------------------------------------------------------------


def test_phases_record_order_and_spans():
    mon = MemoryMonitor(interval=10, warn=False)
    with mon.phase("load"):
        time.sleep(0.01)
    with mon.phase("prefill"):
        pass
    with pytest.raises(RuntimeError), mon.phase("decode"):
        raise RuntimeError("closed all the same")
    assert [p.label for p in mon.phases] == ["load", "prefill", "decode"]
    assert all(p.end is not None and p.end >= p.start for p in mon.phases)
    assert mon.phases[0].duration >= 0.01
    assert mon.phases[0].end <= mon.phases[1].start <= mon.phases[1].end <= mon.phases[2].start
    assert len(mon.samples) == 6  # one at each boundary
    assert [row[:2] for row in mon.phase_table()] == [("load", 1), ("prefill", 1), ("decode", 1)]
    assert "3 phases" in str(mon) and "prefill" in mon.timeline()


def test_plot_shades_one_span_per_phase_with_its_label():
    mon = MemoryMonitor(interval=10, warn=False)
    for label in ("load", "prefill", "decode", "train step", "train step", "eval batch", "my step"):
        with mon.phase(label):
            time.sleep(0.002)
    ax = mon.plot().axes[0]
    spans = [p for p in ax.patches if (p.get_gid() or "").startswith("phase:")]
    assert [p.get_gid() for p in spans] == [f"phase:{p.label}" for p in mon.phases]
    colors = {p.get_gid(): p.get_facecolor()[:3] for p in spans}
    assert len(set(colors.values())) == 6  # one colour per label, the same for both train steps
    texts = [t.get_text() for t in ax.texts]
    for label in ("load", "prefill", "decode", "train step", "eval batch", "my step"):
        assert label in texts
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "phase: prefill" in legend and "phase: my step" in legend


def test_plot_without_phases_is_unchanged():
    mon = MemoryMonitor(interval=10, warn=False)
    mon.mark("a")
    ax = mon.plot().axes[0]
    assert not [p for p in ax.patches if (p.get_gid() or "").startswith("phase:")]


def test_plot_without_matplotlib_is_text(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import fails as on a bare machine
    mon = MemoryMonitor(interval=10, warn=False)
    with mon.phase("load"):
        pass
    out = mon.plot()
    assert isinstance(out, str) and "load" in out and "MemoryMonitor" in out


def test_running_monitor_receives_generation_phases(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.loading.generation import generate_batched

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    with MemoryMonitor(interval=10, warn=False) as mon:
        generate_batched(model, tok, ["a", "b", "c"], max_new_tokens=3, batch_size=2)
    assert [p.label for p in mon.phases] == ["eval batch", "prefill", "decode"] * 2
    batch, prefill, decode = mon.phases[:3]
    assert batch.start <= prefill.start <= prefill.end <= decode.start <= decode.end <= batch.end
    later = MemoryMonitor(interval=10, warn=False)  # not running: records only when passed explicitly
    generate_batched(model, tok, ["a"], max_new_tokens=2)
    assert later.phases == []
    generate_batched(model, tok, ["a"], max_new_tokens=2, monitor=later)
    assert [p.label for p in later.phases] == ["eval batch", "prefill", "decode"]


def test_load_is_a_phase_on_a_running_monitor(tiny_llama):
    from helpers.loading.loader import load

    with MemoryMonitor(interval=10, warn=False) as mon:
        model, _, report = load(tiny_llama, load="fp32")
        assert [(p.label, p.end is not None) for p in mon.phases] == [("load", True)]  # closed when load() returns
    assert report.measured_weights > 0


def test_callback_records_each_train_step_as_a_phase():
    mon = MemoryMonitor(interval=10, warn=False)
    cb = MemoryCallback(monitor=mon)
    args, state, control = None, TrainerState(), TrainerControl()
    for _ in range(3):
        cb.on_step_begin(args, state, control)
        cb.on_step_end(args, state, control)
    cb.on_step_begin(args, state, control)  # an exception inside the step: closed at train end
    cb.on_train_end(args, state, control)
    assert [p.label for p in mon.phases] == ["train step"] * 4
    assert all(p.end is not None for p in mon.phases)
