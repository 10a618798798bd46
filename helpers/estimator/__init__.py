"""Memory estimator: exact weight bytes for every load mode, plus KV cache, activations and training.

The architecture is built once on the meta device (no memory, no download) and every parameter is
counted per module, so bitsandbytes' real layout applies layer by layer: which ``nn.Linear`` get
quantized (transformers' own skip rules), int8 row scales, 4-bit packing with absmax per block of
64 and the nested (double-quant) state. Everything else is a formula or a rule of thumb, and each
row of the breakdown says which.

    >>> est = estimate("mistralai/Mistral-7B-v0.1", load="nf4")   # doctest: +SKIP
    >>> fit_one_card(est, "t4")                                   # doctest: +SKIP

Modules: ``rows`` (the row type and error), ``configs`` (what the user named -> a config),
``layout`` (weights per module on the meta device), ``inference`` (generation rows: KV cache,
prefill and what kernels add to it), ``training`` (training-step rows), ``core`` (``estimate``),
``hub_headers`` (exact weights from a hub repo's safetensors headers), ``prequantized`` (a checkpoint's own
quantization_config), ``kernel_paths`` (mxfp4/fp8 kept or dequantized on a machine, and their weights),
``fitting`` (``fit_one_card``, the verdict on a card, and its ranked fixes; ``helpers.fit`` adds the fixes past one card), ``footprint`` (a loaded model), ``family_rows`` (encoder-decoder
and VLM generation rows), ``family_training`` (their LoRA steps' activations), ``families`` (decoder-only,
encoder-decoder, speech, vision-language: the Auto class and the modules kept unquantized).
"""

from __future__ import annotations

from .configs import resolve_config
from .core import FRAGMENTATION, MemoryEstimate, estimate
from .families import FAMILIES, auto_class, family
from .fitting import (
    DeviceSuggestion,
    FitVerdict,
    Suggestion,
    fit_one_card,
    format_params,
    max_batch_that_fits,
    max_new_tokens_that_fit,
)
from .footprint import footprint, footprint_by_device, footprint_by_name
from .kernel_paths import KernelPath, kernel_path
from .layout import kv_cache_bytes, quantization_skip_modules, weight_rows
from .rows import ROW_GROUPS, EstimateError, EstimateRow
from .training import OPTIMIZERS, FullTraining, LoraTraining

__all__ = [
    "estimate", "fit_one_card", "footprint", "footprint_by_device", "footprint_by_name", "max_new_tokens_that_fit", "max_batch_that_fits", "resolve_config",
    "MemoryEstimate", "EstimateRow", "EstimateError", "FitVerdict", "Suggestion", "DeviceSuggestion", "LoraTraining", "FullTraining",
    "OPTIMIZERS", "FRAGMENTATION", "ROW_GROUPS", "kv_cache_bytes", "weight_rows", "format_params",
    "FAMILIES", "family", "auto_class", "quantization_skip_modules", "KernelPath", "kernel_path",
]  # fmt: skip
