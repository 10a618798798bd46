"""Per-cell memory accounting: after each cell, one line with GPU allocated change and peak, RAM
change and time; a cell whose re-runs keep growing memory is flagged.

Turned on by ``%load_ext helpers``; ``%oomkit off`` / ``%oomkit on`` switch the line off and on.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import psutil
import torch

from ..core.memory import allocated, peak_allocated, peak_resets
from ..core.units import MiB, format_bytes

__all__ = ["CellRecord", "CellStats"]


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

    @property
    def growing(self) -> bool:
        return self.growing_runs >= CellStats.flag_after

    def __str__(self) -> str:
        if self.peak_reset:  # a monitor or an evaluation restarted the counters mid-cell
            peak = f"peak at least {format_bytes(self.gpu_peak)}"
        else:
            peak = (
                f"peak {format_bytes(self.gpu_peak)}" if self.peak_new else f"peak under {format_bytes(self.gpu_peak)}"
            )
        gpu = (
            f"GPU {_signed(self.gpu_change)} ({peak})"
            if self.gpu_change is not None
            else f"tensors {_signed(self.tensor_change or 0)} (no GPU)"
        )
        line = f"[oomkit] {gpu} · RAM {_signed(self.ram_change)} · {self.seconds:.2f} s"
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
    records: list[CellRecord] = field(default_factory=list)
    _start: tuple | None = None
    _peak_before: int | None = None
    _resets_before: int = 0
    _history: dict = field(default_factory=dict)  # cell source hash -> consecutive growing runs

    flag_after = 3
    active = None

    @staticmethod
    def _gpu() -> tuple[int | None, int | None]:
        if not torch.cuda.is_available():
            return None, None
        return allocated("all"), peak_allocated("all")  # every GPU: a split model's cell grows both

    @staticmethod
    def _tensors() -> int | None:
        """Without CUDA: bytes of live tensors (RSS alone cannot tell kept memory from malloc's cache)."""
        if torch.cuda.is_available():
            return None
        from ..leaks.tensors import tensor_bytes

        return tensor_bytes()

    def pre_run_cell(self, info=None) -> None:
        if not self.enabled:
            self._start = None
            return
        src = getattr(info, "raw_cell", "") or ""
        gpu0, self._peak_before = self._gpu()  # peak stats are not reset: other tools read them
        self._resets_before = peak_resets()
        self._start = (
            time.perf_counter(),
            gpu0,
            psutil.Process().memory_info().rss,
            hashlib.sha1(src.encode()).hexdigest(),
            src,
            self._tensors(),
        )

    def post_run_cell(self, result=None) -> None:
        if not self.enabled or self._start is None:
            return
        started, gpu0, rss0, key, src, tensors0 = self._start
        self._start = None
        if src.lstrip().startswith(("%oomkit", "%load_ext", "%reload_ext", "%unload_ext")):
            return
        gpu1, peak = self._gpu()
        rss1 = psutil.Process().memory_info().rss
        gpu_change = gpu1 - gpu0 if gpu1 is not None else None
        tensor_change = self._tensors() - tensors0 if tensors0 is not None else None
        # what a cell left behind: GPU allocated, or live tensor bytes without CUDA (both exact)
        left = gpu_change if gpu_change is not None else tensor_change
        runs, total = self._history.get(key, (0, 0))
        runs, total = (runs + 1, total + left) if left >= self.threshold else (0, 0)
        self._history[key] = (runs, total)
        cell = getattr(result, "execution_count", None)
        # below an earlier cell's peak, this cell's own peak is only known to be under it
        peak_new = peak is None or peak > (self._peak_before or 0)
        reset = peak_resets() != self._resets_before
        rec = CellRecord(
            cell,
            gpu_change,
            peak,
            rss1 - rss0,
            time.perf_counter() - started,
            runs,
            total // runs if runs else 0,
            tensor_change,
            peak_new,
            reset and peak is not None,
        )
        self.records.append(rec)
        print(rec)


def _oomkit_magic(line: str) -> None:
    """``%oomkit off`` / ``%oomkit on`` / ``%oomkit``: switch the per-cell memory line, or show its state."""
    stats = CellStats.active
    arg = line.strip().lower()
    if stats is None:
        print("oomkit cell accounting is not loaded: run %load_ext helpers")
        return
    if arg in ("off", "on"):
        stats.enabled = arg == "on"
    elif arg:
        print(f"%oomkit takes 'on' or 'off', not {arg!r}")
        return
    print(f"oomkit per-cell memory line is {'on' if stats.enabled else 'off'}")


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
