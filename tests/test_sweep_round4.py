"""A sweep of bad and odd inputs (issue 48 item 6), our own, none from test_bad_input.py.

Each case is an input a user could pass; it either gets one clear error (an ``OomkitError``, naming what
to do) or is a documented acceptance (it works, and a check says it worked right). A case is classed as
clear / accepted, or as one of the failures: raw (a library traceback), silent (a wrong acceptance),
hang (still running after ``HANG_S``, caught by ``signal.alarm``) or false refusal. Every case is built to
run well under 2 s; the alarm only catches a hang, nothing here measures speed.

``python tests/test_sweep_round4.py`` prints the counts by class (the issue's before/after figures).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers.core.errors import OomkitError

HANG_S = 10  # the threshold for a hang
REPO = Path(__file__).resolve().parents[1]


class _Hang(Exception):
    pass


@dataclass
class Case:
    name: str
    run: Callable  # run(ctx) -> for "accept": True when the result is right
    expect: str  # "error" or "accept"


def _alarm(signum, frame):
    raise _Hang()


def classify(case: Case, ctx: dict) -> tuple[str, str]:
    """(class, detail) of one case: clear, accepted, raw, silent, hang or false_refusal."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        result = case.run(ctx)
    except _Hang:
        return "hang", f"> {HANG_S} s"
    except OomkitError as e:
        return ("clear" if case.expect == "error" else "false_refusal"), f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - classing it is the point
        return "raw", f"{type(e).__name__}: {e}"[:300]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if case.expect == "error":
        return "silent", f"accepted: {result!r:.200}"
    return ("accepted", "") if result is True else ("silent", f"wrong result: {result!r:.200}")


# ---------------------------------------------------------------------------------------------- inputs


def _fifo(ctx) -> str:
    path = ctx["tmp"] / f"fifo{len(list(ctx['tmp'].glob('fifo*')))}"
    os.mkfifo(path)
    return str(path)


def _deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


def _format_huge(ctx):
    from helpers.core.units import format_bytes

    return format_bytes(10**19) == "9094947.02 TiB" and format_bytes(10**400).endswith(" TiB")


def _format_huge_negative(ctx):
    from helpers.core.units import format_bytes

    return format_bytes(-(10**400)).startswith("-")


def _prompt_file(ctx, text: str) -> Path:
    path = ctx["tmp"] / f"prompts{len(list(ctx['tmp'].glob('prompts*')))}.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def _deep_prompts(ctx):
    from helpers.evaluation.prompts import load_prompts

    return load_prompts(_prompt_file(ctx, '{"prompt": "hi", "meta": ' + _deep() + "}\n"))


def _line_separators_in_prompts(ctx):
    from helpers.evaluation.prompts import load_prompts

    rows = [{"prompt": "one\u2028two"}, {"prompt": "three\u0085four", "reference": "x\u2029y"}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    got = load_prompts(_prompt_file(ctx, text))
    return [r["prompt"] for r in got] == ["one\u2028two", "three\u0085four"] and got[1]["reference"] == "x\u2029y"


def _line_separators_in_instructions(ctx):
    from helpers.training.data import load_instructions

    path = ctx["tmp"] / "instructions.jsonl"
    path.write_text(json.dumps({"instruction": "a\u2028b", "response": "c\u0085d"}, ensure_ascii=False) + "\n")
    return load_instructions(path) == [{"instruction": "a\u2028b", "response": "c\u0085d"}]


def _deep_results(ctx):
    from helpers.evaluation.results_file import ResultsFile

    path = ctx["tmp"] / "deep.jsonl"
    good = json.dumps({"id": "a", "output": "x"})
    path.write_text(good + "\n" + '{"id": "b", "output": ' + _deep() + "}\n" + good.replace('"a"', '"c"') + "\n")
    return ResultsFile(path).read()


def _prompts_fifo(ctx):
    from helpers.evaluation.prompts import load_prompts

    return load_prompts(_fifo(ctx))


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from helpers.loading.loader import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer, _ = load(str(tiny_llama), load="fp32", check=False)
    yield model, tokenizer
    torch.set_num_threads(threads)


def _generate(ctx, results: str | None = None, **kwargs):
    from helpers.evaluation.evaluate import safe_generate

    model, tok = ctx["tiny"]
    results = results or str(ctx["tmp"] / f"r{len(list(ctx['tmp'].glob('r*.jsonl')))}.jsonl")
    kwargs.setdefault("progress", False)
    return safe_generate(model, tok, ["Hello there", "Tell me"], max_new_tokens=2, results=results, **kwargs)


def _gen_kwargs(**generation_kwargs):
    return lambda ctx: _generate(ctx, generation_kwargs=generation_kwargs)


def _stop_strings(ctx):
    report = _generate(ctx, generation_kwargs={"stop_strings": ["\n"]})
    return report.done == 2 and all(isinstance(o, str) for o in report.outputs)


def _tilde_results(ctx):
    home = ctx["tmp"] / "home"
    home.mkdir(exist_ok=True)
    old = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        report = _generate(ctx, results="~/x.jsonl")
    finally:
        if old is None:
            del os.environ["HOME"]
        else:
            os.environ["HOME"] = old
    return (home / "x.jsonl").is_file() and not Path("~").exists() and report.results_path == home / "x.jsonl"


def _nan_scores_with_references(ctx):
    from helpers.evaluation.evaluate import safe_generate

    model, tok = ctx["tiny"]
    scores = {"p1": float("nan"), "p2": 1.0, "p3": float("inf")}
    prompts = [{"id": k, "prompt": f"prompt {k}", "reference": k} for k in scores]

    def by_reference(output, reference):
        return scores[reference]

    report = safe_generate(model, tok, prompts, max_new_tokens=1, results=str(ctx["tmp"] / "scored.jsonl"),
                           score=by_reference, progress=False)  # fmt: skip
    text = str(report)
    return report.scores["by_reference"] == 1.0 and "2 not finite" in text


def _results_special(path: str):
    return lambda ctx: _generate(ctx, results=path)


def _results_fifo(ctx):
    return _generate(ctx, results=_fifo(ctx))


def _load_plan(max_memory):
    def run(ctx):
        from helpers.loading.plan import LoadPlan

        return LoadPlan(str(ctx["tiny_path"]), max_memory=max_memory)

    return run


def _load_plan_valid(ctx):
    from helpers.loading.plan import LoadPlan

    caps = {0: "10GiB", "cpu": 30 << 30, "disk": "100GB"}
    return LoadPlan(str(ctx["tiny_path"]), max_memory=caps).max_memory == caps


def _rank_ram_negative(ctx):
    from helpers.loading.host_ram import rank_ram

    return rank_ram(str(ctx["tiny_path"]), 1, machine=16 << 30, offloaded=-1)


def _gptq(**qc):
    def run(ctx):
        from types import SimpleNamespace

        from helpers.estimator.prequantized import repo_quantization

        return repo_quantization(SimpleNamespace(quantization_config={"quant_method": "gptq", **qc}))

    return run


def _gptq_valid(ctx):
    rq = _gptq(bits=3, group_size=-1)(ctx)
    return (rq.bits, rq.group_size) == (3, -1)


def _launch_many(ctx):
    from helpers.training.distributed import launch

    return launch(print, (), num_processes=10**6, via="debug")


def _sites(which: str):
    def run(ctx):
        from helpers import top_allocation_sites

        return top_allocation_sites(_fifo(ctx) if which == "fifo" else which)

    return run


def _instructions(which: str):
    def run(ctx):
        from helpers.training.data import load_instructions

        return load_instructions(_fifo(ctx) if which == "fifo" else which)

    return run


def _cli_explain(which: str):
    """The CLI's refusal is its exit status and a line on stderr: read as a clear error here."""

    def run(ctx):
        from helpers.cli import explain_main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = explain_main([_fifo(ctx) if which == "fifo" else which])
        if rc != 0 and "cannot read" in err.getvalue():
            raise OomkitError(err.getvalue().strip())
        return rc

    return run


def _deep_namespace():
    deep: list = []
    gc.disable()  # 200,000 new lists would set off full collections of everything loaded (seconds, not the code's)
    try:
        for _ in range(200_000):
            deep = [deep]
    finally:
        gc.enable()
    return {"deep": deep, "t": torch.zeros(3)}


def _census_deep(ctx):
    from helpers import census

    c = census(_deep_namespace())
    return any("depth" in n for n in c.notes)


def _leak_checks_deep(ctx):
    from helpers import leak_checks

    return leak_checks(_deep_namespace()) is not None


def _many_tensors():
    return {"many": [torch.zeros(2) for _ in range(20_000)]}


def _census_many(ctx):
    from helpers import census

    ns = _many_tensors()
    c = census(ns)
    return sum(1 for e in c.entries if e.holder.startswith("many")) >= 1


def _leak_checks_many(ctx):
    from helpers import leak_checks

    return leak_checks(_many_tensors()) is not None


CASES = [
    Case("format_bytes of 10**19 and 10**400", _format_huge, "accept"),
    Case("format_bytes of -10**400", _format_huge_negative, "accept"),
    Case("prompt file with a 100,000-deep JSON value", _deep_prompts, "error"),
    Case("prompt file with U+2028/U+0085/U+2029 inside strings", _line_separators_in_prompts, "accept"),
    Case("instruction file with U+2028/U+0085 inside strings", _line_separators_in_instructions, "accept"),
    Case("results file with a 100,000-deep JSON line", _deep_results, "error"),
    Case("prompt file that is a FIFO", _prompts_fifo, "error"),
    Case("generation_kwargs pad_token_id", _gen_kwargs(pad_token_id=0), "error"),
    Case("generation_kwargs stop_strings without a tokenizer", _stop_strings, "accept"),
    Case("generation_kwargs streamer=5", _gen_kwargs(streamer=5), "error"),
    Case("generation_kwargs output_scores", _gen_kwargs(output_scores=True), "error"),
    Case("generation_kwargs return_dict_in_generate", _gen_kwargs(return_dict_in_generate=True), "error"),
    Case("generation_kwargs generation_config as a string", _gen_kwargs(generation_config="greedy"), "error"),
    Case("generation_kwargs num_beams=2**20", _gen_kwargs(num_beams=2**20), "error"),
    Case("progress='no'", lambda ctx: _generate(ctx, progress="no"), "error"),
    Case("progress=None", lambda ctx: _generate(ctx, progress=None), "error"),
    Case("results='~/x.jsonl'", _tilde_results, "accept"),
    Case("NaN and inf scores", _nan_scores_with_references, "accept"),
    Case("results=/dev/full", _results_special("/dev/full"), "error"),
    Case("results=/dev/zero", _results_special("/dev/zero"), "error"),
    Case("results= a FIFO", _results_fifo, "error"),
    Case("max_memory {'cpu': 'lots'}", _load_plan({"cpu": "lots"}), "error"),
    Case("max_memory {0: -5}", _load_plan({0: -5}), "error"),
    Case("max_memory {'cuda:0': '10GiB'}", _load_plan({"cuda:0": "10GiB"}), "error"),
    Case("max_memory {0: 1.5e9}", _load_plan({0: 1.5e9}), "error"),
    Case("max_memory {True: '1GiB'}", _load_plan({True: "1GiB"}), "error"),
    Case("max_memory valid caps", _load_plan_valid, "accept"),
    Case("rank_ram(offloaded=-1)", _rank_ram_negative, "error"),
    Case("GPTQ bits 0", _gptq(bits=0), "error"),
    Case("GPTQ bits 5", _gptq(bits=5), "error"),
    Case("GPTQ group_size 0", _gptq(bits=4, group_size=0), "error"),
    Case("GPTQ bits '4bit'", _gptq(bits="4bit"), "error"),
    Case("GPTQ 3-bit per-channel", _gptq_valid, "accept"),
    Case("launch(num_processes=10**6)", _launch_many, "error"),
    Case("top_allocation_sites on a FIFO", _sites("fifo"), "error"),
    Case("top_allocation_sites on /dev/zero", _sites("/dev/zero"), "error"),
    Case("load_instructions on a FIFO", _instructions("fifo"), "error"),
    Case("load_instructions on /dev/zero", _instructions("/dev/zero"), "error"),
    Case("CLI explain on a FIFO", _cli_explain("fifo"), "error"),
    Case("CLI explain on /dev/zero", _cli_explain("/dev/zero"), "error"),
    Case("census of a 200,000-deep nested list", _census_deep, "accept"),
    Case("leak_checks of a 200,000-deep nested list", _leak_checks_deep, "accept"),
    Case("census of 20,000 small tensors", _census_many, "accept"),
    Case("leak_checks of 20,000 small tensors", _leak_checks_many, "accept"),
]


@pytest.fixture
def ctx(tmp_path, tiny, tiny_llama):
    return {"tmp": tmp_path, "tiny": tiny, "tiny_path": tiny_llama}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_input_gets_a_clear_error_or_is_accepted_right(case, ctx):
    outcome, detail = classify(case, ctx)
    assert outcome == ("clear" if case.expect == "error" else "accepted"), detail


if __name__ == "__main__":  # the counts by class: python tests/test_sweep_round4.py
    import tempfile

    from helpers.loading.loader import load

    tiny_path = REPO / "data" / "tiny" / "llama"  # built by the test fixtures (make test) or data/build_tiny_models.py
    model, tok, _ = load(str(tiny_path), load="fp32", check=False)
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES):
            if len(sys.argv) > 1 and i < int(sys.argv[1]):
                continue
            work = Path(tmp) / str(i)
            work.mkdir()
            outcome, detail = classify(case, {"tmp": work, "tiny": (model, tok), "tiny_path": tiny_path})
            counts[outcome] += 1
            print(
                f"{outcome:<14} {case.name}" + (f"  [{detail[:160]}]" if detail and outcome not in ("clear",) else "")
            )
    print(dict(counts), "of", len(CASES))
