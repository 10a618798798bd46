"""safe_generate on the tiny T5, Whisper (audio) and LLaVA (image + text): one record per prompt, the media's
hash in the recorded prompt, resume after an interruption, injected OOMs that lose or change nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.core.errors import EvalError
from helpers.evaluation.evaluate import safe_generate
from helpers.evaluation.inputs import MediaError
from helpers.evaluation.results_file import is_record
from helpers.loading.loader import load
from helpers.oom import batch_size as bs
from helpers.testing import simulated_budget
from helpers.training.family_data import load_processor

NEW = 4


def _prompts(name: str) -> list:
    from PIL import Image

    rng = np.random.default_rng(1)
    if name == "t5":
        return [f"translate: {w}" for w in ("hello", "a cat sat on the mat", "yes", "one two three four")]
    if name == "whisper":
        return [
            {"id": f"clip{n}", "audio": rng.standard_normal(n).astype("float32")} for n in (4000, 8000, 16000, 2000)
        ]
    pics = [Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")) for _ in range(4)]
    return [{"id": f"img{i}", "image": pic, "prompt": "what is it?" + " really" * i} for i, pic in enumerate(pics)]


@pytest.fixture(scope="module")
def family_models(tiny_t5, tiny_whisper, tiny_vlm):
    out = {}
    for name, path in (("t5", tiny_t5), ("whisper", tiny_whisper), ("llava", tiny_vlm)):
        model, _, _ = load(str(path), load="fp32", device_map=None)
        out[name] = (model, load_processor(str(path)))
    return out


def _run(model, proc, prompts, path, **kw):
    return safe_generate(model, proc, prompts, max_new_tokens=NEW, results=path, progress=False, **kw)


def _outputs(path) -> dict[str, str]:
    rows = [r for line in path.read_text().splitlines() if is_record(r := json.loads(line))]  # headers left out
    assert len({r["id"] for r in rows}) == len(rows), "a sample was written twice"
    return {r["id"]: r["output"] for r in rows}


@pytest.mark.parametrize("name", ["t5", "whisper", "llava"])
def test_every_prompt_once_and_a_resumed_run_continues_where_it_stopped(family_models, name, tmp_path):
    model, proc = family_models[name]
    bs.clear_cache()
    whole = _run(model, proc, _prompts(name), tmp_path / "whole.jsonl", batch_size=4)
    reference = _outputs(tmp_path / "whole.jsonl")
    assert whole.done == len(reference) == 4 and all(r["new_tokens"] >= 1 for r in whole.records)
    if name != "t5":
        kind = "audio" if name == "whisper" else "image"
        assert all(r["prompt"].startswith(f"[{kind} ") for r in whole.records)

    def stop(record):
        raise KeyboardInterrupt  # the runtime dies right after the first result is on disk

    path = tmp_path / "cut.jsonl"
    with pytest.raises(KeyboardInterrupt):
        _run(model, proc, _prompts(name), path, batch_size=1, on_result=stop)
    assert len(_outputs(path)) == 1
    again = _run(model, proc, _prompts(name), path, batch_size=1)
    assert again.skipped == 1 and again.done == 3
    assert _outputs(path) == reference  # the same outputs as the run that never stopped


@pytest.mark.parametrize("name", ["whisper", "llava"])
def test_injected_ooms_lose_or_change_no_result(family_models, name, tmp_path):
    model, proc = family_models[name]
    bs.clear_cache()
    _run(model, proc, _prompts(name), tmp_path / "ref.jsonl", batch_size=4)
    reference = _outputs(tmp_path / "ref.jsonl")
    ooms = 0
    for seed in range(4):
        bs.clear_cache()
        path = tmp_path / f"run{seed}.jsonl"
        # two prompts at a time fit (a Whisper prompt is its audio: no prompt tokens), plus random OOMs
        tokens = 2 * NEW if name == "whisper" else 2 * (40 + NEW)
        with simulated_budget(model, tokens=tokens, oom_rate=0.3, seed=seed) as budget:
            report = _run(model, proc, _prompts(name), path, batch_size=4)
        assert report.oom_retries == budget.ooms
        assert _outputs(path) == reference
        ooms += budget.ooms
    assert ooms >= 4


def test_another_clip_under_the_same_id_is_not_reused(family_models, tmp_path):
    model, proc = family_models["whisper"]
    prompts = _prompts("whisper")
    _run(model, proc, prompts, tmp_path / "r.jsonl")
    changed = [dict(prompts[0], audio=prompts[0]["audio"] * 0.5), *prompts[1:]]
    with pytest.raises(EvalError, match="another prompt text under the same id"):
        _run(model, proc, changed, tmp_path / "r.jsonl")


def test_media_prompts_without_the_processor_or_mixed_with_text_are_refused(family_models, tmp_path):
    model, proc = family_models["whisper"]
    with pytest.raises(MediaError, match="load_processor"):
        _run(model, proc.tokenizer, _prompts("whisper"), tmp_path / "a.jsonl")
    with pytest.raises(MediaError, match="separate runs"):
        _run(model, proc, [*_prompts("whisper")[:1], {"prompt": "text"}], tmp_path / "b.jsonl")
