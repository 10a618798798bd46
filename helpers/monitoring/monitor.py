"""Watch memory while something runs: a sampling thread with a timeline, and a Trainer callback.

``MemoryMonitor`` samples every GPU (PyTorch allocated/reserved, and the driver's view through NVML),
the process RSS and the machine's RAM every ``interval`` seconds in a background thread; on a
machine with two cards (a model split over Kaggle's 2×T4) each card is kept and judged on its own. ``mark()``
puts named events on the timeline and ``phase()`` named spans (load, prefill, decode, train step,
eval batch: oomkit's own code emits these into a running monitor through :mod:`helpers.core.phases`);
``plot()`` draws it with each phase shaded and labelled, ``to_csv()`` keeps it. When usage crosses
``threshold`` of a card (of the RAM without a GPU) it warns once per crossing, naming the card and
the largest live tensors at that moment by who holds them (the census of the notebook's namespace, or of
``namespace=``; without one it says how to get the names).

``MemoryCallback`` adds memory figures to the Hugging Face ``Trainer``'s logs (allocated, reserved,
peak since the last log, RAM) and says so when memory grows steadily from one log to the next.
"""

from __future__ import annotations

import bisect
import contextlib
import csv
import io
import math
import numbers
import operator
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import psutil
import torch

from ..core import phases as phase_hub
from ..core.arguments import ArgumentError, flag, namespace_dict, whole_number
from ..core.html import theme_figure
from ..core.memory import nvml_handle
from ..core.session import user_namespace
from ..core.units import format_bytes
from ..core.vocab import TIGHT_FRACTION

__all__ = [
    "PHASE_COLORS",
    "OTHER_PHASE_COLORS",
    "MAX_PHASE_SPANS",
    "TextTimeline",
    "annotate_peak",
    "grouped_marks",
    "phase_color",
    "phase_spans",
    "shade_phases",
    "MemoryWarning",
    "GpuSample",
    "Sample",
    "Mark",
    "Phase",
    "ThresholdCrossing",
    "UNNAMED_NOTE",
    "MemoryMonitor",
]
# a crossing warns once; it re-arms when memory falls this far under the threshold again (no flapping)
REARM_SHARE = 0.95

MIN_INTERVAL = 0.01  # seconds; faster sampling measurably slows the run it watches (bench/monitor_overhead.py)
PEAK_KEYS = ("allocated", "reserved", "device_used", "ram_used", "process_rss")
GPU_KEYS = ("allocated", "reserved", "device_used")


class MemoryWarning(UserWarning):
    """A threshold crossing or a leak. A ``UserWarning``: Python's default filters hide
    ``ResourceWarning`` in Colab, Kaggle and plain scripts, so the warning would never be seen."""


class GpuSample(NamedTuple):
    """One card's figures in a :class:`Sample` (bytes; ``device_used`` is None without NVML)."""

    index: int
    allocated: int
    reserved: int
    device_used: int | None


@dataclass(frozen=True)
class Sample:
    """One reading, ``t`` seconds after the monitor started. Bytes; ``device_used`` is None without NVML.

    ``allocated``, ``reserved`` and ``device_used`` add up every watched card; ``gpus`` holds each
    card's own figures when more than one is watched (empty otherwise: one card is the totals).
    """

    t: float
    allocated: int
    reserved: int
    device_used: int | None
    ram_used: int
    process_rss: int
    gpus: tuple[GpuSample, ...] = ()


def _max_or_none(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _merge(pair: list[Sample]) -> Sample:
    """One sample standing for a pair: the later time, each figure's highest value."""
    if len(pair) == 1:
        return pair[0]
    a, b = pair
    # field by field, not getattr in a loop: the sampling thread merges 50,000 pairs at a time, holding the GIL
    gpus = tuple(
        GpuSample(x.index, max(x.allocated, y.allocated), max(x.reserved, y.reserved),
                  _max_or_none(x.device_used, y.device_used))
        for x, y in zip(a.gpus, b.gpus)
    )  # fmt: skip
    return Sample(b.t, max(a.allocated, b.allocated), max(a.reserved, b.reserved),
                  _max_or_none(a.device_used, b.device_used), max(a.ram_used, b.ram_used),
                  max(a.process_rss, b.process_rss), gpus)  # fmt: skip


@dataclass(frozen=True)
class Mark:
    t: float
    label: str


@dataclass(frozen=True)
class Phase:
    """A named span of the run, ``start`` to ``end`` seconds after the monitor started (``end`` is None
    while it is still open)."""

    label: str
    start: float
    end: float | None = None

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def __str__(self) -> str:
        end = "…" if self.end is None else f"{self.end:.2f}"
        return f"{self.label}: {self.start:.2f}-{end} s"


@dataclass
class ThresholdCrossing:
    """Usage crossed the threshold: when, on which card (None: the RAM), how much, and
    the largest live tensors at that moment."""

    t: float
    used: int
    capacity: int
    what: str
    top: list[tuple[str, int, str]] = field(default_factory=list)
    device: int | None = None
    note: str = ""  # where the tensors could not be named, how to get their names

    def __str__(self) -> str:
        lines = [
            f"{self.what} at {format_bytes(self.used)} of {format_bytes(self.capacity)} "
            f"({self.used / self.capacity:.0%}) at t={self.t:.1f} s; largest live tensors:"
        ]
        lines += [f"  {format_bytes(b):>10}  {name}  {desc}" for name, b, desc in self.top] or ["  (none found)"]
        return "\n".join(lines + ([f"  {self.note}"] if self.note else []))


# said under a crossing's tensors where no namespace names them (a script, or a thread with no notebook)
UNNAMED_NOTE = (
    "(unnamed): the sampling thread sees no notebook namespace; for who holds them, run census() in the "
    "notebook, or pass MemoryMonitor(namespace=globals())"
)


class MemoryMonitor:
    """Sample memory in a background thread while a block runs.

    Args:
        interval: seconds between samples (the thread sleeps in between; cost is one readout).
        threshold: warn when usage reaches this share of ``capacity`` (re-armed below 95 % of it).
        capacity: bytes to compare each card against (e.g. a T4's on a bigger card); default each
            GPU's total memory, or the machine's RAM without a GPU.
        device: the CUDA device index to watch, or a list of them; default every visible GPU (a
            model split over two cards can fill the second while the first has room).
        top: how many live tensors a threshold warning names.
        warn: also emit a Python warning on a crossing (the crossings are kept in ``.crossings``).
        namespace: where a crossing looks for who holds the tensors (``globals()``); default the notebook's
            (IPython's ``user_ns``, readable from the sampling thread). Without either the tensors are
            listed unnamed, with a note saying how to name them.

    >>> with MemoryMonitor() as mon:  # doctest: +SKIP
    ...     mon.mark("train")
    ...     trainer.train()
    >>> mon.plot()  # doctest: +SKIP
    """

    def __init__(
        self,
        interval: float = 0.5,
        *,
        threshold: float = TIGHT_FRACTION,
        capacity: int | None = None,
        device: int | None = None,
        top: int = 5,
        warn: bool = True,
        max_samples: int = 100_000,
        namespace: dict | None = None,
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
                f"capacity is a positive number of bytes (e.g. 15 * helpers.GiB) or None for "
                f"the GPU's total memory, got {capacity!r}"
            )
        _check_settings(device, top, warn, max_samples)
        self.interval, self.threshold, self.top, self.warn = interval, threshold, top, warn
        self.namespace = namespace_dict("namespace", namespace)
        self.cuda = torch.cuda.is_available()
        self.devices: tuple[int, ...] = _watched(device) if self.cuda else ()
        self.device = self.devices[0] if self.devices else None  # the first watched card
        self._handles = {d: nvml_handle(d) for d in self.devices}
        self.capacities = {
            d: int(capacity) if capacity else torch.cuda.get_device_properties(d).total_memory for d in self.devices
        }
        # what used(sample) is compared with: every watched card together (capacities: each card's)
        self.capacity = (
            sum(self.capacities.values()) if self.cuda else int(capacity) if capacity else psutil.virtual_memory().total
        )
        self.samples: list[Sample] = []  # in time order; older ones merged pairwise past max_samples
        self.max_samples = max_samples
        self._merging: list[int] | None = None  # a pairwise merge under way: [next index, end of the old half]
        # the sampling thread merges `samples` in place while a callback may bisect it: one lock for both
        self._samples_lock = threading.Lock()
        self._peaks = dict.fromkeys(PEAK_KEYS, 0)
        self._gpu_peaks = {d: dict.fromkeys(GPU_KEYS, 0) for d in self.devices}
        self.marks: list[Mark] = []
        self.phases: list[Phase] = []  # in start order; nested or overlapping phases are kept as they come
        self._phase_lock = threading.Lock()
        self.crossings: list[ThresholdCrossing] = []
        self._proc = psutil.Process()
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        # readouts that raised in the thread (a transient NVML or /proc error): counted, the thread goes on;
        # after MAX_READ_FAILURES in a row it stops and says why (``stopped_by``), never silently
        self.read_errors: list[str] = []
        self.stopped_by: str | None = None
        self._thread: threading.Thread | None = None
        self._above: dict[int | None, bool] = {}  # per card (None: the RAM): warned, not yet back below
        self._check_lock = threading.Lock()  # the thread and mark() both sample: one crossing, one warning

    # -- sampling --------------------------------------------------------------------------------
    def sample(self) -> Sample:
        """Take one reading now (the thread calls this every ``interval``) and check the threshold."""
        gpus = tuple(self._read_gpu(d) for d in self.devices)
        used = [g.device_used for g in gpus]
        vm = psutil.virtual_memory()
        s = Sample(
            time.perf_counter() - self._t0,
            sum(g.allocated for g in gpus),
            sum(g.reserved for g in gpus),
            None if not gpus or None in used else sum(used),
            vm.total - vm.available,
            self._proc.memory_info().rss,
            gpus if len(gpus) > 1 else (),  # one card: its figures are the totals, stored once
        )
        self._keep(s)
        self._check(s)
        return s

    def _read_gpu(self, index: int) -> GpuSample:
        nvml, handle = self._handles[index]
        used = None
        if handle is not None:
            try:
                used = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:  # noqa: BLE001 - the driver view is optional; PyTorch's figures stand
                used = None
        stats = torch.cuda.memory_stats(index)  # one dict for both figures (each readout builds it anew)
        return GpuSample(
            index, stats.get("allocated_bytes.all.current", 0), stats.get("reserved_bytes.all.current", 0), used
        )

    def cards(self, s: Sample) -> tuple[GpuSample, ...]:
        """Each watched card's figures in ``s`` (one card: the sample's totals)."""
        if s.gpus or not self.devices:
            return s.gpus
        return (GpuSample(self.device, s.allocated, s.reserved, s.device_used),)

    def _keep(self, s: Sample) -> None:
        with self._samples_lock:
            self._keep_locked(s)

    def _keep_locked(self, s: Sample) -> None:
        self.samples.append(s)
        for k in PEAK_KEYS:
            self._peaks[k] = max(self._peaks[k], getattr(s, k) or 0)
        for g in s.gpus:
            peaks = self._gpu_peaks[g.index]
            for k in GPU_KEYS:
                peaks[k] = max(peaks[k], getattr(g, k) or 0)
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

    def used(self, s: Sample | GpuSample) -> int:
        """What the threshold compares: a card's use (driver view, else reserved; a ``Sample``: every
        watched card's), or the RAM in use without a GPU."""
        if self.cuda or isinstance(s, GpuSample):
            return s.device_used if s.device_used is not None else s.reserved
        return s.ram_used

    def _check(self, s: Sample) -> None:
        with self._check_lock:
            if not self.cuda:
                self._check_one(s.t, None, self.used(s), self.capacity, "RAM")
                return
            named = len(self.devices) > 1 or self.device != 0  # "GPU memory" only where it cannot be another
            for g in self.cards(s):  # each card against its own capacity: a split model fills one first
                name = f"GPU {g.index} memory" if named else "GPU memory"
                self._check_one(s.t, g.index, self.used(g), self.capacities[g.index], name)

    def _check_one(self, t: float, device: int | None, used: int, capacity: int, what: str) -> None:
        limit = self.threshold * capacity
        if used >= limit and not self._above.get(device):
            self._above[device] = True
            try:
                top, note = self.largest()
            except Exception as e:  # noqa: BLE001 - a census must never kill the sampler
                top, note = [], f"(the census failed: {type(e).__name__}: {str(e)[:120]})"
            crossing = ThresholdCrossing(t, used, capacity, f"{what} crossed {self.threshold:.0%}", top, device, note)
            self.crossings.append(crossing)
            if self.warn:
                warnings.warn(str(crossing), MemoryWarning, stacklevel=4)
        elif used < REARM_SHARE * limit:
            self._above[device] = False

    def largest(self) -> tuple[list[tuple[str, int, str]], str]:
        """The ``top`` largest live tensors as ``(holder, bytes, "shape dtype device")`` and a note: named by the
        census of ``namespace`` (else the notebook's), else unnamed with :data:`UNNAMED_NOTE`. Safe from the
        sampling thread (it only reads the namespace)."""
        from ..leaks.census import census
        from ..leaks.tensors import largest_tensors

        ns = self.namespace if self.namespace is not None else user_namespace()
        if not ns:
            return largest_tensors(self.top), UNNAMED_NOTE
        found = census(dict(ns))  # a copy: the main thread may bind a name while the walk runs
        top = [(e.holder, e.nbytes, f"{e.shape} {e.dtype} {e.device}") for e in found.entries[: self.top]]
        return top, ""

    def _run(self) -> None:
        in_a_row = 0
        while not self._stop.wait(self.interval):
            try:
                self.sample()
                in_a_row = 0
            except Exception as e:  # noqa: BLE001 - one failed readout must not end the monitoring
                in_a_row += 1
                self.read_errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                if in_a_row >= MAX_READ_FAILURES:
                    self.stopped_by = (
                        f"sampling stopped after {in_a_row} failed readouts in a row ({self.read_errors[-1]})"
                    )
                    if self.warn:
                        warnings.warn(f"MemoryMonitor: {self.stopped_by}", MemoryWarning, stacklevel=1)
                    return

    def start(self) -> MemoryMonitor:
        """Start the sampling thread (a no-op when it runs already)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self.sample()
            self._thread = threading.Thread(target=self._run, name="oomkit-memory-monitor", daemon=True)
            self._thread.start()
        phase_hub.register(self)  # oomkit's own phases (prefill, decode, train step...) land here while it runs
        return self

    def stop(self) -> MemoryMonitor:
        """Stop the thread and take a last sample."""
        phase_hub.unregister(self)
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

    def start_phase(self, label: str) -> int:
        """Open phase ``label`` now (a sample is taken at its start); returns the handle :meth:`end_phase` takes."""
        with self._phase_lock:
            self.phases.append(Phase(str(label), time.perf_counter() - self._t0))
            handle = len(self.phases) - 1
        self._sample_quietly()
        return handle

    def end_phase(self, handle: int) -> Phase:
        """Close the phase :meth:`start_phase` opened (a sample is taken at its end)."""
        self._sample_quietly()
        with self._phase_lock:
            opened = self.phases[handle]
            self.phases[handle] = closed = Phase(opened.label, opened.start, time.perf_counter() - self._t0)
        return closed

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """The block as phase ``label``: shaded and labelled in :meth:`plot`, summed in :meth:`phase_table`.

        >>> with mon.phase("prefill"):  # doctest: +SKIP
        ...     model(**batch)
        """
        handle = self.start_phase(label)
        try:
            yield
        finally:
            self.end_phase(handle)

    def _sample_quietly(self) -> None:
        """A sample at a phase boundary; a failed readout is counted, never raised into the caller's run."""
        try:
            self.sample()
        except Exception as e:  # noqa: BLE001 - the run being watched matters more than one reading
            self.read_errors.append(f"{type(e).__name__}: {str(e)[:200]}")

    def phase_table(self) -> list[tuple[str, int, float, int]]:
        """(label, count, seconds in all, peak bytes) per phase label, in order of first start; the peak is
        the highest figure sampled inside any of its spans (GPU allocated, else the process RSS)."""
        key = "allocated" if self.cuda else "process_rss"
        samples = list(self.samples)
        times = [s.t for s in samples]
        out: dict[str, list] = {}
        for ph in list(self.phases):
            end = ph.end if ph.end is not None else (times[-1] if times else ph.start)
            row = out.setdefault(ph.label, [0, 0.0, 0])
            inside = samples[bisect.bisect_left(times, ph.start) : bisect.bisect_right(times, end)]
            row[0] += 1
            row[1] += end - ph.start
            row[2] = max([row[2], *(getattr(s, key) or 0 for s in inside)])
        return [(label, n, secs, peak) for label, (n, secs, peak) in out.items()]

    def timeline(self) -> str:
        """The run as text (what :meth:`plot` shows, for a terminal or a log): the peaks and each phase."""
        lines = [str(self)]
        figure = "GPU allocated" if self.cuda else "process RSS"
        for label, n, secs, peak in self.phase_table():
            lines.append(f"  {label:<16} ×{n:<5} {secs:8.2f} s   peak {figure} {format_bytes(peak)}")
        return "\n".join(lines)

    # -- results ---------------------------------------------------------------------------------
    def peak(self, since: float = 0.0) -> dict[str, int]:
        """Highest value of each figure over the samples taken at or after ``since`` seconds (GPU
        figures: every watched card added up at each moment; :meth:`peak_by_gpu` has each card's)."""
        if since <= 0:
            return dict(self._peaks)  # kept up to date per sample: no scan
        rows = self._since(since)
        return {k: max((getattr(s, k) or 0 for s in rows), default=0) for k in PEAK_KEYS}

    def peak_by_gpu(self, since: float = 0.0) -> dict[int, dict[str, int]]:
        """Each watched card's highest ``allocated``, ``reserved`` and ``device_used`` (bytes), by index."""
        if len(self.devices) == 1:
            totals = self.peak(since)
            return {self.device: {k: totals[k] for k in GPU_KEYS}}
        if since <= 0:
            return {d: dict(p) for d, p in self._gpu_peaks.items()}
        rows = self._since(since)
        return {
            d: {k: max((getattr(s.gpus[i], k) or 0 for s in rows), default=0) for k in GPU_KEYS}
            for i, d in enumerate(self.devices)
        }

    def _since(self, since: float) -> list[Sample]:
        with self._samples_lock:  # a merge in the sampling thread would shift the indices under bisect
            samples = self.samples
            return samples[bisect.bisect_left(samples, since, key=lambda s: s.t) :]

    def to_csv(self, path: str | Path | None = None) -> str:
        """The samples (and marks, as rows with a label) as CSV; written to ``path`` when given. With
        more than one card, each card's figures follow the totals (``gpu1_allocated``, ...)."""
        per_gpu = [f"gpu{d}_{k}" for d in self.devices for k in GPU_KEYS] if len(self.devices) > 1 else []
        head = ["t", *PEAK_KEYS[:3], "ram_used", "process_rss", *per_gpu, "mark"]

        def cell(v):
            return "" if v is None else v

        rows = [
            (s.t, s.allocated, s.reserved, cell(s.device_used), s.ram_used, s.process_rss,
             *(cell(getattr(g, k)) for g in s.gpus for k in GPU_KEYS), "")
            for s in list(self.samples)
        ]  # fmt: skip
        rows += [(m.t, *[""] * (len(head) - 2), m.label) for m in self.marks]
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(head)
        for r in sorted(rows, key=lambda r: r[0]):
            w.writerow([f"{r[0]:.3f}", *r[1:]])
        text = buf.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text

    def _series(self, samples: list[Sample]) -> list[tuple[str, list[int]]]:
        """(label, values) per line of the plot: each card's when there are several."""
        if len(self.devices) > 1:  # (a card without the driver view drops its NVML line in plot())
            return [
                (f"GPU {d} {label}", [getattr(s.gpus[i], key) for s in samples])
                for i, d in enumerate(self.devices)
                for key, label in (("allocated", "allocated"), ("reserved", "reserved"), ("device_used", "used (NVML)"))
            ]
        series = ([("allocated", "PyTorch allocated"), ("reserved", "PyTorch reserved"),
                   ("device_used", "device used (NVML)")] if self.cuda else
                  [("process_rss", "process RSS"), ("ram_used", "machine RAM in use")])  # fmt: skip
        return [(label, [getattr(s, key) for s in samples]) for key, label in series]

    def _limits(self) -> list[tuple[int, str]]:
        """(bytes, label) per warning line: one per distinct capacity among the watched cards."""
        if not self.cuda or len(self.devices) == 1:
            return [(self.threshold * self.capacity, f"{self.threshold:.0%} of {format_bytes(self.capacity)}")]
        by_capacity: dict[int, list[int]] = {}
        for d in self.devices:
            by_capacity.setdefault(self.capacities[d], []).append(d)
        return [
            (self.threshold * cap, f"{self.threshold:.0%} of {format_bytes(cap)} (GPU {', '.join(map(str, ds))})")
            for cap, ds in by_capacity.items()
        ]

    def plot(self, title: str = "memory over time"):
        """A matplotlib ``Figure``: each figure over time with its peak, the warning threshold, the marks
        and each phase (:meth:`phase`) as a shaded span in its own colour, labelled on the chart and in
        the legend. Without matplotlib: the run as text (:meth:`timeline`).

        The y axis fits the data (GiB, or MiB below 1 GiB); a threshold far above it is named in the
        legend (beside the chart) instead of squashing the lines flat; marks closer than 3 % of the run
        share one label. With several cards each has its own lines.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError:  # headless without matplotlib: the same run as text
            return TextTimeline(self.timeline())

        samples = list(self.samples)
        # through pyplot so a notebook shows it as an image; closed so it is shown once, as the cell's result
        fig, ax = plt.subplots(figsize=(10.5, 3.6))
        plt.close(fig)
        t = [s.t for s in samples]
        plotted = [(label, ys) for label, ys in self._series(samples) if ys and all(y is not None for y in ys)]
        top = max((max(ys) for _, ys in plotted), default=0) or 1  # all zero (nothing allocated yet): still a scale
        limits = [(limit, label, limit <= 1.5 * top) for limit, label in self._limits()]  # else: a flat line
        high = max([top, *(limit for limit, _, shown in limits if shown)])
        scale, unit = (2**30, "GiB") if high >= 2**30 else (2**20, "MiB")
        for label, ys in plotted:
            (line,) = ax.plot(t, [y / scale for y in ys], label=label)
            annotate_peak(ax, t, ys, scale, line.get_color())
        for limit, label, shown in limits:
            label = f"{label} = {format_bytes(limit)}"
            if shown:
                ax.axhline(limit / scale, color="#c0392b", ls="--", lw=1, label=label)
            else:
                ax.plot([], [], color="#c0392b", ls="--", lw=1, label=f"{label} (above the chart)")
        ax.set_ylim(0, high / scale * 1.12)
        span = (t[-1] - t[0]) if len(t) > 1 else 0.0
        phase_handles = shade_phases(ax, list(self.phases), t[-1] if t else 0.0, span)
        for when, text in grouped_marks(self.marks, span):
            ax.axvline(when, color="grey", lw=0.8, ls=":")
            ax.annotate(text, (when, 0.98), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        va="top", ha="right", color="grey")  # fmt: skip
        ax.set_xlabel("seconds")
        ax.set_ylabel(unit)
        ax.set_title(title)
        handles, _ = ax.get_legend_handles_labels()
        ax.legend(handles=handles + phase_handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
                  frameon=False)  # fmt: skip  # beside, never over a line
        fig.tight_layout()
        return theme_figure(fig)  # transparent, its text readable in a light or a dark notebook

    def __str__(self) -> str:
        if not self.samples:
            return "MemoryMonitor: no samples yet"
        p = self.peak()
        span = self.samples[-1].t - self.samples[0].t
        counted = f", {len(self.phases)} phases" if self.phases else ""
        head = (
            f"MemoryMonitor: {len(self.samples)} samples over {span:.1f} s, {len(self.marks)} marks{counted}; peaks: "
        )
        if len(self.devices) > 1:
            head += "".join(
                f"GPU {d} allocated {format_bytes(g['allocated'])}, reserved {format_bytes(g['reserved'])}; "
                for d, g in self.peak_by_gpu().items()
            )
        elif self.cuda:
            head += f"allocated {format_bytes(p['allocated'])}, reserved {format_bytes(p['reserved'])}, "
        head += f"process RSS {format_bytes(p['process_rss'])}, RAM in use {format_bytes(p['ram_used'])}"
        problems = []
        if self.read_errors:
            problems.append(f"{len(self.read_errors)} readouts failed (last: {self.read_errors[-1]})")
        if self.stopped_by:
            problems.append(f"the sampling thread {self.stopped_by}; later figures are missing")
        return "\n".join([head, *problems, *(str(c) for c in self.crossings)])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from ..core.html import table

        p = self.peak()
        rows = []
        if len(self.devices) > 1:
            for d, g in self.peak_by_gpu().items():
                keys = GPU_KEYS if self._handles[d][1] is not None else GPU_KEYS[:2]  # NVML: where it is read
                rows += [[f"GPU {d} {k.replace('_', ' ')}", format_bytes(g[k])] for k in keys]
        elif self.cuda:
            rows += [[k.replace("_", " "), format_bytes(p[k])] for k in GPU_KEYS]
        rows += [[k.replace("_", " "), format_bytes(p[k])] for k in ("process_rss", "ram_used")]
        rows += [[f"⚠ t={c.t:.1f} s", c.what] for c in self.crossings]
        return table(["peak", "bytes"], rows, title=f"{len(self.samples)} samples, {len(self.marks)} marks")


MAX_READ_FAILURES = 5  # failed readouts in a row before the sampling thread gives up (and says so)


def _check_settings(device, top, warn, max_samples) -> None:
    """MemoryMonitor's other arguments, checked on every machine (a CPU-only one ignores ``device``)."""
    whole_number("top (largest tensors to name)", top, minimum=0)
    flag("warn", warn)
    whole_number("max_samples", max_samples)
    for d in device if isinstance(device, list | tuple) else [device]:
        if d is not None and (
            isinstance(d, bool)
            or not isinstance(d, numbers.Integral | str | torch.device)
            or (isinstance(d, numbers.Integral) and d < 0)
        ):
            raise ArgumentError(f"device={d!r}: pass a GPU index such as 0 or 'cuda:1', a list of them, or None")


def _watched(device) -> tuple[int, ...]:
    """The CUDA device indices a monitor watches: those asked for (checked), else every visible one, or
    under DDP (a process per card) this process's own card."""
    count = torch.cuda.device_count()
    if device is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return (torch.cuda.current_device(),) if distributed else tuple(range(count))
    asked = list(device) if isinstance(device, list | tuple) else [device]
    if not asked:
        raise ValueError("device=[] watches nothing: pass a GPU index, a list of them, or None for every GPU")
    return tuple(dict.fromkeys(_device_index(d, count, device) for d in asked))


def _device_index(d, count: int, asked) -> int:
    """``d`` (``1``, ``"cuda:1"``, ``torch.device("cuda")``, a numpy integer) as a checked CUDA index."""
    index = None
    try:
        if isinstance(d, str | torch.device):
            dev = torch.device(d)
            if dev.type == "cuda":
                index = torch.cuda.current_device() if dev.index is None else dev.index
        elif not isinstance(d, bool):
            index = operator.index(d)
    except (TypeError, RuntimeError):
        index = None
    if index is None or not 0 <= index < count:
        raise ValueError(
            f"device={asked!r}: this machine has {count} GPU(s), numbered 0 to {count - 1}; pass one of those "
            "(1, 'cuda:1'), a list of them, or None for every GPU"
        )
    return index


# ----------------------------------------------------------------------------- the chart's pieces: the peak's label, grouped marks, phases shaded by colour


# phase fills (areas at low opacity; the label is written in the same hue, readable on white)
PHASE_COLORS = {"load": "#9334e6", "prefill": "#1a73e8", "decode": "#007b83", "train step": "#188038",
                "eval batch": "#c26401"}  # fmt: skip
OTHER_PHASE_COLORS = ("#c5221f", "#5f6368", "#a142f4", "#b06000", "#185abc", "#0d652d")
MAX_PHASE_SPANS = 400  # more phases than this: consecutive ones of the same label share one span


def annotate_peak(ax, t: list[float], ys: list[int], scale: int, color) -> None:
    i = max(range(len(ys)), key=ys.__getitem__)
    late = i > len(ys) / 2  # label to the left of a late peak, so it stays inside the axes
    ax.annotate(f"peak {format_bytes(ys[i])}", (t[i], ys[i] / scale), textcoords="offset points",
                xytext=(-4 if late else 4, 4), ha="right" if late else "left", fontsize=8, color=color)  # fmt: skip


def grouped_marks(marks, span: float, share: float = 0.03) -> list[tuple[float, str]]:
    """(time, label) per group of marks closer than ``share`` of the run: one line, labels joined."""
    groups: list[list] = []
    for m in sorted(marks, key=lambda m: m.t):
        if groups and m.t - groups[-1][-1].t <= share * span:
            groups[-1].append(m)
        else:
            groups.append([m])
    return [(g[0].t, " · ".join(m.label for m in g)) for g in groups]


class TextTimeline(str):
    """:meth:`MemoryMonitor.plot` without matplotlib: the run as text, shown as such in a notebook."""

    def __repr__(self) -> str:
        return str(self)


def phase_color(label: str, seen: dict[str, str]) -> str:
    """The colour of phase ``label`` (kept in ``seen``): oomkit's own phases have fixed ones, any other
    label takes the next colour of :data:`OTHER_PHASE_COLORS`."""
    if label not in seen:
        others = sum(1 for k in seen if k not in PHASE_COLORS)
        seen[label] = PHASE_COLORS.get(label) or OTHER_PHASE_COLORS[others % len(OTHER_PHASE_COLORS)]
    return seen[label]


def phase_spans(phases: list, last: float, span: float) -> list[tuple[str, float, float]]:
    """(label, start, end) per span to shade: one per phase (open ones end at ``last``); past
    MAX_PHASE_SPANS, consecutive phases of one label closer than 1 % of the run share a span."""
    spans = [(p.label, p.start, max(p.start, p.end if p.end is not None else last)) for p in phases]
    if len(spans) <= MAX_PHASE_SPANS:
        return spans
    merged: list[tuple[str, float, float]] = []
    for label, a, b in spans:
        if merged and merged[-1][0] == label and a - merged[-1][2] <= 0.01 * span:
            merged[-1] = (label, merged[-1][1], max(b, merged[-1][2]))
        else:
            merged.append((label, a, b))
    return merged


def shade_phases(ax, phases: list, last: float, span: float) -> list:
    """Each phase as a shaded span (gid ``phase:<label>``) with its label at the foot of the chart (a run
    of same-label phases labelled once, upright where the span is narrow); returns one legend handle per label."""
    from matplotlib.patches import Patch

    colors: dict[str, str] = {}
    spans = phase_spans(phases, last, span)
    previous = None
    for i, (label, a, b) in enumerate(spans):
        first = label not in colors
        color = phase_color(label, colors)
        ax.axvspan(a, b, color=color, alpha=0.14, lw=0, gid=f"phase:{label}", zorder=0)
        if first or (label != previous and b - a >= 0.02 * (span or 1)):
            depth = sum(1 for j, (_, c, d) in enumerate(spans) if j < i and c <= a and d >= b)  # inside others
            ax.annotate(label, (a, 0.02 + 0.12 * min(depth, 3)), xycoords=("data", "axes fraction"), fontsize=7,
                        color=color, ha="left", va="bottom", rotation=90 if b - a < 0.06 * (span or 1) else 0,
                        gid=f"phase-label:{label}", annotation_clip=True)  # fmt: skip
        previous = label
    return [Patch(color=color, alpha=0.35, label=f"phase: {label}") for label, color in colors.items()]
