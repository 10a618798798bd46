"""The one stylesheet: labels left, numbers right and unwrapped, every text colour readable (WCAG AA,
4.5:1) on white and on JupyterLab's dark backgrounds, badges readable whatever the theme."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.core.html import (
    COLORS,
    DARK_BACKGROUNDS,
    LIGHT_BACKGROUND,
    STYLE,
    TEXT_COLORS,
    badge,
    colored,
    contrast_ratio,
    is_number,
    table,
)

AA = 4.5


def test_contrast_ratio_matches_wcag_reference_values():
    assert contrast_ratio("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast_ratio("#ffffff", "#ffffff") == pytest.approx(1.0)
    assert contrast_ratio("#fbbc04", "#ffffff") == pytest.approx(1.71, abs=0.01)  # the old amber: unreadable


@pytest.mark.parametrize("status", sorted(TEXT_COLORS))
def test_each_text_colour_is_readable_in_both_themes(status):
    light, dark = TEXT_COLORS[status]
    assert contrast_ratio(light, LIGHT_BACKGROUND) >= AA, (status, light)
    for background in DARK_BACKGROUNDS:
        assert contrast_ratio(dark, background) >= AA, (status, dark, background)
    assert f"{{color:{dark} !important}}" in STYLE  # the dark theme switches to it


@pytest.mark.parametrize("status", sorted(COLORS))
def test_white_text_on_each_badge_is_readable(status):
    assert contrast_ratio("#ffffff", COLORS[status]) >= AA
    assert "color:#ffffff" in badge(status)


def test_no_module_colours_text_outside_the_palette():
    """Every ``color:#...`` (text, not background) written in helpers/ is a tested light-theme colour."""
    allowed = {light for light, _ in TEXT_COLORS.values()} | {"#ffffff"}
    found = set()
    for path in (Path(__file__).resolve().parents[1] / "helpers").rglob("*.py"):
        found |= {m.lower() for m in re.findall(r"(?<![-\w])color:\s*(#[0-9a-fA-F]{6})", path.read_text("utf-8"))}
    assert found - allowed == set()


def test_tight_is_readable_amber_in_the_panel_verdict():
    html = colored("TIGHT", "tight")
    assert "class='oomkit-tight'" in html and "color:#8a5a00" in html
    assert contrast_ratio("#8a5a00", LIGHT_BACKGROUND) >= AA


@pytest.mark.parametrize(
    ("text", "number"),
    [("1.63 MiB", True), ("-120.00 MiB", True), ("12 / 60", True), ("[4096, 4096]", True), ("(1, 2)", True),
     ("0:07", True), ("95%", True), ("13.48 GiB of 15.00 GiB", True), ("fits", False), ("weights", False),
     ("n/a", False), ("", False), ("4 layers", False), ("nf4", False)],
)  # fmt: skip
def test_what_reads_as_a_number(text, number):
    assert is_number(text) is number


def test_table_puts_numbers_right_and_unwrapped_and_labels_left():
    html = table(["", "bytes", "note"], [["weights", "3.50 GiB", "4-bit"], ["kv cache", "1.63 MiB", "<b>x</b>"]])
    assert html.startswith(STYLE) and "class='oomkit-table'" in html
    assert "<th class='oomkit-num' style='text-align:right'>bytes</th>" in html  # a header may wrap at its spaces
    assert "<td class='oomkit-num' style='text-align:right;white-space:nowrap'>1.63 MiB</td>" in html
    # labels left inline: JupyterLab's own `td` rule (right) outranks the stylesheet's class selector
    assert "<td style='text-align:left'>weights</td>" in html and "<th style='text-align:left'>note</th>" in html
    assert "&lt;b&gt;x&lt;/b&gt;" in html  # outside text stays escaped


def test_the_estimate_table_keeps_its_figures_on_one_line(tiny_llama):
    from helpers.estimator.core import estimate

    html = estimate(str(tiny_llama), load="fp16", max_new_tokens=64)._repr_html_()
    figures = re.findall(r"<td class='oomkit-num'[^>]*>([^<]*)</td>", html)
    assert figures and all(re.search(r"\d", f) for f in figures)
    assert "nowrap" in html


def test_each_estimate_row_shows_its_share_of_the_card_as_a_mini_bar():
    """Where the memory goes at a glance: a bar per row, its percent of the card beside it (of the total without one)."""
    from helpers.core.html import mini_bar
    from helpers.estimator.core import estimate

    est = estimate("Llama-2-7b-hf", load="nf4", device="t4", max_new_tokens=512)
    html = est._repr_html_()
    assert ">share of t4</th>" in html
    shares = [int(p) for p in re.findall(r"</span></span> (\d+)%</span>", html)]
    weights = next(r for r in est.rows if r.key.startswith("weights"))
    assert len(shares) == len(est.rows) + 1  # every row and the total
    assert shares[0] == round(100 * weights.bytes / est.capacity)
    assert shares[-1] == round(100 * est.total / est.capacity)
    assert ">share</th>" in estimate("Llama-2-7b-hf", load="nf4", device="cpu")._repr_html_()
    assert "width:1px" in mini_bar(1, 1000) and mini_bar(5, None) == ""  # a sliver stays visible; no whole, no bar


def test_a_bar_wraps_its_figures_under_it_in_a_narrow_column():
    """At 760 px the figures of a fixed-width bar ran past the right edge (tests/test_browser.py measures it)."""
    from helpers.core.html import bar

    html = bar(3 << 30, 15 << 30, "Disk (working dir)")
    assert "class='oomkit-bar'" in html and "flex-wrap:wrap" in html
    assert "3.00 GiB / 15.00 GiB (20%)" in html


def test_a_charts_line_reads_on_light_and_dark_backgrounds():
    """WCAG asks 3:1 of graphics; the training view's memory line sits on the notebook's own background."""
    from helpers.core.html import DARK_BACKGROUNDS, LIGHT_BACKGROUND, LINE_COLOR, contrast_ratio, sparkline

    assert all(contrast_ratio(LINE_COLOR, bg) >= 3 for bg in (LIGHT_BACKGROUND, *DARK_BACKGROUNDS))
    svg = sparkline([(0, 5), (1, 5)], "flat")
    assert f"stroke='{LINE_COLOR}'" in svg and "background" not in svg  # no light box in a dark theme
