"""Training settings and the rows of one training step: adapters, gradients, optimizer, activations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.arguments import flag, number, whole_number
from ..core.vocab import DEFAULTS, MODES, QUANTIZED
from .families import IMAGE_TEXT, SEQ2SEQ, SPEECH_SEQ2SEQ, family
from .family_training import (
    head_input_row,
    seq2seq_activation_rows,
    vision_training_rows,
    vlm_layer_bytes,
    vlm_sequence,
)
from .layout import Layout, adapted_linears, dims, should_convert
from .reducers import loss_bytes, offload_rows
from .rows import EstimateError, EstimateRow

__all__ = ["OPTIMIZERS", "LoraTraining", "FullTraining", "training_rows"]

OPTIMIZERS = {  # bytes of optimizer state per trainable parameter (None: same dtype as the parameter, x2)
    "adamw_torch": None, "adamw": None, "paged_adamw_32bit": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2,
    "adamw_bnb_8bit": 2, "sgd": 0, "sgd_momentum": None, "adafactor": 0,
}  # fmt: skip
# States an optimizer of ``None`` above keeps per parameter, each in the parameter's dtype: AdamW its two
# moments, SGD with momentum the one momentum_buffer torch.optim.SGD allocates (plain SGD none: 0 above)
STATE_COPIES = {"sgd_momentum": 1}


def _state_copies(optimizer: str) -> int:
    return STATE_COPIES.get(optimizer, 2)


# Capacity as torch.cuda.get_device_properties().total_memory reports it (what OOM messages call


@dataclass
class LoraTraining:
    """LoRA / QLoRA fine-tuning settings that decide training memory.

    Args:
        r, alpha: LoRA rank and scale (alpha does not change memory).
        targets: "all-linear" (every quantizable linear but the output layer, as peft does) or a list
            of module-name suffixes such as ``["q_proj", "v_proj"]``.
        optimizer: "paged_adamw_8bit", "adamw_8bit" (2 bytes/param), "adamw_torch" or
            "paged_adamw_32bit" (8 bytes/param), "sgd".
        gradient_checkpointing: recompute activations in the backward pass (saves most of them).
        seq_len, micro_batch: tokens per sample and samples per step.
        lora_dropout: dropout > 0 stores a dropped copy of each adapted layer's input.
        loss: "plain", "chunked" or "fused" (see :mod:`helpers.estimator.reducers`).
        offload_activations: what the forward pass saves for backward waits in RAM.
    """

    r: int = 16
    alpha: int = 32
    targets: str | list[str] = "all-linear"
    optimizer: str = "paged_adamw_8bit"
    gradient_checkpointing: bool = True
    seq_len: int = DEFAULTS.seq_len
    micro_batch: int = DEFAULTS.micro_batch
    lora_dropout: float = 0.05
    loss: str = "plain"
    offload_activations: bool = False

    def __post_init__(self):
        whole_number("LoraTraining.r", self.r, error=EstimateError)
        number("LoraTraining.alpha", self.alpha, low=0, low_open=True, error=EstimateError)
        number("LoraTraining.lora_dropout", self.lora_dropout, low=0, high=1, high_open=True, error=EstimateError)
        targets = self.targets
        if targets != "all-linear" and (
            not isinstance(targets, list | tuple) or not targets or not all(isinstance(t, str) and t for t in targets)
        ):
            raise EstimateError(
                f"LoraTraining.targets must be 'all-linear' or a list of module names such as ['q_proj', "
                f"'v_proj'], got {targets!r}"
            )
        _check_common(self)


@dataclass
class FullTraining:
    """Full fine-tuning: every parameter trains (the load mode must be fp32, fp16 or bf16).

    Args:
        optimizer: as in :class:`LoraTraining`; "adamw_torch" keeps two states in the parameter dtype.
        master_weights: keep an fp32 copy of half-precision weights (mixed-precision training).
        loss, offload_activations: as in :class:`LoraTraining`.
    """

    optimizer: str = "adamw_torch"
    gradient_checkpointing: bool = True
    seq_len: int = DEFAULTS.seq_len
    micro_batch: int = DEFAULTS.micro_batch
    master_weights: bool = False
    loss: str = "plain"
    offload_activations: bool = False

    def __post_init__(self):
        flag("FullTraining.master_weights", self.master_weights, error=EstimateError)
        _check_common(self)


def _check_common(tr: LoraTraining | FullTraining) -> None:
    """What both kinds of training settings share: the optimizer, checkpointing and the step's shape."""
    kind = type(tr).__name__
    if not isinstance(tr.optimizer, str) or tr.optimizer not in OPTIMIZERS:
        raise EstimateError(f"{kind}.optimizer {tr.optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    flag(f"{kind}.gradient_checkpointing", tr.gradient_checkpointing, error=EstimateError)
    whole_number(f"{kind}.seq_len", tr.seq_len, error=EstimateError)
    whole_number(f"{kind}.micro_batch", tr.micro_batch, error=EstimateError)


def _lora_rows(
    lay: Layout, d: dict, b: int, tr: LoraTraining, encoder_decoder: bool = False
) -> tuple[list[EstimateRow], int, int, list]:
    """Adapters, their gradients and optimizer states; the bytes per token peft adds to activations; and
    the adapted layers (``encoder_decoder``: T5's fp32-kept ``wo`` adapts too, as peft's all-linear does)."""
    rows = []
    targets = tr.targets
    adapted = adapted_linears(lay, targets, fp32_kept_adapt=encoder_decoder)
    n_lora = sum(tr.r * (e.linear[0] + e.linear[1]) for e in adapted)
    if not adapted:
        raise EstimateError(f"LoRA targets {targets!r} match no linear layer of this model")
    trainable = n_lora
    rows.append(
        EstimateRow(
            "training.adapters", "LoRA adapters (fp32)", 4 * n_lora, "exact", f"{n_lora:,} parameters, r={tr.r}"
        )
    )
    rows.append(EstimateRow("training.gradients", "gradients (fp32)", 4 * n_lora, "exact"))
    per_param = OPTIMIZERS.get(tr.optimizer)
    rows.append(
        EstimateRow(
            "training.optimizer",
            f"optimizer states ({tr.optimizer})",
            (4 * _state_copies(tr.optimizer) if per_param is None else per_param) * n_lora,
            "formula",
            "AdamW 32-bit 8 bytes/param, 8-bit 2",
        )
    )
    if b < 4:  # under 16-bit autocast each adapter matmul keeps a 16-bit copy of its fp32 weights
        rows.append(EstimateRow("training.adapter_casts", "16-bit copies of the adapters (autocast)", b * n_lora,
                                "exact", "kept from forward to backward (measured on CUDA, fp16)"))  # fmt: skip
    # Per adapted layer, per token: dropout keeps its mask (1 B); lora_A keeps its input, which under
    # 16-bit autocast is the 16-bit cast of peft's fp32 input (b bytes; a 7B QLoRA step on CUDA,
    # docs/gpu_check.md) and without autocast the fp32 dropped copy (4 B); plus lora_A's r outputs.
    lora_in = sum(e.linear[1] for e in adapted) // max(1, d["layers"])
    mask = 1 if tr.lora_dropout > 0 else 0
    kept = b if b < 4 else (4 if tr.lora_dropout > 0 else 0)
    per_tok_lora = lora_in * (mask + kept) + len(adapted) // max(1, d["layers"]) * tr.r * min(b, 4)
    return rows, trainable, per_tok_lora, adapted


def _full_rows(lay: Layout, load: str, b: int, tr: FullTraining) -> tuple[list[EstimateRow], int]:
    """Gradients, optimizer states and master weights when every parameter trains."""
    rows = []
    if load in QUANTIZED or load not in MODES:  # bitsandbytes, or a GPTQ/AWQ/mxfp4/fp8 checkpoint's packed weights
        raise EstimateError(f"full fine-tuning cannot train {load} weights; use LoraTraining or load=bf16/fp16/fp32")
    trainable = lay.params
    pb = 4 if MODES[load].bits == 32 else b  # an fp32 load trains in fp32, a 16-bit one in its dtype
    rows.append(EstimateRow("training.gradients", f"gradients ({load})", pb * trainable, "exact"))
    per_param = OPTIMIZERS.get(tr.optimizer)
    # with fp32 master weights the optimizer steps the fp32 copy: its states are fp32 (mixed precision, K=12)
    sb = 4 if tr.master_weights else pb
    opt = _state_copies(tr.optimizer) * sb * trainable if per_param is None else per_param * trainable
    rows.append(
        EstimateRow(
            "training.optimizer",
            f"optimizer states ({tr.optimizer})",
            opt,
            "formula",
            f"torch: {_state_copies(tr.optimizer)} state(s) per parameter in {'fp32 (the master weights)' if sb == 4 and pb < 4 else 'its dtype'}"
            if per_param is None
            else "",
        )
    )
    if tr.master_weights and MODES[load].bits != 32:
        rows.append(EstimateRow("training.master_weights", "fp32 master weights", 4 * trainable, "exact"))
    return rows, trainable


def _per_token_layer(d: dict, b: int, upcast: bool) -> int:
    """Bytes one decoder layer keeps for backward per token, adapters aside."""
    h, inter, heads, kv, hd = d["h"], d["inter"], d["heads"], d["kv"], d["hd"]
    if upcast:
        # QLoRA under 16-bit autocast, by the tensors autograd kept in a 7B step on CUDA (docs/gpu_check.md):
        # each RMSNorm its fp32 input; SDPA q, k, v and its output in 16 bits (k and v counted at full
        # heads: expanded for grouped-query attention) and its fp32 log-sum-exp; bitsandbytes hands
        # its output back in the input's dtype, so the MLP keeps gate, act(gate) and up in fp32.
        return 2 * 4 * h + b * 4 * heads * hd + 4 * heads + 3 * 4 * inter
    # Otherwise (measured on CPU with live-tensor tracking, bench/estimate_accuracy.py): each RMSNorm
    # keeps its fp32 upcast, the normalized fp32 value and the cast-back output; attention keeps q and
    # k before and after rotary, v, the GQA-expanded k/v, its output and the o_proj input; the MLP
    # keeps gate, act(gate), up and their product.
    attn = 3 * heads * hd + 3 * kv * hd + (2 * heads * hd if kv < heads else 0) + 2 * h
    return 2 * (8 * h + b * h) + b * attn + 4 * b * inter


def _dequantized(lay: Layout, load: str, b: int) -> int:
    """A quantized layer's weight is dequantized to the compute dtype for each matmul (forward and
    backward): the largest one, twice, is alive at once. The output layer stays unquantized."""
    if load not in QUANTIZED:
        return 0
    biggest = max(
        (e.linear[0] * e.linear[1] for e in lay.entries if e.linear and should_convert(e.module, lay.not_convert)),
        default=0,
    )
    return 2 * biggest * b


def _activation_rows(lay: Layout, d: dict, load: str, b: int, tr, per_tok_lora: int,
                     layer_bytes: tuple[int, int] | None = None) -> list[EstimateRow]:  # fmt: skip
    """What the forward pass keeps for backward, the loss's peak and the dequantized weights (``layer_bytes``:
    a family's own bytes per token and layer, adapters included, instead of the formula's, and what a
    recomputed layer's backward adds per token under checkpointing)."""
    rows = []
    seq, mb = tr.seq_len, tr.micro_batch
    h, upcast = d["h"], load in QUANTIZED and b < 4
    per_tok, recompute = (_per_token_layer(d, b, upcast) + per_tok_lora, 0) if layer_bytes is None else layer_bytes
    # The loss's peak comes at the start of backward: log-softmax's fp32 output (saved), its incoming
    # gradient and the gradient it returns, each batch x seq x vocab x 4 B (the model's own logits
    # and the fp32 upcast are gone by then: measured with live-tensor tracking); a chunked or fused
    # loss holds them for one chunk of tokens (estimator/reducers.py).
    logits, loss_note = loss_bytes(d, mb * seq, b, tr.loss)
    dequant = _dequantized(lay, load, b)
    # QLoRA (prepare_model_for_kbit_training) upcasts the embeddings, norms and output layer to fp32:
    # the residual stream every layer takes as input is fp32, and under 16-bit autocast the output
    # layer's matmul keeps a 16-bit copy of its fp32 weight until its backward (at the loss's peak).
    if upcast:
        rows.append(
            EstimateRow("activations.lm_head_copy", "16-bit copy of the fp32 output layer (autocast)",
                        d["vocab"] * h * b, "formula", "vocab x hidden, kept from its forward to its backward")
        )  # fmt: skip
    if tr.gradient_checkpointing:
        # Only each layer's input is kept; one layer's activations are recomputed at a time during
        # backward, after the loss's buffers are freed, so the peak is the larger of the two.
        saved = d["layers"] * mb * seq * h * (4 if upcast else b)
        rows.append(
            EstimateRow(
                "activations.saved",
                "activations (gradient checkpointing)",
                saved,
                "formula",
                "one hidden state per layer" + (" (fp32: the upcast residual stream)" if upcast else ""),
            )
        )
        layer = mb * seq * (per_tok + recompute) + dequant
        rows.append(
            EstimateRow(
                "activations.backward_peak",
                "backward peak: logits + loss or one recomputed layer",
                max(logits, layer),
                "formula",
                f"{loss_note}, or one layer's activations",
            )
        )
    else:
        saved = d["layers"] * mb * seq * per_tok
        rows.append(
            EstimateRow(
                "activations.saved",
                "activations (no checkpointing)",
                saved,
                "formula",
                "tensors kept for backward, per layer and token"
                + (" (as measured in a 7B QLoRA step on CUDA)" if upcast else ""),
            )
        )
        rows.append(EstimateRow("activations.loss", f"logits + loss ({tr.loss})", logits, "formula", loss_note))
    if dequant and not tr.gradient_checkpointing:
        rows.append(
            EstimateRow("activations.dequantized", "dequantized weight (backward)", dequant, "formula",
                        "largest layer, transient")
        )  # fmt: skip
    return rows


def training_rows(lay: Layout, config, load: str, b: int, tr, unquantized: int = 0, extra: dict | None = None,
                  cpu: bool = False) -> tuple[list[EstimateRow], int]:  # fmt: skip
    """The rows of one training step and the number of trainable parameters (``unquantized``: the bytes of
    the weights a quantized load keeps in 16 bits, which QLoRA's preparation casts to fp32). ``extra``: the
    family inputs ``estimate()`` took (``encoder_tokens``, ``images``, ...); ``cpu``: the step runs on the
    CPU, whose dropout and attention kernels keep more than CUDA's (the family formulas count it)."""
    d = dims(config)
    fam = family(config)
    lora = isinstance(tr, LoraTraining)
    if lora:
        rows, trainable, per_tok_lora, adapted = _lora_rows(lay, d, b, tr, fam in (SEQ2SEQ, SPEECH_SEQ2SEQ))
        if load in QUANTIZED and b < 4:
            # peft's prepare_model_for_kbit_training casts every 16-bit parameter (embeddings, norms,
            # lm_head) to fp32 for training: those weights take twice the room they took after loading
            rows.insert(0, EstimateRow("training.fp32_upcast", "fp32 upcast of unquantized weights", unquantized,
                                       "exact", "prepare_model_for_kbit_training trains around fp32 norms and embeddings"))  # fmt: skip
    else:
        (rows, trainable), per_tok_lora = _full_rows(lay, load, b, tr), 0
    if fam in (SEQ2SEQ, SPEECH_SEQ2SEQ):
        adapted = adapted if lora else []
        rows += seq2seq_activation_rows(config, b, tr, adapted, extra or {}, cpu, _dequantized(lay, load, b), not lora)
    elif fam == IMAGE_TEXT:
        seq = vlm_sequence(config, tr, extra or {})[0]
        own = vlm_layer_bytes(d, b, tr, adapted if lora else [], cpu, full=not lora)
        lm = _activation_rows(lay, d, load, b, dataclasses.replace(tr, seq_len=seq), per_tok_lora, own)
        lm += [] if lora else [head_input_row(d, tr, seq, b)]
        rows += lm + vision_training_rows(config, tr, extra or {}, b, sum(r.bytes for r in lm), full=not lora)
    else:
        rows += _activation_rows(lay, d, load, b, tr, per_tok_lora)
    return (_offloaded(rows, d, b, tr) if tr.offload_activations else rows), trainable


def _offloaded(rows: list[EstimateRow], d: dict, b: int, tr) -> list[EstimateRow]:
    """The rows with activation offload: the saved activations (and the plain loss's saved fp32
    log-softmax, or Liger's gradient of the hidden states) in RAM, one layer's worth on the GPU."""
    tokens = tr.micro_batch * tr.seq_len
    loss_saved = {"plain": tokens * d["vocab"] * 4, "chunked": 0, "fused": tokens * d["h"] * b}[tr.loss]
    i = next(i for i, r in enumerate(rows) if r.key == "activations.saved")
    saved = rows[i].bytes
    new, _ = offload_rows(saved, saved // max(1, d["layers"]), loss_saved, tr.gradient_checkpointing)
    keep = [rows[i]] if tr.gradient_checkpointing else []
    return rows[:i] + keep + new + rows[i + 1 :]
