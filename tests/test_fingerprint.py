"""Issue 31 item 1: a resume never trusts results made by a changed model, adapter, load mode,
tokenizer or generation setting; the unchanged model resumes and skips."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers.core.errors import EvalError, FingerprintError
from helpers.evaluation.evaluate import prompt_hash, safe_generate
from helpers.evaluation.results_file import MADE, is_record
from helpers.loading.fingerprint import adapter_fingerprint, describe, model_identity, weights_fingerprint
from helpers.loading.loader import load, setup_tokenizer
from helpers.testing import simulated_budget

PROMPTS = ["memory item one", "memory memory item two", "item three"]
NEW = 2


def _run(model, tok, path, **kwargs):
    return safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False, **kwargs)


def _fresh(path) -> tuple:
    model, tok, _ = load(str(path), load="fp32", check=False)
    return model, tok


def _with_lora(model):
    """A LoRA adapter with trained-looking (non-zero) lora_B, as after fine-tuning."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return peft_model


@pytest.fixture(scope="module")
def base(tiny_llama):
    torch.set_num_threads(1)
    return _fresh(tiny_llama)


def test_the_unchanged_model_resumes_and_skips(base, tiny_llama, tmp_path):
    model, tok = base
    path = tmp_path / "r.jsonl"
    first = _run(model, tok, path)
    assert first.done == 3
    again_model, again_tok = _fresh(tiny_llama)  # loaded again: a new session, the same weights
    with simulated_budget(again_model, tokens=10**9) as budget:
        again = _run(again_model, again_tok, path)
    assert again.skipped == 3 and again.done == 0 and budget.calls == 0
    rec = json.loads(path.read_text().splitlines()[0])["model"]
    assert rec["identity"] == 2 and len(rec["weights"]) == 16 and rec["tokenizer"]["padding_side"] == "left"


def test_merged_adapter_is_refused(tiny_llama, tmp_path):
    model, tok = _fresh(tiny_llama)
    peft_model = _with_lora(model)
    path = tmp_path / "r.jsonl"
    _run(peft_model, tok, path)
    merged = peft_model.merge_and_unload()  # same _name_or_path, same load mode
    with pytest.raises(EvalError, match=r"the adapter differs.*the weights differ.*resume='force'"):
        _run(merged, tok, path)


def test_negated_lora_b_is_refused(tiny_llama, tmp_path):
    model, tok = _fresh(tiny_llama)
    peft_model = _with_lora(model)
    before = adapter_fingerprint(peft_model)
    path = tmp_path / "r.jsonl"
    _run(peft_model, tok, path)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.neg_()  # |sum| per tensor is unchanged: the old fingerprint did not see this
    assert adapter_fingerprint(peft_model) != before
    with pytest.raises(EvalError, match=r"3 of these prompt ids.*the adapter differs"):
        _run(peft_model, tok, path)


def test_weights_replaced_at_the_same_path_are_refused(tiny_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    model, tok = _fresh(folder)
    path = tmp_path / "r.jsonl"
    _run(model, tok, path)
    with torch.no_grad():  # another checkpoint saved over the first, e.g. a later training step
        model.model.layers[0].mlp.down_proj.weight.mul_(1.01)
    model.save_pretrained(folder)
    replaced, tok2 = _fresh(folder)
    assert replaced.config._name_or_path == model.config._name_or_path
    with pytest.raises(EvalError, match=r"the weights differ \(same name, other content"):
        _run(replaced, tok2, path)


def test_fp4_results_are_not_reused_by_nf4(tiny_llama, tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    def quantized(kind):
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config, device_map="cpu")
        tok = AutoTokenizer.from_pretrained(tiny_llama)
        setup_tokenizer(tok, model)
        return model, tok

    fp4, tok = quantized("fp4")
    nf4, _ = quantized("nf4")
    assert model_identity(fp4)["load"] == "fp4" and model_identity(nf4)["load"] == "nf4"
    path = tmp_path / "r.jsonl"
    _run(fp4, tok, path)
    with pytest.raises(EvalError, match=r"the load mode differs: 'fp4' \(this run: 'nf4'\)"):
        _run(nf4, tok, path)


def test_a_generation_config_change_is_refused(base, tmp_path):
    from transformers import GenerationConfig

    model, tok = base
    path = tmp_path / "r.jsonl"
    _run(model, tok, path, generation_kwargs={"generation_config": GenerationConfig(num_beams=1, do_sample=False)})
    with pytest.raises(EvalError, match=r"other settings: generation_config .*num_beams.*3"):
        _run(model, tok, path, generation_kwargs={"generation_config": GenerationConfig(num_beams=3, do_sample=False)})
    with monkeypatch_generation_config(model, num_beams=3):  # the model's own default config counts too
        with pytest.raises(EvalError, match=r"other settings: model.generation_config"):
            _run(
                model,
                tok,
                path,
                generation_kwargs={"generation_config": GenerationConfig(num_beams=1, do_sample=False)},
            )


class monkeypatch_generation_config:  # noqa: N801 - used as a context manager
    def __init__(self, model, **changes):
        self.config, self.changes = model.generation_config, changes
        self.before = {k: getattr(self.config, k) for k in changes}

    def __enter__(self):
        for k, v in self.changes.items():
            setattr(self.config, k, v)

    def __exit__(self, *exc):
        for k, v in self.before.items():
            setattr(self.config, k, v)


def test_logits_processors_are_fingerprinted_by_content(base, tmp_path):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Bias(LogitsProcessor):
        def __init__(self, token, amount):
            self.token, self.amount = token, amount

        def __call__(self, input_ids, scores):
            scores[:, self.token] += self.amount
            return scores

    model, tok = base
    path = tmp_path / "r.jsonl"
    _run(model, tok, path, generation_kwargs={"logits_processor": LogitsProcessorList([Bias(5, 1.0)])})
    with pytest.raises(EvalError, match=r"other settings: logits_processor"):
        _run(model, tok, path, generation_kwargs={"logits_processor": LogitsProcessorList([Bias(5, 9.0)])})
    again = _run(model, tok, path, generation_kwargs={"logits_processor": LogitsProcessorList([Bias(5, 1.0)])})
    assert again.skipped == 3


def test_an_object_that_cannot_be_fingerprinted_is_refused_with_the_fix(base, tmp_path):
    model, tok = base
    with pytest.raises(FingerprintError, match=r"generation_kwargs\['logits_processor'\]\[0\].*oomkit_fingerprint"):
        _run(model, tok, tmp_path / "r.jsonl", generation_kwargs={"logits_processor": [object()]})
    assert not (tmp_path / "r.jsonl").exists() or not (tmp_path / "r.jsonl").read_text()

    class Named:
        __slots__ = ()

        def oomkit_fingerprint(self):
            return "v1"

    assert describe(Named())["fingerprint"] == "v1"


def test_a_changed_tokenizer_padding_side_is_refused(base, tmp_path):
    model, tok = base
    path = tmp_path / "r.jsonl"
    _run(model, tok, path)
    tok.padding_side = "right"
    try:
        with pytest.raises(EvalError, match=r"tokenizer padding_side 'left' \(this run: 'right'\)"):
            _run(model, tok, path)
    finally:
        tok.padding_side = "left"


def _old_format(path) -> list[dict]:
    """The records of a results file as oomkit wrote them before header lines: settings and model in each."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    made = {r[MADE]: r for r in lines if MADE in r}
    rows = [r for r in lines if is_record(r)]
    for r in rows:
        header = made[r.pop("made")]
        r.update(settings=header["settings"], model=header["model"], prompt_hash=prompt_hash(r["prompt"]))
    return rows


def test_results_files_of_the_format_before_headers_still_resume(base, tmp_path):
    """Each record held its own copy of the settings and model (about 1 KB): such a file resumes as it is,
    and the records this run adds are compact, after one header."""
    model, tok = base
    path = tmp_path / "r.jsonl"
    _run(model, tok, path)
    rows = _old_format(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    with simulated_budget(model, tokens=10**9) as budget:
        again = _run(model, tok, path)
    assert again.skipped == 2 and again.done == 1 and budget.calls > 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [MADE in r for r in lines] == [False, False, True, False]  # old, old, the header, the new record
    assert "settings" not in lines[3] and lines[3]["made"] == lines[2][MADE]
    assert {r["id"] for r in again.records} == {r["id"] for r in rows}


def test_old_records_without_a_weights_fingerprint_are_refused_clearly(base, tmp_path):
    model, tok = base
    path = tmp_path / "r.jsonl"
    _run(model, tok, path)
    rows = _old_format(path)
    for r in rows:  # what oomkit wrote before issue 31
        r["model"] = {"name": r["model"]["name"], "load": "fp32", "adapter": None}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(EvalError, match=r"older oomkit.*cannot be checked.*results= a new file.*resume='force'"):
        _run(model, tok, path)
    with pytest.warns(UserWarning, match="older oomkit"):
        forced = _run(model, tok, path, resume="force")
    assert forced.skipped == 3


def test_offloaded_and_meta_weights_count_without_being_read():
    layer = torch.nn.Linear(4, 4)
    real = weights_fingerprint(layer)
    with torch.device("meta"):
        empty = torch.nn.Linear(4, 4)
    assert weights_fingerprint(empty).endswith("+meta2") and weights_fingerprint(empty) != real

    class Hook:  # accelerate's offload hook: the weights live in its weights_map
        weights_map = dict(layer.state_dict())

    empty._hf_hook = Hook()
    assert weights_fingerprint(empty) == real


def test_the_sample_sees_a_change_anywhere_in_a_big_tensor_it_reads():
    big = torch.nn.Linear(4096, 1024, bias=False)
    before = weights_fingerprint(big)
    with torch.no_grad():
        big.weight.mul_(-1)
    assert weights_fingerprint(big) != before


def test_a_7b_sized_tensor_is_sampled_within_its_bounds():
    """11008 x 4096 (a 7B's MLP matrix): float sample positions rounded past its end (IndexError)."""
    big = torch.nn.Module()
    big.weight = torch.nn.Parameter(torch.zeros(11008 * 4096, dtype=torch.uint8), requires_grad=False)
    before = weights_fingerprint(big)
    big.weight.data[-1] = 1  # the last element is in the sample
    assert weights_fingerprint(big) != before


def test_fingerprint_reads_a_fixed_sample_per_tensor(monkeypatch):
    """The sample is fixed-size: a big tensor costs what a small one does (the 7B claim rests on this).
    Counted in bytes read, not timed: a busy machine cannot fail it (bench/hot_spots.py times it)."""
    import helpers.loading.fingerprint as fp

    read: list[int] = []
    sample = fp._sample
    monkeypatch.setattr(
        fp, "_sample", lambda t, whole, count: read.append(sample(t, whole, count).numel()) or sample(t, whole, count)
    )
    for side in (4096, 1024):
        read.clear()
        weights_fingerprint(torch.nn.ModuleList([torch.nn.Linear(side, side, bias=False) for _ in range(4)]))
        assert read == [fp.SAMPLE * 4] * 4  # 1024 fp32 elements of each 16M- (or 1M-) element matrix
    read.clear()
    weights_fingerprint(torch.nn.Linear(16, 16, bias=False))  # at most SAMPLE elements: read whole
    assert read == [16 * 16 * 4]
