"""The activations of a training step (LoRA, or full fine-tuning) for the families beyond decoder-only LMs.

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

Full fine-tuning trains every part: both stacks, Whisper's audio encoder (and its conv stem), a VLM's vision
tower and projector keep their activations, and every linear keeps its input (a norm's output, the attention's
output, the feed-forward's activation), each norm with a weight what its gradient needs. The tiny T5, Whisper
and LLaVA peak within 15 % of these rows in fp32 and bf16 on CPU, checkpointing on and off
(tests/test_estimate_family_full_training.py; bench/estimate_accuracy.py's full fine-tuning table).
"""

from __future__ import annotations

from dataclasses import dataclass

from .families import SPEECH_SEQ2SEQ, family
from .family_rows import EncDecDims, encdec_dims, encoder_peak, encoder_positions, image_tokens, vision_tower_peak
from .layout import Param
from .reducers import loss_bytes
from .rows import LOWER_BOUND, EstimateRow

__all__ = [
    "seq2seq_activation_rows", "vlm_sequence", "vlm_layer_bytes", "vision_training_rows", "head_input_row",
    "CROSS_ATTENTION",
]  # fmt: skip

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
    full: bool = False  # full fine-tuning: every weight trains, so every linear and norm keeps its input


def _lora_split(adapted: list[Param], tr, s: _Step, trained_encoder: bool) -> dict[str, int]:
    """Bytes peft's adapters keep per token, summed over each stack's layers: ``encoder`` (over E),
    ``decoder`` (over L) and ``cross`` (the cross-attention's key and value adapters, over E).

    As in the decoder-only formula: each adapter keeps its dropout's mask and the dropped fp32 copy of
    its input, which lora_A keeps (under 16-bit autocast its 16-bit cast instead, with or without
    dropout; without either, lora_A keeps the layer's own input: nothing more), and lora_A's r outputs.
    A dropout whose input needs no gradient keeps no mask: the cross-attention's key and value adapters
    read a frozen encoder's output (Whisper's)."""
    out = {"encoder": 0, "decoder": 0, "cross": 0}
    if not adapted:
        return out
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
    kv = 2 * inner * b
    if _upcast(d, s):  # the CPU's math kernel computes a 16-bit attention in fp32: q, k and v copies
        attn, cross, kv = attn + 3 * inner * 4, cross + inner * 4, kv + 2 * inner * 4
    if d.buckets and b < 4:  # T5's RMS norm keeps the fp32 upcast of its 16-bit input (for its variance)
        attn, mlp, cross = attn + 4 * h, mlp + 4 * h, cross + 4 * h
    if s.full:  # each norm's output (and T5's normalized value, for its weight), o's and wo's inputs
        norm = _norm_kept(d) * h * b
        attn, mlp, cross = attn + norm + inner * b, mlp + norm + ffn * b, cross + norm + inner * b
    return attn + mlp, cross, kv


def _upcast(d: EncDecDims, s: _Step) -> bool:
    """Whether the attention is the CPU's math kernel over 16-bit inputs, which it computes in fp32."""
    return not _flash(d, s) and s.b < 4


def _norm_kept(d: EncDecDims) -> int:
    """Hidden states a trained norm keeps beyond its input: its output (the next linear's input) and, for
    T5's RMS norm (written out in PyTorch ops), the normalized value its weight's gradient needs."""
    return 2 if d.buckets else 1


def _attention_bytes(d: EncDecDims, s: _Step, heads: int, q: int, k: int) -> int:
    """Per sample: what the math kernel keeps over the q x k scores (its softmax output, the dropout's
    noise and the dropped probabilities); nothing for a flash kernel."""
    if _flash(d, s):
        return 0
    return heads * q * k * (3 * 4 if _upcast(d, s) else 2 * s.b + s.mask)


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
    if s.full:
        # the output layer's input; T5's final norms their normalized value; Whisper's trained conv stem
        # (two GELUs' inputs over 2E and E frames and the second conv's input over 2E)
        out += s.batch * d.h * s.b * (s.dec + (tokens if d.buckets else 0) + (5 * s.enc if d.mel else 0))
    if d.buckets and s.b < 4:  # the final norms' fp32 upcasts
        out += s.batch * tokens * d.h * 4
    return out


def seq2seq_activation_rows(config, b: int, tr, adapted: list[Param], extra: dict, cpu: bool,
                            dequant: int = 0, full: bool = False) -> list[EstimateRow]:  # fmt: skip
    """The activation rows of a LoRA step of T5 or Whisper: what the layers keep for backward, the loss's
    peak, the encoder's output (held by the decoder's checkpoints) and Whisper's frozen encoder pass.
    ``cpu``: the CPU's dropout keeps a noise tensor in the dtype (CUDA a 1-byte mask), and dropout on the
    attention probabilities sends it to the math kernel, which keeps them. ``full``: a full fine-tuning
    step (``adapted`` empty): both stacks train, Whisper's audio encoder too, and every linear keeps its input."""
    d = encdec_dims(config)
    speech = family(config) == SPEECH_SEQ2SEQ
    trained = full or not speech  # whether the encoder trains (keeps its activations)
    E, notes = encoder_positions(d, extra, tr.seq_len)
    s = _Step(tr.micro_batch, E, tr.seq_len, b, b if cpu else 1, 4 if cpu else 1, cpu, full)
    enc, dec, note = _layers(d, s, _lora_split(adapted, tr, s, trained), trained_encoder=trained)
    enc_layers = d.enc_layers if trained else 0
    logits, loss_note = loss_bytes({"h": d.h, "vocab": d.vocab}, s.batch * s.dec, b, tr.loss)
    if tr.loss == "plain" and b < 4:  # T5, BART and Whisper take the cross-entropy of their 16-bit logits as they are
        logits, loss_note = s.batch * s.dec * d.vocab * 3 * b, f"batch x labels x vocab x 3 buffers of {b} B"
    tail = _tail(d, s, trained_encoder=trained)
    rows = []
    if tr.gradient_checkpointing:
        out = s.batch * E * d.h * b  # every decoder layer's checkpoint holds it for its recomputation
        rows.append(EstimateRow("activations.encoder_output", "encoder output", out, "formula",
                                f"{s.batch} x {E} x {d.h} x {b} B, held by the decoder layers' checkpoints; "
                                + "; ".join(notes or [f"{E} encoder tokens"])))  # fmt: skip
        saved = (enc_layers * E + d.dec_layers * s.dec) * s.batch * d.h * b + tail
        rows.append(EstimateRow("activations.saved", "activations (gradient checkpointing)", saved, "formula",
                                "one hidden state per layer" + (", encoder and decoder" if trained else "")
                                + " (the frozen encoder keeps none)" * (not trained)))  # fmt: skip
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
        # (full fine-tuning: the embeddings train, and the cross-attention's k and v keep the encoder's output)
        first = (
            0
            if full
            else s.batch * (s.dec + (0 if speech else E)) * d.h * (b + 3 * (s.lora_mask if tr.lora_dropout else 0))
        )
        held = s.batch * E * d.h * b if full else 0
        rows.append(EstimateRow("activations.saved", "activations (no checkpointing)",
                                enc_layers * enc + d.dec_layers * dec + tail - first + held, "formula",
                                f"tensors kept for backward: {enc_layers} encoder and {d.dec_layers} decoder "
                                f"layers ({note}); " + "; ".join(notes or [f"{E} encoder tokens"])))  # fmt: skip
        rows.append(EstimateRow("activations.loss", f"logits + loss ({tr.loss})", logits, "formula", loss_note))
        if dequant:
            rows.append(EstimateRow("activations.dequantized", "dequantized weight (backward)", dequant, "formula",
                                    "largest layer, transient"))  # fmt: skip
    if speech and not trained:
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


def vlm_layer_bytes(d: dict, b: int, tr, adapted: list[Param], cpu: bool, full: bool = False) -> tuple[int, int] | None:
    """Bytes one LM layer of a VLM keeps per token in an fp32 step (``None`` under 16-bit compute: the
    decoder-only formula, measured there, applies), counted as for T5 and Whisper: each norm its input,
    attention q (after rotary), k, v (key-value heads), its output and fp32 log-sum-exp, the MLP its gate,
    activation and up projection; per adapter its dropout's mask (the CPU's fp32 noise), the dropped copy
    and lora_A's r outputs. (The decoder-only formula, measured on 16-bit steps, counts about a quarter
    more for an fp32 step on CPU: the tiny LLaVA's LM, tests/test_estimate_family_training.py.) Second:
    what a recomputed layer's backward adds per token under checkpointing, as in T5 and Whisper. ``full``:
    full fine-tuning, where each RMS norm also keeps its normalized value and its output (the next linear's
    input) and the down projection its input (``adapted`` is empty)."""
    if b < 4:
        return None
    layers = max(1, d["layers"])
    h, inner, kv = d["h"], d["heads"] * d["hd"], d["kv"] * d["hd"]
    base = 2 * h * b + (2 * inner + 2 * kv) * b + 4 * d["heads"] + 3 * d["inter"] * b
    if full:
        return base + (4 * h + d["inter"]) * b, (3 * h + d["inter"]) * b
    mask = (4 if cpu else 1) if tr.lora_dropout > 0 else 0
    kept = 4 if tr.lora_dropout > 0 else 0
    lora = sum(e.linear[1] * (mask + kept) + tr.r * 4 for e in adapted) // layers
    return base + lora, (3 * h + d["inter"]) * b


def vision_training_rows(config, tr, extra: dict, b: int, lm_rows: int, full: bool = False) -> list[EstimateRow]:
    """The frozen vision tower's pass at the start of the step (no graph: a transient), as what it adds
    above ``lm_rows`` (the LM's activation rows); ``full``: the trained tower's and projector's activations."""
    _, images, per, note = vlm_sequence(config, tr, extra)
    n = tr.micro_batch * images
    if not n:
        return []
    if full:
        return [_trained_vision_row(config, tr, n, per, b)]
    tower, patches = vision_tower_peak(config, n, b)
    return [EstimateRow("activations.vision", "frozen vision tower's pass (no graph)", max(0, tower - lm_rows),
                        "formula", f"{n} images x {patches} patches ({images} x {per} tokens in each sample's "
                        f"{tr.seq_len}: {note}); its widest layer holds {format(tower, ',')} B before the LM "
                        "runs; this is what it adds above the LM's rows")]  # fmt: skip


def head_input_row(d: dict, tr, seq: int, b: int) -> EstimateRow:
    """Full fine-tuning: the final RMS norm keeps its normalized value (for its weight) and the output layer its
    input, both outside the checkpointed layers, alive from the forward pass to the loss's backward."""
    tokens = tr.micro_batch * seq
    return EstimateRow(
        "activations.head_input",
        "final norm and output layer's input (trained)",
        2 * tokens * d["h"] * b,
        "formula",
        f"{tokens} tokens x 2 x {d['h']} x {b} B",
    )


def _trained_vision_row(config, tr, n: int, per: int, b: int) -> EstimateRow:
    """What a trained vision tower and projector keep for backward over ``n`` images of ``per`` tokens each.

    Per patch and layer (measured on the tiny LLaVA's CLIP tower, fp32 on CPU): each LayerNorm its input and
    output (the next linear's), attention q, k, v, its output and fp32 log-sum-exp, the MLP fc2's input and
    the activation's input (quick GELU its sigmoid's output too); the pre- and post-layer norms their input.
    Under checkpointing, one hidden state per layer. The projector keeps its input and its two linears'
    widths per image token."""
    vc = config.vision_config
    hv = getattr(vc, "hidden_size", 0) or getattr(vc, "embed_dim", 0)
    inter = getattr(vc, "intermediate_size", None) or int(getattr(vc, "mlp_ratio", 4) * hv)
    layers = getattr(vc, "num_hidden_layers", None) or getattr(vc, "depth", 0)
    heads = getattr(vc, "num_attention_heads", None) or getattr(vc, "num_heads", 1)
    patches = vision_tower_peak(config, n, b)[1]
    act = 3 if getattr(vc, "hidden_act", "") == "quick_gelu" else 2
    per_layer = hv * b if tr.gradient_checkpointing else (8 * hv + act * inter) * b + 4 * heads
    h = config.get_text_config().hidden_size
    out = n * patches * (layers * per_layer + 2 * hv * b) + n * per * (hv + 2 * h) * b
    what = "one hidden state per layer (checkpointing)" if tr.gradient_checkpointing else "every layer's activations"
    note = f"{n} images x {patches} patches x {layers} layers: {what}; projector over {n} x {per} tokens"
    if not (hv and layers):  # a tower whose config names its width or depth otherwise: the projector alone counted
        return EstimateRow("activations.vision", "vision tower and projector (trained)", out, LOWER_BOUND,
                           "the vision config gives no hidden size or layer count: its tower's activations are not "
                           "counted, only the projector's; " + note)  # fmt: skip
    return EstimateRow("activations.vision", "vision tower and projector (trained)", out, "formula", note)
