"""Watch memory while something runs: a sampling thread with a timeline, and a Trainer callback.

``MemoryMonitor`` samples the GPU (PyTorch allocated/reserved, and the driver's view through NVML),
the process RSS and the machine's RAM every ``interval`` seconds in a background thread. ``mark()``
puts named events on the timeline, ``plot()`` draws it, ``to_csv()`` keeps it. When usage crosses
``threshold`` of the card (of the RAM without a GPU) it warns once per crossing, naming the largest
live tensors at that moment.

``MemoryCallback`` adds memory figures to the Hugging Face ``Trainer``'s logs (allocated, reserved,
peak since the last log, RAM) and says so when memory grows steadily from one log to the next.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from .memory import nvml_handle
from .units import MiB, format_bytes

__all__ = ["Sample", "Mark", "ThresholdCrossing", "MemoryMonitor", "MemoryCallback"]  # noqa: F822 (lazy, below)

MIN_INTERVAL = 0.01  # seconds; faster sampling measurably slows the run it watches (bench/monitor_overhead.py)
PEAK_KEYS = ("allocated", "reserved", "device_used", "ram_used", "process_rss")


@dataclass(frozen=True)
class Sample:
    """One reading, ``t`` seconds after the monitor started. Bytes; ``device_used`` is None without NVML."""

    t: float
    allocated: int
    reserved: int
    device_used: int | None
    ram_used: int
    process_rss: int


def _merge(pair: list[Sample]) -> Sample:
    """One sample standing for a pair: the later time, each figure's highest value."""
    if len(pair) == 1:
        return pair[0]
    a, b = pair
    # field by field, not getattr in a loop: the sampling thread merges 50,000 pairs at a time, holding the GIL
    dev = (
        b.device_used
        if a.device_used is None
        else a.device_used
        if b.device_used is None
        else max(a.device_used, b.device_used)
    )
    return Sample(b.t, max(a.allocated, b.allocated), max(a.reserved, b.reserved), dev, max(a.ram_used, b.ram_used),
                  max(a.process_rss, b.process_rss))  # fmt: skip


@dataclass(frozen=True)
class Mark:
    t: float
    label: str


@dataclass
class ThresholdCrossing:
    """Usage crossed the threshold: when, how much, and the largest live tensors at that moment."""

    t: float
    used: int
    capacity: int
    what: str
    top: list[tuple[str, int, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"{self.what} at {format_bytes(self.used)} of {format_bytes(self.capacity)} "
            f"({self.used / self.capacity:.0%}) at t={self.t:.1f} s; largest live tensors:"
        ]
        lines += [f"  {format_bytes(b):>10}  {name}  {desc}" for name, b, desc in self.top] or ["  (none found)"]
        return "\n".join(lines)


class MemoryMonitor:
    """Sample memory in a background thread while a block runs.

    Args:
        interval: seconds between samples (the thread sleeps in between; cost is one readout).
        threshold: warn when usage reaches this share of ``capacity`` (re-armed below 95 % of it).
        capacity: bytes to compare against; default the GPU's total memory, or the machine's RAM.
        device: CUDA device index (default: the current one).
        top: how many live tensors a threshold warning names.
        warn: also emit a Python warning on a crossing (the crossings are kept in ``.crossings``).

    >>> with MemoryMonitor() as mon:  # doctest: +SKIP
    ...     mon.mark("train")
    ...     trainer.train()
    >>> mon.plot()  # doctest: +SKIP
    """

    def __init__(
        self,
        interval: float = 0.5,
        *,
        threshold: float = 0.9,
        capacity: int | None = None,
        device: int | None = None,
        top: int = 5,
        warn: bool = True,
        max_samples: int = 100_000,
    ) -> None:
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not math.isfinite(interval)
            or interval <= 0
        ):
            raise ValueError(f"interval is in seconds and must be a positive number, got {interval!r}")
        if interval < MIN_INTERVAL:
            raise ValueError(
                f"interval {interval!r} s is below {MIN_INTERVAL} s: sampling faster costs the run itself "
                "(each readout takes the GIL); pass 0.01 or more"
            )
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
            hint = (
                f" (for {threshold} %, pass {threshold / 100:g})"
                if isinstance(threshold, int | float) and 1 < threshold <= 100
                else ""
            )
            raise ValueError(f"threshold is a share of capacity in (0, 1], got {threshold!r}{hint}")
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int | float) or capacity <= 0
        ):
            raise ValueError(
                f"capacity is a positive number of bytes (e.g. 15 * helpers.units.GiB) or None for "
                f"the GPU's total memory, got {capacity!r}"
            )
        self.interval, self.threshold, self.top, self.warn = interval, threshold, top, warn
        self.cuda = torch.cuda.is_available()
        self.device = (torch.cuda.current_device() if device is None else device) if self.cuda else None
        self._nvml, self._handle = nvml_handle(self.device) if self.cuda else (None, None)
        self.capacity = (
            int(capacity)
            if capacity
            else (
                torch.cuda.get_device_properties(self.device).total_memory
                if self.cuda
                else psutil.virtual_memory().total
            )
        )
        self.samples: list[Sample] = []  # in time order; older ones merged pairwise past max_samples
        self.max_samples = max_samples
        self._merging: list[int] | None = None  # a pairwise merge under way: [next index, end of the old half]
        # the sampling thread merges `samples` in place while a callback may bisect it: one lock for both
        self._samples_lock = threading.Lock()
        self._peaks = dict.fromkeys(PEAK_KEYS, 0)
        self.marks: list[Mark] = []
        self.crossings: list[ThresholdCrossing] = []
        self._proc = psutil.Process()
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._above = False

    # -- sampling --------------------------------------------------------------------------------
    def sample(self) -> Sample:
        """Take one reading now (the thread calls this every ``interval``) and check the threshold."""
        alloc = res = 0
        dev_used = None
        if self.cuda:
            alloc, res = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
            if self._handle is not None:
                try:
                    dev_used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
                except Exception:
                    dev_used = None
        vm = psutil.virtual_memory()
        s = Sample(
            time.perf_counter() - self._t0, alloc, res, dev_used, vm.total - vm.available, self._proc.memory_info().rss
        )
        self._keep(s)
        self._check(s)
        return s

    def _keep(self, s: Sample) -> None:
        with self._samples_lock:
            self._keep_locked(s)

    def _keep_locked(self, s: Sample) -> None:
        self.samples.append(s)
        for k in PEAK_KEYS:
            self._peaks[k] = max(self._peaks[k], getattr(s, k) or 0)
        if self._merging is None and len(self.samples) > self.max_samples:
            # merge the older half pairwise, keeping each pair's highest figures: storage stays bounded and
            # no peak is lost, only the time resolution of the distant past
            self._merging = [0, len(self.samples) // 2]  # [next index to write, end of the old half]
        if self._merging is not None:
            self._merge_some()

    def _merge_some(self, pairs: int = 256) -> None:
        """Merge the next ``pairs`` pairs of the old half in place: a few hundred per sample, never the
        whole half in one call (50,000 pairs took 0.15-0.25 s in the sampling thread, holding the GIL)."""
        at, end = self._merging
        end = min(end, len(self.samples))
        chunk = self.samples[at : min(end, at + 2 * pairs)]
        self.samples[at : at + len(chunk)] = [_merge(chunk[i : i + 2]) for i in range(0, len(chunk), 2)]
        merged = (len(chunk) + 1) // 2
        at, end = at + merged, end - (len(chunk) - merged)
        self._merging = [at, end] if at < end else None

    def used(self, s: Sample) -> int:
        """What the threshold compares: the card's use (driver view, else reserved), or the RAM in use."""
        if self.cuda:
            return s.device_used if s.device_used is not None else s.reserved
        return s.ram_used

    def _check(self, s: Sample) -> None:
        used, limit = self.used(s), self.threshold * self.capacity
        if used >= limit and not self._above:
            self._above = True
            from .oom import largest_tensors

            try:
                top = largest_tensors(self.top)
            except Exception:  # noqa: BLE001 - a census must never kill the sampler
                top = []
            what = "GPU memory" if self.cuda else "RAM"
            crossing = ThresholdCrossing(s.t, used, self.capacity, f"{what} crossed {self.threshold:.0%}", top)
            self.crossings.append(crossing)
            if self.warn:
                warnings.warn(str(crossing), ResourceWarning, stacklevel=2)
        elif used < 0.95 * limit:
            self._above = False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> MemoryMonitor:
        """Start the sampling thread (a no-op when it runs already)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self.sample()
            self._thread = threading.Thread(target=self._run, name="oomkit-memory-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> MemoryMonitor:
        """Stop the thread and take a last sample."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()
        return self

    def __enter__(self) -> MemoryMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def mark(self, label: str) -> Mark:
        """Put a named event on the timeline (and a sample next to it)."""
        m = Mark(time.perf_counter() - self._t0, str(label))
        self.marks.append(m)
        self.sample()
        return m

    # -- results ---------------------------------------------------------------------------------
    def peak(self, since: float = 0.0) -> dict[str, int]:
        """Highest value of each figure over the samples taken at or after ``since`` seconds."""
        if since <= 0:
            return dict(self._peaks)  # kept up to date per sample: no scan
        with self._samples_lock:  # a merge in the sampling thread would shift the indices under bisect
            samples = self.samples
            rows = samples[bisect.bisect_left(samples, since, key=lambda s: s.t) :]
        return {k: max((getattr(s, k) or 0 for s in rows), default=0) for k in PEAK_KEYS}

    def to_csv(self, path: str | Path | None = None) -> str:
        """The samples (and marks, as rows with a label) as CSV; written to ``path`` when given."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["t", "allocated", "reserved", "device_used", "ram_used", "process_rss", "mark"])
        rows = [
            (
                s.t,
                s.allocated,
                s.reserved,
                "" if s.device_used is None else s.device_used,
                s.ram_used,
                s.process_rss,
                "",
            )
            for s in list(self.samples)
        ]
        rows += [(m.t, "", "", "", "", "", m.label) for m in self.marks]
        for r in sorted(rows, key=lambda r: r[0]):
            w.writerow([f"{r[0]:.3f}", *r[1:]])
        text = buf.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text

    def plot(self, title: str = "memory over time"):
        """A matplotlib ``Figure``: each figure over time with its peak, the warning threshold and the marks.

        The y axis fits the data (GiB, or MiB below 1 GiB); a threshold far above it is named in the
        legend (beside the chart) instead of squashing the lines flat; marks closer than 3 % of the run share one label.
        """
        import matplotlib.pyplot as plt

        samples = list(self.samples)
        # through pyplot so a notebook shows it as an image; closed so it is shown once, as the cell's result
        fig, ax = plt.subplots(figsize=(10.5, 3.6))
        plt.close(fig)
        t = [s.t for s in samples]
        series = ([("allocated", "PyTorch allocated"), ("reserved", "PyTorch reserved"),
                   ("device_used", "device used (NVML)")] if self.cuda else
                  [("process_rss", "process RSS"), ("ram_used", "machine RAM in use")])  # fmt: skip
        plotted = [(label, [getattr(s, key) for s in samples]) for key, label in series]
        plotted = [(label, ys) for label, ys in plotted if ys and all(y is not None for y in ys)]
        top = max((max(ys) for _, ys in plotted), default=0) or 1  # all zero (nothing allocated yet): still a scale
        limit = self.threshold * self.capacity
        shown_limit = limit <= 1.5 * top  # else the data would be a flat line at the bottom
        scale, unit = (2**30, "GiB") if max(top, limit if shown_limit else 0) >= 2**30 else (2**20, "MiB")
        for label, ys in plotted:
            (line,) = ax.plot(t, [y / scale for y in ys], label=label)
            _annotate_peak(ax, t, ys, scale, line.get_color())
        limit_label = f"{self.threshold:.0%} of {format_bytes(self.capacity)} = {format_bytes(limit)}"
        if shown_limit:
            ax.axhline(limit / scale, color="#c0392b", ls="--", lw=1, label=limit_label)
        else:
            ax.plot([], [], color="#c0392b", ls="--", lw=1, label=f"{limit_label} (above the chart)")
        ax.set_ylim(0, max(top, limit if shown_limit else 0) / scale * 1.12)
        span = (t[-1] - t[0]) if len(t) > 1 else 0.0
        for when, text in _grouped_marks(self.marks, span):
            ax.axvline(when, color="grey", lw=0.8, ls=":")
            ax.annotate(text, (when, 0.98), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        va="top", ha="right", color="grey")  # fmt: skip
        ax.set_xlabel("seconds")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)  # beside, never over a line
        fig.tight_layout()
        return fig

    def __str__(self) -> str:
        if not self.samples:
            return "MemoryMonitor: no samples yet"
        p = self.peak()
        span = self.samples[-1].t - self.samples[0].t
        head = f"MemoryMonitor: {len(self.samples)} samples over {span:.1f} s, {len(self.marks)} marks; peaks: "
        if self.cuda:
            head += f"allocated {format_bytes(p['allocated'])}, reserved {format_bytes(p['reserved'])}, "
        head += f"process RSS {format_bytes(p['process_rss'])}, RAM in use {format_bytes(p['ram_used'])}"
        return "\n".join([head, *(str(c) for c in self.crossings)])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from .html import table

        p = self.peak()
        keys = (["allocated", "reserved", "device_used"] if self.cuda else []) + ["process_rss", "ram_used"]
        rows = [[k.replace("_", " "), format_bytes(p[k])] for k in keys]
        rows += [[f"⚠ t={c.t:.1f} s", c.what] for c in self.crossings]
        return table(["peak", "bytes"], rows, title=f"{len(self.samples)} samples, {len(self.marks)} marks")


class _MemoryCallback:
    """Add memory figures to the Trainer's logs and detect steady growth between log steps.

    Each log gets ``mem_allocated_mib``, ``mem_reserved_mib``, ``mem_peak_mib`` (peak allocated
    since the previous log; this resets CUDA's peak counter) on a GPU, and ``ram_rss_mib`` (and
    ``ram_peak_mib`` when a ``monitor`` samples in between). The same figures go into
    ``trainer.state.log_history``. Growth is judged by a :class:`helpers.leaks.GrowthDetector`
    over the log steps; a leak is reported once, in ``.leaks`` and as a warning.

    Args:
        monitor: a running :class:`MemoryMonitor` to put train/checkpoint marks on and read peaks from.
        warmup, window, min_growth: passed to the ``GrowthDetector`` (in log steps and bytes).
        measure: bytes to watch for growth; default CUDA allocated, or the process RSS on a CPU.
    """

    def __init__(
        self,
        monitor: MemoryMonitor | None = None,
        *,
        warmup: int = 2,
        window: int = 6,
        min_growth: int = 1 * MiB,
        measure=None,
    ) -> None:
        from .leaks import GrowthDetector

        self.monitor = monitor
        self.cuda = torch.cuda.is_available()
        self._proc = psutil.Process()
        self.measure = measure or (torch.cuda.memory_allocated if self.cuda else lambda: self._proc.memory_info().rss)
        self.detector = GrowthDetector(warmup=warmup, window=window, min_growth=min_growth, measure=self.measure)
        self.leaks: list[str] = []
        self._last_t = 0.0

    def figures(self) -> dict[str, float]:
        """The memory figures of one log line, in MiB (rounded to 0.1)."""
        out = {}
        if self.cuda:
            out["mem_allocated_mib"] = torch.cuda.memory_allocated() / MiB
            out["mem_reserved_mib"] = torch.cuda.memory_reserved() / MiB
            out["mem_peak_mib"] = torch.cuda.max_memory_allocated() / MiB
            torch.cuda.reset_peak_memory_stats()
        out["ram_rss_mib"] = self._proc.memory_info().rss / MiB
        if self.monitor is not None and self.monitor.samples:
            out["ram_peak_mib"] = max(out["ram_rss_mib"], self.monitor.peak(self._last_t)["process_rss"] / MiB)
            self._last_t = self.monitor.samples[-1].t
        return {k: round(v, 1) for k, v in out.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        if self.monitor is not None:
            self.monitor.mark(f"train from step {state.global_step}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        figures = self.figures()
        if logs is not None:
            logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)
        if self.detector.record() and not self.leaks:
            report = self.detector.report()
            message = (
                f"step {state.global_step}: {report.verdict}. Something keeps tensors alive across steps "
                "(a list of losses without .item(), outputs kept for later, a growing cache); "
                "see notebooks/04_leak_hunting."
            )
            self.leaks.append(message)
            warnings.warn(message, ResourceWarning, stacklevel=2)

    def on_save(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.mark(f"checkpoint {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.mark(f"train end (step {state.global_step})")


def __getattr__(name: str):
    # MemoryCallback subclasses transformers' TrainerCallback, whose import pulls the Trainer, peft and
    # bitsandbytes (seconds): built on first use, so `import helpers.monitor` stays cheap
    if name == "MemoryCallback":
        from transformers import TrainerCallback

        cls = type("MemoryCallback", (_MemoryCallback, TrainerCallback), {"__module__": __name__})
        cls.__doc__ = _MemoryCallback.__doc__
        globals()["MemoryCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _annotate_peak(ax, t: list[float], ys: list[int], scale: int, color) -> None:
    i = max(range(len(ys)), key=ys.__getitem__)
    late = i > len(ys) / 2  # label to the left of a late peak, so it stays inside the axes
    ax.annotate(f"peak {format_bytes(ys[i])}", (t[i], ys[i] / scale), textcoords="offset points",
                xytext=(-4 if late else 4, 4), ha="right" if late else "left", fontsize=8, color=color)  # fmt: skip


def _grouped_marks(marks, span: float, share: float = 0.03) -> list[tuple[float, str]]:
    """(time, label) per group of marks closer than ``share`` of the run: one line, labels joined."""
    groups: list[list] = []
    for m in sorted(marks, key=lambda m: m.t):
        if groups and m.t - groups[-1][-1].t <= share * span:
            groups[-1].append(m)
        else:
            groups.append([m])
    return [(g[0].t, " · ".join(m.label for m in g)) for g in groups]
