"""oomkit's DatasetWarning as an oomkit note (issue 44 item 6): said once, as ``[oomkit] note: ...``, not in
Python's raw ``file:line: DatasetWarning:`` form and not once per rank of a DDP launch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from transformers import AutoTokenizer

from helpers.training.data import DatasetWarning, build_dataset, load_instructions, main_process

ROWS = [{"instruction": "say " * 40, "response": "a long answer " * 40}, {"instruction": "hi", "response": "ok"}]


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_the_cost_is_one_oomkit_note_and_still_a_warning_for_code_that_catches_it(tok, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = build_dataset(tok, ROWS, 48)
    notes = [line for line in capsys.readouterr().out.splitlines() if "[oomkit] note:" in line]
    assert notes == [f"[oomkit] note: {data.summary()}"]
    assert [w.category for w in caught] == [DatasetWarning]
    build_dataset(tok, ROWS[1:], 512)  # nothing lost: nothing said
    assert "[oomkit]" not in capsys.readouterr().out


def test_only_the_first_rank_says_it(tok, capsys, monkeypatch):
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main_process() is said
        with pytest.warns(DatasetWarning):  # raised on every rank for code that catches it; said on the first
            build_dataset(tok, ROWS, 48)
        assert ("[oomkit] note:" in capsys.readouterr().out) is said
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not main_process()


def test_a_plain_run_prints_no_raw_warning(tiny_llama):
    """As a notebook or a script sees it: the default warning filters, no pytest around it."""
    code = textwrap.dedent(f"""
        import os
        from transformers import AutoTokenizer
        from helpers.training.data import build_dataset
        tok = AutoTokenizer.from_pretrained({str(tiny_llama)!r})
        rows = {ROWS!r}
        build_dataset(tok, rows, 48)
        os.environ["RANK"] = "1"  # a second rank of the same launch
        build_dataset(tok, rows, 48)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "PYTHONWARNINGS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("[oomkit] note: seq_len=48") == 1
    assert "DatasetWarning" not in out.stderr and "warnings.warn" not in out.stderr


def test_the_shipped_set_keeps_its_figures(tok, capsys):
    with pytest.warns(DatasetWarning):
        data = build_dataset(tok, load_instructions(), 64)
    assert data.cut == 295 and capsys.readouterr().out.count("[oomkit] note:") == 1
