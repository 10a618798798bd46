"""Memory step by step: a leak (sustained growth) told from warm-up and from a cache that fills up."""

from __future__ import annotations

import inspect
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.arguments import flag, number, whole_number
from ..core.html import Markup, badge, progress_bar, sparkline
from ..core.memory import allocated
from ..core.session import caller_namespace
from ..core.units import format_bytes
from .census import CensusDiff, census, census_diff
from .patterns import LeakChecks, leak_checks
from .tensors import tensor_bytes

__all__ = ["GrowthReport", "GrowthDetector", "WatchReport", "watch"]


def _theil_sen(ys: list[float]) -> float:
    """Median of pairwise slopes: one spike or one jump does not tilt it."""
    slopes = [(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]
    return statistics.median(slopes) if slopes else 0.0


def _measure() -> int:
    if torch.cuda.is_available():
        return allocated("all")  # every card: a split model's leak (losses kept on the last card) grows GPU 1
    return tensor_bytes()


def _headroom() -> int | None:
    """Bytes that can still be allocated before an OOM: a GPU's free memory plus PyTorch's cache there.
    With several cards, the least of those that hold this process's tensors: growth spread over a split
    model runs out on the first card to fill (a card it does not use cannot take the growth)."""
    try:
        if torch.cuda.is_available():
            used = [d for d in range(torch.cuda.device_count()) if torch.cuda.memory_allocated(d)]
            return min(_card_headroom(d) for d in used or [torch.cuda.current_device()])
        import psutil

        return psutil.virtual_memory().available
    except Exception:
        return None


def _card_headroom(device: int) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


@dataclass
class GrowthReport:
    """The detector's verdict after ``steps`` steps."""

    steps: int
    samples: list[int]
    leaking: bool
    bytes_per_step: float
    accelerating: bool
    predicted_oom_step: int | None
    detected_at: int | None
    verdict: str
    measure: str = "tensor bytes"

    def __str__(self) -> str:
        lines = [f"growth: {self.verdict}"]
        if self.samples:
            lines.append(
                f"  {self.measure}: {format_bytes(self.samples[0])} at step 1 -> "
                f"{format_bytes(self.samples[-1])} at step {self.steps}; trend "
                f"{format_bytes(int(self.bytes_per_step))}/step" + (", accelerating" if self.accelerating else "")
            )
        if self.predicted_oom_step is not None:
            lines.append(f"  at this rate memory runs out at about step {self.predicted_oom_step:,}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        status = "warn" if self.leaking else "pass"
        return (
            f"<div style='font-family:monospace'>{badge(status)} {Markup(_esc(self.verdict))}"
            f"{sparkline(list(enumerate(self.samples)), f'memory over {len(self.samples)} steps')}"
            f"<pre>{_esc(str(self))}</pre></div>"
        )


def _esc(s: str) -> str:
    from html import escape

    return escape(s)


class GrowthDetector:
    """Record memory once per step; tell sustained growth (a leak) from warm-up and from caches.

    A leak is growth in at least half of the last ``window`` steps after ``warmup``, with the last
    third of that window entirely above its first third and a robust (Theil-Sen) trend of at least
    ``min_growth`` bytes per step. A cache that fills and then stays flat, or a warm-up spike, fails
    those tests once it has settled.

    Args:
        warmup: steps ignored at the start (optimizer state, allocator warm-up, first-shape caches).
        window: recent steps the verdict is based on.
        min_growth: smallest growth per step worth calling a leak, in bytes.
        capacity: bytes available to the measured quantity in total; default: what is measured now
            plus the free GPU memory (CUDA) or the available RAM.
        measure: a callable returning bytes; default CUDA allocated on every card (``allocated("all")``), else
            :func:`tensor_bytes`.
    """

    def __init__(
        self,
        warmup: int = 4,
        window: int = 10,
        min_growth: int = 1024,
        *,
        capacity: int | None = None,
        measure: Callable[[], int] | None = None,
    ) -> None:
        whole_number("warmup", warmup, minimum=0)
        whole_number("window (steps to see a trend)", window, minimum=3)
        whole_number("min_growth (bytes)", min_growth, minimum=0)
        number("capacity (bytes)", capacity, low=0, low_open=True, none_ok=True)
        self.warmup, self.window, self.min_growth = warmup, window, min_growth
        self.capacity = capacity
        self.measure = measure or _measure
        self.measure_name = (
            "GPU allocated"
            if measure is None and torch.cuda.is_available()
            else "tensor bytes"
            if measure is None
            else "memory"
        )
        self.samples: list[int] = []
        self._detected_at: int | None = None

    def record(self, nbytes: int | None = None) -> bool:
        """Record one step (measuring now unless ``nbytes`` is given); returns whether it leaks."""
        self.samples.append(int(self.measure() if nbytes is None else nbytes))
        leaking = self._leaking()
        if leaking and self._detected_at is None:
            self._detected_at = len(self.samples)
        elif not leaking:
            self._detected_at = None
        return leaking

    def _recent(self) -> list[int]:
        post = self.samples[self.warmup :]
        return post[-(self.window + 1) :] if len(post) > self.window else []

    def _leaking(self) -> bool:
        w = self._recent()
        if not w:
            return False
        deltas = [b - a for a, b in zip(w, w[1:])]
        ups = sum(d >= self.min_growth / 2 for d in deltas)
        third = max(1, len(w) // 3)
        sustained = min(w[-third:]) > max(w[:third])
        return ups * 2 >= len(deltas) and sustained and _theil_sen(w) >= self.min_growth

    def report(self) -> GrowthReport:
        n = len(self.samples)
        post = self.samples[self.warmup :]
        leaking = self._leaking()
        w = self._recent()
        slope = _theil_sen(w) if w else (_theil_sen(post) if len(post) > 2 else 0.0)
        accelerating, oom = False, None
        if leaking and len(post) >= 6:
            half = len(post) // 2
            s1, s2 = _theil_sen(post[:half]), _theil_sen(post[half:])
            accelerating = s2 > 1.5 * max(s1, 1.0) and s2 - s1 >= self.min_growth
        if leaking and slope > 0:
            level = self.samples[-1]
            room = (self.capacity - level) if self.capacity is not None else _headroom()
            if room is not None:
                oom = n + _steps_until(room, post, slope, accelerating)
        if not w:
            verdict = f"not enough steps yet ({n} of {self.warmup + self.window + 1} needed)"
        elif leaking:
            verdict = f"LEAK: memory grew {format_bytes(int(slope))} per step over the last {self.window} steps" + (
                " and the growth is accelerating" if accelerating else ""
            )
        else:
            verdict = f"no leak: memory is flat over the last {self.window} steps (after {self.warmup} warm-up steps)"
        return GrowthReport(
            n,
            list(self.samples),
            leaking,
            slope,
            accelerating,
            oom,
            self._detected_at if leaking else None,
            verdict,
            self.measure_name,
        )


def _steps_until(room: int, post: list[int], slope: float, accelerating: bool) -> int:
    """Steps from now to the first that needs more than ``room``: the step k past the k that growth fills
    exactly (that one still fits), hence floor(k) + 1; the next step when nothing is left."""
    room = max(room, 0)
    if accelerating and len(post) >= 6:
        # growth per step rising linearly: room = slope*k + accel*k^2/2
        half = len(post) // 2
        accel = (_theil_sen(post[half:]) - _theil_sen(post[:half])) / max(half, 1)
        if accel > 0:
            return int((-slope + math.sqrt(slope * slope + 2 * accel * room)) / accel) + 1
    return int(room / slope) + 1


@dataclass
class WatchReport:
    """What :func:`watch` saw: the growth verdict, what appeared (by holder), and pattern findings."""

    growth: GrowthReport
    new: CensusDiff | None
    findings: LeakChecks | None

    @property
    def leaking(self) -> bool:
        return self.growth.leaking

    @property
    def suspect(self) -> str | None:
        """The holder that gained the most memory during the watch."""
        return self.new.top_holder if self.new is not None else None

    def __str__(self) -> str:
        parts = [str(self.growth)]
        if self.new is not None and self.growth.leaking:
            parts.append(str(self.new))
        if self.findings is not None and self.findings.problems:
            parts.append("\n".join(str(c) for c in self.findings.problems))
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        parts = [self.growth._repr_html_()]
        if self.new is not None and self.growth.leaking:
            parts.append(self.new._repr_html_())
        if self.findings is not None and self.findings.problems:
            parts.append(LeakChecks(self.findings.problems)._repr_html_())
        return "".join(parts)


def watch(
    step_fn: Callable,
    steps: int,
    *,
    namespace: dict | None = None,
    warmup: int = 4,
    window: int = 10,
    min_growth: int = 1024,
    capacity: int | None = None,
    stop_on_leak: bool = False,
    progress: bool = True,
) -> WatchReport:
    """Run ``step_fn`` ``steps`` times (it gets the step index if it takes an argument), measure memory
    after each step, and say whether it leaks, who gained memory, and which leak pattern is present.
    ``progress``: a step counter (with the memory now) while it runs, gone when the report shows.

    >>> report = watch(lambda i: train_step(batch), steps=30)   # doctest: +SKIP
    """
    if not callable(step_fn):
        raise TypeError(
            f"watch() runs a function once per step, got {type(step_fn).__name__}: "
            "pass the step itself, e.g. watch(lambda: train_step(batch), steps=30)"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
    flag("stop_on_leak", stop_on_leak)
    flag("progress", progress)
    ns = caller_namespace(namespace)
    try:
        takes_arg = bool(inspect.signature(step_fn).parameters)
    except (TypeError, ValueError):
        takes_arg = False
    det = GrowthDetector(warmup, window, min_growth, capacity=capacity)
    counter = progress_bar(steps, "watch", "step", disable=not progress, leave=False)
    try:
        baseline = _watch_steps(step_fn, steps, takes_arg, det, ns, warmup, stop_on_leak, counter)
    finally:
        counter.close()
    growth = det.report()
    return WatchReport(growth, census_diff(baseline, census(ns)) if baseline else None, leak_checks(ns))


def _watch_steps(step_fn: Callable, steps: int, takes_arg: bool, det: GrowthDetector, ns: dict, warmup: int,
                 stop_on_leak: bool, counter) -> Any:  # fmt: skip
    """:func:`watch`'s loop: each step, its memory recorded and counted on ``counter``; the census after the
    warm-up (or the last step) as the baseline."""
    baseline = None
    for i in range(steps):
        try:
            step_fn(i) if takes_arg else step_fn()
        except BaseException as e:  # noqa: BLE001 - re-raised; an interrupt keeps its report too
            # the steps measured so far are the evidence (an OOM here is often the leak itself): keep them
            e.watch_report = WatchReport(det.report(), None, None)
            if hasattr(e, "add_note"):  # Python 3.11+
                first = str(e.watch_report).splitlines()[0]
                e.add_note(
                    f"helpers.watch: step {i} of {steps} raised this; the {i} steps measured "
                    f"before it are in the exception's .watch_report ({first})"
                )
            raise
        if i + 1 == warmup or (baseline is None and i + 1 == steps):
            baseline = census(ns)
        leaking = det.record()
        counter.update(1)
        counter.set_postfix_str(format_bytes(det.samples[-1]) if det.samples else "", refresh=False)
        if leaking and stop_on_leak:
            break
    return baseline
