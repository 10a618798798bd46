"""safe_generate: OOMs injected for real, crashes and resumes, bad inputs, scoring."""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers.core.errors import EvalError, ScoreError
from helpers.evaluation.batching import batch_cache_key
from helpers.evaluation.evaluate import contains_reference, exact_match, safe_generate
from helpers.evaluation.prompts import load_prompts, prompt_id
from helpers.evaluation.results_file import ResultsFile, ResultsWriteError, is_record
from helpers.oom import batch_size as bs
from helpers.testing import simulated_budget

REPO = Path(__file__).resolve().parents[1]
NEW = 4  # new tokens per prompt: enough to tell outputs apart, cheap on 2 CPU cores
PROMPTS = [f"{' '.join(['memory'] * (1 + (7 * k) % 13))} item {k}" for k in range(12)]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """The tiny model, with one torch thread and the library objects frozen out of the collector.

    Both only change speed: on a shared 2-core machine two torch threads fight each other, and
    every OOM's full ``gc.collect()`` would otherwise walk all of transformers' objects (0.2 s);
    what a failed batch creates after the freeze is still collected.
    """
    from helpers.loading.loader import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer, _ = load(str(tiny_llama), load="fp32", check=False)
    gc.freeze()
    yield model, tokenizer
    gc.unfreeze()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """Outputs of an OOM-free run, by id."""
    model, tok = tiny
    path = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert report.done == len(PROMPTS) and report.oom_retries == 0
    return {r["id"]: r["output"] for r in report.records}


def _lines(path: Path) -> list[dict]:
    """The result records of a results file (its header lines, what made them, left out)."""
    text = path.read_text()
    assert text.endswith("\n")
    return [rec for line in text.splitlines() if is_record(rec := json.loads(line))]


def _assert_complete(path: Path, reference: dict[str, str]) -> None:
    rows = _lines(path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a sample was written twice"
    assert set(ids) == set(reference), "a sample is missing"
    assert {r["id"]: r["output"] for r in rows} == reference


def test_injected_ooms_never_lose_or_change_a_result(tiny, reference, tmp_path):
    """50 seeded runs, OOM above a token budget and at random moments: every prompt exactly once, same outputs."""
    model, tok = tiny
    longest = max(len(ids) for ids in tok(PROMPTS)["input_ids"])
    retries = 0
    for seed in range(50):
        bs.clear_cache()
        path = tmp_path / f"run{seed}.jsonl"
        budget_tokens = longest + NEW + (seed * 37) % 150  # from "one prompt at a time" to "most at once"
        with simulated_budget(model, tokens=budget_tokens, oom_rate=0.15, seed=seed) as budget:
            report = safe_generate(
                model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False, batch_size=len(PROMPTS)
            )
        assert report.oom_retries == budget.ooms
        assert report.full_collections == 0  # refcounting freed every failed batch: no 0.2 s gc.collect()
        assert report.truncated == 0
        _assert_complete(path, reference)
        retries += report.oom_retries
    assert retries >= 50  # the runs really went through the OOM path


def test_a_kv_cache_kind_runs_through_to_generate_and_is_remembered_apart(tiny, reference, tmp_path):
    """safe_generate(kv_cache="fp8"): transformers' 8-bit cache in every batch (greedy tokens equal on the
    tiny model, as tests/test_reducers.py checks), the kind in the recorded settings, and the batch size
    it learned remembered under its own key."""
    from helpers.evaluation.batching import batch_cache_key
    from helpers.oom.batch_size import remembered_batch

    model, tok = tiny
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=tmp_path / "fp8.jsonl", progress=False,
                           kv_cache="fp8")  # fmt: skip
    assert report.done == len(PROMPTS)
    assert {r["id"]: r["output"] for r in report.records} == reference
    settings = json.dumps(report.records[0]["settings"])
    assert "fp8" in settings  # recorded with the generation settings, so a resume with another cache re-runs
    assert remembered_batch(batch_cache_key(model, NEW, "fp8")) is not None


def test_adapts_instead_of_halving_and_grows_back(tiny, tmp_path):
    model, tok = tiny
    bs.clear_cache()
    prompts = [" ".join(["x"] * n) for n in (40, 38, 36, 34, 6, 5, 5, 4, 4, 3, 3, 2, 2, 2, 1, 1)]
    with simulated_budget(model, tokens=4 * (42 + NEW)) as budget:
        report = safe_generate(
            model, tok, prompts, max_new_tokens=NEW, results=tmp_path / "r.jsonl", progress=False, batch_size=16
        )
    assert budget.ooms >= 1
    assert report.done == len(prompts)
    # the longest prompts went first in small batches; the short ones later in bigger batches
    assert report.batch_sizes[0] < report.batch_sizes[-1]
    first = [r for r in report.records if r["batch_size"] == report.batch_sizes[0]]
    assert all(r["prompt_tokens"] >= 30 for r in first)


def test_single_prompt_that_does_not_fit_is_truncated_and_recorded(tiny, tmp_path):
    model, tok = tiny
    prompt = "a prompt that only fits with fewer new tokens"
    full = safe_generate(model, tok, [prompt], max_new_tokens=16, results=tmp_path / "full.jsonl", progress=False)
    n = full.records[0]["prompt_tokens"]
    with simulated_budget(model, tokens=n + 8):
        report = safe_generate(model, tok, [prompt], max_new_tokens=16, results=tmp_path / "r.jsonl", progress=False)
    rec = report.records[0]
    assert report.truncated == 1 and rec["truncated"] and rec["truncated_reason"] == "memory"
    assert rec["max_new_tokens"] == 8 and rec["new_tokens"] <= 8
    assert full.records[0]["output"].startswith(rec["output"])


def test_context_overflow_caps_new_tokens_and_records_it(tiny, tmp_path):
    model, tok = tiny
    ctx = model.config.max_position_embeddings
    long = " ".join(["memory"] * 2000)
    n = len(tok(long)["input_ids"])
    keep = tok.decode(tok(long)["input_ids"][: ctx - 6], skip_special_tokens=True)
    m = len(tok(keep)["input_ids"])
    assert ctx - 16 < m < ctx
    report = safe_generate(model, tok, [keep, "short"], max_new_tokens=16, results=tmp_path / "r.jsonl", progress=False)
    capped = next(r for r in report.records if r["prompt"] == keep)
    assert capped["truncated"] and capped["truncated_reason"] == "context" and capped["max_new_tokens"] == ctx - m
    assert not next(r for r in report.records if r["prompt"] == "short")["truncated"]
    # a prompt that leaves no room at all is refused before any generation
    assert n >= ctx
    with pytest.raises(EvalError, match="context"):
        safe_generate(model, tok, [long], results=tmp_path / "x.jsonl", progress=False)
    assert not (tmp_path / "x.jsonl").exists()


def test_interrupted_run_resumes_without_loss(tiny, reference, tmp_path):
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    seen = []

    def stop_after_5(rec):
        seen.append(rec["id"])
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        safe_generate(
            model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False, batch_size=3, on_result=stop_after_5
        )
    # the callback saw 5; the whole second batch (3, then 6: it doubles while it fits) was on disk first
    written = [r["id"] for r in _lines(path)]
    assert written[:5] == seen and len(written) == 9
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert report.skipped == 9 and report.done == len(PROMPTS) - 9
    _assert_complete(path, reference)
    again = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert again.done == 0 and again.skipped == len(PROMPTS) and len(again.records) == len(PROMPTS)
    # results made with other settings are not reused silently (issue 16 item 3): an error, or resume="force"
    with pytest.raises(EvalError, match="other settings.*new file.*resume='force'"):
        safe_generate(model, tok, PROMPTS, max_new_tokens=NEW + 1, results=path, progress=False)
    with pytest.warns(UserWarning, match="other settings"):
        forced = safe_generate(
            model, tok, PROMPTS, max_new_tokens=NEW + 1, results=path, progress=False, resume="force"
        )
    assert forced.done == 0 and forced.skipped == len(PROMPTS)


def test_starting_over_moves_the_earlier_results_aside_instead_of_deleting_them(tiny, tmp_path):
    """resume=False (a notebook cell re-run after a disconnect) keeps the earlier run's file as a backup."""
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    safe_generate(model, tok, PROMPTS[:4], max_new_tokens=NEW, results=path, progress=False)
    earlier = path.read_bytes()
    with pytest.warns(UserWarning, match=r"resume=False: the earlier results in .*r\.jsonl were moved to .*\.bak"):
        report = safe_generate(model, tok, PROMPTS[:2], max_new_tokens=NEW, results=path, progress=False, resume=False)
    assert report.backup is not None and report.backup.read_bytes() == earlier
    assert len(_lines(path)) == 2 and "the earlier results moved to" in str(report)
    with pytest.warns(UserWarning, match="moved to"):  # a second start-over in the same second keeps both
        second = safe_generate(model, tok, PROMPTS[:1], max_new_tokens=NEW, results=path, progress=False, resume=False)
    assert second.backup != report.backup and report.backup.read_bytes() == earlier
    assert len(_lines(second.backup)) == 2


def test_torn_last_line_is_repaired_not_duplicated(tiny, reference, tmp_path):
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    safe_generate(model, tok, PROMPTS[:4], max_new_tokens=NEW, results=path, progress=False)
    rows = _lines(path)
    torn = json.dumps({**rows[-1], "id": "x"})[:40]
    with open(path, "a") as f:  # a crash in the middle of writing the fifth line
        f.write(torn)
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert report.repaired and report.skipped == 4
    assert torn in (tmp_path / "r.jsonl.torn").read_text()
    _assert_complete(path, reference)


def test_sigkill_midway_then_resume(tiny, reference, tmp_path, tiny_llama):
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    script = textwrap.dedent(f"""
        import time
        from helpers.loading.loader import load
        from helpers.evaluation.evaluate import safe_generate
        model, tok, _ = load({str(tiny_llama)!r}, load="fp32", check=False)
        safe_generate(model, tok, {PROMPTS!r}, max_new_tokens={NEW}, results={str(path)!r}, progress=False,
                      batch_size=2, on_result=lambda rec: time.sleep(0.3))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600  # a hang guard: the child's load may be slow on a busy machine
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and path.read_text().count("\n") >= 4:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(10)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    before = len(ResultsFile(path).read())
    assert 4 <= before < len(PROMPTS)
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert report.skipped == before and report.done == len(PROMPTS) - before
    _assert_complete(path, reference)


def test_full_disk_keeps_what_was_written_and_hands_back_the_rest(tiny, reference, tmp_path):
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    safe_generate(model, tok, PROMPTS[:2], max_new_tokens=NEW, results=path, progress=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 900, hard))
    try:
        with pytest.raises(ResultsWriteError) as err:
            safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False, batch_size=4)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert "resume=True" in str(err.value) and err.value.unsaved
    written = ResultsFile(path).read()  # repairs a line the limit cut in half
    assert {r["id"] for r in err.value.unsaved}.isdisjoint(written)
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert report.skipped == len(written)
    _assert_complete(path, reference)


def test_bad_inputs_fail_before_any_generation(tiny, tmp_path):
    model, tok = tiny
    with simulated_budget(model, tokens=10**9) as budget:
        with pytest.raises(EvalError, match="empty"):
            safe_generate(model, tok, [], results=tmp_path / "a.jsonl", progress=False)
        blocker = tmp_path / "not_a_dir"
        blocker.write_text("")
        with pytest.raises(EvalError, match="cannot write results"):
            safe_generate(model, tok, PROMPTS, results=blocker / "r.jsonl", progress=False)
        with pytest.raises(EvalError, match="twice"):
            safe_generate(
                model,
                tok,
                [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}],
                results=tmp_path / "b.jsonl",
                progress=False,
            )
        with pytest.raises(EvalError, match="score"):
            safe_generate(model, tok, PROMPTS, score="bleu", results=tmp_path / "c.jsonl", progress=False)
        with pytest.raises(EvalError, match="not found"):
            safe_generate(model, tok, tmp_path / "missing.jsonl", results=tmp_path / "d.jsonl", progress=False)
        with pytest.raises(EvalError, match="max_batch_size must be a positive int"):
            safe_generate(model, tok, PROMPTS, max_batch_size=0, results=tmp_path / "e.jsonl", progress=False)
    assert budget.calls == 0


def test_typical_prompt_mistakes_say_what_to_pass(tiny, tmp_path):
    model, tok = tiny
    with simulated_budget(model, tokens=10**9) as budget:
        for wrong in ({"prompt": "hi"}, {"q1": "hi", "q2": "bye"}):  # a dict iterates its keys: never a prompt
            with pytest.raises(EvalError, match=r"prompts is a dict.*\[prompts\].*prompts.items\(\)"):
                safe_generate(model, tok, wrong, results=tmp_path / "a.jsonl", progress=False)
        with pytest.raises(EvalError, match=r"single prompt, pass a list: \['hello world'\]"):
            safe_generate(model, tok, "hello world", results=tmp_path / "a.jsonl", progress=False)
        array = tmp_path / "p.json"
        array.write_text('[{"prompt": "hi"}]')
        with pytest.raises(EvalError, match="line 1 is a JSON array; the file must be JSONL"):
            safe_generate(model, tok, array, results=tmp_path / "a.jsonl", progress=False)
        with pytest.raises(EvalError, match="generation_kwargs must be a dict"):
            safe_generate(
                model, tok, PROMPTS, generation_kwargs=["do_sample"], results=tmp_path / "a.jsonl", progress=False
            )
        with pytest.raises(EvalError, match="pass them in that order"):
            safe_generate(tok, model, PROMPTS, results=tmp_path / "a.jsonl", progress=False)
        with pytest.raises(EvalError, match="got LlamaForCausalLM and NoneType"):
            safe_generate(model, None, PROMPTS, results=tmp_path / "a.jsonl", progress=False)
    assert budget.calls == 0 and not (tmp_path / "a.jsonl").exists()


def test_prompt_forms_and_stable_ids(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "q1", "prompt": "one", "reference": "1"}\n\n{"prompt": "two"}\n')
    assert load_prompts(path) == [
        {"id": "q1", "prompt": "one", "reference": "1"},
        {"id": prompt_id("two"), "prompt": "two", "reference": None},
    ]
    twice = load_prompts(["same", "same"])
    assert [p["id"] for p in twice] == [prompt_id("same"), prompt_id("same") + "#2"]
    assert prompt_id("same") == prompt_id("same") and len(prompt_id("same")) == 12

    class FakeDataset(list):  # what safe_generate uses of a datasets.Dataset
        column_names = ["prompt", "reference"]

    assert load_prompts(FakeDataset([{"prompt": "a", "reference": "b"}]))[0]["reference"] == "b"


def test_scores_and_report(tiny, tmp_path):
    assert exact_match(" Paris. ", "paris") == 1.0 and exact_match("Paris is", "Paris") == 0.0
    assert contains_reference("It is Paris, I think", "paris") == 1.0
    model, tok = tiny
    rows = [{"id": f"p{k}", "prompt": p, "reference": "memory"} for k, p in enumerate(PROMPTS[:4])]
    rows.append({"id": "noref", "prompt": "no reference here"})
    report = safe_generate(
        model,
        tok,
        rows,
        max_new_tokens=NEW,
        results=tmp_path / "r.jsonl",
        progress=False,
        score=lambda out, ref: float(len(out) > 0),
    )
    assert report.scores == {"<lambda>": 1.0}
    assert [r["id"] for r in report.records] == [r["id"] for r in rows]
    assert "score" not in report.records[-1]
    assert "generated" in str(report) and "<table" in report._repr_html_()
    assert report.tokens_per_s > 0 and report.peak_memory > 0
    assert report.plot().axes


def test_a_score_function_that_raises_loses_no_output_and_is_named(tiny, reference, tmp_path):
    model, tok = tiny
    rows = [{"id": k, "prompt": p, "reference": "odd" if k % 3 else "memory"} for k, p in enumerate(PROMPTS)]

    def picky(output, ref):
        if ref == "memory":
            raise ValueError("cannot score this one")
        return 1.0

    path = tmp_path / "r.jsonl"
    with pytest.raises(ScoreError, match=r"score function 'picky' raised on 4 of 12 samples.*ValueError: cannot score"):
        safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False, score=picky, batch_size=4)
    saved = _lines(path)
    assert len(saved) == 12 and sorted(r["output"] for r in saved) == sorted(reference.values())  # none lost
    assert sum("score_error" in r for r in saved) == 4 and all("output" in r for r in saved)
    # fixed: the rerun generates nothing and scores the saved outputs
    with simulated_budget(model, tokens=10**9) as budget:
        report = safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False, score=exact_match)
    assert budget.calls == 0 and report.skipped == 12 and "exact_match" in report.scores
    assert all("exact_match" in r["score"] for r in report.records)


def test_auto_batch_starts_from_the_finders_cache(tiny, tmp_path):
    model, tok = tiny
    bs.clear_cache()
    with simulated_budget(model, tokens=3 * (30 + NEW)):
        first = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=tmp_path / "a.jsonl", progress=False)
        assert first.oom_retries >= 1
        second = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=tmp_path / "b.jsonl", progress=False)
    assert second.oom_retries == 0 and second.batch_sizes[0] >= 2


def test_auto_batch_starts_from_a_search_the_user_ran(tiny, tmp_path):
    model, tok = tiny
    bs.clear_cache()
    longest = max(PROMPTS, key=lambda p: len(tok(p)["input_ids"]))
    seq = len(tok(longest)["input_ids"]) + NEW

    def step(b):
        enc = tok([longest] * b, return_tensors="pt", padding=True)
        model.generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)

    with simulated_budget(model, tokens=5 * seq):
        search = bs.find_max_batch_size(step, key=batch_cache_key(model, NEW), limit=len(PROMPTS))
        assert search.max_ok == 5
        report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=tmp_path / "r.jsonl", progress=False)
    assert report.batch_sizes[0] == 5 and report.oom_retries == 0 and report.done == len(PROMPTS)


def test_a_search_stopped_by_its_limit_does_not_cap_the_evaluation(tiny, tmp_path):
    """A search whose every size ran (limit 3) says nothing about 4: the evaluation starts at 3 and grows."""
    model, tok = tiny
    bs.clear_cache()
    search = bs.find_max_batch_size(lambda b: None, key=batch_cache_key(model, NEW), limit=3)
    assert search.max_ok == 3 and search.limit_bound
    same = [{"id": str(i), "prompt": "memory item"} for i in range(12)]  # one length: the token budget is the batch
    report = safe_generate(model, tok, same, max_new_tokens=NEW, results=tmp_path / "r.jsonl", progress=False)
    assert report.batch_sizes[0] == 3 and max(report.batch_sizes) > 3 and report.oom_retries == 0


@pytest.mark.cuda
def test_runs_on_cuda_and_reports_gpu_memory(tmp_path, tiny_llama):  # pragma: no cover - needs a GPU
    from helpers.loading.loader import load

    model, tok, _ = load(str(tiny_llama), load="fp16")
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=tmp_path / "r.jsonl", progress=False)
    assert report.done == len(PROMPTS) and report.memory_kind == "GPU allocated"
    assert torch.cuda.memory_allocated() > 0


# ---------------------------------------------------------------------------------------------
# issue 16: resume that never trusts the wrong results, one writer, no abort, clear input errors


def test_resume_refuses_results_of_another_model_or_prompt_text(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    rows = [{"id": f"q{k}", "prompt": p} for k, p in enumerate(PROMPTS[:3])]
    first = safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False)
    rec = first.records[0]
    assert {k: rec["model"][k] for k in ("name", "load", "adapter")} == {
        "name": str(model.config._name_or_path),
        "load": "fp32",
        "adapter": None,
    }
    assert rec["prompt"] == rows[0]["prompt"] and len(rec["made"]) == 16  # compared on resume
    with monkeypatch.context() as m:
        m.setattr(model.config, "_name_or_path", "someone/another-model")
        with pytest.raises(EvalError, match=r"3 of these prompt ids made differently.*another model.*new file"):
            safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False)
    edited = [{**rows[0], "prompt": rows[0]["prompt"] + " (edited)"}, *rows[1:]]
    with pytest.raises(EvalError, match=r"id q0: another prompt text.*resume='force'"):
        safe_generate(model, tok, edited, max_new_tokens=NEW, results=path, progress=False)
    with simulated_budget(model, tokens=10**9) as budget:
        again = safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False)
    assert again.skipped == 3 and budget.calls == 0


def test_a_second_writer_gets_an_error_naming_the_first(tiny, tmp_path):
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    safe_generate(model, tok, PROMPTS[:2], max_new_tokens=NEW, results=path, progress=False)
    with open(path, "a") as f:
        f.write('{"id": "half a li')  # a torn line, or one the other writer is in the middle of
    before = path.read_bytes()
    holder = subprocess.Popen(  # another process holding the lock, as safe_generate's ResultsFile takes it
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(path) + '.lock'!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.write(fd, f'{os.getpid()}\\n'.encode())\n"
            "print('locked', flush=True); time.sleep(3600)",  # killed below: no deadline under load
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(EvalError, match=rf"being written by another run \(process {holder.pid};"):
            safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
        assert ResultsFile(path).read().keys() == {r["id"] for r in _lines_prefix(before)}
        assert path.read_bytes() == before  # the repair never touches a file someone else holds
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert report.repaired and report.skipped == 2 and report.done == len(PROMPTS) - 2
    # in one process too: a notebook re-run while the first run still holds the file
    first = ResultsFile(path)
    first.open()
    try:
        with pytest.raises(EvalError, match=rf"process {os.getpid()}"):
            safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    finally:
        first.close()


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_a_second_writer_through_a_link_to_the_same_file_gets_an_error(tiny, tmp_path, link):
    """Two names of one file (a symlink, a hard link) are one results file: one writer at a time."""
    model, tok = tiny
    real = tmp_path / "r.jsonl"
    safe_generate(model, tok, PROMPTS[:2], max_new_tokens=NEW, results=real, progress=False)
    alias = tmp_path / "elsewhere" / "alias.jsonl"
    alias.parent.mkdir()
    (os.symlink if link == "symlink" else os.link)(real, alias)
    before = real.read_bytes()
    said = rf"being written by another run \(process {os.getpid()}" if link == "symlink" else "a hard link"
    for held, other in ((real, alias), (alias, real)):
        first = ResultsFile(held)
        first.open()
        try:
            with pytest.raises(EvalError, match=said):
                safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=other, progress=False)
            with pytest.raises(EvalError, match=said):
                ResultsFile(other).open()
        finally:
            first.close()
    assert real.read_bytes() == before
    report = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=alias, progress=False)
    assert report.skipped == 2 and report.done == len(PROMPTS) - 2
    ids = [r["id"] for r in _lines(real)]
    assert len(ids) == len(set(ids)) == len(PROMPTS)


def _lines_prefix(data: bytes) -> list[dict]:
    return [rec for line in data.split(b"\n")[:-1] if line.strip() and is_record(rec := json.loads(line))]


def test_a_prompt_that_never_fits_is_recorded_as_failed_and_the_rest_goes_on(tiny, tmp_path):
    model, tok = tiny
    long = " ".join(["memory"] * 40)
    prompts = [long, *PROMPTS[:4]]
    n_long = len(tok(long)["input_ids"])
    path = tmp_path / "r.jsonl"
    with simulated_budget(model, tokens=n_long):  # the long prompt alone with one new token: over
        report = safe_generate(model, tok, prompts, max_new_tokens=NEW, results=path, progress=False)
    assert report.done == 4 and report.failed == 1 and len(report.records) == 4
    fail = report.failures[0]
    assert fail["error"] == "does not fit" and fail["prompt_tokens"] == n_long and fail["output"] is None
    assert "does not fit" in str(report) and f"({n_long} tokens)" in str(report) and "1 failed" in repr(report)
    # a rerun with more memory tries the failed prompt again
    again = safe_generate(model, tok, prompts, max_new_tokens=NEW, results=path, progress=False)
    assert again.done == 1 and again.skipped == 4 and again.failed == 0 and len(again.records) == 5


def test_a_prompt_that_never_fits_is_recorded_once_however_often_it_is_rerun(tiny, tmp_path):
    model, tok = tiny
    long = " ".join(["memory"] * 40)
    prompts = [long, *PROMPTS[:2]]
    n_long = len(tok(long)["input_ids"])
    path = tmp_path / "r.jsonl"
    for run in range(3):
        with simulated_budget(model, tokens=n_long):  # the long prompt never fits
            report = safe_generate(model, tok, prompts, max_new_tokens=NEW, results=path, progress=False)
        assert report.failed == 1 and report.failed_again == (1 if run else 0)
        assert [r["id"] for r in _lines(path)].count(report.failures[0]["id"]) == 1, f"rerun {run}: written twice"
    assert len(_lines(path)) == 3 and "1 failed before too (recorded once)" in str(report)
    # another setting is another attempt: its failure is recorded (the newer line is the one read)
    with simulated_budget(model, tokens=n_long), pytest.warns(UserWarning, match="reused anyway"):
        report = safe_generate(
            model, tok, prompts, max_new_tokens=NEW, results=path, resume="force", generation_kwargs={"top_k": 5},
            progress=False,
        )  # fmt: skip
    assert report.failed == 1 and report.failed_again == 0 and len(_lines(path)) == 4
    assert report.failures[0]["settings"]["top_k"] == 5


def test_bad_results_and_generation_arguments_say_what_to_pass(tiny, tmp_path):
    model, tok = tiny
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    original = prompt_file.read_bytes()
    with simulated_budget(model, tokens=10**9) as budget:
        with pytest.raises(EvalError, match="results must be the path of a JSONL file.*got None"):
            safe_generate(model, tok, PROMPTS, results=None, progress=False)
        with pytest.raises(EvalError, match="num_return_sequences=2.*one output per prompt id"):
            safe_generate(
                model, tok, PROMPTS, results=tmp_path / "a.jsonl", generation_kwargs={"num_return_sequences": 2}
            )
        with pytest.raises(EvalError, match="resume must be True.*got 'yes'"):
            safe_generate(model, tok, PROMPTS, results=tmp_path / "a.jsonl", resume="yes", progress=False)
        for resume in (True, False):  # never append to, nor empty, the prompt file
            with pytest.raises(EvalError, match="is the prompt file"):
                safe_generate(model, tok, prompt_file, results=prompt_file, resume=resume, progress=False)
        other = tmp_path / "notes.txt"
        other.write_text("my notes\n")
        with pytest.raises(EvalError, match="not a safe_generate results file.*will not delete it"):
            safe_generate(model, tok, PROMPTS, results=other, resume=False, progress=False)
        assert other.read_text() == "my notes\n"
        with pytest.raises(EvalError, match=r"prompt #1's prompt holds a lone surrogate '\\ud800'"):
            safe_generate(model, tok, ["fine", "bad \ud800 text"], results=tmp_path / "a.jsonl", progress=False)
        latin = tmp_path / "latin.jsonl"
        latin.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
        with pytest.raises(EvalError, match=rf"prompt file {latin} is not UTF-8 text \(byte 0xe9.*re-save it"):
            safe_generate(model, tok, latin, results=tmp_path / "a.jsonl", progress=False)
    assert budget.calls == 0 and prompt_file.read_bytes() == original
    assert not (tmp_path / "a.jsonl").exists()


def test_eval_plot_reads_whole_batches_and_marks_the_ooms(tmp_path):
    from helpers.core.units import MiB
    from helpers.evaluation.report import EvalReport

    report = EvalReport(tmp_path / "r.jsonl", total=47, done=22, skipped=25, oom_retries=1, batch_sizes=[6, 3, 8])
    report.timeline = [(0.1, 6, 402 * MiB), (0.3, 3, 403 * MiB), (0.5, 8, 403 * MiB)]
    report.oom_timeline = [(0.2, 12)]
    fig = report.plot()
    ax, mem = fig.axes
    assert all(float(y).is_integer() for y in ax.get_yticks())  # batch sizes, never 6.5
    assert mem.get_ylim()[0] == 0 and mem.get_ylabel().endswith("(MiB)")  # a 1 MiB wobble is not a cliff
    title = ax.get_title()
    assert "22 samples in 3 batches" in title and "25 done before" in title and "1 OOM retry" in title
    (oom,) = ax.collections
    assert oom.get_offsets().tolist() == [[0.2, 12.0]]


def test_a_split_models_second_card_is_read_and_its_cache_given_back(fake_gpus):
    """A model split over 2×T4 generates on both cards: the memory timeline adds them up, and a cache
    left on GPU 1 (12 GiB reserved, 2 GiB in tensors) is given back, where GPU 0 alone showed nothing."""
    from helpers.core import memory
    from helpers.evaluation import evaluate

    cuda = fake_gpus(2, 15 * 2**30)
    cuda.set(0, 3 * 2**30, 3 * 2**30)
    cuda.set(1, 2 * 2**30, 12 * 2**30)
    gpu = torch.device("cuda:0")  # where a split model's first weights are: safe_generate's run device
    assert evaluate._memory(gpu) == 5 * 2**30
    assert evaluate._should_empty_cache(gpu) is True
    cuda.set(1, 2 * 2**30, 2 * 2**30)
    assert evaluate._should_empty_cache(gpu) is False
    cuda.peak = {0: 4 * 2**30, 1: 6 * 2**30}
    assert memory.peak_allocated("all") == 10 * 2**30
    import types

    report = evaluate.EvalReport(results_path="r.jsonl")
    run = types.SimpleNamespace(device=gpu, scorer=None)
    evaluate._finish(report, run, types.SimpleNamespace(records={}), [])  # what a finished run records
    assert report.peak_memory == 10 * 2**30 and report.peak_by_gpu == {0: 4 * 2**30, 1: 6 * 2**30}
    assert "10.00 GiB (GPU 0 4.00 GiB; GPU 1 6.00 GiB)" in str(report)  # what to hold against one card
    memory.reset_peak_allocated("all")
    assert sorted(cuda.resets) == [0, 1] and memory.peak_allocated("all") == 5 * 2**30


def test_a_results_write_error_keeps_its_unsaved_records_through_pickle():
    """A worker process handing the error back pickles it: the records that never reached the disk go
    with it (its __init__ takes them, so the default exception pickling failed)."""
    import pickle

    err = ResultsWriteError("disk full writing results.jsonl", [{"id": "a", "output": "x"}])
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ResultsWriteError and str(back) == str(err) and back.unsaved == err.unsaved


def test_a_torn_line_that_cannot_be_set_aside_is_a_clear_error_and_changes_nothing(tmp_path):
    from helpers.evaluation.results_file import ResultsFile

    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a", "output": "x"}\n{"id": "b", "out')
    (tmp_path / "r.jsonl.torn").mkdir()  # where the torn line would go cannot be written (as on a full disk)
    before = path.read_bytes()
    with pytest.raises(EvalError, match="torn line that could not be set aside.*nothing was changed"):
        ResultsFile(path).read()
    assert path.read_bytes() == before  # no record lost, nothing cut
