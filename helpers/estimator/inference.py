"""The rows of a ``generate()`` call: the KV cache, the prompt's forward pass (prefill) with what the
attention kernel and bitsandbytes' matmuls add to it, the last position's logits and sampling.

Prefill is modelled one layer at a time, as phases whose tensors are alive together: attention
(residual, normed input, q, k, v, output) and the MLP (residual, normed input and three intermediates).
The widest phase is the prefill row; a kernel's extra buffers (K and V repeated per head, eager
attention's score matrices, a dequantized weight) belong to one phase, so each extra row is what it
adds to the widest phase, not its own size: a buffer that fits inside the MLP's peak adds nothing.
Measured on CPU with a tracker of live tensors, a dequantized copy raised a Llama layer's peak by
exactly this amount and repeated K/V (inside the wider MLP) by nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.units import format_bytes
from ..core.vocab import BF16, FP16, FP32, MODES
from .layout import Layout, dims, kv_cache_bytes, largest_quantized_linear
from .reducers import kv_cache_rows
from .rows import EstimateRow

__all__ = ["Generation", "generation_rows", "SAMPLING_BYTES", "dequantizes_4bit"]

# Bytes per batch x vocab entry that top-k/top-p sampling allocates besides the greedy path's logits
# (transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, then softmax for
# multinomial): the scaled scores (4), top-k's filtered copy (4), top-p's sort values (4) and int64
# indices (8), its softmax and cumsum (4 + 4), two bool masks (2), its filtered copy (4) and the
# probabilities (4), about 34 in all (fp32 scores).
SAMPLING_BYTES = 34
# bitsandbytes 0.50 (backends/cuda/ops.py): gemm_4bit runs its own kernel for at most 4 rows
# (_GEMM_4BIT_CUSTOM_FLOOR_M), never past 1536 rows (_gemm_4bit_custom_max_m), and in between as
# _gemm_4bit_use_custom_cuda decides per GPU and shape: for 7B-size layers (>= 4 Mi weights) a T4,
# an A100 and an H100 dequantize past 64 rows, every GPU past 512; fp32 inputs and pre-sm75 GPUs
# past 7.
DEQUANT_FLOOR_ROWS, DEQUANT_ALWAYS_ROWS, DEQUANT_ROWS, DEQUANT_ROWS_NO_MMA = 4, 1536, 64, 7


@dataclass
class Generation:
    """What a generation estimate's rows depend on besides the model (shapes, dtype, device, load)."""

    batch: int
    prompt: int
    new: int
    b: int  # bytes per element of activations and the KV cache
    cdtype: str  # "fp16", "bf16" or "fp32"
    dev: dict | None  # the resolved device (None: CPU)
    load: str
    double_quant: bool = True
    skip_modules: list[str] | None = None
    sampling: bool = False
    kv_cache: str = "dynamic"  # or a reducer: "fp8", "int4", "int2", "offload" (estimator/reducers.py)

    @property
    def tokens(self) -> int:
        """Rows of every matmul in the prompt's forward pass: batch x prompt tokens."""
        return self.batch * self.prompt


@dataclass
class _Extra:
    key: str
    name: str
    phase: str  # "attention" or "linear" (a quantized linear's call inside the MLP)
    bytes: int  # alive during its phase only
    resident: int  # alive through the whole forward pass (eager attention's masks)
    note: str


def generation_rows(config, lay: Layout, g: Generation) -> list[EstimateRow]:
    """KV cache, prefill (with the extras of the attention kernel and of quantized matmuls), logits, sampling."""
    d = dims(config)
    tokens = g.prompt + g.new
    kv_note = f"{d['layers']} layers x 2 x {g.batch} x {tokens} tokens x {d['kv']} kv heads x {d['hd']} x {g.b} B"
    if d["window"] and "sliding_attention" in d["types"] and g.prompt > min(tokens, d["window"]):
        kv_note += f"; sliding layers hold the whole {g.prompt}-token prompt until the first decoding step"
    kv = kv_cache_bytes(config, g.batch, tokens, g.b, prompt_tokens=g.prompt)
    if g.kv_cache == "dynamic":
        rows = [EstimateRow("kv_cache", "KV cache", kv, "formula", kv_note)]
    else:
        rows = kv_cache_rows(kv, d["layers"], tokens, g.new, g.b, g.kv_cache)
    rows += _prefill_rows(d, lay, g)
    rows.append(
        EstimateRow("activations.logits", "logits (last position, fp32 copy)", g.batch * d["vocab"] * (g.b + 4) * 2,
                    "formula", "generate() keeps logits of the last token only")
    )  # fmt: skip
    if g.sampling:
        rows.append(
            EstimateRow("activations.sampling", "sampling (top-k / top-p)", g.batch * d["vocab"] * SAMPLING_BYTES,
                        "formula", f"~{SAMPLING_BYTES} B per batch x vocab: sort values + int64 indices, softmax, "
                        "cumsum, masks, filtered scores, probabilities")
        )  # fmt: skip
    return rows


def _prefill_rows(d: dict, lay: Layout, g: Generation) -> list[EstimateRow]:
    t, b = g.tokens, g.b
    attn = t * (2 * d["h"] + 2 * d["heads"] * d["hd"] + 2 * d["kv"] * d["hd"]) * b
    mlp = t * (2 * d["h"] + 3 * d["inter"]) * b
    linear = 0  # a quantized linear's call: one MLP intermediate alive, the next being written, plus its buffers
    peak = max(attn, mlp)
    base = EstimateRow("activations.prefill", "prefill activations", peak, "formula",
                       f"widest layer of the prompt's forward pass ({'MLP' if mlp >= attn else 'attention'})")  # fmt: skip
    rows = [base]
    for extra in filter(None, (_attention_extra(d, lay, g), _matmul_extra(d, lay, g))):
        if extra.phase == "attention":
            attn += extra.bytes
        else:
            linear = t * (2 * d["h"] + 2 * d["inter"]) * b + extra.bytes
        added = max(attn, mlp, linear) - peak + extra.resident
        peak = max(attn, mlp, linear)
        if added > 0:
            part = "" if added == extra.bytes + extra.resident else f"; adds {format_bytes(added)} to the widest layer"
            rows.append(EstimateRow(extra.key, extra.name, added, "formula", extra.note + part))
        else:  # shown all the same: a user reading the table sees it was counted
            base.note += f"; inside it: {extra.note}"
    return rows


def _attention_extra(d: dict, lay: Layout, g: Generation) -> _Extra | None:
    """K and V repeated per query head (GQA without flash attention), or eager attention's scores."""
    t, b, heads = g.tokens, g.b, d["heads"]
    repeat = 2 * t * heads * d["hd"] * b if d["kv"] < heads else 0
    what = f"K and V repeated to {heads} heads for one layer ({format_bytes(repeat)})"
    if lay.attention == "eager":
        n = g.batch * heads * g.prompt * g.prompt
        # q @ k.T in the compute dtype, then softmax(dtype=float32) and .to(dtype) with the input still
        # alive (fp16 on CUDA goes straight to fp32; bf16 is converted first, one more fp32 matrix)
        per = b + 4 + (b if b < 4 else 0) + (4 if g.cdtype == BF16 else 0)
        kinds = len(set(d["types"][: d["layers"]])) or 1
        masks = kinds * g.batch * g.prompt * g.prompt * b  # one float (B, 1, S, S) mask per attention kind
        note = (f"no SDPA for this architecture: {g.batch} x {heads} heads x {g.prompt}^2 scores x {per} B in one "
                f"layer ({format_bytes(n * per)}), {kinds} float mask(s) of {g.batch} x {g.prompt}^2 x {b} B "
                f"({format_bytes(masks)})" + (f", {what}" if repeat else ""))  # fmt: skip
        return _Extra(
            "activations.eager_attention", "eager attention scores", "attention", repeat + n * per, masks, note
        )
    if repeat and lay.attention == "sdpa" and g.dev is not None and not g.dev.get("bf16"):
        # Before sm80 oomkit's load() makes transformers repeat K and V (memory-efficient kernel) instead
        # of SDPA's enable_gqa, which falls back to the math kernel's fp32 S x S scores there
        note = f"{what}: GQA without flash attention (compute capability < 8.0)"
        return _Extra("activations.gqa_repeat", "GQA: K/V repeated per head", "attention", repeat, 0, note)
    return None


def dequantizes_4bit(rows: int, cdtype: str, capability: tuple[int, int] | None) -> bool:
    """Whether bitsandbytes' 4-bit matmul of ``rows`` input rows dequantizes the whole weight first."""
    if rows <= DEQUANT_FLOOR_ROWS:
        return False
    if rows > DEQUANT_ALWAYS_ROWS:
        return True
    if cdtype == FP32 or (capability is not None and tuple(capability) < (7, 5)):
        return rows > DEQUANT_ROWS_NO_MMA
    return rows > DEQUANT_ROWS


def _matmul_extra(d: dict, lay: Layout, g: Generation) -> _Extra | None:
    """bitsandbytes on CUDA: a 4-bit weight dequantized for a long input, or LLM.int8's int32 product."""
    mode = MODES.get(g.load)
    if g.dev is None or mode is None or not mode.quantized:
        return None
    shape = largest_quantized_linear(lay, g.skip_modules)
    if shape is None:
        return None
    out, inp = shape
    t = g.tokens
    if mode.bits == 8:
        # int8_vectorwise_quant's int8 copy of the input and row scales, int8_linear_matmul's int32
        # out x tokens product (alive with the dequantized output), an fp16 copy of a bf16/fp32 input
        extra = t * (inp + 4 * out + 4) + (2 * t * inp if g.cdtype != FP16 else 0)
        note = (f"largest linear ({out} x {inp}): {t} tokens x {out} outputs x 4 B (int32 product) + the int8 "
                f"input ({format_bytes(extra)})")  # fmt: skip
        return _Extra("activations.int8_matmul", "int8 matmul buffers", "linear", extra, 0, note)
    if not dequantizes_4bit(t, g.cdtype, (g.dev or {}).get("capability")):
        return None
    # _dequant_linear_fallback: the whole weight in the compute dtype, and with double quantization
    # the absmax dequantized to fp32 plus its offset-added copy
    blocks = math.ceil(out * inp / 64)
    extra = out * inp * g.b + (8 * blocks if g.double_quant else 0)
    note = (f"largest linear ({out} x {inp}) dequantized to {g.cdtype} ({format_bytes(extra)} with its absmax): "
            f"bitsandbytes' 4-bit matmul does this for {t} tokens")  # fmt: skip
    return _Extra("activations.dequant", "4-bit weight dequantized for prefill", "linear", extra, 0, note)
