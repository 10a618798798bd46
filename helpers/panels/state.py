"""What a panel shows for one setting: :class:`PanelState` (estimate, verdict, top fix) and its bar.

Shared by every panel (:mod:`helpers.panels.widgets`, :mod:`helpers.panels.train_panel`) and by the states over
several GPUs (:mod:`helpers.panels.gpus`), so one bar drawing and one verdict wording serve them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

from ..core.html import LEVEL_FILLS, STYLE, TRACK_COLOR, color_attrs, table
from ..core.units import format_bytes
from ..core.vocab import FITS, VERDICT_STATUS, verdict
from ..estimator.core import MemoryEstimate
from ..estimator.fitting import Suggestion
from ..estimator.reducers import host_cost
from ..estimator.timing import approx_duration
from ..placement.machine_fit import fit

__all__ = [
    "SEGMENTS",
    "PanelState",
    "ReducerTable",
    "judgement",
    "stacked_bar",
    "REDUCER_SPEED",
    "host_note",
    "notes_html",
    "load_time_text",
    "train_time_text",
    "NO_TIME",
]

SEGMENTS = [  # (label, estimate row groups, opacity) in bar order; a load panel has no training state
    ("weights", ("weights",), 1.0),
    ("KV cache", ("kv_cache",), 0.7),
    ("activations", ("activations",), 0.5),
    ("overheads", ("training", "overhead"), 0.3),
]


def stacked_bar(
    parts: list[tuple[str, int, float]], total: int, capacity: int, verdict_: str, caption: str, *, width: int = 420,
    attrs: str = "",
) -> str:  # fmt: skip
    """A bar of ``parts`` (label, bytes, opacity) against ``capacity``, its legend and ``caption`` (HTML: the
    caller escapes what it puts there); ``attrs`` goes into the outer ``div`` (a class, data attributes)."""
    status = VERDICT_STATUS[verdict_]
    color = LEVEL_FILLS["warn" if status == "warn" else "fail" if status == "fail" else "ok"]
    scale = max(capacity, total) or 1
    spans, legend = [], []
    for label, nbytes, alpha in parts:
        pct = 100 * nbytes / scale
        spans.append(
            f"<span title='{escape(label)} {format_bytes(nbytes)}' style='display:block;float:left;"
            f"width:{pct:.2f}%;height:100%;background:{color};opacity:{alpha}'></span>"
        )
        # nowrap: a narrow output area wraps between items, never between a label and its size
        legend.append(
            f"<span style='white-space:nowrap'><span style='opacity:{max(alpha, 0.5)}'>&#9632;</span> "
            f"{escape(label)} {format_bytes(nbytes)}</span>"
        )
    cap_mark = 100 * capacity / scale
    return (
        f"{STYLE}<div{attrs} style='font-family:monospace'>"
        # width 100% up to ``width``: a fixed width set the panel's narrowest size (a percentage max-width does
        # not count there), and ipywidgets 7.7 (Colab) widened the whole output past a narrow column with it,
        # cutting off the slider values
        f"<div style='position:relative;width:100%;max-width:{width}px;height:14px;background:{TRACK_COLOR};border-radius:3px;"
        f"overflow:hidden'>{''.join(spans)}"
        f"<span style='position:absolute;left:{cap_mark:.2f}%;top:0;width:2px;height:100%;background:currentColor'>"
        "</span></div>"
        f"<div {color_attrs(status)}>{' &nbsp; '.join(legend)}</div>"
        f"<div>{caption}</div></div>"
    )


@dataclass
class PanelState:
    """What the panel shows for one setting: the estimate, the verdict, the top fix, how long it took."""

    plan: Any  # a LoadPlan, or a TrainPlan in the training panel
    estimate: Any
    verdict: str
    capacity: int
    device: str
    suggestion: Any = None
    seconds: float = 0.0
    cached: bool = False
    segments_spec: tuple = tuple(SEGMENTS)  # (label, estimate row groups, opacity) per bar segment
    alternative: Any = None  # a panel_gpus.Alternative: a multi-GPU set of this GPU where the plan would fit
    time: Any = None  # the plan's TimeEstimate (estimator.timing.view_time), None where it cannot be timed
    time_text: str = ""  # the panel's time line, rendered from ``time``

    @property
    def headroom(self) -> int:
        return self.capacity - self.estimate.total

    def _named_device(self) -> bool:
        """False when the device is a bare byte count: its label is the capacity, shown once already."""
        return self.device != format_bytes(self.capacity)

    def _on(self, html: bool = False) -> str:
        device = escape(self.device) if html else self.device
        return f" on {device}" if self._named_device() else ""

    def segments(self) -> list[tuple[str, int]]:
        """Bytes per bar segment (weights, KV cache, activations, overheads for a load panel)."""
        return [(label, sum(self.estimate.group_bytes(g) for g in groups)) for label, groups, _ in self.segments_spec]

    def verdict_text(self) -> str:
        text = (
            f"{self.verdict.upper()}: {format_bytes(self.estimate.total)} of {format_bytes(self.capacity)}"
            f"{self._on()} (headroom {format_bytes(self.headroom)})"
        )
        text += self.fix_text()
        if self.alternative is not None:
            text += f". {self.alternative}"
        return text

    def fix_text(self) -> str:
        """ ". Top fix: <change> (saves ...)" when there is one; "" otherwise."""
        if self.suggestion is None:
            return ""
        return f". Top fix: {self.suggestion.change} (saves {format_bytes(self.suggestion.saving)}{self._short()})"

    def _short(self) -> str:
        """Said after a top fix that does not make the plan fit by itself (no single change does)."""
        after = self.suggestion.verdict_on(self.capacity)  # a split or an offload: as its placement decided
        return "" if after == FITS else f"; still {after}: not enough alone"

    def bar_html(self, width: int = 420) -> str:
        parts = [
            (label, nbytes, alpha)
            for (label, nbytes), (_, _, alpha) in zip(self.segments(), self.segments_spec, strict=True)
        ]
        caption = (
            f"total {format_bytes(self.estimate.total)} / {format_bytes(self.capacity)}"
            f"{f' ({escape(self.device)})' if self._named_device() else ''}"
        )
        return stacked_bar(parts, self.estimate.total, self.capacity, self.verdict, caption, width=width)

    def text_lines(self) -> list[str]:
        """The summary's lines for this state: the breakdown, the verdict and the time."""
        segs = ", ".join(f"{label} {format_bytes(b)}" for label, b in self.segments())
        return [f"estimate: {segs}", self.verdict_text(), *([self.time_text] if self.time_text else [])]

    def time_html(self) -> str:
        """The time line as the panel's ``oomkit-time`` element ("" when there is none)."""
        if not self.time_text:
            return ""
        return f"<div class='oomkit-time-text' style='font-family:monospace'>{escape(self.time_text)}</div>"

    def notes(self) -> list[str]:
        """Notes of this state beyond the estimate's warnings (a split's, a device set that would fit)."""
        return []

    def verdict_html(self) -> str:
        fix = ""
        if self.suggestion is not None:
            fix = (
                f"<div class='oomkit-suggestion'>Top fix: <b>{escape(self.suggestion.change)}</b> "
                f"(saves {format_bytes(self.suggestion.saving)}{escape(self._short())})</div>"
            )
        if self.alternative is not None:
            fix += f"<div class='oomkit-alternative'>{escape(str(self.alternative))}</div>"
        return (
            f"<div class='oomkit-verdict-text' data-verdict='{escape(self.verdict)}' "
            f"style='font-family:monospace'>{STYLE}<b {color_attrs(VERDICT_STATUS[self.verdict])}>"
            f"{escape(self.verdict.upper())}</b>: "
            f"{format_bytes(self.estimate.total)} of {format_bytes(self.capacity)}{self._on(html=True)} "
            f"(headroom {format_bytes(self.headroom)}){fix}</div>"
        )


def judgement(est: MemoryEstimate, capacity: int, target: Any) -> tuple[str, Suggestion | None]:
    """(verdict of ``est`` against ``capacity``, the estimator's top fix for ``target`` when it is not "fits")."""
    result = verdict(est.total, capacity)
    if result == FITS:
        return result, None
    sugg = fit(est, target).suggestions
    return result, (sugg[0] if sugg else None)


REDUCER_SPEED = {  # what a memory reducer costs in time, besides the PCIe copies its host RAM row states
    "loss=plain": "-",
    "loss=chunked": "the output layer's matmul once more per step (a few %)",
    "loss=fused": "none (Liger's kernel is as fast or faster)",
    "offload_activations=True": "activations copied to RAM and back each step (PCIe)",
    "kv_cache=dynamic": "-",
    "kv_cache=fp8": "a layer dequantized per token; outputs may differ slightly",
    "kv_cache=int4": "a layer dequantized per token; outputs may differ",
    "kv_cache=int2": "a layer dequantized per token; outputs differ more",
    "kv_cache=offload": "the cache crosses PCIe twice per token",
}


@dataclass
class ReducerTable:
    """One plan's estimate with each memory reducer (a row per setting) against one device."""

    title: str
    capacity: int
    rows: list[tuple[str, MemoryEstimate, str]]  # (setting, its estimate, why it cannot run here or "")

    def cells(self) -> list[list[str]]:
        """Setting, GPU total, saving against the first row, verdict, host RAM and speed cost per row."""
        base = self.rows[0][1].total if self.rows else 0
        out = []
        for change, est, why in self.rows:
            speed = " + ".join(REDUCER_SPEED.get(part, "") for part in change.split(" + ")).strip(" +")
            out.append([change, format_bytes(est.total), format_bytes(base - est.total), verdict(est.total, self.capacity),
                        (host_cost(est.host_rows) if est.host_total else "") or "-", f"not here: {why}" if why else speed])  # fmt: skip
        return out

    HEADER = ("setting", "GPU total", "saves", "verdict", "host RAM", "speed cost")

    def __str__(self) -> str:
        rows = [list(self.HEADER), *self.cells()]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [self.title] + ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True))
                                + ("  " + r[5] if r[5] != "-" else "") for r in rows]  # fmt: skip
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return table(self.HEADER, self.cells(), title=self.title)


def load_time_text(t, batch: int) -> str:
    """A load panel's time line from :func:`~helpers.estimator.timing.view_time`'s answer ``t`` (timed at
    ``batch``): load time, decode tokens/s, and the answers' total; or how to get one when ``t`` is None."""
    if t is None:
        return NO_TIME
    return (
        f"time on {t.device}: load {approx_duration(t.load_total)} · ~{t.decode_tokens_per_s[batch]:,.1f} tokens/s "
        f"at batch {batch} · {t.answers} answers of {t.new_tokens} tokens: {approx_duration(t.answers_seconds[batch])}"
    )


def train_time_text(t, steps: int, accumulation: int) -> str:
    """A training panel's time line from ``t`` (timed over ``steps`` x ``accumulation`` micro-batch steps): one
    optimizer step and the run's ``steps``; or how to get one when ``t`` is None or has no step."""
    if t is None or t.step_seconds is None or t.step_shape is None:
        return NO_TIME
    step = t.step_seconds * accumulation
    mb, seq = t.step_shape
    what = f"{accumulation} x {mb}" if accumulation > 1 else f"{mb}"
    total = f" · {steps} steps: {approx_duration(t.steps * t.step_seconds)}" if steps else ""
    return f"time on {t.device}: {approx_duration(step)} per step ({what} x {seq} tokens){total}"


NO_TIME = "time: not timed here (pick a device preset such as 't4', or run calibrate() once to time this machine)"


def notes_html(notes: list[str]) -> str:
    """A panel's notes (why a chosen option cannot run here, ...) as escaped HTML lines; "" for none."""
    return "".join(
        f"<div class='oomkit-panel-note' style='font-family:monospace'>note: {escape(n)}</div>" for n in notes
    )


def host_note(est: MemoryEstimate) -> list[str]:
    """The host RAM (and PCIe time) an offloading reducer of ``est`` asks for, as a panel note; [] for none."""
    return [f"offloaded: {host_cost(est.host_rows)}"] if est.host_total else []
