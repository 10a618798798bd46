"""Full fine-tuning's model states have one answer: the estimator's rows. training_memory divides them as a
strategy shards them (the ZeRO paper's K is the estimator's optimizer + master-weight rows), and with fp32 master
weights the optimizer steps the fp32 copy, so its states are fp32."""

from __future__ import annotations

import pytest

from helpers.estimator.core import estimate
from helpers.estimator.training import FullTraining
from helpers.training.distributed import training_memory

MODEL = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


@pytest.mark.parametrize(("optimizer", "mixed", "k"), [("adamw", True, 12), ("adamw_8bit", True, 6), ("sgd", True, 4),
                                                      ("adamw", False, 8), ("sgd", False, 0)])  # fmt: skip
def test_training_memory_reads_the_estimators_state_rows(optimizer, mixed, k):
    mem = training_memory(MODEL, optimizer=optimizer, mixed_precision=mixed)
    psi = mem.params
    assert mem.state_bytes("optimizer") == k * psi
    assert mem.state_bytes("grads") == (2 if mixed else 4) * psi
    est = estimate(MODEL, load="bf16" if mixed else "fp32", training=FullTraining(
        optimizer={"adamw": "adamw_torch"}.get(optimizer, optimizer), master_weights=mixed))  # fmt: skip
    states = sum(r.bytes for r in est.rows if r.key in ("training.optimizer", "training.master_weights"))
    assert mem.state_bytes("optimizer") == states and mem.state_bytes("params") == est.weights
    four = training_memory(MODEL, strategy="zero2", world_size=4, optimizer=optimizer, mixed_precision=mixed)
    assert four.state_bytes("optimizer") == states // 4 and four.state_bytes("grads") == mem.state_bytes("grads") // 4


def test_master_weights_keep_adamw_states_in_fp32():
    plain = estimate(MODEL, load="bf16", training=FullTraining())
    mixed = estimate(MODEL, load="bf16", training=FullTraining(master_weights=True))
    assert plain.row("training.optimizer").bytes == 4 * plain.params  # two bf16 moments
    assert mixed.row("training.optimizer").bytes == 8 * mixed.params  # two fp32 moments of the fp32 copy
    assert mixed.row("training.master_weights").bytes == 4 * mixed.params
