"""mxfp4 and fp8 checkpoints: which path transformers takes on a machine, and the weights of each.

transformers keeps a pre-quantized mxfp4 checkpoint (gpt-oss) packed only with compute capability >= 7.5,
Triton >= 3.4 and the ``kernels`` package (``Mxfp4HfQuantizer.validate_environment``), and a fine-grained
fp8 one (DeepSeek-V3, Qwen3-FP8) only with compute capability >= 8.9 (``FineGrainedFP8HfQuantizer``);
anywhere else it dequantizes the weights to bf16 at load: 2 bytes per value instead of ~0.53 or ~1. A
compressed-tensors checkpoint loads compressed and is decompressed on its first forward pass
(``CompressedTensorsHfQuantizer``), so what it holds while it runs is dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.units import format_bytes
from ..core.vocab import BF16
from .layout import Layout, fp32_modules, should_convert, tied_note, weight_rows
from .prequantized import RepoQuantization
from .rows import EstimateError, EstimateRow

__all__ = ["KernelPath", "kernel_path", "mxfp4_software", "native_rows", "dequantized_rows", "DEQUANTIZED",
           "MXFP4_CAPABILITY", "FP8_CAPABILITY"]  # fmt: skip

DEQUANTIZED = BF16  # what transformers dequantizes mxfp4 and fp8 weights to
MXFP4_CAPABILITY = (7, 5)  # transformers' rule: T4, L4, A100, H100 run the mxfp4 Triton kernels
FP8_CAPABILITY = (8, 9)  # fp8 matmuls: L4, RTX 4090, H100; a T4 (7.5) or an A100 (8.0) dequantizes
_FP8_CARDS = "a card with compute capability >= 8.9 (L4, RTX 4090, H100)"


@dataclass
class KernelPath:
    """The load a pre-quantized checkpoint gets on a machine: ``load`` is the format kept ("mxfp4", "fp8")
    or "bf16" (dequantized); ``why`` says what decided it and ``fix`` what keeps the format (empty when kept)."""

    load: str
    why: str
    fix: str = ""

    @property
    def dequantized(self) -> bool:
        return self.load == DEQUANTIZED

    def __str__(self) -> str:
        return f"{self.load}: {self.why}" + (f"; fix: {self.fix}" if self.fix else "")


def mxfp4_software() -> tuple[bool, bool]:
    """``(triton, kernels)``: whether this environment has Triton >= 3.4 and a ``kernels`` version that
    transformers accepts, asked of transformers' own probes (the versions it checks move with it)."""
    from transformers.utils import is_kernels_available, is_triton_available

    return is_triton_available("3.4.0"), is_kernels_available()


def _mxfp4(dev: dict | None, requested: str) -> KernelPath:
    bnb = "a bitsandbytes 4-bit checkpoint of the same model"
    if dev is None:
        return KernelPath(DEQUANTIZED, "on the CPU transformers dequantizes mxfp4 to bf16 (unless use_kernels=True)",
                          f"load it on a GPU with compute capability >= 7.5, or {bnb}")  # fmt: skip
    cap = dev.get("capability")
    name = dev.get("name", "this GPU")
    if cap is not None and tuple(cap) < MXFP4_CAPABILITY:
        return KernelPath(DEQUANTIZED, f"{name} has compute capability {cap[0]}.{cap[1]} < 7.5: transformers "
                          "dequantizes mxfp4 to bf16", f"{bnb}, or a bigger card")  # fmt: skip
    if requested == "mxfp4":
        return KernelPath("mxfp4", f"mxfp4 kept (as asked: Triton >= 3.4 and the `kernels` package on {name})")
    triton, kernels = mxfp4_software()
    missing = [w for w, ok in (("Triton >= 3.4", triton), ("the `kernels` package", kernels)) if not ok]
    if missing:
        return KernelPath(DEQUANTIZED, f"this environment lacks {' and '.join(missing)}: transformers dequantizes "
                          "mxfp4 to bf16", f"pip install -U kernels triton (transformers then keeps mxfp4), {bnb}, "
                          "or a bigger card")  # fmt: skip
    return KernelPath("mxfp4", f"mxfp4 kept: {name} (compute >= 7.5) with Triton >= 3.4 and `kernels`")


def _fp8(dev: dict | None) -> KernelPath:
    bnb = "a bitsandbytes 4-bit checkpoint of the same model"
    if dev is None:
        return KernelPath(DEQUANTIZED, "without a GPU transformers dequantizes fp8 to bf16", f"{_FP8_CARDS}, or {bnb}")
    cap = dev.get("capability")
    name = dev.get("name", "this GPU")
    if cap is not None and tuple(cap) < FP8_CAPABILITY:
        return KernelPath(DEQUANTIZED, f"{name} has compute capability {cap[0]}.{cap[1]} < 8.9 (no fp8 matmuls): "
                          "transformers dequantizes fp8 to bf16", f"{bnb}, or {_FP8_CARDS}")  # fmt: skip
    known = "" if cap is not None else " (its compute capability is not known: taken as >= 8.9)"
    return KernelPath("fp8", f"fp8 kept on {name}{known}")


def _training_path(rq: RepoQuantization, requested: str, full: bool) -> KernelPath | None:
    """Training takes the dequantized load where the packed one cannot train: transformers' mxfp4 quantizer is
    not trainable at all (``is_trainable`` False: LoRA too), and full fine-tuning trains 16-bit weights."""
    if requested == DEQUANTIZED or not (rq.method == "mxfp4" or full):
        return None
    what = "full fine-tuning trains 16-bit weights" if full else "transformers cannot train mxfp4 weights"
    if requested == rq.load:
        raise EstimateError(
            f"{what}, and load={requested!r} keeps them {rq.method}: pass load='bf16' (the checkpoint loaded with "
            f"dequantize=True{', as OpenAI fine-tunes gpt-oss' if rq.method == 'mxfp4' else ''}) or load='auto'"
        )
    return KernelPath(DEQUANTIZED, f"{what}: {rq.method} dequantized to bf16 for training (dequantize=True)")


def kernel_path(
    rq: RepoQuantization, dev: dict | None, requested: str = "auto", training: str | None = None
) -> KernelPath:
    """What transformers does with ``rq`` on ``dev`` (a device preset's dict, ``None`` for the CPU).

    ``requested``: "auto" follows this environment's software (Triton, ``kernels``); the format's own name
    ("mxfp4") states the target has them; "bf16" asks for the dequantized load (``dequantize=True``). The
    hardware rule (compute capability) holds whatever is asked: transformers applies it at load.
    ``training``: None (generation), "lora" or "full"."""
    if rq.method != "compressed-tensors" and training is not None:
        trained = _training_path(rq, requested, training == "full")
        if trained is not None:
            return trained
    if rq.method == "compressed-tensors":
        return KernelPath(DEQUANTIZED, "compressed-tensors loads compressed and decompresses each layer on the "
                          "first forward pass: dense bf16 while it runs", "a bitsandbytes 4-bit checkpoint of the "
                          "same model, or a bigger card")  # fmt: skip
    if requested == DEQUANTIZED:
        return KernelPath(DEQUANTIZED, f"{rq.method} dequantized to bf16 (as asked: dequantize=True)")
    return _mxfp4(dev, requested) if rq.method == "mxfp4" else _fp8(dev)


def _is_expert_weight(name: str) -> bool:
    # transformers 5 holds an MoE layer's experts as 3-D parameters (experts.gate_up_proj, experts.down_proj)
    return ".experts." in f".{name}" and not name.endswith("bias")


def native_rows(lay: Layout, rq: RepoQuantization, b: int) -> list[EstimateRow]:
    """The weights as transformers holds an mxfp4 or fp8 checkpoint it keeps packed.

    mxfp4 (``Mxfp4GptOssExperts``): only the fused expert tensors, n values -> n/2 bytes of blocks and n/32
    uint8 scales; their biases are fp32. fp8 (``FP8Linear``/``FP8Experts``): every linear and expert tensor
    not skipped, 1 byte a value and one fp32 scale per weight block (one per tensor without blocks)."""
    skip = list(set(lay.not_convert) | set(rq.skip))
    fp32 = fp32_modules(lay, DEQUANTIZED)  # the checkpoint's own dtype, bf16
    packed = state = plain = buffers = n = 0
    for e in lay.entries:
        if e.module == "buffer":
            buffers += e.numel * (e.fixed_bytes or b)
            continue
        expert = e.linear is None and _is_expert_weight(e.name)
        if rq.method == "mxfp4" and expert and should_convert(e.module, skip):
            packed, state, n = packed + e.numel // 2, state + math.ceil(e.numel / rq.group_size), n + 1
        elif rq.method == "mxfp4" and e.linear is None and ".experts." in f".{e.name}":
            plain += 4 * e.numel  # the expert biases: Mxfp4GptOssExperts declares them fp32
        elif rq.method == "fp8" and (expert or e.linear is not None) and should_convert(e.module, skip):
            per_scale = rq.block[0] * rq.block[1] if rq.block else e.numel
            if e.linear is not None and rq.block:
                scales = math.ceil(e.linear[0] / rq.block[0]) * math.ceil(e.linear[1] / rq.block[1])
            else:
                scales = math.ceil(e.numel / per_scale)
            packed, state, n = packed + e.numel, state + 4 * scales, n + 1
        else:
            plain += e.numel * (4 if any(k in e.name for k in fp32) else b)
    if rq.method == "mxfp4":
        what = ("weights: mxfp4 expert tensors (two fp4 values a byte)", "weights: mxfp4 scales (one uint8 per 32)",
                f"{n} expert tensors")  # fmt: skip
    else:
        block = f"{rq.block[0]}x{rq.block[1]} blocks" if rq.block else "one per tensor"
        what = ("weights: fp8 linear layers and experts", f"weights: fp8 scales (fp32, {block})", f"{n} tensors")
    return [
        EstimateRow("weights.quantized", what[0], packed, "formula", what[2]),
        EstimateRow("weights.quant_state", what[1], state, "formula", "as transformers allocates them"),
        EstimateRow(
            "weights.unquantized",
            "weights: unquantized (embeddings, attention, norms, lm_head)"
            if rq.method == "mxfp4"
            else "weights: unquantized (embeddings, norms, lm_head)",
            plain,
            "exact",
            tied_note(lay),
        ),  # fmt: skip
        EstimateRow("weights.buffers", "weights: buffers", buffers, "exact", "rotary tables, masks"),
    ]


def dequantized_rows(lay: Layout, path: KernelPath, rq: RepoQuantization) -> list[EstimateRow]:
    """Every weight in bf16, as transformers holds a checkpoint it dequantized; the weights row says why."""
    rows = weight_rows(lay, DEQUANTIZED, 2)
    for r in rows:
        if r.key == "weights.unquantized":
            r.name = f"weights: bf16 (dequantized from {rq.method})"
            r.note = f"{path.why}; {r.note}"
    return rows


def path_note(path: KernelPath, rq: RepoQuantization, rows: list[EstimateRow], native: list[EstimateRow]) -> str:
    """The estimate's note on the path taken: dequantized weights against what the packed format would hold."""
    held = sum(r.bytes for r in rows if r.group == "weights")
    if not path.dequantized:
        return f"{path.why}: {format_bytes(held)} of weights"
    packed = sum(r.bytes for r in native if r.group == "weights")
    kept = f" ({format_bytes(packed)} kept as {rq.method})" if rq.method in ("mxfp4", "fp8") else ""
    fix = f". Fix: {path.fix}" if path.fix else ""
    return f"{path.why}: {format_bytes(held)} of weights{kept}{fix}"
