"""An estimate at a glance (issue 44 item 8): the few segments first, the 9-16 rows folded; over a card
reads over 100 % everywhere it is drawn (item 7)."""

from __future__ import annotations

import re

import pytest

from helpers.core.html import bar, mini_bar, share_percent
from helpers.estimator.core import SUMMARY_SEGMENTS, estimate
from helpers.training.plan import TrainPlan

SEGMENT_LABELS = {label for label, _ in SUMMARY_SEGMENTS}


@pytest.fixture(scope="module")
def qlora():
    return TrainPlan("Qwen/Qwen2.5-1.5B", load="nf4").estimate("t4")  # 16 rows


@pytest.fixture(scope="module")
def over():
    # 15.22 GiB of a 14.74 GiB T4 (docs/guides/00_preflight.md's example)
    return estimate("Llama-2-7b-hf", load="fp16", device="t4", batch_size=2, prompt_tokens=1024, max_new_tokens=1024)


def test_the_summary_is_the_panels_segments_and_adds_up_to_the_total(qlora, over):
    assert [label for label, _ in qlora.summary()] == ["weights", "training state", "activations", "overheads"]
    assert [label for label, _ in over.summary()] == ["weights", "KV cache", "activations", "overheads"]
    for est in (qlora, over):
        assert sum(n for _, n in est.summary()) == est.total


def test_the_text_form_is_short_and_the_details_hold_every_row(qlora):
    short, full = str(qlora), qlora.details()
    assert len(qlora.rows) == 16 and len(short.splitlines()) <= 9, short
    assert not any(r.name in short for r in qlora.rows if r.name not in SEGMENT_LABELS)
    assert all(r.name in full for r in qlora.rows) and "16 rows in .details()" in short
    assert re.search(r"total +3\.\d\d GiB of 14\.74 GiB on t4 \(2\d %\): 11\.\d\d GiB free", short), short


def test_the_html_shows_the_summary_first_and_folds_the_rows(qlora):
    html = qlora._repr_html_()
    fold = html.index("<details>")
    head = html[:fold]
    from helpers.core.units import format_bytes

    for label, n in qlora.summary():
        assert f"{label} {format_bytes(n)}" in head  # each segment with its bytes, before the fold
    assert "free " in head and "total " in head
    assert "<table" not in head and "<table" in html[fold:] and html.count("<tr>") >= len(qlora.rows)
    assert "all 16 rows" in html[fold:]
    assert "#e8eaed" not in head  # the summary's track is translucent: it reads on a dark theme too


def test_over_the_card_reads_over_100_percent_everywhere(over):
    assert over.total > over.capacity
    shown = share_percent(over.total, over.capacity)
    assert shown > 100
    text, html = str(over), over._repr_html_()
    assert f"({shown} %)" in text and "over" in text and "(100 %)" not in text
    assert f"({shown} %)" in html and "over the card by" in html
    # the folded table's total row, and the bars every other output draws
    assert f"</span></span> {shown}%</span>" in html
    assert f" {shown}%</span>" in mini_bar(over.total, over.capacity)
    assert f"({shown}%)" in bar(over.total, over.capacity, "model")


@pytest.mark.parametrize(("used", "shown"), [(14_740, 99), (14_800, 101), (14_700, 99), (16_270, 110), (500, 3)])
def test_a_share_is_never_rounded_across_100(used, shown):
    """0.4 % over a card read "(100%)" beside "does not fit"; 0.3 % under read 100 % beside "fits"."""
    assert share_percent(used, 14_741 if used == 14_740 else 14_740) == shown
    assert share_percent(5, 5) == 100


def test_the_plain_text_a_notebook_falls_back_to_is_the_short_form(qlora):
    """Without HTML (papermill, a terminal) a notebook shows repr(): it was the dataclass's, every row's fields."""
    assert repr(qlora) == str(qlora) and "EstimateRow(" not in repr(qlora)
