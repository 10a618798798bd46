"""build_dataset says what seq_len cost (issue 31 item 4): answers cut, rows dropped; cut answers keep EOS or go."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from helpers import build_dataset, load_instructions
from helpers.training.data import DatasetWarning
from helpers.training.plan import FinetuneError


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_a_short_seq_len_reports_the_cut_answers_and_dropped_rows(tok):
    rows = load_instructions()
    with pytest.warns(DatasetWarning, match=r"answers cut short"):
        data = build_dataset(tok, rows, 64)
    assert data.rows == len(rows) == 303 and data.cut == 295  # the shipped set with the tiny tokenizer
    assert len(data) == data.rows - data.dropped
    assert f"{data.cut} answers cut" in data.summary() and "Raise seq_len" in data.summary()


def test_cut_answers_end_in_eos_so_they_still_teach_stopping(tok):
    rows = load_instructions()
    with pytest.warns(DatasetWarning):
        data = build_dataset(tok, rows, 128)
    assert data.cut > 0
    assert all(e["input_ids"][-1] == tok.eos_token_id for e in data)  # whole answers end in EOS too


def test_drop_keeps_only_whole_answers(tok):
    rows = load_instructions()
    with pytest.warns(DatasetWarning, match="dropped"):
        data = build_dataset(tok, rows, 128, cut_answers="drop")
    assert data.dropped == data.cut > 0 and len(data) == data.rows - data.dropped
    assert all(e["labels"][-1] == tok.eos_token_id for e in data)


def test_a_long_enough_seq_len_loses_nothing_and_says_nothing(tok, recwarn):
    rows = load_instructions()[:10]
    data = build_dataset(tok, rows, 4096)
    assert (data.cut, data.dropped, len(data)) == (0, 0, 10)
    assert not [w for w in recwarn if issubclass(w.category, DatasetWarning)]


def test_an_unknown_choice_is_refused(tok):
    with pytest.raises(FinetuneError, match="cut_answers='truncate'"):
        build_dataset(tok, load_instructions()[:2], 64, cut_answers="truncate")
