"""The estimate of the families beyond decoder-only LMs: encoder-decoder (T5, Whisper) and a VLM (LLaVA)
rows, their inputs, and the predicted activation peak of one generate() call against the live tensors
the tiny models allocate on CPU (the tracker of bench/estimate_accuracy.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from helpers.estimator.core import estimate
from helpers.estimator.families import family
from helpers.estimator.rows import EstimateError

BENCH = Path(__file__).resolve().parents[1] / "bench" / "estimate_accuracy.py"


def _tracker():
    spec = importlib.util.spec_from_file_location("oomkit_estimate_accuracy", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PeakTracker


def _activations(path, **kw) -> int:
    est = estimate(str(path), load="fp32", device="cpu", **kw)
    return sum(r.bytes for r in est.rows if r.group in ("kv_cache", "activations"))


def _measured(model, inputs: dict, new: int) -> int:
    with torch.no_grad(), _tracker()(model) as peak:
        model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return peak.peak


@pytest.mark.parametrize("batch, tokens, new", [(2, 256, 32), (4, 128, 16)])
def test_t5_peak_is_its_encoders_widest_layer(tiny_t5, batch, tokens, new):
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5)
    ids = torch.randint(10, 1000, (batch, tokens))
    measured = _measured(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, new)
    predicted = _activations(tiny_t5, batch_size=batch, encoder_tokens=tokens, max_new_tokens=new)
    assert abs(predicted - measured) <= 0.15 * measured


@pytest.mark.parametrize("batch, new", [(2, 32), (4, 16)])
def test_whisper_peak_counts_the_padded_window(tiny_whisper, batch, new):
    from transformers import AutoModelForSpeechSeq2Seq

    model = AutoModelForSpeechSeq2Seq.from_pretrained(tiny_whisper)
    features = torch.randn(batch, 80, 2 * model.config.max_source_positions)
    measured = _measured(model, {"input_features": features}, new)
    predicted = _activations(tiny_whisper, batch_size=batch, audio_seconds=1.5, max_new_tokens=new)
    assert abs(predicted - measured) <= 0.15 * measured


@pytest.mark.parametrize("batch, text, images, new", [(2, 64, 1, 32), (8, 64, 3, 32)])
def test_vlm_peak_counts_image_tokens_per_image(tiny_vlm, batch, text, images, new):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    ids = torch.randint(10, 1000, (batch, text + 16 * images))
    ids[:, 1 : 1 + 16 * images] = model.config.image_token_id
    pixels = torch.randn(batch * images, 3, 32, 32)
    measured = _measured(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}, new)
    predicted = _activations(tiny_vlm, batch_size=batch, prompt_tokens=text, images=images, max_new_tokens=new)
    assert abs(predicted - measured) <= 0.15 * measured


def test_encoder_decoder_rows_follow_the_encoder_length(tiny_t5):
    short = estimate(str(tiny_t5), load="fp32", device="cpu", encoder_tokens=64, max_new_tokens=8)
    long = estimate(str(tiny_t5), load="fp32", device="cpu", encoder_tokens=256, max_new_tokens=8)
    assert long.row("kv_cache.cross").bytes == 4 * short.row("kv_cache.cross").bytes == 4 * 2 * 2 * 64 * 128 * 4
    assert long.row("kv_cache").bytes == short.row("kv_cache").bytes == 2 * 2 * 9 * 128 * 4  # 1 start + 8 new
    # without encoder_tokens, the prompt is the encoder's input
    assert estimate(str(tiny_t5), load="fp32", device="cpu", prompt_tokens=256, max_new_tokens=8).total == long.total


def test_whisper_memory_is_one_window_whatever_the_audio_length(tiny_whisper):
    one = estimate(str(tiny_whisper), load="fp32", device="cpu", audio_seconds=1)
    long = estimate(str(tiny_whisper), load="fp32", device="cpu", audio_seconds=9)
    assert one.total == long.total
    assert "2-second window" in long.row("activations.encoder_output").note
    assert "5 windows" in long.row("activations.encoder_output").note


def test_each_image_adds_its_tokens_and_the_resolution_is_the_processors(tiny_vlm):
    none = estimate(str(tiny_vlm), load="fp32", device="cpu", images=0, prompt_tokens=64, max_new_tokens=0)
    two = estimate(str(tiny_vlm), load="fp32", device="cpu", images=2, prompt_tokens=64, max_new_tokens=0)
    assert two.row("kv_cache").bytes == none.row("kv_cache").bytes * (64 + 2 * 16) // 64
    assert "activations.vision" not in {r.key for r in none.rows}
    big = estimate(str(tiny_vlm), load="fp32", device="cpu", images=2, image_size=1024, prompt_tokens=64)
    assert big.total == estimate(str(tiny_vlm), load="fp32", device="cpu", images=2, prompt_tokens=64).total
    assert "resized to 32 x 32" in big.row("kv_cache").note


@pytest.mark.parametrize(
    "model, kwargs, words",
    [("llama", {"images": 1}, "vision-language model"), ("t5", {"audio_seconds": 3}, "encoder-decoder (speech)"),
     ("llava", {"encoder_tokens": 64}, "encoder-decoder (text)"), ("whisper", {"image_size": 336}, "vision-language")],
)  # fmt: skip
def test_a_family_input_is_refused_where_the_family_has_none(tiny_models, model, kwargs, words):
    with pytest.raises(EstimateError, match=re.escape(f"{list(kwargs)[0]}= is for the family {words}") + ".*leave"):
        estimate(str(tiny_models[model]), load="fp32", device="cpu", **kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"images": -1}, {"encoder_tokens": 0}, {"audio_seconds": 0}, {"image_size": (1, 2, 3)}]
)
def test_family_inputs_out_of_range_are_refused(tiny_models, kwargs):
    model = {"images": "llava", "encoder_tokens": "t5", "audio_seconds": "whisper", "image_size": "llava"}
    with pytest.raises(EstimateError, match=list(kwargs)[0]):
        estimate(str(tiny_models[model[list(kwargs)[0]]]), load="fp32", device="cpu", **kwargs)


def test_a_quantized_vlm_says_its_vision_tower_stays_16_bit(tiny_vlm):
    est = estimate(str(tiny_vlm), load="nf4", device="t4")
    assert any("vision tower and projector, kept in 16 bits" in w for w in est.warnings)
    assert not any("vision tower" in w for w in estimate(str(tiny_vlm), load="fp16", device="t4").warnings)


def test_training_every_family_has_its_own_formulas(tiny_models):
    from helpers.estimator.training import FullTraining, LoraTraining

    # LoRA steps (tests/test_estimate_family_training.py) and full fine-tuning, which trains the frozen parts too
    # (tests/test_estimate_family_full_training.py): no family is left to the decoder-only formulas
    for name in ("t5", "whisper", "llava", "llama"):
        for tr, load in ((LoraTraining(seq_len=64), "nf4"), (FullTraining(seq_len=64), "fp16")):
            est = estimate(str(tiny_models[name]), load=load, device="t4", training=tr)
            assert not any("decoder-only formulas" in w or "lower bound" in w for w in est.warnings), name


def test_fit_suggests_fewer_images_and_a_shorter_encoder_input(tiny_vlm, tiny_t5):
    from helpers.estimator.fitting import fit_one_card as fit

    for model, inputs, change in [
        (tiny_vlm, {"images": 8, "prompt_tokens": 64}, {"images": 4}),
        (tiny_t5, {"encoder_tokens": 512}, {"encoder_tokens": 256}),
    ]:
        est = estimate(str(model), load="fp32", device="cpu", batch_size=8, max_new_tokens=8, **inputs)
        verdict = fit(est, device=int(est.total * 0.97))
        fix = next(s for s in verdict.suggestions if s.kwargs == change)
        assert all(fix.estimate.inputs[k] == v for k, v in change.items()) and fix.saving > 0


def test_idefics3_image_tokens_fold_patches_by_the_pixel_shuffle():
    from transformers import Idefics3Config

    from helpers.estimator.family_rows import image_tokens

    # SmolVLM's processor: image_seq_len 64 for 512-pixel tiles of 16-pixel patches, scale_factor 4
    config = Idefics3Config(vision_config={"image_size": 512, "patch_size": 16}, scale_factor=4)
    assert family(config) == "image_text" and image_tokens(config)[0] == 64
