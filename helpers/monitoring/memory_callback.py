"""``MemoryCallback``: memory figures in the Trainer's logs, growth detected between log steps, each
optimizer step a ``"train step"`` phase on a running :class:`helpers.MemoryMonitor`'s chart.

Kept apart from :mod:`helpers.monitoring.monitor` because it subclasses transformers' ``TrainerCallback``, whose
import pulls the Trainer, peft and bitsandbytes (seconds): the class is built on first use.
"""

from __future__ import annotations

import warnings

import psutil
import torch

from ..core import phases as phase_hub
from ..core.arguments import ArgumentError
from ..core.memory import reset_peak_allocated
from ..core.units import MiB
from .monitor import MemoryMonitor, MemoryWarning

__all__ = ["MemoryCallback"]  # noqa: F822 (built on first use, below)


class _MemoryCallback:
    """Add memory figures to the Trainer's logs and detect steady growth between log steps.

    Each log gets ``mem_allocated_mib``, ``mem_reserved_mib``, ``mem_peak_mib`` (peak allocated
    since the previous log; this resets CUDA's peak counters) on a GPU, and ``ram_rss_mib`` (and
    ``ram_peak_mib`` when a ``monitor`` samples in between). With more than one GPU the first three
    add every card up and each card's peak follows (``mem_gpu1_peak_mib``): that is the figure to
    hold against one card's capacity. The same figures go into
    ``trainer.state.log_history``. Growth is judged by a :class:`helpers.leaks.GrowthDetector`
    over the log steps; a leak is reported once, in ``.leaks`` and as a warning.

    Each optimizer step is a ``"train step"`` phase (:mod:`helpers.core.phases`): in ``monitor`` when one is
    given, else in every running monitor, so its chart shades the steps.

    Args:
        monitor: a running :class:`MemoryMonitor` to put train/checkpoint marks and step phases on and read peaks from.
        warmup, window, min_growth: passed to the ``GrowthDetector`` (in log steps and bytes).
        measure: bytes to watch for growth; default CUDA allocated on every card, or the process RSS
            on a CPU.
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
        from ..leaks.growth import GrowthDetector

        if monitor is not None and not isinstance(monitor, MemoryMonitor):
            raise ArgumentError(f"monitor must be a MemoryMonitor (or None), got {monitor!r:.60}")
        self.monitor = monitor
        self.cuda = torch.cuda.is_available()
        # every visible card, not the monitor's: a monitor may watch another card than the one training
        self.devices = tuple(range(torch.cuda.device_count())) if self.cuda else ()
        self._proc = psutil.Process()
        self.measure = measure or (self._allocated if self.cuda else lambda: self._proc.memory_info().rss)
        self.detector = GrowthDetector(warmup=warmup, window=window, min_growth=min_growth, measure=self.measure)
        self.leaks: list[str] = []
        self._last_t = 0.0
        self._step: list = []  # the open "train step" phase (helpers.core.phases.begin's handles)

    def figures(self) -> dict[str, float]:
        """The memory figures of one log line, in MiB (rounded to 0.1)."""
        out = {}
        if self.cuda:
            peaks = {d: torch.cuda.max_memory_allocated(d) for d in self.devices}
            out["mem_allocated_mib"] = self._allocated() / MiB
            out["mem_reserved_mib"] = sum(torch.cuda.memory_reserved(d) for d in self.devices) / MiB
            out["mem_peak_mib"] = sum(peaks.values()) / MiB  # several cards: their peaks' sum, an upper bound
            if len(self.devices) > 1:
                out.update({f"mem_gpu{d}_peak_mib": peak / MiB for d, peak in peaks.items()})
            self._reset_peaks()
        out["ram_rss_mib"] = self._proc.memory_info().rss / MiB
        if self.monitor is not None and self.monitor.samples:
            out["ram_peak_mib"] = max(out["ram_rss_mib"], self.monitor.peak(self._last_t)["process_rss"] / MiB)
            self._last_t = self.monitor.samples[-1].t
        return {k: round(v, 1) for k, v in out.items()}

    def _allocated(self) -> int:
        return sum(torch.cuda.memory_allocated(d) for d in self.devices)

    def _reset_peaks(self) -> None:
        reset_peak_allocated("all")  # every card: reset_peak_memory_stats() alone resets the current one

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cuda:
            self._reset_peaks()
        if self.monitor is not None:
            self.monitor.mark(f"train from step {state.global_step}")

    def on_step_begin(self, args, state, control, **kwargs):
        self._end_step()  # a step the Trainer left open (an exception inside it) ends here
        self._step = phase_hub.begin("train step", self.monitor)

    def on_step_end(self, args, state, control, **kwargs):
        self._end_step()

    def _end_step(self) -> None:
        phase_hub.end(self._step)
        self._step = []

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
            warnings.warn(message, MemoryWarning, stacklevel=2)

    def on_save(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.mark(f"checkpoint {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self._end_step()
        if self.monitor is not None:
            self.monitor.mark(f"train end (step {state.global_step})")


def __getattr__(name: str):
    # MemoryCallback subclasses transformers' TrainerCallback, whose import pulls the Trainer, peft and
    # bitsandbytes (seconds): built on first use, so `import helpers.monitoring.memory_callback` stays cheap
    if name == "MemoryCallback":
        from transformers import TrainerCallback

        cls = type("MemoryCallback", (_MemoryCallback, TrainerCallback), {"__module__": __name__})
        cls.__doc__ = _MemoryCallback.__doc__
        globals()["MemoryCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
