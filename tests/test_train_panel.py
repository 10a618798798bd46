"""The training panel (notebook 02's controls), driven headless, and the micro-batch it hands to the search."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.estimator.fitting import fit_one_card as fit
from helpers.panels.train_panel import TrainPanel, divisors
from helpers.training.finetune import find_micro_batch
from helpers.training.plan import FinetuneError, TrainPlan

SEVEN_B = "codellama/CodeLlama-7b-hf"  # shipped config: offline, arithmetic only


@pytest.fixture
def panel(tmp_path):
    plan = TrainPlan(SEVEN_B, seq_len=256, batch_size=16, output_dir=str(tmp_path / "run"))
    return TrainPanel(plan, device="t4", widgets=True)


def test_widgets_drive_the_plan_and_its_estimate(panel):
    assert panel.plan.micro_batch is None  # none in the plan: "auto", find_micro_batch decides (margin kept)
    options = [value for _, value in panel.controls["micro_batch"].options]
    assert options == ["auto", 1, 2, 4, 8, 16]  # auto, then exact accumulation only
    shown = panel.controls["micro_batch"]
    assert (shown.index, shown.label) == (0, "auto (measure)")  # a None value showed the dropdown blank
    assert panel.state.verdict == "fits"
    # moving the controls as a user does: the plan and the estimate follow, and the bar redraws
    panel.controls["micro_batch"].value = 16
    panel.controls["load"].value = "fp16"
    assert panel.plan.load == "fp16" and panel.state.verdict == "does not fit"
    assert panel.controls["double_quant"].disabled  # means nothing for fp16
    assert "DOES NOT FIT" in panel.controls["verdict"].value and "Top fix" in panel.controls["verdict"].value
    want = TrainPlan(SEVEN_B, load="fp16", seq_len=256, batch_size=16, micro_batch=16).estimate("t4")
    assert panel.state.estimate.total == want.total
    assert panel.state.suggestion.change == fit(want, "t4").suggestions[0].change

    panel.controls["load"].value = "nf4"
    panel.controls["seq_len"].value = 1024
    panel.controls["micro_batch"].value = 4
    plan = panel.plan
    assert (plan.load, plan.seq_len, plan.micro_batch, plan.gradient_accumulation) == ("nf4", 1024, 4, 4)
    assert plan.output_dir.endswith("run") and plan.batch_size == 16 and plan.r == 16  # the rest is kept
    segments = dict(panel.state.segments())
    assert set(segments) == {"weights", "training state", "activations", "overheads"}
    assert sum(segments.values()) == panel.state.estimate.total  # every byte in one segment


def test_checkpointing_off_is_shown_with_its_fix(panel):
    state = panel.set(gradient_checkpointing=False, seq_len=2048, micro_batch=16)
    # no single change fits, so the top fix joins them, the largest saving first (micro-batch 1 since
    # checkpointed layer inputs are counted in fp32, as the QLoRA upcast keeps them)
    change = state.suggestion.change
    assert state.verdict == "does not fit" and " + " in change and "gradient_checkpointing=True" in change
    assert "not enough alone" not in state.verdict_text()
    assert "training state" in str(panel) and "checkpointing off" in str(panel)


def test_set_validates_before_changing_anything(panel):
    with pytest.raises(FinetuneError, match="does not divide"):
        panel.set(micro_batch=3)
    with pytest.raises(TypeError, match="unknown panel value"):
        panel.set(max_new_tokens=64)
    assert panel.plan.micro_batch is None
    panel.set(micro_batch=4)
    panel.set(micro_batch=None)  # back to "auto (measure)", shown as such
    assert panel.plan.micro_batch is None and panel.controls["micro_batch"].label == "auto (measure)"


def test_a_model_name_instead_of_a_plan_is_a_clear_error():
    with pytest.raises(TypeError, match=r"TrainPanel takes a TrainPlan, got str .*e\.g\. TrainPanel\(TrainPlan\("):
        TrainPanel(SEVEN_B)


def test_divisors():
    assert divisors(12) == (1, 2, 3, 4, 6, 12) and divisors(1) == (1,)


class BudgetedModel(torch.nn.Module):
    """A model whose training step runs out of memory above ``budget`` examples (a real OutOfMemoryError)."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget, self.sizes = budget, []
        self.emb = torch.nn.Embedding(32, 4)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, labels):
        self.sizes.append(input_ids.shape[0])
        if input_ids.shape[0] > self.budget:
            raise torch.OutOfMemoryError(f"simulated: {input_ids.shape[0]} examples > budget {self.budget}")
        return SimpleNamespace(loss=self.emb(input_ids).float().pow(2).mean())


@pytest.mark.parametrize(
    ("budget", "chosen", "expected"),
    [
        (16, 4, 4),  # the choice runs: kept whole, nothing larger tried
        (16, None, 16),  # no choice: the effective batch runs, kept whole (it was 8: the margin with no OOM)
        (12, None, 8),  # no choice, 13 runs out of memory: the margin (12 -> 10 -> divisor 8)
        (2, 8, 1),  # the choice does not run: 2 did, and the margin leaves floor(2 x 0.9) = 1
    ],
)
def test_find_micro_batch_tries_at_most_the_chosen_micro_batch(tmp_path, budget, chosen, expected):
    model = BudgetedModel(budget)
    plan = TrainPlan(
        f"budget-{budget}-{chosen}", seq_len=8, batch_size=16, micro_batch=chosen, output_dir=str(tmp_path)
    )
    mb = find_micro_batch(model, plan)
    assert mb.micro_batch == expected and mb.micro_batch * mb.gradient_accumulation == 16
    assert max(model.sizes) <= (chosen or 16)
    assert ("no margin" in str(mb)) == (budget >= (chosen or 16))  # the report says why


def test_a_larger_choice_after_a_smaller_one_is_searched_again(tmp_path):
    """The search cache is keyed by the limit too: a search stopped at a chosen 4 does not cap a later 16
    (it did: the second search tried [1, 2, 3, 4, 4] and gave 2)."""
    model = BudgetedModel(16)
    plan = TrainPlan("budget-again", seq_len=8, batch_size=16, micro_batch=4, output_dir=str(tmp_path))
    assert find_micro_batch(model, plan).micro_batch == 4
    model.sizes.clear()
    assert find_micro_batch(model, plan.replace(micro_batch=16)).micro_batch == 16 and max(model.sizes) == 16


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"targets": ["q_proj"]}, {"targets": "all-linear"}),
        ({"dropout": 0.0}, {"dropout": 0.1}),
        ({"precision": "fp32"}, {"precision": "fp16"}),
    ],
)
def test_targets_dropout_and_precision_have_their_own_micro_batch_search(tmp_path, first, second):
    """Each changes a step's memory: a search for one setting must not answer for another (they shared
    the cache key, so a second search started at the first's 4, trusted its OOM at 5 and gave 2)."""
    plan = TrainPlan("budget-key", seq_len=8, batch_size=16, output_dir=str(tmp_path))
    assert find_micro_batch(BudgetedModel(4), plan.replace(**first)).micro_batch == 2
    model = BudgetedModel(16)
    assert find_micro_batch(model, plan.replace(**second)).micro_batch == 16 and max(model.sizes) == 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this runtime may train as the target does")
def test_summary_says_how_the_target_trains_when_this_runtime_differs(panel):
    """The plan's text names this runtime's optimizer and precision (adamw_torch, fp32 on a CPU); the
    estimate is for the T4's (paged 8-bit AdamW, fp16): the summary says so instead of leaving both."""
    text = str(panel)
    assert "adamw_torch, fp32" in text
    assert "estimated as it trains on t4: paged_adamw_8bit, fp16" in text


# -- memory reducers: the loss and activation offload are controls like the others ------------------

LLAMA3 = "meta-llama/Llama-3.1-8B"  # shipped config, 128k vocabulary: the loss's buffers are a large part of a step


def _changed_rows(a, b) -> set[str]:
    """Keys of the GPU rows whose bytes differ between estimates ``a`` and ``b``."""
    before, after = {r.key: r.bytes for r in a.rows}, {r.key: r.bytes for r in b.rows}
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def test_chunked_loss_lowers_the_estimate_by_the_loss_rows_and_flips_the_verdict():
    plan = TrainPlan(LLAMA3, seq_len=2048, batch_size=16, micro_batch=2)
    panel = TrainPanel(plan, device="t4", widgets=True)
    c = panel.controls
    assert c["loss"].description == "Loss" and [v for _, v in c["loss"].options] == ["plain", "chunked", "fused"]
    before = panel.state
    assert before.verdict == "does not fit" and panel.plan.loss == "plain"
    c["loss"].value = "chunked"
    after = panel.state
    assert panel.plan.loss == "chunked" and after.verdict == "fits"
    assert "data-verdict='fits'" in c["verdict"].value
    plain, chunked = plan.estimate("t4"), plan.replace(loss="chunked").estimate("t4")
    assert (before.estimate.total, after.estimate.total) == (plain.total, chunked.total)
    # only the loss's peak (and the fragmentation counted on it) moved: the saving is the loss row's
    assert _changed_rows(plain, chunked) == {"activations.backward_peak", "overhead.fragmentation"}
    saved = plain.row("activations.backward_peak").bytes - chunked.row("activations.backward_peak").bytes
    frag = plain.row("overhead.fragmentation").bytes - chunked.row("overhead.fragmentation").bytes
    assert saved > 4 * 2**30 and plain.total - chunked.total == saved + frag


def test_offload_activations_moves_the_saved_activations_to_ram():
    plan = TrainPlan(SEVEN_B, seq_len=1024, batch_size=16, micro_batch=1, gradient_checkpointing=False)
    panel = TrainPanel(plan, device="t4", widgets=True)
    c = panel.controls
    assert c["offload_activations"].description == "Offload activations" and c["offload_activations"].value is False
    before = panel.state
    assert before.verdict == "does not fit"
    c["offload_activations"].value = True
    after = panel.state
    assert panel.plan.offload_activations is True and after.verdict == "fits"
    want = plan.replace(offload_activations=True).estimate("t4")
    assert after.estimate.total == want.total and want.host_total > 0
    saved = before.estimate.row("activations.saved").bytes - want.row("activations.saved").bytes
    assert before.estimate.total - after.estimate.total >= saved > 0  # + the fragmentation counted on them
    assert sum(dict(after.segments()).values()) == after.estimate.total  # host RAM is not in the GPU bar
    assert "offloaded: +" in c["notes"].value and "host RAM" in str(panel)  # where they went, and its cost


def test_panel_plan_carries_the_reducers_and_set_validates_them(panel):
    panel.set(loss="chunked", offload_activations=True)
    assert (panel.plan.loss, panel.plan.offload_activations) == ("chunked", True)
    assert (panel.controls["loss"].value, panel.controls["offload_activations"].value) == ("chunked", True)
    with pytest.raises(FinetuneError, match="unknown loss"):
        panel.set(loss="sparse")
    assert panel.plan.loss == "chunked"
    start = TrainPanel(TrainPlan(SEVEN_B, loss="chunked", offload_activations=True), widgets=False)
    assert start.values["loss"] == "chunked" and start.values["offload_activations"] is True


@pytest.mark.parametrize("installed", [False, True])
def test_fused_loss_says_why_it_cannot_run_here(monkeypatch, installed):
    import helpers.core.reducers as reducers

    monkeypatch.setattr(reducers, "liger_available", lambda: installed)
    panel = TrainPanel(TrainPlan(LLAMA3, seq_len=2048, batch_size=16, micro_batch=2), device="t4", widgets=True)
    labels = dict((v, label) for label, v in panel.controls["loss"].options)
    assert labels["fused"] == ("fused" if installed else "fused (not here)") and labels["chunked"] == "chunked"
    panel.controls["loss"].value = "fused"  # still estimated: the plan may be for another machine
    assert panel.plan.loss == "fused" and panel.state.verdict == "fits"
    notes = panel.controls["notes"].value
    assert ("pip install liger-kernel" in notes) is not installed
    assert ("loss=&#x27;fused&#x27; needs liger-kernel" in notes) is not installed  # escaped
    assert ("needs liger-kernel" in str(panel)) is not installed


def test_reducers_table_prices_each_loss_and_offload_for_the_current_plan():
    plan = TrainPlan(SEVEN_B, seq_len=2048, batch_size=16, micro_batch=1, gradient_checkpointing=False)
    table = TrainPanel(plan, device="t4", widgets=False).reducers()
    rows = {change: est for change, est, _ in table.rows}
    assert rows["loss=chunked"].total == plan.replace(loss="chunked").estimate("t4").total < rows["loss=plain"].total
    assert rows["offload_activations=True"].host_total > 0 and rows["loss=plain"].host_total == 0
    cells = {c[0]: c for c in table.cells()}
    assert cells["loss=plain"][3] == "does not fit" and cells["offload_activations=True"][3] == "fits"
    assert "host RAM" in cells["offload_activations=True"][4] and "loss=chunked" in str(table)
    assert "<table" in table._repr_html_() and "&#x27;" not in table._repr_html_().split("<table")[0]
