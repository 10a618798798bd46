"""The monitor's chart pieces: the peak's label, grouped marks, and phases shaded by colour.

Pure drawing on a matplotlib ``Axes`` from plain values (phases are anything with ``label``,
``start`` and ``end``), so :mod:`helpers.monitoring.monitor` stays about sampling.
"""

from __future__ import annotations

from ..core.units import format_bytes

__all__ = ["PHASE_COLORS", "OTHER_PHASE_COLORS", "MAX_PHASE_SPANS", "TextTimeline", "annotate_peak",
           "grouped_marks", "phase_color", "phase_spans", "shade_phases"]  # fmt: skip

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
