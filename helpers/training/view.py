"""The live training view: one display that updates while ``Trainer`` runs, then one summary line.

``TrainView`` is a ``TrainerCallback``. At each step it reads the step and total, the time so far,
the last logged loss, the tokens seen (``TrainingArguments.include_num_input_tokens_seen``) and the
GPU's allocated memory and peaks (with a line of the memory per step so far against the card: a leak or
a growing sequence shows while it happens), and shows them as a :class:`TrainProgress`: in a notebook one
output updated in place (IPython's ``display(..., display_id=True)``: no widget, so it renders with
ipywidgets 7.7, 8 or none, in JupyterLab, Colab and papermill's copies alike), without a kernel a text
line every tenth of the run. When training ends it shows the summary: peak reserved, its share of
the card, and the wall time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from typing import Any

import psutil
import torch

from ..core.devices import resolve_device
from ..core.html import LOSS_COLOR, STYLE, bar, sparkline, table
from ..core.memory import allocated, peak_allocated, reserved
from ..core.session import ipython
from ..core.units import format_bytes

__all__ = ["TrainProgress", "TrainView", "format_seconds", "MAX_POINTS", "bounded"]  # noqa: F822 (TrainView is built lazily, below)


MAX_POINTS = 400  # points of the live memory chart (a 320 px line: more would not show)


def format_seconds(seconds: float | None) -> str:
    """``0:07``, ``3:12``, ``1:02:03``; ``?`` for an unknown time."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass
class TrainProgress:
    """Where a training run stands: one update of the live view (``finished`` for the last)."""

    step: int
    total: int
    elapsed: float  # seconds since this run (or resume) started
    steps_done: int  # steps this run trained (the resumed-from step excluded), for the rate and ETA
    loss: float | None = None
    tokens: int | None = None  # input tokens this run has seen
    allocated: int | None = None  # GPU bytes now (None on a CPU)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    capacity: int | None = None  # the card's bytes
    device: str = "cpu"
    process_rss: int | None = None  # on a CPU: this process's resident memory
    finished: bool = False
    history: list[tuple[int, int]] = field(default_factory=list)  # (step, GPU allocated or process RSS) so far
    predicted_step: float | None = None  # seconds per optimizer step the plan predicted (estimator.timing)
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, logged loss) so far

    @property
    def eta(self) -> float | None:
        """Seconds left at this run's pace so far (None before the first step)."""
        if self.steps_done <= 0:
            return None
        return self.elapsed / self.steps_done * max(0, self.total - self.step)

    @property
    def predicted_eta(self) -> float | None:
        """Seconds left as the plan predicted them (None without a prediction)."""
        return None if self.predicted_step is None else self.predicted_step * max(0, self.total - self.step)

    @property
    def predicted_run(self) -> float | None:
        """This run's steps as the plan predicted them (None without a prediction)."""
        return None if self.predicted_step is None else self.predicted_step * self.steps_done

    def _eta(self) -> str:
        """The ETA at this run's pace, and the plan's beside it when there is one."""
        eta = format_seconds(self.eta)
        return eta if self.predicted_eta is None else f"{eta} (predicted {format_seconds(self.predicted_eta)})"

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.elapsed if self.tokens and self.elapsed > 0 else None

    def _memory(self) -> str:
        if self.allocated is None:
            return f"CPU run, process {format_bytes(self.process_rss)}" if self.process_rss else "CPU run"
        of = f" of {format_bytes(self.capacity)}" if self.capacity else ""
        return f"GPU {format_bytes(self.allocated)} allocated, peak {format_bytes(self.peak_allocated)}{of}"

    def summary(self) -> str:
        """One line: peak reserved, its share of the card, wall time (the line to remember after a run)."""
        time_ = f"wall time {format_seconds(self.elapsed)} for {self.steps_done} step{'s' * (self.steps_done != 1)}"
        if self.predicted_run is not None:
            time_ += f" (predicted {format_seconds(self.predicted_run)})"
        if self.peak_reserved is None:
            return f"{self._memory()}; {time_}"
        share = f" = {self.peak_reserved / self.capacity:.0%} of the {format_bytes(self.capacity)} card" if (
            self.capacity) else ""  # fmt: skip
        return f"peak reserved {format_bytes(self.peak_reserved)}{share} ({self.device}); {time_}"

    def __str__(self) -> str:
        if self.finished:
            return f"trained to step {self.step}/{self.total}: {self.summary()}"
        loss = f"loss {self.loss:.4f}" if self.loss is not None else "loss -"
        rate = f"{self.tokens_per_second:,.0f} tokens/s" if self.tokens_per_second else "tokens/s -"
        return (
            f"step {self.step}/{self.total} · {format_seconds(self.elapsed)} elapsed, ETA {self._eta()}"
            f" · {loss} · {rate} · {self._memory()}"
        )

    def rows(self) -> list[list[object]]:
        """The view's table rows: label, value."""
        rows: list[list[object]] = [
            ["step", f"{self.step} / {self.total}"],
            ["elapsed", format_seconds(self.elapsed)],
            ["ETA", "done" if self.finished else self._eta()],
            ["loss", f"{self.loss:.4f}" if self.loss is not None else "-"],
            ["tokens/s", f"{self.tokens_per_second:,.0f}" if self.tokens_per_second else "-"],
        ]
        if self.allocated is not None:
            rows += [["allocated", format_bytes(self.allocated)], ["peak allocated", format_bytes(self.peak_allocated)],
                     ["peak reserved", format_bytes(self.peak_reserved)]]  # fmt: skip
        elif self.process_rss:
            rows.append(["process memory", format_bytes(self.process_rss)])
        return rows

    def _repr_html_(self) -> str:
        title = f"training on {self.device}" + (" - finished" if self.finished else "")
        html = STYLE + "<div class='oomkit oomkit-train-view'>"
        frac = self.step / self.total if self.total else 0.0
        html += (
            f"<progress value='{self.step}' max='{max(self.total, 1)}' style='width:320px'></progress> "
            f"<span class='oomkit-num'>{frac:.0%}</span>"
        )
        html += table(["", ""], self.rows(), title=title)
        html += sparkline(
            self.losses, "loss per step", fmt=lambda v: f"{v:.4f}", color=LOSS_COLOR, css="oomkit-loss-line"
        )
        what = "GPU allocated per step" if self.allocated is not None else "process memory per step"
        html += sparkline(self.history, what, self.capacity if self.allocated is not None else None)
        if self.capacity and self.peak_reserved is not None:
            html += bar(self.peak_reserved, self.capacity, "peak reserved")
        if self.finished:
            html += f"<div class='oomkit-summary'>{escape(self.summary())}</div>"
        return html + "</div>"


def bounded(points: list[tuple[int, Any]], step: int, value: Any) -> list[tuple[int, Any]]:
    """``points`` with one point per step (a step seen again replaces its point); past ``MAX_POINTS`` every
    other older point goes, so a long run keeps its shape in a bounded list."""
    points = points[:-1] if points and points[-1][0] == step else points
    points = [*points, (step, value)]
    return points[:-1:2] + points[-1:] if len(points) > MAX_POINTS else points


def _html_sink() -> Callable[[TrainProgress], None] | None:
    """An updating output in a notebook kernel, else None."""
    shell = ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    from IPython.display import display

    handle: list[Any] = []

    def show(progress: TrainProgress) -> None:
        bundle = {"text/html": progress._repr_html_(), "text/plain": str(progress)}
        if handle:
            handle[0].update(bundle, raw=True)
        else:
            handle.append(display(bundle, raw=True, display_id=True))

    return show


class _TrainView:
    """Show a :class:`TrainProgress` while ``Trainer`` trains; ``.last`` is the latest, ``.updates`` counts them.

    Args:
        display: ``"auto"`` (an updating output in a notebook, else text lines), ``"html"``, ``"text"``,
            or a function taking each :class:`TrainProgress`.
        min_interval: seconds between two updates of the notebook output (the first and last always show).
        lines: how many text lines a headless run prints at most (plus the summary).
        stream: where text lines go (default ``sys.stdout``).
        predicted_step: seconds per optimizer step the plan predicts (:func:`helpers.estimator.timing.view_time`;
            ``train()`` sets it), shown beside the ETA measured; None shows the measured one alone.
    """

    def __init__(self, display: str | Callable = "auto", *, min_interval: float = 0.5, lines: int = 10,
                 stream=None, predicted_step: float | None = None) -> None:  # fmt: skip
        self.min_interval, self.lines, self.stream = min_interval, max(1, lines), stream
        self.predicted_step = predicted_step
        self.updates = 0
        self.last: TrainProgress | None = None
        self._sink = self._choose(display)
        self._shown_at = -1.0
        self._start, self._first_step, self._first_tokens, self._loss = 0.0, 0, 0, None
        self._peak_alloc = self._peak_reserved = 0
        self._history: list[tuple[int, int]] = []
        self._losses: list[tuple[int, float]] = []
        label, dev = resolve_device("current")
        self._device, self._capacity = label, (dev or {}).get("capacity")

    def _choose(self, display) -> Callable[[TrainProgress], None]:
        if callable(display):
            return display
        if display not in ("auto", "html", "text"):
            raise ValueError(f"display must be 'auto', 'html', 'text' or a function, not {display!r}")
        sink = _html_sink() if display in ("auto", "html") else None
        return sink or self._print

    def _print(self, progress: TrainProgress) -> None:
        every = max(1, progress.total // self.lines)
        if progress.finished or progress.step % every == 0 or progress.steps_done == 1:
            print(progress.summary() if progress.finished else progress, file=self.stream or sys.stdout, flush=True)

    def progress(self, state, finished: bool = False) -> TrainProgress:
        """Read the figures now (``state`` is the Trainer's ``TrainerState``)."""
        cuda = torch.cuda.is_available()
        if cuda:
            self._peak_alloc = max(self._peak_alloc, peak_allocated("all"))
            self._peak_reserved = max(self._peak_reserved, reserved("all"),
                                      sum(torch.cuda.max_memory_reserved(d) for d in range(torch.cuda.device_count())))  # fmt: skip
        tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0) - self._first_tokens
        rss = None if cuda else psutil.Process().memory_info().rss
        self._history = bounded(self._history, state.global_step, allocated("all") if cuda else rss)
        return TrainProgress(
            step=state.global_step, total=state.max_steps, elapsed=time.perf_counter() - self._start,
            steps_done=state.global_step - self._first_step, loss=self._loss, tokens=tokens if tokens > 0 else None,
            allocated=allocated("all") if cuda else None, peak_allocated=self._peak_alloc if cuda else None,
            peak_reserved=self._peak_reserved if cuda else None, capacity=self._capacity, device=self._device,
            process_rss=rss, finished=finished, history=list(self._history), predicted_step=self.predicted_step,
            losses=list(self._losses),
        )  # fmt: skip

    def _show(self, progress: TrainProgress, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._shown_at < self.min_interval and progress.step < progress.total:
            return
        self._shown_at, self.last = now, progress
        self.updates += 1
        self._sink(progress)

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._first_step = time.perf_counter(), state.global_step
        self._first_tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._show(self.progress(state), force=True)

    def on_step_end(self, args, state, control, **kwargs):
        self._show(self.progress(state))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._loss = float(logs["loss"])
            self._losses = bounded(self._losses, state.global_step, self._loss)

    def on_train_end(self, args, state, control, **kwargs):
        self._show(self.progress(state, finished=True), force=True)


def __getattr__(name: str):
    # TrainView subclasses transformers' TrainerCallback, whose import pulls the Trainer (seconds): built on
    # first use, so `import helpers.training.view` stays cheap
    if name == "TrainView":
        from transformers import TrainerCallback

        cls = type("TrainView", (_TrainView, TrainerCallback), {"__module__": __name__})
        cls.__doc__ = _TrainView.__doc__
        globals()["TrainView"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
