"""The activations of a LoRA step on the families beyond decoder-only LMs (T5, Whisper, LLaVA), against the live
tensors a real step allocates on CPU (fp32, the tracker of bench/estimate_accuracy.py): the model set up as
``prepare_qlora`` sets it up (frozen audio encoder and vision tower, adapters everywhere else), gradient
checkpointing on and off, two shapes each."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers.estimator.core import estimate
from helpers.estimator.training import LoraTraining

BENCH = Path(__file__).resolve().parents[1] / "bench" / "estimate_accuracy.py"


def _tracker():
    spec = importlib.util.spec_from_file_location("oomkit_estimate_accuracy", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PeakTracker


def _lora_model(path, ckpt: bool, tmp_path):
    from helpers.loading.loader import load
    from helpers.training.adapters import prepare_qlora
    from helpers.training.plan import TrainPlan

    plan = TrainPlan(str(path), load="fp32", gradient_checkpointing=ckpt, output_dir=str(tmp_path))
    model, _, _ = load(plan.load_plan(), device_map=None)
    model, _ = prepare_qlora(model, plan)
    model.train()
    return model


def _measured(model, inputs: dict) -> int:
    """Peak bytes of the tensors one forward + backward allocates, the adapters' gradients aside (they
    exist from a first step on, as in training; the estimate's gradients row counts them)."""
    model(**inputs).loss.backward()
    model.zero_grad(set_to_none=False)
    tracker = _tracker()(model)
    tracker.known |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    with tracker:
        model(**inputs).loss.backward()
    return tracker.peak


def _predicted(path, batch: int, seq: int, ckpt: bool, **family) -> int:
    training = LoraTraining(optimizer="adamw_torch", gradient_checkpointing=ckpt, seq_len=seq, micro_batch=batch)
    est = estimate(str(path), load="fp32", device="cpu", training=training, **family)
    assert not any("decoder-only formulas" in w for w in est.warnings)
    return est.group_bytes("activations")


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(10, 1000, (batch, seq))


@pytest.mark.parametrize("ckpt", [True, False])
def test_t5_step_keeps_both_stacks_and_the_cross_attention(tiny_t5, tmp_path, ckpt):
    model = _lora_model(tiny_t5, ckpt, tmp_path)
    for batch, enc, labels in [(2, 128, 32), (4, 64, 64)]:
        torch.manual_seed(0)
        ids = _ids(batch, enc)
        measured = _measured(
            model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(batch, labels)}
        )
        predicted = _predicted(tiny_t5, batch, labels, ckpt, encoder_tokens=enc)
        assert abs(predicted - measured) <= 0.15 * measured, (batch, enc, labels, predicted, measured)


@pytest.mark.parametrize("ckpt", [True, False])
def test_whisper_step_keeps_the_decoder_over_the_encoders_positions(tiny_whisper, tmp_path, ckpt):
    model = _lora_model(tiny_whisper, ckpt, tmp_path)
    frames = 2 * model.config.max_source_positions
    for batch, labels in [(2, 32), (4, 96)]:
        torch.manual_seed(0)
        inputs = {
            "input_features": torch.randn(batch, model.config.num_mel_bins, frames),
            "labels": _ids(batch, labels),
        }
        measured = _measured(model, inputs)
        predicted = _predicted(tiny_whisper, batch, labels, ckpt, audio_seconds=1.5)
        assert abs(predicted - measured) <= 0.15 * measured, (batch, labels, predicted, measured)


@pytest.mark.parametrize("ckpt", [True, False])
def test_vlm_step_counts_the_image_tokens_inside_seq_len(tiny_vlm, tmp_path, ckpt):
    model = _lora_model(tiny_vlm, ckpt, tmp_path)
    for batch, seq, images in [(2, 64, 1), (4, 96, 2)]:
        torch.manual_seed(0)
        ids = _ids(batch, seq)
        ids[:, 1 : 1 + 16 * images] = model.config.image_token_id
        labels = ids.clone()
        labels[:, : 1 + 16 * images] = -100
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                  "pixel_values": torch.randn(batch * images, 3, 32, 32)}  # fmt: skip
        measured = _measured(model, inputs)
        predicted = _predicted(tiny_vlm, batch, seq, ckpt, images=images)
        assert abs(predicted - measured) <= 0.15 * measured, (batch, seq, images, predicted, measured)


def test_the_frozen_encoder_and_vision_tower_run_without_a_graph(tiny_whisper, tiny_vlm, tmp_path):
    """transformers hooks every sub-model's input embeddings to need a gradient (the audio encoder's conv, the
    vision tower's patch embedding): prepare_qlora takes those hooks back, so the frozen parts keep nothing for
    backward (a third less memory in the tiny Whisper's checkpointed step), as the estimate counts them."""
    whisper = _lora_model(tiny_whisper, True, tmp_path).get_base_model()
    features = torch.randn(1, whisper.config.num_mel_bins, 2 * whisper.config.max_source_positions)
    assert not whisper.model.encoder(features).last_hidden_state.requires_grad
    vlm = _lora_model(tiny_vlm, True, tmp_path).get_base_model()
    assert not vlm.model.vision_tower(torch.randn(1, 3, 32, 32)).last_hidden_state.requires_grad
    assert vlm.get_input_embeddings()(torch.tensor([[5]])).requires_grad  # the LM's own inputs still need one


def test_a_vlm_seq_len_holds_the_image_tokens(tiny_vlm):
    tight = estimate(str(tiny_vlm), load="fp32", device="cpu", images=2, training=LoraTraining(seq_len=20))
    assert any("seq_len 20 cannot hold 2 image(s) x 16 tokens" in w for w in tight.warnings)
    roomy = estimate(str(tiny_vlm), load="fp32", device="cpu", images=2, training=LoraTraining(seq_len=64))
    assert not any("cannot hold" in w for w in roomy.warnings)
    one = estimate(str(tiny_vlm), load="fp32", device="cpu", images=1, training=LoraTraining(seq_len=64))
    # the image tokens are inside seq_len: the LM's activations do not grow with the images
    assert one.row("activations.saved").bytes == roomy.row("activations.saved").bytes


def test_whisper_cross_attention_follows_the_encoder_positions(tiny_whisper):
    from helpers.estimator.configs import resolve_config

    config, _, _ = resolve_config(str(tiny_whisper))
    tr = LoraTraining(seq_len=32, micro_batch=2, gradient_checkpointing=False)
    short = estimate(config, load="fp32", device="cpu", training=tr).row("activations.saved").bytes
    config.max_source_positions *= 2
    long = estimate(config, load="fp32", device="cpu", training=tr).row("activations.saved").bytes
    assert (
        long > short
        and "200 encoder positions"
        in estimate(config, load="fp32", device="cpu", training=tr).row("activations.saved").note
    )
