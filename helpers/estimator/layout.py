"""The weights of a model counted module by module on the meta device, in every load mode."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from ..core.vocab import BF16, FP32, MODES, QUANTIZED
from .families import SPEECH_SEQ2SEQ, auto_class, family, frozen_modules
from .rows import EstimateError, EstimateRow

__all__ = [
    "Param",
    "Layout",
    "layout",
    "weight_rows",
    "dims",
    "kv_cache_bytes",
    "prefill_bytes",
    "should_convert",
    "clear_layout_cache",
    "tied_note",
    "largest_quantized_linear",
    "quantization_skip_modules",
    "adapted_linears",
    "fp32_modules",
]


@dataclass
class Param:
    name: str
    numel: int
    fixed_bytes: int | None  # element size when the dtype does not follow the load dtype (fp32 buffers)
    linear: tuple[int, int] | None  # (out, in) when this is the weight of a quantizable linear
    module: str


@dataclass
class Layout:
    params: int
    entries: list[Param]  # parameters (unique) then buffers
    not_convert: list[str]
    keep_fp32: list[str]
    n_layers: int
    approximate: bool = False
    missing: list[str] = field(default_factory=list)
    # "sdpa", "eager", ...: what transformers runs the attention with (a loaded model's own choice;
    # else "eager" for an architecture whose class says _supports_sdpa = False, as Gemma-2's does)
    attention: str = "sdpa"
    tied: bool | None = None  # the config's tie_word_embeddings (None: the config does not say)
    kept: list[str] = field(
        default_factory=list
    )  # a VLM's vision tower and projector, Whisper's encoder: never quantized
    speech: bool = False  # kept is an audio encoder (Whisper), not a vision tower
    keep_fp32_strict: list[str] = field(default_factory=list)  # kept in fp32 in bf16 loads too
    # answers computed from the entries, per setting: a panel move or a fit()'s fixes re-estimate the same
    # layout a dozen times, and each walk over a 70B's 720 entries took milliseconds (bench/panel_latency.py)
    memo: dict = field(default_factory=dict, repr=False, compare=False)


def fp32_modules(lay: Layout, load: str) -> list[str]:
    """The modules transformers keeps in fp32 for a load: ``_keep_in_fp32_modules`` only when it loads in fp16
    (T5's ``wo``; a bf16 load keeps them bf16), ``_keep_in_fp32_modules_strict`` in fp16 and bf16 alike
    (``PreTrainedModel._get_dtype_plan``). A quantized load's compute dtype is taken as fp16 (a T4's)."""
    return list(lay.keep_fp32_strict) if load == BF16 else [*lay.keep_fp32, *lay.keep_fp32_strict]


def _config_key(config) -> str:
    try:
        return config.to_json_string(use_diff=False)
    except Exception:
        return repr(sorted(config.to_dict().items()))


_LAYOUTS: dict[str, Layout] = {}


def clear_layout_cache() -> None:
    """Forget every architecture built so far (the next estimate of each rebuilds it on the meta device)."""
    _LAYOUTS.clear()


def layout(config, loaded: torch.nn.Module | None = None) -> Layout:
    """Per-parameter layout, from the meta device (cached per config) or from a loaded model."""
    key = _config_key(config)
    if loaded is None and key in _LAYOUTS:
        return _LAYOUTS[key]
    if loaded is not None:
        lay = _layout_of(loaded, config, getattr(config, "_attn_implementation", None) or "sdpa")
    else:
        try:
            model = _meta_model(config)
            lay = _layout_of(model, config, _default_attention(type(model)))
        except EstimateError:
            raise
        except Exception as e:
            lay = _dimension_layout(config, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        _LAYOUTS[key] = lay
    return lay


def _meta_model(config):
    import transformers

    if getattr(config, "oomkit_unknown", None):
        raise ValueError(config.oomkit_unknown)

    from transformers.initialization import no_init_weights

    # no_init_weights: initialising meta tensors computes nothing but costs tens of ms per model; it also
    # skips the weight tying init_weights does, so that is done here (tied embeddings count once)
    config = _untied_as_checkpoint(config)
    with torch.device("meta"), no_init_weights():
        try:
            model = auto_class(config).from_config(config, dtype=torch.bfloat16)
        except ValueError:
            model = transformers.AutoModel.from_config(config, dtype=torch.bfloat16)
    model.tie_weights()
    return model


def _untied_as_checkpoint(config):
    """A multimodal config whose text_config says ``tie_word_embeddings: false`` while the top level does not
    (Mistral3, Gemma3: the field absent, the class default True): the checkpoint stores lm_head apart, and
    from_pretrained, finding both matrices with different values, does not tie them. Build it untied too."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config or getattr(text, "tie_word_embeddings", None) is not False:
        return config
    if not getattr(config, "tie_word_embeddings", False):
        return config
    config = copy.copy(config)  # the caller's config (and the layout cache's key) stay as given
    config.tie_word_embeddings = False
    return config


def _default_attention(cls) -> str:
    # what load() ends up with: it asks for SDPA where the class supports it and otherwise lets
    # transformers pick, which is eager attention without flash-attn installed (Colab has none)
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def _tied(config) -> bool | None:
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = getattr(c, "tie_word_embeddings", None)
    return None if tied is None else bool(tied)


def _layout_of(model: torch.nn.Module, config, attention: str = "sdpa") -> Layout:
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer

    keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    try:
        not_convert = HfQuantizer.get_modules_to_not_convert(model, None, keep_fp32)
    except Exception:
        not_convert = ["lm_head"]
    kept = frozen_modules(model)  # what LoRA leaves frozen stays 16-bit: it trains around them, as loaded
    not_convert = [*not_convert, *(k for k in kept if k not in not_convert)]
    modules = dict(model.named_modules())
    entries = []
    seen = set()
    total = 0
    for name, p in model.named_parameters():
        mod_name = name.rsplit(".", 1)[0] if "." in name else ""
        mod = modules.get(mod_name)
        linear = None
        if name.endswith(".weight") and mod is not None and p.dim() == 2:
            if type(mod) is torch.nn.Linear or _is_bnb_linear(mod):
                linear = (mod.out_features, mod.in_features)
            elif isinstance(mod, Conv1D):
                linear = (p.shape[1], p.shape[0])
        numel = _logical_numel(p, linear)
        total += numel
        seen.add(id(p))
        entries.append(Param(name, numel, None, linear, mod_name))
    for name, b in model.named_buffers():
        if b is None:
            continue
        follows = b.is_floating_point() and b.dtype == torch.bfloat16
        entries.append(Param(name, b.numel(), None if follows else b.element_size(), None, "buffer"))
    n_layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 0)
    return Layout(
        total,
        entries,
        not_convert,
        keep_fp32,
        n_layers,
        attention=attention,
        tied=_tied(config),
        kept=kept,
        speech=family(config) == SPEECH_SEQ2SEQ,
        keep_fp32_strict=strict,
    )


def _is_bnb_linear(mod) -> bool:
    return type(mod).__name__ in ("Linear8bitLt", "Linear4bit", "LinearNF4", "LinearFP4")


def _logical_numel(p: torch.Tensor, linear: tuple[int, int] | None) -> int:
    # A loaded 4-bit weight is packed (numel/2 bytes); count the logical matrix.
    if linear is not None and p.dtype in (torch.uint8, torch.int8) and p.numel() != linear[0] * linear[1]:
        return linear[0] * linear[1]
    return p.numel()


def _unbuildable(config, why: str, missing: list[str]) -> EstimateError:
    """The error when transformers cannot build a config and its dimensions cannot be counted either. A model
    type this transformers knows but fails to build (Llama 4 under transformers 5.1: its class reads a
    ``pad_token_id`` the config lacks) is that release's limit: the fix is another transformers, not the file."""
    import transformers

    model_type = getattr(config, "model_type", "") or ""
    lacks = f"the config lacks {', '.join(missing)} for a count from its dimensions"
    if model_type and not getattr(config, "oomkit_unknown", None):
        return EstimateError(
            f"transformers {transformers.__version__} cannot build model_type {model_type!r} from this config "
            f"({why}), and {lacks}; upgrade transformers (pip install -U transformers) or pass another model"
        )
    return EstimateError(f"cannot build this architecture ({why}) and {lacks}; pass the model's full config.json")


def _dimension_layout(config, why: str) -> Layout:
    """Fallback when the architecture cannot be built: a Llama-shaped count from the dimensions."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    need = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_hidden_layers": ("num_hidden_layers", "n_layer"),
            "vocab_size": ("vocab_size",)}  # fmt: skip
    got, missing = {}, []
    for k, alts in need.items():
        v = next((d[a] for a in alts if d.get(a)), None)
        (got.__setitem__(k, v) if v else missing.append(k))
    if missing:
        raise _unbuildable(config, why, missing)
    h, n, v = got["hidden_size"], got["num_hidden_layers"], got["vocab_size"]
    inter = d.get("intermediate_size") or d.get("n_inner") or 4 * h
    heads = d.get("num_attention_heads") or d.get("n_head") or max(1, h // 64)
    kv = d.get("num_key_value_heads") or heads
    hd = d.get("head_dim") or h // heads
    entries = [Param("embed", v * h, None, None, "embed")]
    for i in range(n):
        pre = f"layers.{i}"
        for nm, o, k in [("q", heads * hd, h), ("k", kv * hd, h), ("v", kv * hd, h), ("o", h, heads * hd),
                         ("gate", inter, h), ("up", inter, h), ("down", h, inter)]:  # fmt: skip
            entries.append(Param(f"{pre}.{nm}.weight", o * k, None, (o, k), f"{pre}.{nm}"))
        entries.append(Param(f"{pre}.norms", 2 * h, None, None, pre))
    entries.append(Param("norm", h, None, None, "norm"))
    tied = bool(d.get("tie_word_embeddings", True))
    if not tied:
        entries.append(Param("lm_head.weight", v * h, None, None, "lm_head"))
    lay = Layout(sum(e.numel for e in entries), entries, ["lm_head"], [], n, approximate=True, tied=tied)
    lay.missing = [why]
    return lay


def quantization_skip_modules(config) -> list[str] | None:
    """``llm_int8_skip_modules`` for a quantized load of ``config``: transformers' own list plus a VLM's
    vision tower and projector; ``None`` where transformers' default is already the whole list."""
    lay = layout(config)
    return list(lay.not_convert) if lay.kept else None


def _in_kept(module: str, kept: list[str]) -> bool:
    return any(module == k or module.startswith(k + ".") for k in kept)


def adapted_linears(lay: Layout, targets: str | list[str], *, fp32_kept_adapt: bool = False) -> list[Param]:
    """The linear layers LoRA adapts: for ``"all-linear"`` every linear bitsandbytes would quantize (the
    output layer never is: peft's rule), else those named in ``targets``; never one of the frozen parts
    (``lay.kept``: a VLM's vision tower and projector, Whisper's encoder), which ``TrainPlan.lora_config``
    excludes by path. ``fp32_kept_adapt``: a module the model keeps in fp32 (T5's ``wo``) is adapted too,
    as ``helpers.training.plan.target_modules`` picks it (every linear but the output layer)."""
    skip = [n for n in lay.not_convert if n not in lay.keep_fp32] if fp32_kept_adapt else lay.not_convert
    out = []
    for e in lay.entries:
        if e.linear is None or e.module == "buffer" or _in_kept(e.module, lay.kept):
            continue
        if targets == "all-linear":
            if should_convert(e.module, skip):
                out.append(e)
        elif e.module.rsplit(".", 1)[-1] in targets or e.module in targets:
            out.append(e)
    return out


def should_convert(module: str, not_convert: list[str]) -> bool:
    """transformers' own rule (a regex per pattern), asked once per module name and skip list: a fit()'s
    fixes re-ask it for every module of every re-estimate, which grew with layers squared."""
    return _should_convert(module, tuple(not_convert))


@functools.lru_cache(maxsize=1 << 16)
def _should_convert(module: str, not_convert: tuple[str, ...]) -> bool:
    from transformers.quantizers.quantizers_utils import should_convert_module

    return should_convert_module(module, list(not_convert))


def tied_note(lay: Layout) -> str:
    """What the unquantized weights row says about the embeddings, from the config's tie_word_embeddings."""
    if lay.tied is None:
        return "embeddings and lm_head as the model defines them (the config does not say whether they are tied)"
    return "tied embeddings counted once" if lay.tied else "embeddings and lm_head are separate matrices (untied)"


def _not_convert(lay: Layout, skip_modules: list[str] | None) -> list[str]:
    return lay.not_convert if skip_modules is None else list(set(skip_modules) | set(lay.keep_fp32))


def largest_quantized_linear(lay: Layout, skip_modules: list[str] | None = None) -> tuple[int, int] | None:
    """``(out, in)`` of the biggest linear bitsandbytes would quantize (``None`` if there is none)."""
    key = ("largest_quantized_linear", None if skip_modules is None else tuple(skip_modules))
    if key not in lay.memo:
        not_convert = _not_convert(lay, skip_modules)
        shapes = [e.linear for e in lay.entries if e.linear is not None and should_convert(e.module, not_convert)]
        lay.memo[key] = max(shapes, key=lambda s: s[0] * s[1], default=None)
    return lay.memo[key]


def _quantized_bytes(e: Param, load: str, double_quant: bool, blocksize: int) -> tuple[int, int]:
    """(weight bytes, quantization-state bytes) of one linear layer in bitsandbytes' layout."""
    if MODES[load].bits == 8:
        return e.numel, 4 * e.linear[0]  # int8 matrix (CB shares its storage); SCB: one fp32 scale per row
    blocks = math.ceil(e.numel / blocksize)
    state = 16 * 4  # the 16-entry fp32 code of nf4/fp4, one per layer
    if double_quant:
        # absmax quantized to uint8, one fp32 absmax per 256 of them, an fp32 offset, and the 256-entry
        # fp32 dynamic code of the nested state (a copy per layer)
        state += blocks + 4 * math.ceil(blocks / 256) + 4 + 256 * 4
    else:
        state += 4 * blocks
    return (e.numel + 1) // 2, state  # two 4-bit values per uint8


def _is_fused_expert(e: Param) -> bool:
    # transformers 5 stores an MoE layer's experts as one 3-D parameter (experts.gate_up_proj, ...):
    # no nn.Linear, so bitsandbytes leaves it in the compute dtype
    return e.linear is None and ".experts." in f".{e.name}"


def weight_rows(
    lay: Layout,
    load: str,
    dtype_bytes: int,
    double_quant: bool = True,
    skip_modules: list[str] | None = None,
    blocksize: int = 64,
) -> list[EstimateRow]:
    """The exact bytes of the weights as bitsandbytes/transformers lay them out for ``load``."""
    key = ("weight_rows", load, dtype_bytes, double_quant, None if skip_modules is None else tuple(skip_modules),
           blocksize)  # fmt: skip
    if key not in lay.memo:
        lay.memo[key] = _weight_rows(lay, load, dtype_bytes, double_quant, skip_modules, blocksize)
    return [dataclasses.replace(r) for r in lay.memo[key]]  # copies: callers extend and annotate their rows


def _weight_rows(lay: Layout, load: str, dtype_bytes: int, double_quant: bool, skip_modules: list[str] | None,
                 blocksize: int) -> list[EstimateRow]:  # fmt: skip
    not_convert = _not_convert(lay, skip_modules)
    q_bytes = state_bytes = plain = buffers = experts = kept = n_q = 0
    half = 4 if load == FP32 else dtype_bytes
    fp32 = fp32_modules(lay, load)
    for e in lay.entries:
        if e.module == "buffer":
            buffers += e.numel * (e.fixed_bytes or half)
        elif load in QUANTIZED and e.linear is not None and should_convert(e.module, not_convert):
            q, state = _quantized_bytes(e, load, double_quant, blocksize)
            q_bytes, state_bytes, n_q = q_bytes + q, state_bytes + state, n_q + 1
        elif load in QUANTIZED and _is_fused_expert(e):
            experts += e.numel * half
        elif load in QUANTIZED and lay.kept and _in_kept(e.module, lay.kept):
            kept += e.numel * half
        else:
            plain += e.numel * (4 if any(k in e.name for k in fp32) else half)
    rows = []
    mode = MODES.get(load)
    label = (load if mode.bits == 8 else f"{mode.bits}-bit {load}") if mode is not None and mode.quantized else None
    if label:
        rows.append(
            EstimateRow("weights.quantized", f"weights: {label} linear layers", q_bytes, "exact", f"{n_q} layers")
        )
        what = "row scales" if mode.bits == 8 else ("absmax, nested absmax" if double_quant else "fp32 absmax")
        rows.append(EstimateRow("weights.quant_state", "weights: quantization state", state_bytes, "exact", what))
    if experts:
        rows.append(EstimateRow("weights.moe_experts", "weights: MoE experts, not quantized", experts, "exact",
                                "fused expert tensors are no nn.Linear: bitsandbytes leaves them unquantized"))  # fmt: skip
    if kept and lay.speech:
        rows.append(EstimateRow("weights.audio_encoder", "weights: audio encoder, not quantized", kept, "exact",
                                f"{', '.join(lay.kept)} stays in 16 bits (quantizing it costs transcripts more "
                                "than the decoder's)"))  # fmt: skip
    elif kept:
        rows.append(EstimateRow("weights.vision", "weights: vision tower and projector, not quantized", kept, "exact",
                                f"{', '.join(lay.kept)} stay in 16 bits (quantizing the image path costs quality)"))  # fmt: skip
    rows.append(
        EstimateRow(
            "weights.unquantized",
            "weights: unquantized (embeddings, norms, lm_head)" if label else f"weights: {load}",
            plain,
            "exact",
            tied_note(lay),
        )
    )
    rows.append(EstimateRow("weights.buffers", "weights: buffers", buffers, "exact", "rotary tables, masks"))
    return rows


def dims(config) -> dict:
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    g = lambda *names, default=None: next((getattr(c, n) for n in names if getattr(c, n, None)), default)  # noqa: E731
    h = g("hidden_size", "n_embd", "d_model")
    heads = g("num_attention_heads", "n_head", "num_heads")
    missing = [n for n, v in [("hidden_size", h), ("num_attention_heads", heads)] if not v]
    layers = g("num_hidden_layers", "n_layer", "num_layers")
    if not layers:
        missing.append("num_hidden_layers")
    vocab = g("vocab_size")
    if not vocab:
        missing.append("vocab_size")
    if missing:
        raise EstimateError(
            f"the config lacks {', '.join(missing)}, needed for the KV cache and activations; "
            "pass the model's full config.json"
        )
    kv = g("num_key_value_heads", "num_kv_heads", default=heads)
    if getattr(c, "multi_query", False):
        kv = 1
    hd = g("head_dim", default=h // heads)
    inter = g("intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    types = getattr(c, "layer_types", None)
    if types is None and window:
        types = ["sliding_attention"] * layers
    return dict(
        h=h,
        heads=heads,
        kv=kv,
        hd=hd,
        inter=inter,
        layers=layers,
        vocab=vocab,
        window=window,
        types=types or ["full_attention"] * layers,
    )


def kv_cache_bytes(config, batch: int, tokens: int, dtype_bytes: int = 2, prompt_tokens: int = 0) -> int:
    """Keys and values of every layer: 2 x batch x cached tokens x kv_heads x head_dim x bytes.

    A sliding-window layer caches ``min(tokens, window)``, but after the prompt's forward pass it
    holds ``prompt_tokens``: transformers' DynamicSlidingWindowLayer keeps a view of the last
    window - 1 positions of the whole prompt it concatenated, so the storage of every position stays
    alive until the first decoding step re-concatenates it (cache_utils.py).
    """
    d = dims(config)
    total = 0
    for t in d["types"][: d["layers"]]:
        cached = tokens
        if t == "sliding_attention" and d["window"]:
            cached = max(min(tokens, d["window"]), min(prompt_tokens, tokens))
        total += 2 * batch * cached * d["kv"] * d["hd"] * dtype_bytes
    return total


def prefill_bytes(d: dict, batch: int, seq: int, b: int) -> int:
    # Inference forward of one layer at its widest: the residual stream, q/k/v/out, then the MLP's
    # gate, up and their product alive together (SDPA/flash attention: no seq x seq matrix).
    attn = batch * seq * (2 * d["h"] + 2 * d["heads"] * d["hd"] + 2 * d["kv"] * d["hd"]) * b
    mlp = batch * seq * (2 * d["h"] + 3 * d["inter"]) * b
    return max(attn, mlp)
