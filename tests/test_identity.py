"""What makes a result and a score is in its identity (issue 48 item 5): whether the adapter is active,
the globals a function reads, the scorer's code and the reference it scored against."""

from __future__ import annotations

import pytest
import torch

from helpers.core.errors import EvalError
from helpers.evaluation.evaluate import safe_generate
from helpers.loading.fingerprint import adapters_disabled, describe, model_identity
from helpers.loading.loader import load
from helpers.testing import simulated_budget

NEW = 4
PROMPTS = ["memory item one", "memory memory item two", "item three"]
THRESHOLD = 0.5  # read by _reads_a_global below


@pytest.fixture(scope="module")
def lora(tiny_llama):
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(1)
    model, tok, _ = load(str(tiny_llama), load="fp32", check=False)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return peft_model, tok


def test_results_made_with_the_adapter_disabled_are_not_the_adapters(lora, tmp_path):
    """Before: the identity held the adapter's weights, not whether it ran: a before/after written to one
    file reported the base model twice."""
    model, tok = lora
    path = tmp_path / "r.jsonl"
    with model.disable_adapter():
        assert adapters_disabled(model)
        off = model_identity(model, tok)
        safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert not adapters_disabled(model) and model_identity(model, tok)["adapter"] != off["adapter"]
    assert "adapter disabled" in off["adapter"]
    with pytest.raises(EvalError, match="the adapter differs.*adapter disabled"):
        safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    with model.disable_adapter(), simulated_budget(model, tokens=10**9) as budget:  # the same again: reused
        again = safe_generate(model, tok, PROMPTS, max_new_tokens=NEW, results=path, progress=False)
    assert again.skipped == 3 and budget.calls == 0


def _reads_a_global(input_ids, scores):
    return scores * THRESHOLD


def test_a_functions_globals_are_part_of_its_fingerprint(monkeypatch):
    """Before: code, defaults and closure only: a logits processor reading a global changed by the user
    kept its fingerprint, and a resume reused results made with the old value."""
    before = describe(_reads_a_global)
    monkeypatch.setitem(globals(), "THRESHOLD", 0.9)
    after = describe(_reads_a_global)
    assert before != after and after["globals"]["THRESHOLD"] == 0.9
    assert "torch" not in after["globals"]  # modules are not values

    def recursive(n):  # reads itself through the globals of a module: counted by name, no endless descent
        return n

    assert describe(recursive)["globals"] == {}


def scorer_v1(output, reference):
    return 0.0


def scorer_v2(output, reference):  # the same name, other code: a fixed scorer
    return 1.0


scorer_v2.__name__ = scorer_v1.__name__ = "agree"


def test_scores_follow_the_reference_and_the_scorers_code_without_generating_again(lora, tmp_path):
    """Before: prompt_hash covered the prompt only and scored records were never rescored: a corrected
    reference, or a fixed scorer of the same name, kept the old scores."""
    model, tok = lora
    rows = [{"id": f"q{k}", "prompt": p, "reference": "no match"} for k, p in enumerate(PROMPTS)]
    path = tmp_path / "r.jsonl"
    first = safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False, score="exact_match")
    assert first.scores["exact_match"] == 0.0  # stored with each record
    rows[0]["reference"] = first.records[0]["output"]  # the reference corrected: that record is scored again
    with simulated_budget(model, tokens=10**9) as budget:
        fixed = safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False, score="exact_match")
    assert budget.calls == 0 and fixed.scores["exact_match"] == pytest.approx(1 / 3)
    assert fixed.records[0]["reference"] == rows[0]["reference"]

    path = tmp_path / "s.jsonl"
    v1 = safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False, score=scorer_v1)
    with simulated_budget(model, tokens=10**9) as budget:
        v2 = safe_generate(model, tok, rows, max_new_tokens=NEW, results=path, progress=False, score=scorer_v2)
    assert budget.calls == 0 and v1.scores["agree"] == 0.0 and v2.scores["agree"] == 1.0


def test_train_resuming_onto_other_base_weights_says_so(tiny_llama, tmp_path):
    """Before: train() compared the settings and the data, not the base weights: a model replaced at the
    same path resumed silently."""
    from helpers.training.adapters import prepare_qlora
    from helpers.training.checkpoints import CheckpointWarning
    from helpers.training.data import build_dataset, load_instructions
    from helpers.training.finetune import train
    from helpers.training.plan import TrainPlan

    def run(max_steps, nudge=0.0):
        plan = TrainPlan(str(tiny_llama), load="fp32", seq_len=64, batch_size=2, micro_batch=2, max_steps=max_steps,
                         save_steps=1, logging_steps=1, output_dir=str(tmp_path / "run"), r=4, alpha=8)  # fmt: skip
        model, tok, _ = load(plan.load_plan())
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.add_(nudge)  # the same path, other weights
        model, _ = prepare_qlora(model, plan)
        return train(model, tok, plan, build_dataset(tok, load_instructions()[:8], plan.seq_len), view=False)

    run(1)
    same = run(2)  # loaded again, the same weights (max_steps differs, and is said)
    assert same.resumed_from == 1 and not any("base weights" in c for c in same.changed)
    with pytest.warns(
        CheckpointWarning, match=r"the base weights \(fingerprint .* -> .*other weights at the same path"
    ):
        other = run(3, nudge=0.01)
    assert other.resumed_from == 2 and "base weights" in str(other)
