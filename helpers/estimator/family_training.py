"""The activations of a LoRA training step for the families beyond decoder-only LMs.

What trains follows :func:`helpers.estimator.families.frozen_modules`, as ``helpers.prepare_qlora``
sets it up:

- **T5** (text encoder-decoder): adapters in every layer of both stacks, so each encoder layer keeps its
  activations over the ``E`` encoder tokens and each decoder layer over the ``L`` label tokens, plus its
  cross-attention's keys and values (and their adapters' inputs) over the ``E`` encoder positions.
  T5 trains with dropout everywhere (``dropout_rate``, the attention probabilities' too).
- **Whisper**: the audio encoder is frozen and its mel input needs no gradient, so it runs without a
  graph (a transient: its widest layer, as in generation) and only its output stays; the decoder
  layers keep their activations over the labels and their cross-attention's keys and values over the
  encoder's positions (1500 for real Whisper), whatever the audio's length.
- **Vision-language**: the vision tower and projector are frozen and run without a graph (a transient
  at the start of the step); the LM trains as a decoder-only model over ``seq_len`` tokens, which hold
  each sample's image tokens (``helpers.training.family_data`` refuses an example longer than ``seq_len``, and
  ``probe_batch`` puts the image inside it).

Per token, the formulas count the tensors autograd keeps, found by what was alive at the peak of real
fp32 LoRA steps on CPU (the live-tensor tracker of ``bench/estimate_accuracy.py``): a frozen linear keeps
nothing of its input, only its adapter does (the dropout's mask, the dropped copy); a dropout whose input
needs no gradient keeps no mask; each norm keeps its input. Without checkpointing the peak is the loss's
start of backward on top of everything saved; with it, one recomputed layer with the gradients flowing
through it. The tiny T5, Whisper and LLaVA peak within 5 % of these rows, two shapes each, checkpointing
on and off (tests/test_estimate_family_training.py). Where CUDA differs (a 1-byte dropout mask, attention
kernels that keep no probabilities) the rows follow the kernels' documented saved tensors: not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from .families import SPEECH_SEQ2SEQ, family
from .family_rows import EncDecDims, encdec_dims, encoder_peak, encoder_positions, image_tokens, vision_tower_peak
from .layout import Param
from .reducers import loss_bytes
from .rows import EstimateRow

__all__ = ["seq2seq_activation_rows", "vlm_sequence", "vlm_layer_bytes", "vision_training_rows", "CROSS_ATTENTION"]

# the decoder's cross-attention modules, whose keys and values run over the encoder's positions
CROSS_ATTENTION = ("EncDecAttention", "encoder_attn", "crossattention")
_KV = ("k", "v", "k_proj", "v_proj", "key", "value")


@dataclass
class _Step:
    """One micro-batch's shape and what the kernels keep per element."""

    batch: int
    enc: int  # encoder positions per sample (E)
    dec: int  # label tokens per sample (L)
    b: int  # bytes per activation (the compute dtype)
    mask: int  # bytes a dropout keeps per element: CUDA's bool mask, the CPU's noise tensor in the dtype
    lora_mask: int  # the same for peft's dropout, whose input is fp32 (the adapters' dtype)
    probs: bool  # the attention kernel keeps its probabilities (CPU's math kernel when dropout is on)


def _lora_split(adapted: list[Param], tr, s: _Step, trained_encoder: bool) -> dict[str, int]:
    """Bytes peft's adapters keep per token, summed over each stack's layers: ``encoder`` (over E),
    ``decoder`` (over L) and ``cross`` (the cross-attention's key and value adapters, over E).

    As in the decoder-only formula: each adapter keeps its dropout's mask and the dropped fp32 copy of
    its input, which lora_A keeps (under 16-bit autocast its 16-bit cast instead, with or without
    dropout; without either, lora_A keeps the layer's own input: nothing more), and lora_A's r outputs.
    A dropout whose input needs no gradient keeps no mask: the cross-attention's key and value adapters
    read a frozen encoder's output (Whisper's)."""
    out = {"encoder": 0, "decoder": 0, "cross": 0}
    mask = s.lora_mask if tr.lora_dropout > 0 else 0
    kept = s.b if s.b < 4 else (4 if tr.lora_dropout > 0 else 0)
    for e in adapted:
        parts = e.module.split(".")
        per = e.linear[1] * (mask + kept) + tr.r * min(s.b, 4)
        if "encoder" in parts:
            out["encoder"] += per
        elif any(p in CROSS_ATTENTION for p in parts) and parts[-1] in _KV:
            out["cross"] += per - (0 if trained_encoder else e.linear[1] * mask)
        else:
            out["decoder"] += per
    return out


def _flash(d: EncDecDims, s: _Step) -> bool:
    """Whether the attention kernel keeps its output and log-sum-exp (flash / memory-efficient) rather than
    its probabilities (the CPU's math kernel, which dropout on the probabilities falls back to)."""
    return not (s.probs and d.attention_dropout > 0)


def _token_bytes(d: EncDecDims, s: _Step, ffn: int, heads: int) -> tuple[int, int, int]:
    """Bytes a layer keeps per token of its own stack (self-attention + feed-forward), per decoder token
    for its cross-attention, and per encoder position for the cross-attention's keys and values.

    The frozen linears keep nothing of their input (only their adapters do: ``_lora_split``); each norm
    keeps its input (the residual stream); the attention kernel q, k and v (the math kernel: q and k
    scaled, v) and, flash, its output and fp32 log-sum-exp; the feed-forward its activation's input
    (GELU) or output (ReLU), gated: the gate, its activation and the up projection; each dropout its mask."""
    h, inner, b = d.h, heads * d.hd, s.b
    drop = s.mask if d.dropout > 0 else 0
    out = (inner * b + 4 * heads) if _flash(d, s) else 0  # the kernel's output and log-sum-exp
    attn = h * b + 3 * inner * b + out + h * drop
    mlp = h * b + (3 if d.gated else 1) * ffn * b + ffn * drop + h * drop
    cross = h * b + inner * b + out + h * drop
    return attn + mlp, cross, 2 * inner * b


def _attention_bytes(d: EncDecDims, s: _Step, heads: int, q: int, k: int) -> int:
    """Per sample: what the math kernel keeps over the q x k scores (its softmax output, the dropout's
    noise and the dropped probabilities); nothing for a flash kernel."""
    return 0 if _flash(d, s) else heads * q * k * (2 * s.b + s.mask)


def _layers(d: EncDecDims, s: _Step, lora: dict[str, int], trained_encoder: bool) -> tuple[int, int, str]:
    """Bytes one encoder layer and one decoder layer keep for backward, and how they are made up."""
    enc_tok, _, _ = _token_bytes(d, s, d.enc_ffn, d.enc_heads)
    dec_tok, cross_tok, kv = _token_bytes(d, s, d.dec_ffn, d.dec_heads)
    nb, E, L = s.batch, s.enc, s.dec
    enc = 0
    if trained_encoder:
        enc = nb * E * (enc_tok + lora["encoder"] // max(1, d.enc_layers))
        enc += nb * _attention_bytes(d, s, d.enc_heads, E, E)
    dec = nb * L * (dec_tok + cross_tok + lora["decoder"] // max(1, d.dec_layers))
    dec += nb * E * (kv + lora["cross"] // max(1, d.dec_layers))
    dec += nb * (_attention_bytes(d, s, d.dec_heads, L, L) + _attention_bytes(d, s, d.dec_heads, L, E))
    note = f"{E} encoder positions, {L} label tokens x {nb}"
    return enc, dec, note


def _tail(d: EncDecDims, s: _Step, trained_encoder: bool) -> int:
    """What the stacks keep outside their layers: each trained stack's final norm input and dropout mask,
    T5's relative-position biases (the encoder's E x E, the decoder's L x L and its cross-attention's
    L x E zeros, one per model, held while their stack runs)."""
    drop = s.mask if d.dropout > 0 else 0
    tokens = s.dec + (s.enc if trained_encoder else 0)
    out = s.batch * tokens * d.h * (s.b + drop)
    if d.buckets:
        out += d.enc_heads * s.enc * s.enc * s.b + d.dec_heads * s.dec * (s.dec + s.enc) * s.b
    return out


def seq2seq_activation_rows(config, b: int, tr, adapted: list[Param], extra: dict, cpu: bool,
                            dequant: int = 0) -> list[EstimateRow]:  # fmt: skip
    """The activation rows of a LoRA step of T5 or Whisper: what the layers keep for backward, the loss's
    peak, the encoder's output (held by the decoder's checkpoints) and Whisper's frozen encoder pass.
    ``cpu``: the CPU's dropout keeps a noise tensor in the dtype (CUDA a 1-byte mask), and dropout on the
    attention probabilities sends it to the math kernel, which keeps them."""
    d = encdec_dims(config)
    speech = family(config) == SPEECH_SEQ2SEQ
    E, notes = encoder_positions(d, extra, tr.seq_len)
    s = _Step(tr.micro_batch, E, tr.seq_len, b, b if cpu else 1, 4 if cpu else 1, cpu)
    enc, dec, note = _layers(d, s, _lora_split(adapted, tr, s, not speech), trained_encoder=not speech)
    enc_layers = 0 if speech else d.enc_layers
    logits, loss_note = loss_bytes({"h": d.h, "vocab": d.vocab}, s.batch * s.dec, b, tr.loss)
    tail = _tail(d, s, trained_encoder=not speech)
    rows = []
    if tr.gradient_checkpointing:
        out = s.batch * E * d.h * b  # every decoder layer's checkpoint holds it for its recomputation
        rows.append(EstimateRow("activations.encoder_output", "encoder output", out, "formula",
                                f"{s.batch} x {E} x {d.h} x {b} B, held by the decoder layers' checkpoints; "
                                + "; ".join(notes or [f"{E} encoder tokens"])))  # fmt: skip
        saved = (enc_layers * E + d.dec_layers * s.dec) * s.batch * d.h * b + tail
        rows.append(EstimateRow("activations.saved", "activations (gradient checkpointing)", saved, "formula",
                                "one hidden state per layer" + ("" if speech else ", encoder and decoder")
                                + " (the frozen encoder keeps none)" * speech))  # fmt: skip
        # while a layer is recomputed and run backward, the gradients flowing through it (the hidden state's,
        # its norms') and its feed-forward activation's output are alive too (measured: about 3 hidden
        # states and one feed-forward width per token)
        enc += s.batch * E * (3 * d.h + d.enc_ffn) * b if enc else 0
        dec += s.batch * s.dec * (3 * d.h + d.dec_ffn) * b
        rows.append(EstimateRow("activations.backward_peak", "backward peak: logits + loss or one recomputed layer",
                                max(logits, max(enc, dec) + dequant), "formula",
                                f"{loss_note}, or one layer's activations and its gradients ({note})"))  # fmt: skip
    else:
        # without checkpointing nothing makes the embeddings need a gradient: each trained stack's first
        # norm keeps nothing and the adapters after it (q, k, v) keep no dropout mask
        first = s.batch * (s.dec + (0 if speech else E)) * d.h * (b + 3 * (s.lora_mask if tr.lora_dropout else 0))
        rows.append(EstimateRow("activations.saved", "activations (no checkpointing)",
                                enc_layers * enc + d.dec_layers * dec + tail - first, "formula",
                                f"tensors kept for backward: {enc_layers} encoder and {d.dec_layers} decoder "
                                f"layers ({note}); " + "; ".join(notes or [f"{E} encoder tokens"])))  # fmt: skip
        rows.append(EstimateRow("activations.loss", f"logits + loss ({tr.loss})", logits, "formula", loss_note))
        if dequant:
            rows.append(EstimateRow("activations.dequantized", "dequantized weight (backward)", dequant, "formula",
                                    "largest layer, transient"))  # fmt: skip
    if speech:
        peak, what = encoder_peak(d, s.batch, E, b, generate=False)
        held = sum(r.bytes for r in rows)
        rows.append(EstimateRow("activations.encoder", "frozen audio encoder's pass (no graph)", max(0, peak - held),
                                "formula", f"its widest layer ({what}) holds {format(peak, ',')} B before the "
                                "decoder runs; this is what it adds above the rest of the step"))  # fmt: skip
    return rows


def vlm_sequence(config, tr, extra: dict) -> tuple[int, int, int, str]:
    """The LM's tokens per sample in training (``seq_len``, which holds the image tokens; at least the
    image tokens + 1), the images per sample, the tokens per image and how they follow from the config."""
    images = 1 if extra.get("images") is None else extra["images"]
    per, note = image_tokens(config, extra.get("image_size"))
    return max(tr.seq_len, images * per + 1), images, per, note


def vlm_layer_bytes(d: dict, b: int, tr, adapted: list[Param], cpu: bool) -> tuple[int, int] | None:
    """Bytes one LM layer of a VLM keeps per token in an fp32 step (``None`` under 16-bit compute: the
    decoder-only formula, measured there, applies), counted as for T5 and Whisper: each norm its input,
    attention q (after rotary), k, v (key-value heads), its output and fp32 log-sum-exp, the MLP its gate,
    activation and up projection; per adapter its dropout's mask (the CPU's fp32 noise), the dropped copy
    and lora_A's r outputs. (The decoder-only formula, measured on 16-bit steps, counts about a quarter
    more for an fp32 step on CPU: the tiny LLaVA's LM, tests/test_estimate_family_training.py.) Second:
    what a recomputed layer's backward adds per token under checkpointing, as in T5 and Whisper."""
    if b < 4:
        return None
    layers = max(1, d["layers"])
    h, inner, kv = d["h"], d["heads"] * d["hd"], d["kv"] * d["hd"]
    base = 2 * h * b + (2 * inner + 2 * kv) * b + 4 * d["heads"] + 3 * d["inter"] * b
    mask = (4 if cpu else 1) if tr.lora_dropout > 0 else 0
    kept = 4 if tr.lora_dropout > 0 else 0
    lora = sum(e.linear[1] * (mask + kept) + tr.r * 4 for e in adapted) // layers
    return base + lora, (3 * h + d["inter"]) * b


def vision_training_rows(config, tr, extra: dict, b: int, lm_rows: int) -> list[EstimateRow]:
    """The frozen vision tower's pass at the start of the step (no graph: a transient), as what it adds
    above ``lm_rows`` (the LM's activation rows)."""
    _, images, per, note = vlm_sequence(config, tr, extra)
    n = tr.micro_batch * images
    if not n:
        return []
    tower, patches = vision_tower_peak(config, n, b)
    return [EstimateRow("activations.vision", "frozen vision tower's pass (no graph)", max(0, tower - lm_rows),
                        "formula", f"{n} images x {patches} patches ({images} x {per} tokens in each sample's "
                        f"{tr.seq_len}: {note}); its widest layer holds {format(tower, ',')} B before the LM "
                        "runs; this is what it adds above the LM's rows")]  # fmt: skip
