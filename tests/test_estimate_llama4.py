"""Llama-4-Scout's config as published ships (issue 47 item 2): estimate() counts its 109 B parameters, of which
about 17 B are active per token (one of 16 routed experts per layer, the shared expert, attention, embeddings)."""

from __future__ import annotations

from helpers.estimator.configs import resolve_config
from helpers.estimator.core import estimate
from helpers.estimator.layout import layout

SCOUT = "meta-llama/Llama-4-Scout-17B-16E-Instruct"


def test_llama4_scout_counts_109b_parameters_17b_active():
    est = estimate(SCOUT, load="bf16")
    assert est.params == 108_641_793_536  # "109B" on its model card
    assert est.weights == 2 * est.params + est.row("weights.buffers").bytes
    config = resolve_config(SCOUT)[0]
    text = config.get_text_config()
    lay = layout(config)
    experts = sum(e.numel for e in lay.entries if ".experts." in e.name)
    vision = sum(e.numel for e in lay.entries if e.name.split(".")[0] in ("vision_model", "multi_modal_projector"))
    assert 0 < vision < 1e9 and experts > 0.85 * est.params  # the 16 routed experts hold most of the weights
    unused = experts * (text.num_local_experts - text.num_experts_per_tok) // text.num_local_experts
    active = est.params - vision - unused
    assert 16.5e9 < active < 17.5e9, active
