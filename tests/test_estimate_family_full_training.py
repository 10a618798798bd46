"""Full fine-tuning of the families beyond decoder-only LMs (T5, Whisper, LLaVA): every parameter trains, so both
stacks keep their activations, Whisper's audio encoder and a VLM's vision tower too, and every linear keeps its
input. The estimate's activation rows against the live tensors a real step allocates on CPU (fp32, the tracker of
bench/estimate_accuracy.py), checkpointing on and off, two shapes each; a real AdamW step's peak against the
whole estimate; and the Whisper source document's setup, which the decoder-only formulas called a fit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers.core.vocab import DOES_NOT_FIT
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card
from helpers.estimator.training import FullTraining

BENCH = Path(__file__).resolve().parents[1] / "bench" / "estimate_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("oomkit_estimate_accuracy_full", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(path, ckpt: bool):
    from transformers import AutoConfig

    from helpers.estimator.families import auto_class

    model = auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)
    if ckpt:
        model.gradient_checkpointing_enable()
    return model.train()


def _activations(bench, model, inputs: dict) -> int:
    """Peak bytes of the tensors one forward + backward allocates once the gradients exist (the estimate's
    gradients row counts them)."""
    model(**inputs).loss.backward()
    model.zero_grad(set_to_none=False)
    tracker = bench.PeakTracker(model)
    tracker.known |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    with tracker:
        model(**inputs).loss.backward()
    return tracker.peak


def _estimate(path, ckpt: bool, batch: int, tokens: int, family: dict):
    tr = FullTraining(optimizer="adamw_torch", gradient_checkpointing=ckpt, seq_len=tokens, micro_batch=batch)
    return estimate(str(path), load="fp32", device="cpu", training=tr, **family)


@pytest.mark.parametrize("ckpt", [True, False])
@pytest.mark.parametrize("name", ["t5", "whisper", "llava"])
def test_full_fine_tuning_activations_within_15_percent(bench, tiny_t5, tiny_whisper, tiny_vlm, name, ckpt):
    path = {"t5": tiny_t5, "whisper": tiny_whisper, "llava": tiny_vlm}[name]
    model = _model(path, ckpt)
    for batch, tokens, extra in bench.FULL_FT_CASES[name]:
        inputs, family = bench.family_step_inputs(name, model, batch, tokens, extra)
        measured = _activations(bench, model, inputs)
        est = _estimate(path, ckpt, batch, tokens, family)
        predicted = est.group_bytes("activations")
        assert abs(predicted - measured) <= 0.15 * measured, (name, ckpt, batch, tokens, predicted, measured)
        assert not any("lower bound" in w for w in est.warnings)


@pytest.mark.parametrize("name", ["whisper", "llava"])
def test_the_frozen_parts_train_in_full_fine_tuning(tiny_whisper, tiny_vlm, name):
    """LoRA leaves Whisper's audio encoder and the vision tower frozen (a transient pass, no graph); full
    fine-tuning trains them, so their activations stay for backward."""
    from helpers.estimator.training import LoraTraining

    path, family = (tiny_whisper, {"audio_seconds": 2}) if name == "whisper" else (tiny_vlm, {"images": 1})
    full = _estimate(path, False, 2, 64, family)
    lora = estimate(str(path), load="fp32", device="cpu", training=LoraTraining(gradient_checkpointing=False,
                    seq_len=64, micro_batch=2, optimizer="adamw_torch"), **family)  # fmt: skip
    if name == "whisper":
        assert "activations.encoder" in {r.key for r in lora.rows} and "activations.encoder" not in {
            r.key for r in full.rows
        }
        assert "2 encoder and 2 decoder layers" in full.row("activations.saved").note
        assert "0 encoder and 2 decoder layers" in lora.row("activations.saved").note
        assert full.group_bytes("activations") > lora.group_bytes("activations")
    else:  # (LoRA's adapters keep more per token than the tiny LM's own layers: no order between the totals)
        assert full.row("activations.vision").name == "vision tower and projector (trained)"
        assert lora.row("activations.vision").name == "frozen vision tower's pass (no graph)"


@pytest.mark.parametrize("ckpt", [True, False])
def test_a_real_adamw_step_peaks_under_the_whole_estimate(bench, tiny_t5, tiny_whisper, tiny_vlm, ckpt):
    """Weights + the peak of every live tensor over two AdamW steps (gradients, states, activations) never exceed
    the estimate without its allocator rows, and stay within a quarter of it (the estimate adds the gradients to
    the loss's peak; torch frees them between steps)."""
    for name, path in (("t5", tiny_t5), ("whisper", tiny_whisper), ("llava", tiny_vlm)):
        model = _model(path, ckpt)
        batch, tokens, extra = bench.FULL_FT_CASES[name][0]
        inputs, family = bench.family_step_inputs(name, model, batch, tokens, extra)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        base = bench.footprint(model)
        with bench.PeakTracker(model) as pt:
            for _ in range(2):
                model(**inputs).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        est = _estimate(path, ckpt, batch, tokens, family)
        predicted = sum(r.bytes for r in est.rows if r.group != "overhead")
        assert base + pt.peak <= predicted <= 1.25 * (base + pt.peak), (name, ckpt, predicted, base + pt.peak)


def _whisper_large_v2():
    from transformers import WhisperConfig

    return WhisperConfig(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                         decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, vocab_size=51865,
                         num_mel_bins=80, max_source_positions=1500, max_target_positions=448)  # fmt: skip


def test_the_whisper_source_documents_run_no_longer_fits_an_a100_40():
    """fp32 AdamW, batch 4, no checkpointing, Whisper-large-v2 on an A100-40: the run died; the decoder-only
    formulas said "FITS 27.03 GiB, headroom 12.53 GiB" (the encoder's activations over 1500 positions unseen)."""
    tr = FullTraining(optimizer="adamw_torch", gradient_checkpointing=False, micro_batch=4, seq_len=448)
    est = estimate(_whisper_large_v2(), load="fp32", device="a100-40", training=tr)
    verdict = fit_one_card(est, "a100-40", suggest=False)
    assert verdict.verdict == DOES_NOT_FIT and verdict.headroom < 0
    # the 32 trained encoder layers over 4 x 1500 positions dwarf the decoder's 4 x 448 tokens
    assert est.row("activations.saved").bytes > 15 * 2**30
    assert "32 encoder and 32 decoder layers" in est.row("activations.saved").note
    # checkpointing keeps one hidden state per layer of both stacks: it fits then
    ckpt = estimate(
        _whisper_large_v2(), load="fp32", device="a100-40", training=FullTraining(micro_batch=4, seq_len=448)
    )
    assert fit_one_card(ckpt, "a100-40", suggest=False).verdict != DOES_NOT_FIT


def test_a_lower_bound_row_never_fits_with_headroom(tiny_vlm):
    """A trained vision tower whose config gives no depth is counted by its projector alone: a lower bound. The
    verdict then says "at least" and is tight at best, however much room the total leaves."""
    from helpers.core.vocab import FITS, TIGHT
    from helpers.estimator.configs import resolve_config

    config = resolve_config(str(tiny_vlm))[0]
    tr = FullTraining(seq_len=64, micro_batch=2)
    known = estimate(config, load="fp32", device="cpu", training=tr)
    assert not known.lower_bounds and fit_one_card(known, 2**40, suggest=False).verdict == FITS
    config.vision_config.num_hidden_layers = 0
    est = estimate(config, load="fp32", device="cpu", training=tr)
    assert [r.key for r in est.lower_bounds] == ["activations.vision"]
    verdict = fit_one_card(est, 2**40, suggest=False)
    assert verdict.verdict == TIGHT and verdict.note.startswith("at least ") and "lower bound" in verdict.note
    assert "at least" in str(verdict)
