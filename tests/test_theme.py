"""Theme-aware graphics (issue 44 item 5): in a dark notebook every bar's empty track was an opaque near-white
#e8eaed block and every matplotlib figure a white rectangle. Tracks are translucent now, figures transparent
with text that reads on either theme."""

from __future__ import annotations

import io
import re

import pytest

from helpers.core.html import (
    CHART_INK,
    DARK_BACKGROUNDS,
    LIGHT_BACKGROUND,
    TRACK_COLOR,
    bar,
    contrast_ratio,
    mini_bar,
    sparkline,
)

FILL = re.compile(
    r"(?:background(?:-color)?|fill)\s*[:=]\s*['\"]?\s*(#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b|white\b|rgba?\([^)]*\))"
)


def _luminance(color: str) -> tuple[float, float]:
    """(relative luminance, alpha) of a CSS colour as the fills above write them."""
    if color == "white":
        return 1.0, 1.0
    if color.startswith("rgb"):
        parts = [float(x) for x in color[color.index("(") + 1 : -1].split(",")]
        rgb, alpha = parts[:3], (parts[3] if len(parts) > 3 else 1.0)
    else:
        h = color.lstrip("#")
        h = "".join(c * 2 for c in h) if len(h) == 3 else h
        rgb, alpha = [int(h[i : i + 2], 16) for i in (0, 2, 4)], 1.0
    lin = [(c / 255) / 12.92 if c / 255 <= 0.03928 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2], alpha


def opaque_light_fills(html: str) -> list[str]:
    """Fills that would be a light block on a dark background: opaque and luminance over 0.6."""
    return [c for c in FILL.findall(html) if (lambda la: la[0] > 0.6 and la[1] > 0.5)(_luminance(c))]


def test_the_checker_sees_the_old_near_white_track():
    assert opaque_light_fills("<span style='height:12px;background:#e8eaed;border-radius:3px'>") == ["#e8eaed"]
    assert opaque_light_fills(f"<span style='background:{TRACK_COLOR}'>") == []


def _outputs() -> dict[str, str]:
    from helpers.leaks.growth import watch
    from helpers.panels.widgets import LoadPanel
    from helpers.training.view import TrainProgress

    gib = 1024**3
    panel = LoadPanel("mistralai/Mistral-7B-v0.1", device="t4", load="nf4", widgets=False)
    progress = TrainProgress(step=2, total=4, elapsed=2.0, steps_done=2, loss=1.5, allocated=6 * gib,
                             peak_allocated=6 * gib, peak_reserved=7 * gib, capacity=15 * gib, device="Tesla T4",
                             history=[(0, 5 * gib), (1, 6 * gib), (2, 6 * gib)], losses=[(1, 2.0), (2, 1.5)])  # fmt: skip
    return {
        "bar": bar(3 * gib, 15 * gib, "GPU"),
        "mini_bar": mini_bar(1, 4),
        "sparkline": sparkline([(0, 1), (1, 2)], "memory", cap=4),
        "panel": panel._repr_mimebundle_()["text/html"],
        "training view": progress._repr_html_(),
        "watch": watch(lambda: None, 3, namespace={}, progress=False)._repr_html_(),
    }


def test_no_output_paints_an_opaque_light_block():
    for name, html in _outputs().items():
        assert opaque_light_fills(html) == [], name
    assert "#e8eaed" not in "".join(_outputs().values())


def test_the_track_is_translucent_and_the_chart_ink_reads_on_both_themes():
    assert _luminance(TRACK_COLOR)[1] < 0.5  # the background shows through: light on white, dark on dark
    assert all(contrast_ratio(CHART_INK, bg) >= 3.9 for bg in (LIGHT_BACKGROUND, *DARK_BACKGROUNDS))


def _assert_themed(fig) -> None:
    from matplotlib.colors import to_hex, to_rgba

    assert to_rgba(fig.get_facecolor())[3] == 0
    for ax in fig.axes:
        assert to_rgba(ax.get_facecolor())[3] == 0
        assert {to_hex(t.get_color()) for t in ax.get_yticklabels()} <= {CHART_INK}
        assert to_hex(ax.title.get_color()) == CHART_INK
    buf = io.BytesIO()
    fig.savefig(buf, format="png")  # as the inline backend saves it: the figure's own (transparent) face
    buf.seek(0)
    import matplotlib.image

    assert matplotlib.image.imread(buf)[0, 0, 3] == 0  # the corner pixel is see-through: no white rectangle


def test_the_monitor_plot_is_transparent_with_readable_text():
    pytest.importorskip("matplotlib")
    from helpers.monitoring.monitor import MemoryMonitor

    mon = MemoryMonitor(interval=1, warn=False)
    for _ in range(3):
        mon.sample()
    mon.mark("step")
    _assert_themed(mon.plot("a run"))


def test_the_eval_report_plot_is_themed_too():
    pytest.importorskip("matplotlib")
    from helpers.evaluation.report import EvalReport

    report = EvalReport(results_path="r.jsonl", total=2)
    report.timeline = [(0.5, 1, 1 << 20), (1.0, 2, 2 << 20)]
    report.batch_sizes = [1, 2]
    _assert_themed(report.plot())
