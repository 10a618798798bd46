"""Per-cell memory accounting: after a cell that changed memory meaningfully (``SHOWN_FROM``), one line
with GPU allocated change and peak, RAM change and time; a cell whose re-runs keep growing memory is
flagged. Every cell is recorded (``CellStats.active.records``) whether its line shows or not.

Turned on by ``%load_ext helpers``; ``%oomkit off`` / ``%oomkit on`` switch the line off and on,
``%oomkit all`` shows it under every cell.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field

import psutil

from ..core.memory import allocated, peak_allocated, peak_resets
from ..core.units import MiB, format_bytes

__all__ = ["CellRecord", "CellStats", "SHOWN_FROM"]

# A cell's line shows when it moved memory at least this much (tensors or GPU allocated kept, the GPU
# peak above where the cell started, or RAM): most cells (prints, plans, estimates) move none, and a
# line under each of them hid the few that did.
SHOWN_FROM = 16 * MiB


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_bytes(abs(n))


@dataclass
class CellRecord:
    """What one cell run did to memory. Bytes are ints; ``gpu_*`` are None without CUDA."""

    cell: int | None
    gpu_change: int | None
    gpu_peak: int | None
    ram_change: int
    seconds: float
    growing_runs: int = 0  # consecutive re-runs of this cell that each left memory behind
    growth_per_run: int = 0
    tensor_change: int | None = None  # without CUDA: change in live tensor bytes
    peak_new: bool = True  # False: the cell stayed below an earlier cell's peak (gpu_peak is that bound)
    peak_reset: bool = False  # the peak counters were reset during the cell: gpu_peak is a lower bound

    gpu_start: int | None = None  # GPU allocated when the cell started: its peak above this is the cell's own
    # torch was first imported during the cell: its RAM change is mostly the libraries' code, not data
    imported_torch: bool = False

    @property
    def growing(self) -> bool:
        return self.growing_runs >= CellStats.flag_after

    @property
    def meaningful(self) -> bool:
        """The cell moved memory by ``SHOWN_FROM`` or more (or keeps growing): worth its line."""
        kept = self.gpu_change if self.gpu_change is not None else self.tensor_change or 0
        peak = (self.gpu_peak or 0) - (self.gpu_start or 0) if self.peak_new and self.gpu_peak is not None else 0
        ram = 0 if self.imported_torch else abs(self.ram_change)
        return self.growing or max(abs(kept), peak, ram) >= SHOWN_FROM

    def __str__(self) -> str:
        if self.peak_reset:  # a monitor or an evaluation restarted the counters mid-cell
            peak = f"peak at least {format_bytes(self.gpu_peak)}"
        else:
            peak = (
                f"peak {format_bytes(self.gpu_peak)}" if self.peak_new else f"peak under {format_bytes(self.gpu_peak)}"
            )
        if self.gpu_change is not None:
            gpu = f"GPU {_signed(self.gpu_change)} ({peak}) · "
        elif self.tensor_change is not None or self.gpu_peak is not None:
            gpu = f"tensors {_signed(self.tensor_change or 0)} (no GPU) · "
        else:  # torch not imported yet: no tensor exists, only RAM moved
            gpu = ""
        line = f"[oomkit] {gpu}RAM {_signed(self.ram_change)} · {self.seconds:.2f} s"
        if self.growing:
            line += (
                f"\n[oomkit] WARN: each of the last {self.growing_runs} runs of this cell left about "
                f"{format_bytes(self.growth_per_run)} behind: something it appends to or displays keeps "
                f"growing (a list of tensors, Out history, a hook); see helpers.leak_checks()"
            )
        return line


@dataclass
class CellStats:
    """The IPython event handlers. One instance per shell, kept in ``CellStats.active``."""

    threshold: int = 1 * MiB  # a re-run that leaves less than this behind is not growth
    enabled: bool = True
    every_cell: bool = False  # %oomkit all: a line under every cell, not only the ones that moved memory
    records: list[CellRecord] = field(default_factory=list)
    _start: tuple | None = None
    _peak_before: int | None = None
    _resets_before: int = 0
    _history: dict = field(default_factory=dict)  # cell source hash -> consecutive growing runs

    flag_after = 3
    active = None

    @staticmethod
    def _gpu() -> tuple[int | None, int | None]:
        torch = sys.modules.get("torch")  # not imported yet: PyTorch holds nothing (and importing it takes seconds)
        if torch is None or not torch.cuda.is_available():
            return None, None
        return allocated("all"), peak_allocated("all")  # every GPU: a split model's cell grows both

    def pre_run_cell(self, info=None) -> None:
        if not self.enabled:
            self._start = None
            return
        src = getattr(info, "raw_cell", "") or ""
        _, self._peak_before = self._gpu()  # peak stats are not reset: other tools read them
        self._resets_before = peak_resets()
        # what the process holds, measured as cleanup() measures it: the line and its report agree
        self._start = (time.perf_counter(), _held(), _rss(), hashlib.sha1(src.encode()).hexdigest(), src)

    def post_run_cell(self, result=None) -> None:
        if not self.enabled or self._start is None:
            return
        started, before, rss_before, key, src = self._start
        self._start = None
        if src.lstrip().startswith(("%oomkit", "%load_ext", "%reload_ext", "%unload_ext")):
            return
        _, peak = self._gpu()
        change = _change(before, _held(), rss_before)
        # what a cell left behind: GPU allocated, or live tensor bytes without CUDA (both exact)
        left = change.memory if change is not None else 0
        runs, total = self._history.get(key, (0, 0))
        runs, total = (runs + 1, total + left) if left >= self.threshold else (0, 0)
        self._history[key] = (runs, total)
        cell = getattr(result, "execution_count", None)
        # below an earlier cell's peak, this cell's own peak is only known to be under it
        peak_new = peak is None or peak > (self._peak_before or 0)
        reset = peak_resets() != self._resets_before
        rec = CellRecord(
            cell,
            change.gpu_allocated if change is not None else None,
            peak,
            _rss() - rss_before,
            time.perf_counter() - started,
            runs,
            total // runs if runs else 0,
            change.tensors if change is not None else None,
            peak_new,
            reset and peak is not None,
            before.gpu_allocated if before is not None else (0 if peak is not None else None),
            before is None and change is not None,
        )
        self.records.append(rec)
        if self.every_cell or rec.meaningful:
            print(rec)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _held():
    """:func:`~helpers.oom.reclaim.held` now, or None while torch is not imported: no tensor exists yet, and
    reading would import torch (seconds) in a cell that may not need it, such as ``%load_ext helpers``."""
    if "torch" not in sys.modules:
        return None
    from ..oom.reclaim import held

    return held()


def _change(before, after, rss_before: int):
    """``after - before`` (a :class:`~helpers.oom.reclaim.Held`); a cell that imported torch started from
    nothing held; None while torch is still not imported."""
    if after is None:
        return None
    if before is None:
        zero = [None if getattr(after, n) is None else 0 for n in ("gpu_allocated", "gpu_reserved", "tensors")]
        before = type(after)(*zero, rss_before)
    return after - before


def _oomkit_magic(line: str) -> None:
    """``%oomkit off`` / ``%oomkit on`` / ``%oomkit all`` / ``%oomkit``: switch the per-cell memory line (on: under
    the cells that moved memory; all: under every cell), or show its state."""
    stats = CellStats.active
    arg = line.strip().lower()
    if stats is None:
        print("oomkit cell accounting is not loaded: run %load_ext helpers")
        return
    if arg in ("off", "on", "all"):
        stats.enabled = arg != "off"
        stats.every_cell = arg == "all"
    elif arg:
        print(f"%oomkit takes 'on', 'all' or 'off', not {arg!r}")
        return
    state = ("on under every cell" if stats.every_cell else f"on when a cell moves {format_bytes(SHOWN_FROM)} or more"
             ) if stats.enabled else "off"  # fmt: skip
    print(f"oomkit per-cell memory line is {state}")


def load_ipython_extension(ip) -> None:
    if CellStats.active is not None:
        unload_ipython_extension(ip)
    stats = CellStats.active = CellStats()
    ip.events.register("pre_run_cell", stats.pre_run_cell)
    ip.events.register("post_run_cell", stats.post_run_cell)
    ip.register_magic_function(_oomkit_magic, "line", "oomkit")


def unload_ipython_extension(ip) -> None:
    stats = CellStats.active
    if stats is None:
        return
    for name, fn in (("pre_run_cell", stats.pre_run_cell), ("post_run_cell", stats.post_run_cell)):
        try:
            ip.events.unregister(name, fn)
        except ValueError:  # already gone
            pass
    CellStats.active = None
