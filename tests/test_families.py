"""Model families beyond decoder-only LMs (T5, Whisper, a LLaVA VLM): the Auto class each loads with,
the modules a quantized load keeps in 16 bits, and the load report's weights against the estimate."""

from __future__ import annotations

import pytest
import torch

from helpers.estimator.configs import resolve_config
from helpers.estimator.core import estimate
from helpers.estimator.families import auto_class, family
from helpers.loading.loader import load, model_class


@pytest.fixture(scope="module")
def family_models(tiny_t5, tiny_whisper, tiny_vlm, tiny_llama):
    return {"t5": tiny_t5, "whisper": tiny_whisper, "llava": tiny_vlm, "llama": tiny_llama}


@pytest.mark.parametrize(
    "name, fam, cls",
    [("llama", "causal", "AutoModelForCausalLM"), ("t5", "seq2seq", "AutoModelForSeq2SeqLM"),
     ("whisper", "speech_seq2seq", "AutoModelForSpeechSeq2Seq"), ("llava", "image_text", "AutoModelForImageTextToText")],
)  # fmt: skip
def test_the_family_picks_the_auto_class(family_models, name, fam, cls):
    config = resolve_config(family_models[name])[0]
    assert family(config) == fam
    assert auto_class(config).__name__ == cls == model_class(str(family_models[name])).__name__


def test_whisper_is_built_whole_not_as_its_decoder_alone(tiny_whisper):
    """AutoModelForCausalLM maps Whisper to WhisperForCausalLM (the decoder only): the estimate counts the encoder."""
    from transformers import AutoModelForSpeechSeq2Seq

    model = AutoModelForSpeechSeq2Seq.from_pretrained(tiny_whisper)
    assert estimate(tiny_whisper, load="fp32", device="cpu").weights == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.bnb
@pytest.mark.parametrize("name", ["t5", "whisper", "llava"])
@pytest.mark.parametrize("mode", ["fp32", "int8", "nf4"])
def test_each_family_loads_with_the_estimated_weights(family_models, name, mode):
    model, _, report = load(str(family_models[name]), load=mode, device_map=None)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    assert (
        report.measured_weights
        == report.estimated_weights
        == estimate(str(family_models[name]), load=mode, device="cpu").weights
    )


@pytest.mark.bnb
@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_a_quantized_vlm_keeps_its_vision_tower_and_projector_in_16_bits(tiny_vlm, mode):
    import bitsandbytes as bnb

    model, _, report = load(str(tiny_vlm), load=mode, device_map=None)
    quantized = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear8bitLt | bnb.nn.Linear4bit)}
    assert quantized and not {n for n in quantized if "vision_tower" in n or "multi_modal_projector" in n}
    assert all(".language_model." in n for n in quantized)
    vision = report.estimate.row("weights.vision")
    kept = [p for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n]
    assert vision.bytes == sum(p.numel() * p.element_size() for p in kept) > 0
    assert "model.vision_tower" in vision.note and "model.multi_modal_projector" in vision.note


@pytest.mark.bnb
def test_whispers_conv_front_end_stays_unquantized(tiny_whisper):
    model, _, _ = load(str(tiny_whisper), load="nf4", device_map=None)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d)]
    assert len(convs) == 2 and all(c.weight.dtype == torch.float32 for c in convs)
