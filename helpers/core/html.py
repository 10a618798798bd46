"""Small HTML pieces shared by every ``_repr_html_``: one stylesheet, a usage bar, a table, coloured text.

Every table goes through :func:`table`: labels left, numbers (bytes, counts, shapes, times) right
and never wrapped. Coloured text uses :data:`TEXT_COLORS`, a light-theme colour (inline, so it holds
where no stylesheet applies) and a dark-theme one that :data:`STYLE` switches to in JupyterLab's and
Colab's dark themes; each has a WCAG contrast of at least 4.5:1 on its theme's background
(:func:`contrast_ratio`, tested). :data:`COLORS` are fills (bars, badges' backgrounds), not text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from html import escape

from .units import format_bytes
from .vocab import DOES_NOT_FIT, FITS, TIGHT, verdict

# fills: bar segments and badge backgrounds (white text on them: each >= 4.5:1 against white)
COLORS = {"ok": "#137333", "pass": "#137333", "warn": "#8a5a00", "tight": "#8a5a00",
          "fail": "#c5221f", "info": "#1967d2", "none": "#5f6368"}  # fmt: skip
# bar fills for the usage level: bright hues read best as areas (text never goes on these)
# a chart's line: >= 3:1 (WCAG's ratio for graphics) on white and on JupyterLab's dark backgrounds alike
LINE_COLOR = "#4285f4"
LOSS_COLOR = "#d56e0c"  # the loss line beside the memory one: another hue, >= 3:1 on both themes too
FRAME_COLOR = "#9aa0a6"  # a chart's frame: mid grey, >= 2:1 on white and on the dark backgrounds
# a bar's empty track: translucent grey over whatever the notebook's background is (light grey on white,
# dark grey on a dark theme); an opaque #e8eaed was a near-white block in a dark notebook
TRACK_COLOR = "rgba(128,128,128,0.25)"
# a figure's text, ticks and frame: one mid grey that reads on white and on the dark themes (>= 3.9:1 on
# each; no colour reaches 4.5:1 on both, and a server-side figure cannot know the theme)
CHART_INK = "#808080"
LEVEL_FILLS = {"ok": "#34a853", "warn": "#fbbc04", "fail": "#ea4335"}
_VERDICT_FILL = {FITS: "ok", TIGHT: "warn", DOES_NOT_FIT: "fail"}
# text: (on a light background, on a dark one)
TEXT_COLORS = {
    "ok": ("#137333", "#81c995"), "pass": ("#137333", "#81c995"), "warn": ("#8a5a00", "#fdd663"),
    "tight": ("#8a5a00", "#fdd663"), "fail": ("#c5221f", "#f28b82"), "info": ("#1967d2", "#8ab4f8"),
    "none": ("#5f6368", "#bdc1c6"),
}  # fmt: skip
LIGHT_BACKGROUND = "#ffffff"
DARK_BACKGROUNDS = ("#111111", "#212121")  # JupyterLab dark theme: --jp-layout-color0 and -color1
_DARK = ("body[data-jp-theme-light='false'] .oomkit-{0}", "html[theme='dark'] .oomkit-{0}")
NUMBER_STYLE = "text-align:right;white-space:nowrap"
HEADER_NUMBER_STYLE = "text-align:right"
# inline too: JupyterLab right-aligns every cell with a more specific rule than a class selector
# (`:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td`), which turned labels right (browser-tested)
LABEL_STYLE = "text-align:left"
STYLE = (
    "<style>"
    ".oomkit-table{border-collapse:collapse;font-family:monospace}"
    ".oomkit-table th,.oomkit-table td{padding:2px 8px;text-align:left;vertical-align:top}"
    f".oomkit-table td.oomkit-num{{{NUMBER_STYLE}}}.oomkit-table th.oomkit-num{{{HEADER_NUMBER_STYLE}}}"
    # a title wraps (a long model id anywhere) only where the column is narrower than it: unwrapped, it widened
    # preflight's table to 380 px in Colab's 328 px column (browser-tested); table() sets the table's min-width
    ".oomkit-table caption{text-align:left;font-weight:bold;overflow-wrap:anywhere}"
    + "".join(f"{','.join(d.format(s) for d in _DARK)}{{color:{dark} !important}}"
              for s, (_, dark) in TEXT_COLORS.items())
    + "</style>"
)  # fmt: skip

_WORDS = re.compile(r"[A-Za-z]+")
_UNITS = {"B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "s", "ms", "min", "h", "x", "of", "tokens"}


def contrast_ratio(foreground: str, background: str) -> float:
    """WCAG 2 contrast ratio of two ``#rrggbb`` colours (1 to 21; AA asks 4.5 for text)."""

    def luminance(color: str) -> float:
        rgb = [int(color.lstrip("#")[i : i + 2], 16) / 255 for i in (0, 2, 4)]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def is_number(text: str) -> bool:
    """True for what reads as a figure: ``1.63 MiB``, ``-120``, ``12 / 60``, ``(4096, 4096)``, ``0:07``, ``95%``."""
    t = text.strip().lstrip("+-−~≈")
    if not t or not (t[0].isdigit() or (t[0] in "([" and t[1:2].isdigit())):
        return False
    return all(word in _UNITS for word in _WORDS.findall(t))


def level_color(used: float, total: float = 1.0) -> str:
    """The fill of the verdict on ``used`` of ``total`` (:func:`helpers.core.vocab.verdict`: green fits, amber
    tight, red does not fit), so a bar never disagrees with the verdict printed beside it."""
    return LEVEL_FILLS[_VERDICT_FILL[verdict(used, total)]]


def color_attrs(status: str) -> str:
    """``class=... style=...`` attributes colouring an element's text for ``status`` in either theme."""
    status = status if status in TEXT_COLORS else "none"
    return f"class='oomkit-{status}' style='color:{TEXT_COLORS[status][0]}'"


def colored(text: str, status: str, tag: str = "span") -> Markup:
    """``text`` (escaped) coloured for ``status`` (``ok``, ``tight``, ``fail``...), readable in light and dark themes."""
    return Markup(f"<{tag} {color_attrs(status)}>{escape(text)}</{tag}>")


def share_percent(used: float, whole: float) -> int:
    """``used`` as a whole percent of ``whole``, never rounded across 100: under ``whole`` reads at most 99, over
    it at least 101 (a model 0.4 % over a card read "(100%)" beside "does not fit")."""
    shown = round(100 * used / whole)
    return min(shown, 99) if used < whole else max(shown, 101) if used > whole else 100


def bar(used: int | None, total: int | None, label: str, color: str | None = None, width: int = 260) -> str:
    """A Colab-style bar: ``label  [#####.....]  used / total``."""
    if used is None or not total:
        return f"<div style='font-family:monospace'>{escape(label)}: n/a</div>"
    share = used / total  # shown as it is (over 100 % when it does not fit); the fill stops at the end
    frac = max(0.0, min(1.0, share))
    color = color or level_color(used, total)
    return (
        # wrap: in a narrow column (760 px) the figures go under the bar instead of past the right edge
        "<div class='oomkit-bar' style='display:flex;flex-wrap:wrap;align-items:center;gap:8px;"
        "font-family:monospace;margin:2px 0'>"
        f"<span style='min-width:150px'>{escape(label)}</span>"
        f"<span style='display:inline-block;width:{width}px;min-width:{width}px;height:12px;background:{TRACK_COLOR};"
        "border-radius:3px'>"
        f"<span style='display:block;width:{frac * 100:.1f}%;height:100%;background:{color};border-radius:3px'></span>"
        "</span>"
        f"<span style='white-space:nowrap'>{format_bytes(used)} / {format_bytes(total)} ({share_percent(used, total)}%)</span></div>"
    )


def mini_bar(part: int, whole: int | None, width: int = 80) -> Markup:
    """A small inline bar of ``part`` out of ``whole`` for a table cell (the share of one row), its percent
    beside it; empty when ``whole`` is unknown. A row of 0.3 % still shows a sliver: it exists."""
    if not whole or part is None or part < 0:
        return Markup("")
    frac = min(1.0, part / whole)
    fill = 0 if part == 0 else max(1, round(frac * width))
    return Markup(
        f"<span style='white-space:nowrap'><span style='display:inline-block;width:{width}px;height:8px;"
        f"background:{TRACK_COLOR};border-radius:2px;vertical-align:middle'><span style='display:block;width:{fill}px;"
        f"height:100%;background:{COLORS['info']};border-radius:2px'></span></span> {share_percent(part, whole)}%</span>"
    )


def sparkline(
    points: Sequence[tuple[float, float]], label: str, cap: int | None = None, width: int = 320, height: int = 56, *,
    fmt: Callable[[float], str] = format_bytes, color: str = LINE_COLOR, css: str = "oomkit-sparkline",
) -> Markup:  # fmt: skip
    """An inline SVG line of ``(x, y)`` points (memory or loss per training step) with its scale: the top and
    bottom values labelled beside it (``fmt`` writes them), the card's ``cap`` dashed when given (the scale
    then runs from 0 to the cap or the peak); without a cap it spans the line's own min to max, so a nearly flat
    line still shows its shape instead of lying on the frame. Nothing with fewer than two points. Pure SVG in
    the text's own colour (no background): it reads on light and dark themes and redraws in an updating output."""
    if len(points) < 2:
        return Markup("")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    lo, hi = (0, max(max(ys), cap)) if cap else (min(ys), max(ys))
    if hi == lo:  # a flat line: in the middle, its value on both labels' sides
        lo, hi = lo - (abs(lo) * 0.05 or 1), hi + (abs(hi) * 0.05 or 1)
    pad = 4  # px kept free above and below: the line never lies on the frame
    sx = (width - 2) / ((x1 - x0) or 1)
    y = lambda v: height - pad - (height - 2 * pad) * (v - lo) / (hi - lo)  # noqa: E731
    line = " ".join(f"{1 + (x - x0) * sx:.1f},{y(v):.1f}" for x, v in points)
    limit = (f"<line x1='0' x2='{width}' y1='{y(cap):.1f}' y2='{y(cap):.1f}' stroke='{COLORS['fail']}' "
             "stroke-dasharray='4 3' stroke-width='1'/>") if cap else ""  # fmt: skip
    of = f" of {fmt(cap)}" if cap else ""
    scale = (
        "<div class='oomkit-scale' style='display:flex;flex-direction:column;justify-content:space-between;"
        f"text-align:right;font-size:11px;min-width:64px;height:{height}px'>"
        f"<span class='oomkit-scale-max'>{escape(fmt(hi))}</span><span class='oomkit-scale-min'>{escape(fmt(lo))}</span>"
        "</div>"
    )
    return Markup(
        f"<div class='{css}' style='font-family:monospace;margin:4px 0'>"
        f"<div>{escape(label)}: {escape(fmt(ys[-1]))} now, min {escape(fmt(min(ys)))}, max {escape(fmt(max(ys)))}"
        f"{escape(of)}</div>"
        "<div style='display:flex;align-items:flex-start;gap:4px;max-width:100%'>"
        f"{scale}<svg width='{width}' height='{height}' viewBox='0 0 {width} {height}' preserveAspectRatio='none' "
        f"role='img' aria-label='{escape(label)}' style='max-width:calc(100% - 68px);border:1px solid {FRAME_COLOR};"
        f"border-radius:3px'>{limit}<polyline points='{line}' fill='none' stroke='{color}' stroke-width='1.5'/>"
        "</svg></div></div>"
    )


def table(header: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None) -> str:
    """An HTML table in the shared style; cells are escaped unless they are already ``Markup`` (str subclass).

    A cell that reads as a number (:func:`is_number`) is right-aligned and never wrapped; so is its
    column's header when every filled cell of the column is one.
    """
    rows = [list(r) for r in rows]

    def cell(v: object, tag: str = "td") -> str:
        text = str(v)
        if isinstance(v, Markup):
            return f"<{tag} style='{LABEL_STYLE}'>{text}</{tag}>"
        if is_number(text):
            return f"<{tag} class='oomkit-num' style='{NUMBER_STYLE}'>{escape(text)}</{tag}>"
        return f"<{tag} style='{LABEL_STYLE}'>{escape(text)}</{tag}>"

    numeric = [
        bool(column) and all(is_number(str(c)) for c in column if not isinstance(c, Markup))
        for column in ([str(r[i]) for r in rows if i < len(r) and str(r[i]).strip()] for i in range(len(header)))
    ]
    # a numbers column's header right-aligned but free to wrap at its spaces ("KV @ 768 tok" on two lines):
    # the numbers under it never wrap, and in a narrow column their width, not the header's, sets the column's
    head = "".join(
        f"<th class='oomkit-num' style='{HEADER_NUMBER_STYLE}'>{escape(h)}</th>"
        if num
        else f"<th style='{LABEL_STYLE}'>{escape(h)}</th>"
        for h, num in zip(header, numeric, strict=True)
    )
    body = "".join("<tr>" + "".join(cell(c) for c in r) + "</tr>" for r in rows)
    cap = f"<caption>{escape(title)}</caption>" if title else ""
    # as wide as the title where the column has room (a narrow table keeps its title on one line), never wider
    # than the column (monospace: 1ch is one character of the bold title too)
    wide = f" style='min-width:min(100%,{len(title) + 1}ch)'" if title else ""
    return f"{STYLE}<table class='oomkit-table'{wide}>{cap}<tr>{head}</tr>{body}</table>"


class Markup(str):
    """A string that is already HTML and must not be escaped by :func:`table`."""


def badge(status: str) -> Markup:
    """``status`` as white text on its colour (contrast >= 4.5:1 whatever the theme)."""
    color = COLORS.get(status, COLORS["none"])
    return Markup(
        f"<span style='background:{color};color:#ffffff;padding:0 6px;border-radius:3px;white-space:nowrap'>"
        f"{escape(status)}</span>"
    )


BAR_MIN_WIDTH = "160px"  # a notebook progress bar's own width at least: its figures wrap under it instead


def progress_bar(total: int | None = None, desc: str = "", unit: str = "it", *, disable: bool = False, iterable=None,
                 **kwargs):  # fmt: skip
    """A ``tqdm.auto`` bar that keeps its bar in a narrow column: in a notebook the bar widget never shrinks
    under :data:`BAR_MIN_WIDTH` (Colab's ~420 px column with the Files pane open squeezed it to nothing beside
    a long description and its figures), which wrap onto the next line instead; a text bar as tqdm makes it."""
    from tqdm.auto import tqdm

    bar_ = tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, **{"dynamic_ncols": True, **kwargs})
    container = getattr(bar_, "container", None)  # tqdm.notebook's HBox(description, bar, figures)
    if container is not None and len(getattr(container, "children", ())) == 3:
        container.layout.flex_flow = "row wrap"
        container.layout.max_width = "100%"
        container.children[1].layout.min_width = BAR_MIN_WIDTH
    return bar_


def theme_figure(fig):
    """Style a matplotlib ``fig`` for whichever theme shows it: a transparent background (no white rectangle in
    a dark notebook) and text, ticks and frame in :data:`CHART_INK`, which reads on light and dark alike."""
    fig.patch.set_facecolor("none")
    for ax in fig.axes:
        ax.set_facecolor("none")
        ax.tick_params(colors=CHART_INK, which="both")
        for spine in ax.spines.values():
            spine.set_edgecolor(CHART_INK)
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            text.set_color(CHART_INK)
        legend = ax.get_legend()
        for text in legend.get_texts() if legend is not None else ():
            text.set_color(CHART_INK)
    return fig
