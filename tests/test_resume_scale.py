"""A resume costs in proportion to the new work: counted in tokenizer inputs, file reads and bytes, not time.

(bench/resume_scale.py times 10,000 and 100,000 finished rows.)
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.core.errors import EvalError
from helpers.evaluation import evaluate, results_file
from helpers.evaluation.evaluate import safe_generate
from helpers.evaluation.results_file import MADE, ResultsFile, is_record
from helpers.loading.loader import load

NEW = 4
PROMPTS = [f"{' '.join(['memory'] * (1 + k % 5))} item {k}" for k in range(8)]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    torch.set_num_threads(1)
    model, tok, _ = load(str(tiny_llama), load="fp32", check=False)
    return model, tok


@pytest.fixture
def counted(monkeypatch):
    """How many prompt texts are tokenized, and how many times the results file is parsed."""
    seen = {"encoded": 0, "parsed": 0}
    encode, parse = evaluate.encode, results_file.ResultsFile._parse

    def counting_encode(tokenizer, prompts, **kw):
        seen["encoded"] += len(prompts)
        return encode(tokenizer, prompts, **kw)

    def counting_parse(self, **kw):
        seen["parsed"] += 1
        return parse(self, **kw)

    monkeypatch.setattr(evaluate, "encode", counting_encode)
    monkeypatch.setattr(results_file.ResultsFile, "_parse", counting_parse)
    return seen


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_resume_tokenizes_only_the_prompts_left_and_reads_the_file_once(tiny, tmp_path, counted):
    """Before: every prompt was tokenized again (finished ones too) and the file read twice per run."""
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    safe_generate(model, tok, PROMPTS[:5], max_new_tokens=NEW, results=path, progress=False)
    counted.update(encoded=0, parsed=0)
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert report.skipped == 5 and report.done == 3 and len(report.records) == 8
    assert counted == {"encoded": 3, "parsed": 1}
    counted.update(encoded=0, parsed=0)
    again = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert again.skipped == 8 and counted == {"encoded": 0, "parsed": 1}  # nothing left: nothing tokenized
    assert [r["output"] for r in again.records] == [r["output"] for r in report.records]


def test_settings_and_model_are_stored_once_and_each_record_is_compact(tiny, tmp_path):
    """Before: every record carried the settings and the model identity (about 1 KB a record)."""
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    safe_generate(model, tok, PROMPTS[:4], max_new_tokens=NEW, results=path, progress=False)
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    lines = _lines(path)
    headers = [line for line in lines if MADE in line]
    records = [line for line in lines if is_record(line)]
    assert len(headers) == 1 and MADE in lines[0] and len(records) == 8  # one header: the same model, settings
    assert all("settings" not in r and "model" not in r and r["made"] == headers[0][MADE] for r in records)
    record_bytes = [len(line.encode()) for line in path.read_text(encoding="utf-8").splitlines()[1:]]
    assert max(record_bytes) < 400 < len(json.dumps(headers[0]))
    # read back, each record has both again, shared (one object, not a copy per record)
    back = list(ResultsFile(path).read().values())
    assert (
        all(r["settings"] is back[0]["settings"] for r in back)
        and back[0]["settings"] == report.records[-1]["settings"]
    )
    assert report.records[0]["model"]["name"] == str(model.config._name_or_path)
    # other settings (forced): a second header, and the records made so name it
    with pytest.warns(UserWarning, match="reused anyway"):
        safe_generate(model, tok, PROMPTS + ["one more"], max_new_tokens=NEW, results=path, progress=False,
                      resume="force", generation_kwargs={"top_k": 3})  # fmt: skip
    lines = _lines(path)
    assert sum(MADE in line for line in lines) == 2 and lines[-1]["made"] == lines[-2][MADE]


def test_a_torn_or_bad_line_among_chunks_is_repaired_or_refused(tmp_path):
    """The streaming read keeps the old rules: a torn last line is set aside, a bad line before others refused."""
    path = tmp_path / "r.jsonl"
    rows = [json.dumps({"id": f"q{k}", "output": "x"}) for k in range(5000)]  # more than one chunk
    path.write_text("\n".join(rows) + '\n{"id": "q5000", "outp')
    store = ResultsFile(path)
    assert len(store.read()) == 5000 and store.repaired
    assert path.read_text().endswith(rows[-1] + "\n") and "q5000" in (tmp_path / "r.jsonl.torn").read_text()
    path.write_text("\n".join(rows[:3000] + ["not json"] + rows[3000:]) + "\n")
    with pytest.raises(EvalError, match="line 3001 is not a valid result record"):
        ResultsFile(path).read()
    path.write_text("\n".join(rows) + "\n[1, 2]\n\n")  # no record, then only blank lines: a torn end
    assert len(ResultsFile(path).read()) == 5000
    path.write_text("\n".join(rows[:10] + ["[" * 100_000 + "]" * 100_000] + rows[10:]) + "\n")  # too deep to parse
    with pytest.raises(EvalError, match="line 11 is not a valid result record"):
        ResultsFile(path).read()
