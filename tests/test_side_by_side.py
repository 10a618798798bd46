"""Before/after answers as one table (issue 44 item 8): a row per prompt, a column per run, where notebook 02
printed a 39-line dump (a block per answer)."""

from __future__ import annotations

import pytest

from helpers import side_by_side
from helpers.evaluation.report import SHOWN_CHARS, EvalReport, SideBySide

PROMPTS = ["What is a KV cache?", "Name a 4-bit data type.", "Why does memory fragment?"]
BEFORE = ["It is a cache.", "nf4", "Because\nof many sizes."]
AFTER = ["The keys and values of past tokens, kept for decoding.", "nf4", "Blocks of many sizes " * 20]


def test_answers_to_the_same_prompts_are_one_row_each():
    view = side_by_side(BEFORE, AFTER, PROMPTS)
    assert isinstance(view, SideBySide) and view.changed == 2
    html = view._repr_html_()
    assert html.count("<tr>") == 1 + len(PROMPTS)  # the header and one row per prompt
    assert "<th style='text-align:left'>before</th>" in html and "2 answers changed" in html
    text = str(view)
    assert len(text.splitlines()) == 1 + 3 * len(PROMPTS)  # was a block of 6-8 lines per prompt
    assert "Because of many sizes." in text  # one line per answer
    long = max(text.splitlines(), key=len)
    assert long.endswith("…") and len(long) <= SHOWN_CHARS + 12


def test_two_eval_reports_are_matched_by_id_with_their_references():
    def report(outputs):
        return EvalReport(results_path="r.jsonl", records=[
            {"id": i, "prompt": f"[audio {i}]", "output": out, "reference": ref}
            for i, out, ref in zip(["b", "a"], outputs, ["hello", "world"], strict=True)
        ])  # fmt: skip

    view = side_by_side(report(["helo", "word"]), report(["hello", "world"]))
    assert view.prompts == ["[audio a]", "[audio b]"] and view.before == ["word", "helo"]
    assert view.references == ["world", "hello"] and "reference" in view._repr_html_()
    with pytest.raises(ValueError, match="answer different prompts"):
        side_by_side(report(["x", "y"]), EvalReport(results_path="r.jsonl", records=[{"id": "c", "output": "z"}]))


def test_mismatched_lists_say_what_to_pass():
    with pytest.raises(ValueError, match="one answer per prompt"):
        side_by_side(BEFORE, AFTER[:2], PROMPTS)
    with pytest.raises(TypeError, match="two EvalReports"):
        side_by_side(EvalReport(results_path="r.jsonl"), AFTER, PROMPTS)


def test_outside_text_is_escaped():
    html = side_by_side(["<b>x</b>"], ["<script>"], ["<i>q</i>"])._repr_html_()
    assert "<script>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
