"""The T4 preset from evidence (issue 32, item 2): the totals public T4 OOM messages state, cited in
helpers/data/t4_capacity.jsonl, and what the preset does with them: it keeps the 14.74 GiB reading and
carries the 14.56 GiB that recent Colab and GCP T4s report as ``capacity_low``, so a plan between the
two is "tight" and says why."""

from __future__ import annotations

import json
from datetime import date
from importlib import resources

import pytest

from helpers.core.devices import DEVICES, capacity_range
from helpers.core.units import format_bytes, parse_bytes
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card as fit
from helpers.estimator.fitting import max_new_tokens_that_fit

EVIDENCE = [
    json.loads(line)
    for line in resources.files("helpers").joinpath("data/t4_capacity.jsonl").read_text(encoding="utf-8").splitlines()
    if line.strip()
]


def test_the_evidence_is_cited_and_quotes_the_total_it_states():
    assert len(EVIDENCE) >= 6
    for e in EVIDENCE:
        assert e["source"].startswith("https://github.com/") and date.fromisoformat(e["date"])
        assert e["total"] in e["quote"], e  # the figure is read from the message quoted, not restated
        assert 14.5 * 2**30 < parse_bytes(e["total"]) < 14.8 * 2**30


def test_the_preset_carries_the_range_the_recent_messages_state():
    """The low end is the smallest total of the messages from the last 18 months of evidence; the preset
    keeps the largest reading of that time (what most plans were checked against)."""
    latest = max(date.fromisoformat(e["date"]) for e in EVIDENCE)
    recent = [parse_bytes(e["total"]) for e in EVIDENCE if (latest - date.fromisoformat(e["date"])).days <= 548]
    low, high = capacity_range(DEVICES["t4"])
    assert low == min(recent) == parse_bytes("14.56 GiB")
    assert format_bytes(high) == "14.74 GiB" and max(recent) == parse_bytes("14.74 GiB")
    assert capacity_range(DEVICES["l4"]) == (DEVICES["l4"]["capacity"],) * 2  # no range where none is known


@pytest.fixture(scope="module")
def llama_fp16():
    return estimate("Llama-2-7b-hf", load="fp16", max_new_tokens=64)


def test_a_plan_between_the_two_totals_is_tight_and_says_why(llama_fp16):
    n = max_new_tokens_that_fit(llama_fp16, device="t4")  # the most that fits the preset: inside the gap
    verdict = fit(llama_fp16.replace(max_new_tokens=n), "t4", suggest=False)
    low, high = capacity_range(DEVICES["t4"])
    assert low < verdict.estimate.total <= high and verdict.verdict == "tight"
    assert "14.56 GiB that recent Colab and GCP T4s report" in verdict.note
    assert verdict.note in str(verdict) and verdict.to_dict()["note"] == verdict.note
    assert "recent Colab" in verdict._repr_html_()


def test_a_plan_under_the_low_total_has_no_such_note(llama_fp16):
    low, _ = capacity_range(DEVICES["t4"])
    n = max_new_tokens_that_fit(llama_fp16, device=low)
    verdict = fit(llama_fp16.replace(max_new_tokens=n), "t4", suggest=False)
    assert verdict.estimate.total <= low and verdict.note == "" and "note" not in verdict.to_dict()
