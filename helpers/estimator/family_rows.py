"""The generation rows of the families beyond decoder-only LMs, and the inputs only they take.

Encoder-decoder (T5, BART, Whisper): ``generate()`` runs the encoder once over the whole input, keeps
its output and every decoder layer's cross-attention keys and values (encoder length long), then
decodes token by token with its own KV cache. The peak is the larger of two moments: the encoder's
widest layer (with Whisper's two copies of the mel features, T5's relative-position buckets: six
int64 E x E matrices and a bool one, and its position bias with the mask added, B x heads x E x E),
and the decoding state at the last token (encoder output, both caches, logits). The encoder row is
what its pass adds above the decoding state. Measured on CPU with a tracker of live tensors, the
tiny T5 and Whisper peak within 1 % of these phases.

Vision-language (LLaVA, Qwen2-VL): the image tokens join the prompt (``images`` per sample x tokens per
image, from the vision config and the processor's resolution), the embeddings with the image features
scattered in are held through the LM's forward pass, and the vision tower runs first over every image
of the batch (its row: what its widest layer adds above the LM's prefill state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.arguments import whole_number
from .families import FAMILIES, IMAGE_TEXT, SEQ2SEQ, SPEECH_SEQ2SEQ, family
from .rows import EstimateError, EstimateRow

__all__ = [
    "FAMILY_INPUTS", "EncDecDims", "check_family_inputs", "encdec_dims", "encoder_peak", "encoder_positions",
    "encoder_decoder_rows", "image_tokens", "vision_rows", "vision_tower_peak",
]  # fmt: skip

# each family input and the families that take it
FAMILY_INPUTS = {
    "encoder_tokens": (SEQ2SEQ,),
    "audio_seconds": (SPEECH_SEQ2SEQ,),
    "images": (IMAGE_TEXT,),
    "image_size": (IMAGE_TEXT,),
}
T5_BUCKET_BYTES = 6 * 8 + 1  # per E x E entry: six int64 matrices of _relative_position_bucket and a bool
SAMPLE_RATE, HOP = 16000, 160  # Whisper's feature extractor: 100 mel frames a second, 2 per encoder position


def check_family_inputs(config, given: dict) -> None:
    """Refuse a family input the model's family has none of, or a value out of range."""
    fam = family(config)
    for key, value in given.items():
        if value is None:
            continue
        if fam not in FAMILY_INPUTS[key]:
            takes = " or ".join(FAMILIES[f] for f in FAMILY_INPUTS[key])
            raise EstimateError(
                f"{key}= is for the family {takes}; this model ({getattr(config, 'model_type', '?')}) is "
                f"{FAMILIES[fam]}, which takes no {key}: leave it out"
            )
        if key == "audio_seconds":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 10**6:
                raise EstimateError(f"audio_seconds must be a positive number of seconds, got {value!r}")
        elif key == "image_size":
            sizes = value if isinstance(value, tuple | list) else (value,)
            if len(sizes) not in (1, 2):
                raise EstimateError(f"image_size must be one size or (height, width) in pixels, got {value!r}")
            for s in sizes:
                whole_number("image_size", s, error=EstimateError)
        else:
            whole_number(key, value, minimum=0 if key == "images" else 1, error=EstimateError)


@dataclass
class EncDecDims:
    """The sizes an encoder-decoder's activations follow, read from its config."""

    h: int
    enc_layers: int
    dec_layers: int
    enc_heads: int
    dec_heads: int
    hd: int
    enc_ffn: int
    gated: bool
    vocab: int
    buckets: bool  # T5's relative position bias
    mel: int  # Whisper's mel bins (0: a text encoder)
    positions: int  # Whisper's encoder positions (max_source_positions)
    dec_ffn: int = 0  # the decoder's feed-forward width (T5: d_ff, as the encoder's)
    dropout: float = 0.0  # the model's own dropout (T5's dropout_rate, Whisper's dropout), on in training
    attention_dropout: float = 0.0  # dropout of the attention probabilities (T5: dropout_rate as well)


def encdec_dims(config) -> EncDecDims:
    """The encoder and decoder sizes of a T5/BART/Whisper config (EstimateError when they are missing)."""
    g = lambda *names, default=0: next((getattr(config, n) for n in names if getattr(config, n, None)), default)  # noqa: E731
    h = g("d_model", "hidden_size")
    enc_heads = g("encoder_attention_heads", "num_heads", "num_attention_heads")
    if not h or not enc_heads or not g("vocab_size"):
        raise EstimateError("the config lacks d_model, the attention heads or vocab_size; pass the full config.json")
    enc_layers = g("encoder_layers", "num_layers", "num_hidden_layers")
    return EncDecDims(
        h=h, enc_layers=enc_layers, dec_layers=g("decoder_layers", "num_decoder_layers", default=enc_layers),
        enc_heads=enc_heads, dec_heads=g("decoder_attention_heads", "num_heads", default=enc_heads),
        hd=g("d_kv", default=h // enc_heads), enc_ffn=g("encoder_ffn_dim", "d_ff", default=4 * h),
        gated=bool(getattr(config, "is_gated_act", False)), vocab=g("vocab_size"),
        buckets=bool(getattr(config, "relative_attention_num_buckets", 0)), mel=g("num_mel_bins"),
        positions=g("max_source_positions"), dec_ffn=g("decoder_ffn_dim", "d_ff", default=4 * h),
        dropout=float(g("dropout_rate", "dropout", default=0.0)),
        attention_dropout=float(g("dropout_rate", "attention_dropout", default=0.0)),
    )  # fmt: skip


def encoder_peak(d: EncDecDims, batch: int, e: int, b: int, generate: bool = True) -> tuple[int, str]:
    """The encoder's widest moment over ``e`` positions and what it is (``generate``: with the two copies
    of the mel features ``generate()`` makes; a training step hands the batch's features in as they are)."""
    t, inner = batch * e, d.enc_heads * d.hd
    # input, residual, normed; q, k, v, the output (and, in Whisper's attention, its transposed copy)
    attn = t * (3 * d.h + (4 if d.buckets else 5) * inner) * b
    mlp = t * (3 * d.h + (3 if d.gated else 2) * d.enc_ffn) * b
    phases = {"attention": attn, "MLP": mlp}
    if d.buckets:
        bias = 2 * d.enc_heads * e * e * b  # the bias embedding (E, E, heads) and its (1, heads, E, E) copy
        phases = {"attention": attn + bias, "MLP": mlp + bias}
        phases["relative-position buckets"] = T5_BUCKET_BYTES * e * e + t * (2 * d.h + 3 * inner) * b
    features = 2 * batch * d.mel * 2 * e * b if generate else 0  # the mel features sliced and concatenated again
    what = max(phases, key=phases.get)
    return phases[what] + features, what + (f", {format(features, ',')} B of mel features" if features else "")


def encoder_positions(d: EncDecDims, extra: dict, tokens: int) -> tuple[int, list[str]]:
    """The encoder's positions per sample and what decides them: Whisper's padded window whatever the
    audio's length, else ``encoder_tokens`` (default ``tokens``, the prompt or the training seq_len)."""
    if not d.mel:
        return extra.get("encoder_tokens") or tokens, []
    e = d.positions
    window = 2 * e * HOP / SAMPLE_RATE
    seconds = extra.get("audio_seconds")
    notes = [f"audio padded to the {window:g}-second window: {2 * e} mel frames, {e} encoder positions"]
    if seconds and seconds > window:
        notes.append(f"{seconds:g} s is {math.ceil(seconds / window)} windows, transcribed one after another")
    return e, notes


def encoder_decoder_rows(config, batch: int, prompt: int, new: int, b: int, extra: dict) -> list[EstimateRow]:
    """KV caches (decoder and cross-attention), encoder output, logits and the encoder's pass."""
    d = encdec_dims(config)
    e, notes = encoder_positions(d, extra, prompt)
    dec = 1 + new  # the decoder starts from its start token
    self_kv = d.dec_layers * 2 * batch * dec * d.dec_heads * d.hd * b
    cross = d.dec_layers * 2 * batch * e * d.dec_heads * d.hd * b
    out = batch * e * d.h * b
    logits = batch * d.vocab * (b + 4) * 2
    peak, what = encoder_peak(d, batch, e, b)
    rows = [
        EstimateRow("kv_cache", "KV cache (decoder)", self_kv, "formula",
                    f"{d.dec_layers} layers x 2 x {batch} x {dec} tokens x {d.dec_heads} heads x {d.hd} x {b} B"),
        EstimateRow("kv_cache.cross", "cross-attention KV cache", cross, "formula",
                    f"{d.dec_layers} decoder layers x 2 x {batch} x {e} encoder positions x {d.dec_heads} heads x "
                    f"{d.hd} x {b} B, kept for every decoding step"),
        EstimateRow("activations.encoder_output", "encoder output", out, "formula",
                    f"{batch} x {e} x {d.h} x {b} B; " + "; ".join(notes or [f"{e} encoder tokens"])),
        EstimateRow("activations.logits", "logits (last position, fp32 copy)", logits, "formula",
                    "generate() keeps logits of the last token only"),
    ]  # fmt: skip
    state = self_kv + cross + out + logits
    rows.append(EstimateRow("activations.encoder", "encoder forward pass", max(0, peak - state), "formula",
                            f"its widest layer ({what}) holds {format(peak, ',')} B; this is what it adds above "
                            "the decoding state (caches, encoder output, logits)"))  # fmt: skip
    return rows


def image_tokens(config, image_size=None) -> tuple[int, str]:
    """Tokens one image adds to the prompt, and how they follow from the config and the resolution."""
    vc = config.vision_config
    patch = getattr(vc, "patch_size", None) or 14
    merge = getattr(vc, "spatial_merge_size", None)
    if merge:  # Qwen2-VL: the native resolution, rounded to patch x merge, merge x merge patches per token
        h, w = (image_size, image_size) if isinstance(image_size, int) else (image_size or (448, 448))
        unit = patch * merge
        grid = max(1, round(h / unit)) * max(1, round(w / unit))
        return grid, f"{h} x {w} pixels in {unit} x {unit} tiles: {grid} tokens"
    native = getattr(vc, "image_size", 224)
    scale = getattr(config, "scale_factor", None)
    if scale:  # Idefics3 / SmolVLM: pixel shuffle folds scale x scale patches into one token, per image tile
        n = (native // patch) ** 2 // (scale * scale)
        return n, (f"each {native} x {native} tile: ({native}/{patch})^2 patches / {scale}^2 (pixel shuffle) = "
                   f"{n} tokens; a processor that splits images into tiles adds that many per tile")  # fmt: skip
    full = getattr(config, "vision_feature_select_strategy", "default") == "full"
    n = (native // patch) ** 2 + (1 if full else 0)
    note = f"every image resized to {native} x {native}: ({native}/{patch})^2 patches = {n} tokens"
    return n, note + (f" (image_size={image_size} does not change it)" if image_size else "")


def vision_rows(config, batch: int, seq: int, images: int, per: int, b: int, lm_state: int) -> list[EstimateRow]:
    """The prompt's embeddings (image features scattered in) held through the LM's forward pass, and what
    the vision tower's pass adds above ``lm_state`` (the LM's prefill state: KV cache, widest layer, logits)."""
    h = config.get_text_config().hidden_size
    n = batch * images
    tower, patches = vision_tower_peak(config, n, b)
    rows = [EstimateRow("activations.embeddings", "prompt embeddings with image features", batch * seq * h * b,
                        "formula", f"{batch} x {seq} tokens x {h} x {b} B, held through the LM's forward pass")]  # fmt: skip
    if n:
        rows.append(EstimateRow("activations.image_features", "image features (projector output)", n * per * h * b,
                                "formula", f"{n} images x {per} tokens x {h} x {b} B, alive through the prefill"))  # fmt: skip
        rows.append(EstimateRow("activations.vision", "vision tower forward pass", max(0, tower - lm_state),
                                "formula", f"{n} images x {patches} patches: its widest layer holds "
                                f"{format(tower, ',')} B; this is what it adds above the LM's prefill"))  # fmt: skip
    return rows


def vision_tower_peak(config, n: int, b: int) -> tuple[int, int]:
    """Bytes of the vision tower's widest layer over ``n`` images (run without a graph: frozen, its
    input needs no gradient) with the pixel values, and the patches per image."""
    vc = config.vision_config
    size = getattr(vc, "image_size", 224)
    patches = (size // (getattr(vc, "patch_size", None) or 14)) ** 2 + 1
    hv = getattr(vc, "hidden_size", 0) or getattr(vc, "embed_dim", 0)
    inter = getattr(vc, "intermediate_size", 4 * hv)
    t = n * patches
    return max(t * 6 * hv * b, t * (2 * hv + 2 * inter) * b) + n * 3 * size * size * b, patches
