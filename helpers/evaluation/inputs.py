"""What :func:`helpers.safe_generate` feeds a model: token ids per prompt, and for Whisper and a VLM
the audio or image each prompt comes with, turned into tensors once, before any generation.

A media prompt is a dict with ``audio`` (one channel of samples at the feature extractor's rate, or
ready ``input_features``) or ``image`` (a PIL image or an array) beside an optional ``prompt`` (the VLM's
instruction), ``id`` and ``reference``. Its recorded prompt text starts with a hash of the processed
media (``[audio 3f2a...]``), so a resume never reuses a result made from another clip or picture under
the same id: the check :func:`helpers.safe_generate` already runs on prompt texts.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ..core.errors import EvalError
from ..loading.generation import encode
from ..training.family_data import IMAGE_PROMPT
from .prompts import load_prompts

__all__ = ["MEDIA_KEYS", "MediaError", "has_media", "prompt_inputs", "batch_media"]

MEDIA_KEYS = ("audio", "input_features", "image")


class MediaError(EvalError):
    """An audio or image prompt safe_generate cannot feed the model."""


def has_media(prompts: Any) -> bool:
    """Whether ``prompts`` is a list of dicts of which one holds audio or an image."""
    return isinstance(prompts, list | tuple) and any(isinstance(p, dict) and set(MEDIA_KEYS) & set(p) for p in prompts)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]


def _audio(processor, row: dict) -> dict[str, torch.Tensor]:
    if "input_features" in row:
        return {"input_features": torch.as_tensor(row["input_features"])}
    fe = getattr(processor, "feature_extractor", None)
    if fe is None:
        raise MediaError("audio prompts need the model's processor: pass load_processor(model) as the tokenizer")
    samples = np.asarray(row["audio"], dtype=np.float32)
    if samples.ndim != 1 or not samples.size:
        raise MediaError(f"audio must be one channel of samples at {fe.sampling_rate} Hz, got shape {samples.shape}")
    return {"input_features": fe(samples, sampling_rate=fe.sampling_rate, return_tensors="pt").input_features[0]}


def _image(processor, row: dict) -> tuple[dict[str, torch.Tensor], list[int]]:
    if not hasattr(processor, "image_processor"):
        raise MediaError("image prompts need the model's processor: pass load_processor(model) as the tokenizer")
    text = IMAGE_PROMPT.format(image_token=processor.image_token, instruction=row.get("prompt", ""))  # as trained
    out = processor(text=[text], images=[row["image"]], return_tensors="pt")
    return {"pixel_values": out["pixel_values"][0]}, out["input_ids"][0].tolist()


def prompt_inputs(prompts: Any, processor) -> tuple[list[dict], list[list[int]]]:
    """The normalized prompts (``load_prompts``' items; a media prompt's with its tensors under ``media``)
    and each one's token ids (a Whisper prompt has none: the audio is all its encoder reads)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    if not has_media(prompts):
        items = load_prompts(prompts)
        return items, encode(tokenizer, [it["prompt"] for it in items])
    texts, media, ids = [], [], []
    for n, row in enumerate(prompts):
        if not isinstance(row, dict) or not set(MEDIA_KEYS) & set(row):
            raise MediaError(f"prompt #{n} has no audio or image, but others do: evaluate them in separate runs")
        if "image" in row:
            tensors, row_ids = _image(processor, row)
        else:
            tensors, row_ids = _audio(processor, row), []
        kind = "image" if "image" in row else "audio"
        text = f"[{kind} {_digest(next(iter(tensors.values())))}] {row.get('prompt', '')}".strip()
        texts.append({**{k: row[k] for k in ("id", "reference") if k in row}, "prompt": text})
        media.append(tensors)
        ids.append(row_ids)
    items = load_prompts(texts)
    for item, tensors in zip(items, media, strict=True):
        item["media"] = tensors
    return items, ids


def batch_media(items: list[dict]) -> dict[str, torch.Tensor] | None:
    """The batch's audio features or pixels, stacked (None for text prompts)."""
    media = [it.get("media") for it in items]
    if not media or media[0] is None:
        return None
    return {key: torch.stack([m[key] for m in media]) for key in media[0]}
