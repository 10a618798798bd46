"""Checkpoints that are already quantized (``*-bnb-4bit``, GPTQ, AWQ, mxfp4, fp8, compressed-tensors): their
``quantization_config`` decides the layout, so the estimate follows it instead of the load mode a user would
pick. mxfp4 and fp8 stay packed only where transformers has kernels for them (:mod:`.kernel_paths`); elsewhere
transformers dequantizes them to bf16 at load, and the estimate prices that."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.vocab import PREQUANTIZED
from .layout import Layout, should_convert, tied_note
from .rows import EstimateError, EstimateRow

__all__ = [
    "RepoQuantization",
    "repo_quantization",
    "packed_rows",
    "PACKED_METHODS",
    "NATIVE_FORMATS",
    "SHIPS_PREQUANTIZED",
]

PACKED_METHODS = PREQUANTIZED  # int32-packed weights with fp16 scales per group
PACKED_BITS = (2, 3, 4, 8)  # what GPTQ/AWQ kernels pack (AWQ: 4)


def _packed_bits_group(qc: dict, method: str) -> tuple[int, int]:
    """A GPTQ/AWQ config's (bits, group_size), checked: a bits of 0 would estimate "packed layers 0 B"."""
    bits, group = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128))
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in PACKED_BITS:
        raise EstimateError(
            f"this {method} checkpoint's quantization_config says bits={bits!r}; {method} packs "
            f"{', '.join(map(str, PACKED_BITS))}-bit weights: fix the config's 'bits'"
        )
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group > 0):
        raise EstimateError(
            f"this {method} checkpoint's quantization_config says group_size={group!r}; it is a positive number "
            "of input columns per scale (usually 128), or -1 for one scale per output channel"
        )
    return bits, group


@dataclass
class RepoQuantization:
    """What a checkpoint's ``quantization_config`` says: ``load`` is a load mode (nf4/fp4/int8) for
    bitsandbytes repos, or ``"gptq"``/``"awq"``."""

    method: str
    load: str
    bits: int = 4
    group_size: int = 128
    double_quant: bool = False
    skip: list[str] = field(default_factory=list)
    block: tuple[int, int] | None = None  # fp8: the (out, in) block one fp32 scale covers; None: one per tensor
    float_weights: bool = False  # compressed-tensors: the weights are floats (fp8), not packed integers


# Formats transformers keeps packed only with kernels for them, else dequantizes to bf16 at load: the load
# mode names them, as "gptq" names a GPTQ repo's
NATIVE_FORMATS = ("mxfp4", "fp8")
# Architectures whose published checkpoints all ship pre-quantized (a config without quantization_config
# was stripped of it): advice must not send such a model to "a pre-quantized checkpoint"
SHIPS_PREQUANTIZED = {"gpt_oss": "mxfp4"}


def _names(qc: dict, key: str) -> list[str]:
    """A list of module names from quantization_config (``modules_to_not_convert``, ``ignore``)."""
    value = qc.get(key) or []
    if isinstance(value, str):
        return [value]  # one name; list() would make it its letters
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise EstimateError(
            f"{key} in quantization_config is {str(value)[:60]!r}, not a list of module names such as ['lm_head']; "
            "fix the config.json"
        )
    return list(value)


def _fp8(qc: dict) -> RepoQuantization:
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list | tuple) and len(block) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):  # fmt: skip
        raise EstimateError(
            f"weight_block_size in quantization_config is {block!r}; an fp8 checkpoint states two positive whole "
            "numbers such as [128, 128] (or none, for one scale per tensor): fix the config.json"
        )
    return RepoQuantization("fp8", "fp8", bits=8, skip=_names(qc, "modules_to_not_convert"),
                            block=tuple(block) if block else None)  # fmt: skip


def _compressed(qc: dict) -> RepoQuantization:
    """compressed-tensors: the first config group's weight scheme (float-quantized fp8 or pack-quantized int)."""
    groups = qc.get("config_groups") or {}
    groups = groups if isinstance(groups, dict) else {}
    weights = next((g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")), None)
    weights = weights if isinstance(weights, dict) else {}
    bits = weights.get("num_bits", 8)
    return RepoQuantization("compressed-tensors", "bf16", bits=bits if isinstance(bits, int) else 8,
                            group_size=weights.get("group_size") or 0, skip=_names(qc, "ignore"),
                            float_weights=weights.get("type", "float") == "float")  # fmt: skip


def _bnb(qc: dict) -> RepoQuantization:
    skip = list(qc.get("llm_int8_skip_modules") or [])
    if qc.get("load_in_8bit"):
        return RepoQuantization("bitsandbytes", "int8", bits=8, skip=skip)
    return RepoQuantization("bitsandbytes", qc.get("bnb_4bit_quant_type", "fp4"), bits=4,
                            double_quant=bool(qc.get("bnb_4bit_use_double_quant")), skip=skip)  # fmt: skip


def repo_quantization(config) -> RepoQuantization | None:
    """The checkpoint's own quantization, or ``None`` for an ordinary checkpoint."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict) and not hasattr(qc, "to_dict"):  # a string or a list in config.json
        raise EstimateError(
            f"quantization_config is {str(qc)[:60]!r} ({type(qc).__name__}), not an object such as "
            '{"quant_method": "gptq", "bits": 4}; fix the config.json (or remove the field for an unquantized model)'
        )
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method", "")
    method = str(getattr(method, "value", method)).lower()  # a loaded model's config holds the enum
    if method == "bitsandbytes":
        return _bnb(qc)
    if method in PACKED_METHODS:
        bits, group = _packed_bits_group(qc, method)
        skip = list(qc.get("modules_to_not_convert") or [])
        return RepoQuantization(method, method, bits=bits, group_size=group, skip=skip)
    if method == "mxfp4":  # gpt-oss: uint8 blocks of two fp4 values, one uint8 (e8m0) scale per 32 values
        return RepoQuantization("mxfp4", "mxfp4", bits=4, group_size=32, skip=_names(qc, "modules_to_not_convert"))
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed(qc)
    raise EstimateError(
        f"this checkpoint is quantized with {method or 'an unnamed method'!r}, which the estimator does not "
        "know; it reads bitsandbytes, GPTQ, AWQ, mxfp4, fp8 and compressed-tensors checkpoints"
    )


def packed_rows(lay: Layout, rq: RepoQuantization, dtype_bytes: int) -> list[EstimateRow]:
    """GPTQ/AWQ: per quantized linear (in k, out o, group g) qweight k*o*bits/8 and qzeros ceil(k/g)*o*bits/8
    (int32-packed), fp16 scales ceil(k/g)*o*2, and for GPTQ the int32 g_idx, 4*k."""
    not_convert = list(set(lay.not_convert) | set(rq.skip))
    packed = state = plain = buffers = n = 0
    for e in lay.entries:
        if e.module == "buffer":
            buffers += e.numel * (e.fixed_bytes or dtype_bytes)
        elif e.linear is not None and should_convert(e.module, not_convert):
            o, k = e.linear
            groups = math.ceil(k / (k if rq.group_size <= 0 else rq.group_size))
            packed += k * o * rq.bits // 8
            state += groups * o * rq.bits // 8 + groups * o * 2 + (4 * k if rq.method == "gptq" else 0)
            n += 1
        else:
            plain += e.numel * dtype_bytes
    what = f"{rq.bits}-bit, group {rq.group_size}"
    return [
        EstimateRow("weights.quantized", f"weights: {rq.method} packed linear layers", packed, "formula",
                    f"{n} layers, {what}"),
        EstimateRow("weights.quant_state", "weights: zeros, scales" + (", g_idx" if rq.method == "gptq" else ""),
                    state, "formula", "int32 zeros, fp16 scales per group"),
        EstimateRow("weights.unquantized", "weights: unquantized (embeddings, norms, lm_head)", plain, "exact",
                    tied_note(lay)),
        EstimateRow("weights.buffers", "weights: buffers", buffers, "exact", "rotary tables, masks"),
    ]  # fmt: skip
