"""Training examples for the families beyond decoder-only LMs (see :mod:`helpers.estimator.families`):
T5 (text in, text out), Whisper (audio in, its transcript out) and a VLM such as LLaVA (an image and an
instruction in, the answer out). :func:`load_processor` gives the family's processor,
:func:`build_family_dataset` the examples, which :func:`helpers.training.data.collate` batches like any other.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np
import torch

from ..estimator.families import CAUSAL, IMAGE_TEXT, SEQ2SEQ, SPEECH_SEQ2SEQ, family
from .data import IGNORE, TrainingData
from .plan import FinetuneError

__all__ = ["load_processor", "family_example", "build_family_dataset", "probe_batch", "ROW_KEYS", "IMAGE_PROMPT"]

# what a row of each family's data holds (the decoder-only family reads instruction rows with build_dataset)
ROW_KEYS = {
    SEQ2SEQ: ("instruction", "response"),
    SPEECH_SEQ2SEQ: ("audio", "text"),
    IMAGE_TEXT: ("image", "instruction", "response"),
}
# the VLM prompt: the processor expands <image> into the image's tokens
IMAGE_PROMPT = "{image_token}\n{instruction}\n"


def load_processor(model: str, *, token: str | None = None, trust_remote_code: bool = False):
    """The processor that turns a row into model inputs: ``AutoProcessor`` (feature extractor or image
    processor + tokenizer) for Whisper and VLMs, the tokenizer for text models."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(model, token=token, trust_remote_code=trust_remote_code)
    cls = AutoProcessor if family(config) in (SPEECH_SEQ2SEQ, IMAGE_TEXT) else AutoTokenizer
    return cls.from_pretrained(model, token=token, trust_remote_code=trust_remote_code)


def _tokenizer(processor):
    return getattr(processor, "tokenizer", processor)


def _need(row: Any, keys: tuple[str, ...], fam: str) -> None:
    if not isinstance(row, dict) or any(k not in row for k in keys):
        raise FinetuneError(
            f"a {fam} training row needs the keys {', '.join(keys)}, got {row!r:.80}: e.g. {dict.fromkeys(keys, '...')}"
        )


def _text_pair(tok, instruction: str, response: str, seq_len: int) -> dict:
    ids = tok(instruction, truncation=True, max_length=seq_len).input_ids
    labels = tok(response, truncation=True, max_length=seq_len).input_ids  # T5 ends it with </s> itself
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def _speech(processor, audio, text: str, seq_len: int, start: int | None) -> dict:
    fe, tok = processor.feature_extractor, processor.tokenizer
    samples = np.asarray(audio, dtype=np.float32)
    if samples.ndim != 1 or not samples.size:
        raise FinetuneError(f"audio must be one channel of samples at {fe.sampling_rate} Hz, got shape {samples.shape}")
    features = fe(samples, sampling_rate=fe.sampling_rate, return_tensors="pt").input_features[0]
    labels = tok(text, truncation=True, max_length=seq_len).input_ids
    if start is not None and labels and labels[0] == start:
        labels = labels[1:]  # the model puts the decoder start token in front of the shifted labels itself
    if labels[-1:] != [tok.eos_token_id]:
        labels = [*labels, tok.eos_token_id]  # so the model learns where a transcript ends
    return {"input_features": features, "labels": labels}


def _image_text(processor, image, instruction: str, response: str, seq_len: int) -> dict:
    tok = processor.tokenizer
    prompt = IMAGE_PROMPT.format(image_token=processor.image_token, instruction=instruction)
    whole = processor(text=[prompt + response + (tok.eos_token or "")], images=[image], return_tensors="pt")
    prompt_len = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"].shape[1]
    ids = whole["input_ids"][0].tolist()
    if len(ids) > seq_len:  # the image's tokens cannot be cut: the example would not match its pixels
        raise FinetuneError(
            f"an image example takes {len(ids)} tokens (the image alone {prompt_len}), more than seq_len "
            f"{seq_len}: raise TrainPlan.seq_len or shorten the instruction and answer"
        )
    labels = [IGNORE] * prompt_len + ids[prompt_len:]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels,
            "pixel_values": whole["pixel_values"][0]}  # fmt: skip


def family_example(processor, fam: str, row: dict, seq_len: int, *, decoder_start: int | None = None) -> dict:
    """One training example of family ``fam`` from ``row`` (keys: :data:`ROW_KEYS`)."""
    if fam not in ROW_KEYS:
        raise FinetuneError(
            f"family_example is for {', '.join(ROW_KEYS)} models; a {fam} model trains on build_dataset's examples"
        )
    _need(row, ROW_KEYS[fam], fam)
    if fam == SEQ2SEQ:
        return _text_pair(_tokenizer(processor), row["instruction"], row["response"], seq_len)
    if fam == SPEECH_SEQ2SEQ:
        return _speech(processor, row["audio"], row["text"], seq_len, decoder_start)
    return _image_text(processor, row["image"], row["instruction"], row["response"], seq_len)


def build_family_dataset(model, processor, rows: list[dict], seq_len: int) -> TrainingData:
    """Examples for ``model``'s family from ``rows`` (see :data:`ROW_KEYS`), ready for :func:`helpers.train`.

    Text pairs are cut at ``seq_len`` tokens each side; an image example longer than ``seq_len`` is an error
    (its image tokens cannot be cut)."""
    config = getattr(model, "config", None)
    fam = family(config)
    if fam == CAUSAL:
        raise FinetuneError("a decoder-only model trains on build_dataset(tokenizer, rows, seq_len)'s examples")
    if not isinstance(rows, list | tuple) or not rows:
        raise FinetuneError(f"rows must be a non-empty list of dicts with {', '.join(ROW_KEYS[fam])}, got {rows!r:.60}")
    start = getattr(config, "decoder_start_token_id", None)
    examples = [family_example(processor, fam, row, seq_len, decoder_start=start) for row in rows]
    return TrainingData(examples, rows=len(rows), cut=0, dropped=0, seq_len=seq_len, cut_answers="keep_eos")


def probe_batch(model, batch: int, seq_len: int, device: Any = None) -> dict[str, torch.Tensor]:
    """Random inputs for one training step at full length, as :func:`helpers.find_micro_batch` measures
    it: ``seq_len`` tokens in and out (a T5's input and labels), Whisper's full 30 s window of mel frames, a
    VLM's image (its tokens counted as the estimator counts them: LLaVA's fixed size, one Idefics3/SmolVLM
    tile, Qwen2-VL's 448 x 448 native resolution) at the front of ``seq_len`` tokens."""
    from ..estimator.family_rows import image_tokens

    config = getattr(model, "config", None)  # a plain module (a test double, a custom LM): decoder-only
    fam = family(config)
    vocab = model.get_input_embeddings().num_embeddings
    dtype = getattr(model, "dtype", torch.float32)
    ids = torch.randint(0, vocab, (batch, seq_len), device=device)
    if fam == CAUSAL:
        return {"input_ids": ids, "labels": ids}
    if fam == SEQ2SEQ:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if fam == SPEECH_SEQ2SEQ:
        frames = 2 * config.max_source_positions  # the conv front end halves the padded window
        features = torch.randn(batch, config.num_mel_bins, frames, device=device, dtype=dtype)
        return {"input_features": features, "labels": ids}
    vc = config.vision_config
    n = image_tokens(config)[0]
    merge = getattr(vc, "spatial_merge_size", None)
    start = 1 if merge else 0  # Qwen2-VL finds each image by the vision-start token before it
    if start + n >= seq_len:
        raise FinetuneError(
            f"an image takes {start + n} tokens, seq_len is {seq_len}: raise TrainPlan.seq_len above {start + n}"
        )
    # a random text token that is an image's (or the vision-start) token would count as one more image token
    special = [t for t in (getattr(config, k, None) for k in _IMAGE_TOKEN_KEYS) if isinstance(t, int)]
    plain = next(t for t in range(vocab) if t not in special)
    ids[torch.isin(ids, torch.tensor(special, device=ids.device))] = plain
    if merge:
        ids[:, 0] = config.vision_start_token_id
    ids[:, start : start + n] = config.image_token_id
    labels = ids.clone()
    labels[:, : start + n] = IGNORE
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if _takes(model, "mm_token_type_ids"):  # transformers >= 5.2x: Qwen2-VL's M-RoPE reads where images are
        inputs["mm_token_type_ids"] = (ids == config.image_token_id).int()
    return inputs | _probe_pixels(config, batch, n, device, dtype)


def _takes(model, name: str) -> bool:
    """Whether ``model``'s forward (under a PEFT wrapper, the base model's) has a parameter ``name``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return name in inspect.signature(base.forward).parameters


_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "vision_start_token_id", "vision_end_token_id",
                     "video_token_id")  # fmt: skip


def _probe_pixels(config, batch: int, n: int, device: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One random image per example, in the form the model's processor hands it over, of ``n`` tokens each."""
    vc = config.vision_config
    channels = getattr(vc, "in_channels", None) or getattr(vc, "in_chans", None) or getattr(vc, "num_channels", 3)
    merge = getattr(vc, "spatial_merge_size", None)
    if merge:  # Qwen2-VL: flattened patches and each image's (frames, rows, columns) grid of patches
        side = math.isqrt(n) * merge  # the estimator's square image (image_tokens): side x side patches
        t, patch = getattr(vc, "temporal_patch_size", 1), vc.patch_size
        pixels = torch.randn(batch * side * side, channels * t * patch * patch, device=device, dtype=dtype)
        grid = torch.tensor([[1, side, side]] * batch, device=device)
        return {"pixel_values": pixels, "image_grid_thw": grid}
    size = vc.image_size
    if getattr(config, "scale_factor", None):  # Idefics3 / SmolVLM: one tile per image, and its pixel mask
        pixels = torch.randn(batch, 1, channels, size, size, device=device, dtype=dtype)
        mask = torch.ones(batch, 1, size, size, dtype=torch.bool, device=device)
        return {"pixel_values": pixels, "pixel_attention_mask": mask}
    return {"pixel_values": torch.randn(batch, channels, size, size, device=device, dtype=dtype)}
