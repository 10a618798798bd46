"""Tables and bars that fit Colab's ~420 px column: the leak checks' fix under its finding (as preflight's,
tests/test_preflight_stream.py), the census in four columns, and tqdm bars that keep their bar."""

from __future__ import annotations

import re

import pytest
import torch

from helpers.core.checks import Check
from helpers.core.html import BAR_MIN_WIDTH, progress_bar
from helpers.leaks.census import census
from helpers.leaks.patterns import LeakChecks


def columns(html: str) -> int:
    return len(re.findall(r"<th[ >]", html.split("</tr>")[0]))


def test_leak_checks_put_each_fix_under_its_finding():
    checks = LeakChecks([Check("tensors in lists", "warn", "val_losses holds 12 graphs", "append loss.item()"),
                         Check("hooks", "pass", "no forward hooks")])  # fmt: skip
    html = checks._repr_html_()
    assert columns(html) == 3 and ">fix<" not in html
    assert "val_losses holds 12 graphs</div><div style='margin-top:2px'><b>fix:</b> append loss.item()" in html


def test_the_census_table_has_four_columns_with_the_graph_under_the_holder():
    # 16 MiB each: larger than what other tests in the same pytest worker may leave alive (the census lists the largest)
    held = [torch.ones(2048, 2048, requires_grad=True) * 2 for _ in range(3)]  # noqa: F841 (the census finds it)
    html = census(namespace={"held": held})._repr_html_()
    assert columns(html) == 4 and ">grad_fn<" not in html
    assert "cpu · float32 · [2048, 2048]" in html and "with grad_fn</div>" in html


def test_a_notebook_bar_keeps_a_minimum_width(monkeypatch):
    notebook = pytest.importorskip("tqdm.notebook")
    pytest.importorskip("ipywidgets")
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", notebook.tqdm)
    bar = progress_bar(iterable=range(3), desc="safe_generate")
    ltext, pbar, rtext = bar.container.children
    assert pbar.layout.min_width == BAR_MIN_WIDTH
    assert bar.container.layout.flex_flow == "row wrap"  # the figures wrap under the bar, not over it
    bar.close()


def test_outside_a_notebook_it_is_a_text_bar(capsys):
    bar = progress_bar(iterable=range(2), desc="generating")
    assert not hasattr(bar, "container")
    list(bar)
    bar.close()
