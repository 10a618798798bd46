"""compare_loads: quality per load mode on a tiny Llama trained for a few seconds (random weights have no
quality to lose), and its bad-input errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers.loading.compare import LoadCompareError, LoadComparison, LoadQuality, compare_loads

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny" / "llama"
WORDS = "the cat sat on a mat and the dog ran to the park while birds sang in tall green trees".split()


def _corpus(n: int) -> list[str]:
    # repetitive, learnable text: each line a rotation of one sentence
    return [" ".join(WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)]) for i in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """data/tiny/llama's architecture trained from scratch on the corpus (~80 steps, a few seconds on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("trained_llama")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
    ids = torch.stack([tok(t, return_tensors="pt").input_ids[0, :24] for t in _corpus(64)])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(80):
        batch = ids[(step * 8) % 64 : (step * 8) % 64 + 8]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"trained {step + 1} steps: loss {loss.item():.3f}")
    model.save_pretrained(out)
    for f in TINY.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation")):
            shutil.copy(f, out / f.name)
    return out


def test_quantized_modes_lose_quality_in_order(trained):
    texts = _corpus(40)[17:23]
    result = compare_loads(str(trained), texts, loads=("fp32", "int8", "nf4"))
    assert [r.load for r in result.rows] == ["fp32", "int8", "nf4"] and not any(r.error for r in result.rows)
    ref, int8, nf4 = result.rows
    assert ref.perplexity < 3  # it learned the corpus: quantization has something to destroy
    assert ref.agreement == 1.0
    # what each quantization changed grows with it: KL from the reference 0 < int8 < nf4
    assert ref.kl == pytest.approx(0, abs=1e-6) and 0 < int8.kl < nf4.kl
    # the perplexity gap follows (int8 within noise of the reference, either sign: first-order)
    assert abs(result.gap("int8")) < 0.005 and result.gap("int8") <= result.gap("nf4")
    # argmax agreement: near-ties (the corpus' ambiguous next words) flip either way, so no order between modes
    assert min(int8.agreement, nf4.agreement) > 0.95
    assert ref.weight_bytes > int8.weight_bytes > nf4.weight_bytes  # memory beside quality
    assert all(r.tokens_per_s > 0 for r in result.rows)
    text = str(result)
    assert "reference" in text and "nf4" in text and f"{result.gap('nf4'):+.2%}" in text
    print(result)


def test_a_failed_mode_keeps_the_others_and_says_why():
    # "fp16" on CPU loads fine; a missing model fails every mode with the loader's reason, nothing raised
    result = compare_loads("/nonexistent/model", ["some text"], loads=("fp32", "nf4"))
    assert [r.load for r in result.rows] == ["fp32", "nf4"]
    assert all(r.error and "ModelNotFoundError" in r.error for r in result.rows)
    assert "failed" in str(result)


@pytest.mark.parametrize("texts", ["one string", [], ["ok", 3], ["ok", "  "]])
def test_bad_texts_get_one_clear_error(texts):
    with pytest.raises(LoadCompareError, match="texts"):
        compare_loads(str(TINY), texts)


def test_unknown_mode_is_refused_before_loading():
    with pytest.raises(LoadCompareError, match="4-bit is 'nf4'|nf4"):
        compare_loads(str(TINY), ["hello"], loads=("fp32", "int4"))


def test_html_escapes_outside_text():
    comp = LoadComparison(model="<script>x</script>", texts=1, tokens=3,
                          rows=[LoadQuality("fp32", perplexity=2.0, agreement=1.0, weight_bytes=10, tokens_per_s=5.0),
                                LoadQuality("nf4", error="RuntimeError: <b>boom</b>")])  # fmt: skip
    html = comp._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html and "<b>boom" not in html
    assert comp.gap("nf4") is None and "failed" in str(comp)
