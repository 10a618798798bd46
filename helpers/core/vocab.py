"""Each word of oomkit's vocabulary, defined once: load modes, dtype names, fit verdicts, statuses.

Every module that takes a load mode or a dtype, shows a verdict or colours a status reads it from
here, so a new mode or a reworded verdict is one edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import OomkitError

__all__ = [
    "LoadMode", "MODES", "LoadModeError", "load_mode", "load_mode_name", "LOAD_MODES", "PREQUANTIZED", "QUANTIZED", "lighter_load", "lighter_loads", "FP32", "FP16", "BF16", "half_dtype", "FOUR_BIT", "HALF", "DTYPE_BYTES", "DtypeError", "dtype_name", "torch_dtype",
    "RequestSizes", "DEFAULTS", "FITS_TOKENS",
    "FITS", "TIGHT", "DOES_NOT_FIT", "VERDICTS", "VERDICT_STATUS", "TIGHT_FRACTION", "verdict",
    "STATUSES", "STATUS_ORDER", "BF16_CAPABILITY", "supports_bf16", "auto_load_order",
    "LOSSES", "KV_CACHES", "KV_CACHE_BITS", "ReducerError", "loss_name", "kv_cache_name",
]  # fmt: skip


@dataclass(frozen=True)
class LoadMode:
    """One load mode: what its weights are and how transformers is asked for it. Code asks these
    fields instead of comparing mode names, so a new mode is one row of :data:`MODES`."""

    name: str
    bits: int  # bits per weight of a quantized Linear; the dtype's bits for an unquantized load
    bnb: dict | None  # BitsAndBytesConfig keywords (bitsandbytes modes), None for a plain dtype load
    smaller: str | None  # the next mode down when a plan does not fit (about half the weight bytes)
    text: str  # what it is, for help texts and errors

    @property
    def quantized(self) -> bool:
        """Weights quantized by bitsandbytes (Linear layers only: norms and embeddings stay 16-bit)."""
        return self.bnb is not None

    @property
    def four_bit(self) -> bool:
        return self.quantized and self.bits == 4

    @property
    def weight_bytes(self) -> float:
        """Bytes per weight of a quantized Linear (int8: 1, 4-bit: 0.5) or per parameter of a dtype load."""
        return self.bits / 8

    @property
    def dtype(self) -> str | None:
        """The torch dtype name of a plain load (``"fp16"``...); None when bitsandbytes quantizes."""
        return None if self.quantized else self.name


# The dtype words, spelled once: code compares with these, never with a literal.
FP32, FP16, BF16 = "fp32", "fp16", "bf16"


def half_dtype(bf16: bool) -> str:
    """The 16-bit dtype a card computes in: bf16 where it has bf16 (Ampere and newer), else fp16. The one
    rule behind "auto" precision, compute dtype and mixed precision (``devices.compute_dtype_rule`` applies
    it to a device)."""
    return BF16 if bf16 else FP16


# Widest first: the order users read them in (dropdowns, CLI help, error messages).
MODES: dict[str, LoadMode] = {
    m.name: m
    for m in (
        LoadMode("fp32", 32, None, "fp16", "full precision"),
        LoadMode("fp16", 16, None, "int8", "16-bit floats (every GPU)"),
        LoadMode("bf16", 16, None, "int8", "16-bit bfloat (Ampere and newer)"),
        LoadMode("int8", 8, {"load_in_8bit": True}, "nf4", "bitsandbytes LLM.int8"),
        LoadMode("nf4", 4, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, None, "bitsandbytes 4-bit NormalFloat (QLoRA)"),
        LoadMode("fp4", 4, {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, None, "bitsandbytes 4-bit float"),
    )
}  # fmt: skip
LOAD_MODES = tuple(MODES)
# Checkpoints saved quantized by GPTQ or AWQ (int32-packed weights, fp16 scales per group): they load as
# saved, with the kernels of their own backend, so they are a plan's load mode only for such a repo.
PREQUANTIZED = ("gptq", "awq")
QUANTIZED = tuple(n for n, m in MODES.items() if m.quantized)  # bitsandbytes: LLM.int8 and the two 4-bit data types


def lighter_load(load: str, bf16: bool = False) -> str | None:
    """The next lighter load mode after ``load`` (about half its weight bytes), the one answer to "what
    load mode next" for fixes, OOM advice and the fits table: fp32 -> fp16 (bf16 on a card with bf16) ->
    int8 -> nf4. None after nf4/fp4, or for a mode oomkit does not load itself."""
    mode = MODES.get(str(load).lower())
    if mode is None or mode.smaller is None:
        return None
    return half_dtype(True) if bf16 and mode.smaller in HALF and mode.bits > 16 else mode.smaller


def lighter_loads(load: str, bf16: bool = False) -> list[str]:
    """Every lighter load mode after ``load``, nearest first (:func:`lighter_load` repeated)."""
    out: list[str] = []
    while (load := lighter_load(load, bf16)) is not None:
        out.append(load)
    return out


FOUR_BIT = tuple(n for n, m in MODES.items() if m.four_bit)
HALF = tuple(n for n, m in MODES.items() if m.dtype and m.bits == 16)


class LoadModeError(OomkitError, ValueError):
    """A load mode oomkit does not know; the message lists the accepted ones."""


def load_mode(value: Any, *, error: type[Exception] = LoadModeError) -> LoadMode:
    """The :class:`LoadMode` named ``value`` (any case); else ``error`` naming the accepted modes (callers
    pass their own error class, so a bad mode reads the same everywhere but raises what each API raises)."""
    return MODES[load_mode_name(value, error=error)]


def load_mode_name(value: Any, *, auto: bool = False, error: type[Exception] = LoadModeError) -> str:
    """``value`` as a load-mode name (``"auto"`` too where ``auto``), the one check of a load mode every
    public function runs; an unknown one raises ``error`` saying what to pass."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text in MODES or (auto and text == "auto"):
        return text
    four, eight = "4-bit is 'nf4' or 'fp4'", "8-bit is 'int8'"
    hint = {"int4": four, "4bit": four, "4-bit": four, "8bit": eight, "8-bit": eight, "float16": "that is 'fp16'",
            "half": "that is 'fp16'", "bfloat16": "that is 'bf16'", "float32": "that is 'fp32'"}.get(text or "")  # fmt: skip
    said = f" ({hint})" if hint else ""
    also = ", or 'auto' (the first that fits)" if auto else ""
    raise error(f"unknown load mode {value!r}{said}; use nf4 (4-bit, QLoRA), fp4, int8, or fp16/bf16/fp32{also}")


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

# Every spelling users write for a dtype (transformers, BitsAndBytesConfig, torch) -> our name.
_DTYPE_SPELLINGS = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}  # fmt: skip


class DtypeError(OomkitError, ValueError):
    """A dtype oomkit does not know; the message lists the accepted spellings."""


def dtype_name(value: Any, *, allow_auto: bool = True) -> str:
    """``"fp32"``, ``"fp16"``, ``"bf16"`` (or ``"auto"``) for any spelling: ``torch.float16``, ``"float16"``,
    ``"half"``, ``"torch.bfloat16"``, ``"bf16"`` ... Raises :class:`DtypeError` naming the accepted ones."""
    text = str(value).strip().lower() if value is not None else ""
    if allow_auto and text == "auto":
        return "auto"
    name = _DTYPE_SPELLINGS.get(text)
    if name is None:
        accepted = ("auto, " if allow_auto else "") + "fp16/float16/torch.float16, bf16/bfloat16, fp32/float32"
        raise DtypeError(f"unknown dtype {value!r}; use one of {accepted}")
    return name


def torch_dtype(name: str):
    """The torch dtype of one of our dtype names (any spelling :func:`dtype_name` takes)."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name(name, allow_auto=False)]


def auto_load_order(bf16: bool) -> tuple[str, ...]:
    """What load="auto" tries, in order, the first that fits winning: the 16-bit the GPU computes in,
    else nf4. int8 is not an automatic choice: LLM.int8's mixed decomposition generates several times
    slower than nf4, and QLoRA trains on 4-bit, so every notebook and preflight recommend the same."""
    return (half_dtype(bf16), "nf4")


# The sizes a plan, an estimate and a panel start from when the user sets none (a chat-sized request:
# one sequence, a 512-token prompt, 256 new tokens; training at 512 tokens, micro-batch 1). One home, so
# the notebooks, the CLI, preflight and the estimator answer the same question by default.
@dataclass(frozen=True)
class RequestSizes:
    """The sizes of a request when the user names none."""

    batch_size: int = 1
    prompt_tokens: int = 512
    max_new_tokens: int = 256
    seq_len: int = 512  # training
    micro_batch: int = 1  # training


DEFAULTS = RequestSizes()
# the fits table's sequence: a default request's prompt and answer together
FITS_TOKENS = DEFAULTS.prompt_tokens + DEFAULTS.max_new_tokens


# Fit verdicts: an estimate against a device's capacity.
FITS, TIGHT, DOES_NOT_FIT = "fits", "tight", "does not fit"
VERDICTS = (FITS, TIGHT, DOES_NOT_FIT)
# Above this share of capacity a run works only without surprises: the allocator's rounding, a
# longer prompt than planned or another notebook's tensors are not in the estimate.
TIGHT_FRACTION = 0.90


def verdict(total: int, capacity: int) -> str:
    """:data:`FITS`, :data:`TIGHT` (over :data:`TIGHT_FRACTION` of capacity) or :data:`DOES_NOT_FIT`."""
    if total > capacity:
        return DOES_NOT_FIT
    return TIGHT if total > capacity * TIGHT_FRACTION else FITS


# Check statuses, mildest first; "info" reports without judging.
STATUSES = ("pass", "info", "warn", "fail")
STATUS_ORDER = {"pass": 0, "info": 0, "warn": 1, "fail": 2}
VERDICT_STATUS = {FITS: "pass", TIGHT: "warn", DOES_NOT_FIT: "fail"}

# bf16 tensor cores start with Ampere (sm_80); a T4 (sm_75) or V100 (sm_70) computes bf16 slowly
# in emulation or not at all, so oomkit plans fp16 there.
BF16_CAPABILITY = (8, 0)


def supports_bf16(capability: tuple[int, int] | None) -> bool:
    """Whether a CUDA device of this compute capability computes in bf16 (``None``: no GPU)."""
    return capability is not None and tuple(capability) >= BF16_CAPABILITY


# Memory reducers (priced in estimator/reducers.py, switched on by helpers/core/reducers.py). The training
# loss: "plain" (logits for every token at once), "chunked" (oomkit's plain-PyTorch chunked cross-entropy,
# any device) or "fused" (Liger Kernel's fused linear cross-entropy, where liger-kernel is installed).
LOSSES = ("plain", "chunked", "fused")
# The KV cache generate() keeps: "dynamic" (transformers' default), quantized ("fp8": transformers' own
# backend; "int4", "int2": optimum-quanto or HQQ, where installed) or "offload" (one layer on the GPU).
KV_CACHES = ("dynamic", "fp8", "int4", "int2", "offload")
KV_CACHE_BITS = {"fp8": 8, "int4": 4, "int2": 2}


class ReducerError(OomkitError, ValueError):
    """An unknown memory reducer, or one this machine cannot run; the message says what to pass."""


def loss_name(value: Any) -> str:
    """``value`` when it is one of :data:`LOSSES` (``None`` means "plain"), else :class:`ReducerError`."""
    text = "plain" if value is None else str(value).strip().lower()
    if text not in LOSSES:
        raise ReducerError(
            f"unknown loss {value!r}; use 'plain' (default), 'chunked' (chunked cross-entropy in plain PyTorch) "
            "or 'fused' (Liger Kernel's fused linear cross-entropy, needs liger-kernel and a CUDA GPU)"
        )
    return text


def kv_cache_name(value: Any) -> str:
    """``value`` when it is one of :data:`KV_CACHES` (``None`` means "dynamic"), else :class:`ReducerError`."""
    text = "dynamic" if value is None else str(value).strip().lower()
    if text not in KV_CACHES:
        hint = " (4-bit is 'int4')" if text in ("4bit", "4-bit", "nf4", "q4") else ""
        raise ReducerError(
            f"unknown kv_cache {value!r}{hint}; use 'dynamic' (default), 'fp8' (transformers' own 8-bit cache), "
            "'int4' or 'int2' (needs optimum-quanto or hqq) or 'offload' (one layer on the GPU, the rest in RAM)"
        )
    return text
