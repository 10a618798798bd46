"""The OOM card on the CPU demo's OOM (issue 44 item 2): a real tiny model run past ``simulated_budget``.

That is the only card a CPU user ever sees, so it must read as a T4's: the knobs the notebook uses
(``helpers.core.knobs``) with a value to try, never "not a memory shortage ... NCCL timeout", and the
live tensors named as ``census()`` names them (the model's own weights, not "(unnamed)").
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from helpers.core.knobs import KNOBS
from helpers.oom.diagnosis import explain_oom
from helpers.oom.hook import install, uninstall
from helpers.testing import simulated_budget

BATCH, PROMPT, NEW = 8, 64, 32


@pytest.fixture(scope="module")
def model(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def _over_budget(model):
    """generate() for BATCH x (PROMPT + NEW) tokens under a budget of half that: a real OOM."""
    ids = torch.zeros(BATCH, PROMPT, dtype=torch.long)
    with simulated_budget(model, tokens=BATCH * (PROMPT + NEW) // 2):
        model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)


def _weight_names(model) -> set[str]:
    """The parameters as census() names a notebook's holder: ``model.model.layers[0].mlp.up_proj.weight``."""
    return {"model." + re.sub(r"\.(\d+)(?=\.)", r"[\1]", name) for name, _ in model.named_parameters()}


def test_the_card_names_the_notebooks_knobs_and_never_calls_it_a_corrupted_size(model):
    batch_name, tokens_name = KNOBS["batch_size"].names[0], KNOBS["max_new_tokens"].names[0]
    namespace = {"model": model, batch_name: BATCH, tokens_name: NEW}
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _over_budget(model)
    report = explain_oom(caught.value, namespace=namespace)
    text = str(report)
    assert report.cause == "steady_state" and "corrupted_size" not in report.causes
    assert "not a memory shortage" not in text and "NCCL" not in text
    assert report.fixes[0].startswith(f"This notebook: set {batch_name} = {BATCH // 2} (now {BATCH})")
    assert f"set {tokens_name} = {NEW // 2} (now {NEW})" in report.fixes[1]
    # the card says the figures are a T4's, simulated here (this machine's snapshot shows no GPU)
    assert report.notes[0].startswith("simulated for a T4 by helpers.simulated_budget (batch 8 x 96 tokens")
    html = report._repr_html_()
    assert "simulated for a T4" in html and f"{batch_name} = {BATCH // 2}" in html


def test_the_cards_live_tensors_are_the_models_weights_by_name(model):
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _over_budget(model)
    report = explain_oom(caught.value, namespace={"model": model})
    names = [name for name, _, _ in report.tensors]
    # the model's largest weights, named as census() does; an "(unnamed)" entry can only be another test's
    # leftover in this process (a second tiny model nothing in this namespace reaches)
    named = [n for n in names if n != "(unnamed)"]
    assert len(names) == 5 and set(named) <= _weight_names(model), names
    assert {"model.lm_head.weight", "model.model.embed_tokens.weight"} <= set(named), names
    biggest = max(p.numel() * p.element_size() for p in model.parameters())
    assert biggest in [nbytes for _, nbytes, _ in report.tensors]
    assert "model.lm_head.weight" in str(report) and "model.lm_head.weight" in report._repr_html_()


def test_a_local_of_the_failed_call_keeps_its_own_name():
    """The traceback's locals name what the namespace does not reach (the failed step's own tensors)."""
    namespace = {}

    def step():
        held = torch.ones(2 << 20)  # noqa: F841 - 8 MiB the frame pins, larger than any tiny-model weight
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")

    with pytest.raises(torch.OutOfMemoryError) as caught:
        step()
    report = explain_oom(caught.value, namespace=namespace)
    assert report.tensors[0][0] == "step().held" and report.tensors[0][1] == 8 << 20


def test_the_notebook_hook_shows_the_same_card_in_a_cell(model, ipython_shell, capsys):
    # a 32 MiB tensor the notebook names: larger than what other tests in this worker may leave alive, so the
    # card's largest live tensors include it (the model's weights are 512 KiB at most)
    kept = torch.ones(4096, 2048)
    ipython_shell.user_ns.update(model=model, BATCH_SIZE=BATCH, MAX_NEW_TOKENS=NEW, _over_budget=_over_budget,
                                 kept_activations=kept)  # fmt: skip
    assert install(ipython_shell)
    try:
        ipython_shell.run_cell("_over_budget(model)")
    finally:
        uninstall(ipython_shell)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert f"set BATCH_SIZE = {BATCH // 2} (now {BATCH})" in out and f"set MAX_NEW_TOKENS = {NEW // 2}" in out
    assert "NCCL" not in out and "not a memory shortage" not in out
    assert "Largest live tensors:" in out and "kept_activations" in out  # named from the notebook's namespace


def test_a_generate_oom_is_explained_as_a_kv_cache_not_an_optimizer(model):
    """A generate() call has no optimizer state or gradients: its steady state is the KV cache, and its fixes
    are the batch, the new tokens and the cache's kind, not gradient checkpointing or an 8-bit optimizer."""
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _over_budget(model)
    report = explain_oom(caught.value, namespace={})
    assert report.generating and report.explanation.startswith("generating: the weights, the KV cache")
    assert "optimizer" not in str(report) and "gradient checkpointing" not in str(report)
    assert any("kv_cache='int4'" in fix for fix in report.fixes)
    pasted = 'File ".../transformers/generation/utils.py", line 2412, in generate\n' + str(caught.value)
    assert explain_oom(pasted).generating  # a pasted traceback says so too
    training = explain_oom(str(caught.value).split(" (simulated")[0])  # the same figures, no generate in sight
    assert not training.generating and "gradient checkpointing" in str(training)


def test_the_html_card_shows_the_fixes_first_and_folds_the_figures(model):
    """Issue 44 item 8 on the card: what to do at a glance; the figures and the live tensors one click away."""
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _over_budget(model)
    html = explain_oom(caught.value, namespace={"model": model, "BATCH_SIZE": BATCH})._repr_html_()
    fold = html.index("<details>")
    assert "Cause</b>: generating" in html[:fold] and f"BATCH_SIZE = {BATCH // 2}" in html[:fold]
    assert html.index("<ol>") < fold < html.index("What the message says") < html.index("model.lm_head.weight")
    assert "the largest live tensors, memory now</summary>" in html
