"""Memory estimator: exact weight bytes for every load mode, plus KV cache, activations and training.

The architecture is built once on the meta device (no memory, no download) and every parameter is
counted per module, so bitsandbytes' real layout applies layer by layer: which ``nn.Linear`` get
quantized (transformers' own skip rules), int8 row scales, 4-bit packing with absmax per block of
64 and the nested (double-quant) state. Everything else is a formula or a rule of thumb, and each
row of the breakdown says which.

    >>> est = estimate("mistralai/Mistral-7B-v0.1", load="nf4")   # doctest: +SKIP
    >>> fit(est, "t4")                                            # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .html import Markup, badge, bar, table
from .units import MiB, format_bytes

__all__ = [
    "DEVICES", "LOAD_MODES", "EstimateRow", "MemoryEstimate", "LoraTraining", "FullTraining", "FitVerdict",
    "Suggestion", "estimate", "fit", "footprint", "max_new_tokens_that_fit", "max_batch_that_fits",
    "preflight_checks", "shipped_configs", "resolve_config", "main",
]  # fmt: skip

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "data" / "configs"

LOAD_MODES = ("fp32", "fp16", "bf16", "int8", "nf4", "fp4")
QUANTIZED = ("int8", "nf4", "fp4")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
OPTIMIZERS = {  # bytes of optimizer state per trainable parameter (None: same dtype as the parameter, x2)
    "adamw_torch": None, "adamw": None, "paged_adamw_32bit": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2,
    "adamw_bnb_8bit": 2, "sgd": 0, "sgd_momentum": None, "adafactor": 0,
}  # fmt: skip

# Capacity as torch.cuda.get_device_properties().total_memory reports it (what OOM messages call
# "total capacity"), and whether the card computes in bf16.
DEVICES: dict[str, dict[str, Any]] = {
    "t4": {"name": "Tesla T4 (Colab free)", "capacity": 15_828_320_256, "bf16": False},
    "l4": {"name": "NVIDIA L4", "capacity": 23_580_639_232, "bf16": True},
    "v100": {"name": "Tesla V100 16 GB", "capacity": 16_935_682_048, "bf16": False},
    "v100-32": {"name": "Tesla V100 32 GB", "capacity": 34_089_730_048, "bf16": False},
    "a100-40": {"name": "NVIDIA A100 40 GB", "capacity": 42_481_811_456, "bf16": True},
    "a100-80": {"name": "NVIDIA A100 80 GB", "capacity": 85_051_572_224, "bf16": True},
    "rtx3090": {"name": "NVIDIA GeForce RTX 3090", "capacity": 25_438_126_080, "bf16": True},
    "rtx4090": {"name": "NVIDIA GeForce RTX 4090", "capacity": 25_386_352_640, "bf16": True},
    "h100": {"name": "NVIDIA H100 80GB HBM3", "capacity": 85_045_477_376, "bf16": True},
}
DEFAULT_DEVICE = "t4"

# Rules of thumb for what lives on the GPU besides tensors (not counted by memory_allocated()).
CUDA_CONTEXT = 400 * MiB  # driver context + kernels of torch; 300-500 MiB depending on GPU and version
CUBLAS_WORKSPACE = 32 * MiB  # :4096:8 default workspace config, per stream
FRAGMENTATION = 0.05  # of the transient (KV cache, activations) memory
TIGHT_FRACTION = 0.90  # above this share of capacity a run works only without surprises


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class EstimateRow:
    """One line of the breakdown: ``kind`` is "exact", "formula" or "rule of thumb"."""

    name: str
    bytes: int
    kind: str
    note: str = ""


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
    """

    r: int = 16
    alpha: int = 32
    targets: str | list[str] = "all-linear"
    optimizer: str = "paged_adamw_8bit"
    gradient_checkpointing: bool = True
    seq_len: int = 512
    micro_batch: int = 1
    lora_dropout: float = 0.05


@dataclass
class FullTraining:
    """Full fine-tuning: every parameter trains (the load mode must be fp32, fp16 or bf16).

    Args:
        optimizer: as in :class:`LoraTraining`; "adamw_torch" keeps two states in the parameter dtype.
        master_weights: keep an fp32 copy of half-precision weights (mixed-precision training).
    """

    optimizer: str = "adamw_torch"
    gradient_checkpointing: bool = True
    seq_len: int = 512
    micro_batch: int = 1
    master_weights: bool = False


@dataclass
class MemoryEstimate:
    """The predicted memory of a model with given settings, as rows you can read and add up."""

    model: str
    load: str
    rows: list[EstimateRow]
    params: int
    device: str
    capacity: int | None
    approximate: bool = False
    warnings: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict, repr=False)
    source: Any = field(default=None, repr=False)

    @property
    def weights(self) -> int:
        """Bytes of the loaded weights (parameters, buffers, quantization state)."""
        return sum(r.bytes for r in self.rows if r.name.startswith("weights"))

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    def row(self, name: str) -> EstimateRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row {name!r}; rows: {[r.name for r in self.rows]}")

    def replace(self, **changes) -> MemoryEstimate:
        """Re-estimate the same model with some settings changed (``load``, ``max_new_tokens``, ...)."""
        kwargs = {**self.inputs, **changes}
        return estimate(self.source, **kwargs)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "load": self.load, "params": self.params, "device": self.device,
            "capacity": self.capacity, "weights": self.weights, "total": self.total,
            "approximate": self.approximate, "warnings": self.warnings,
            "rows": [{"name": r.name, "bytes": r.bytes, "kind": r.kind, "note": r.note} for r in self.rows],
            "inputs": {k: (dataclasses.asdict(v) | {"type": type(v).__name__}) if dataclasses.is_dataclass(v) else v
                       for k, v in self.inputs.items()},
        }  # fmt: skip

    def __str__(self) -> str:
        head = f"{self.model}: {self.params:,} parameters, load={self.load}" + (
            " (approximate count)" if self.approximate else ""
        )
        w = max(len(r.name) for r in self.rows)
        lines = [head] + [f"  {r.name:<{w}}  {format_bytes(r.bytes):>11}  {r.kind}" for r in self.rows]
        cap = f" of {format_bytes(self.capacity)} on {self.device}" if self.capacity else ""
        lines.append(f"  {'total':<{w}}  {format_bytes(self.total):>11}{cap}")
        lines += [f"  note: {m}" for m in self.warnings]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [[r.name, format_bytes(r.bytes), r.kind, r.note] for r in self.rows]
        rows.append([Markup("<b>total</b>"), Markup(f"<b>{format_bytes(self.total)}</b>"), "", ""])
        title = f"{self.model}: {self.params:,} parameters, load={self.load}"
        html = table(["", "bytes", "kind", "note"], rows, title=title)
        if self.capacity:
            html += bar(self.total, self.capacity, f"vs {self.device}")
        return html + "".join(f"<div>note: {m}</div>" for m in self.warnings)


# ---------------------------------------------------------------------------------------------
# resolving a model to a config and a per-module layout


class EstimateError(ValueError):
    """Bad input to the estimator; the message says what to pass instead."""


def shipped_configs() -> dict[str, Path]:
    """Hub id -> path of every ``config.json`` shipped in ``data/configs`` (usable offline)."""
    out = {}
    for p in sorted(CONFIG_DIR.glob("*.json")):
        out[p.stem.replace("--", "/", 1)] = p
    return out


def _shipped(name: str) -> Path | None:
    configs = shipped_configs()
    if name in configs:
        return configs[name]
    low = name.lower()
    for hub_id, p in configs.items():
        if low in (hub_id.lower(), hub_id.split("/")[-1].lower()):
            return p
    return None


def _config_from_dict(d: dict, where: str):
    """A transformers config for a config.json dict; an unknown or missing ``model_type`` gives a
    generic config (counted from its dimensions, marked approximate) instead of an error."""
    from transformers import AutoConfig, PretrainedConfig

    d = {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path")}
    model_type = d.pop("model_type", None)
    why = None
    if model_type is None:
        why = f"{where} has no 'model_type' field, so the architecture is unknown"
    else:
        try:
            return AutoConfig.for_model(model_type, **d)
        except (ValueError, KeyError) as e:
            why = (
                f"model_type {model_type!r} in {where} is not known to this transformers version "
                f"({str(e).splitlines()[0][:100]})"
            )
    config = PretrainedConfig(**d)
    config.oomkit_unknown = why
    return config


def resolve_config(model: Any):
    """``(config, name, loaded_module_or_None)`` for a hub id, short name, directory, json path,
    config object or loaded model."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, torch.nn.Module):
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise EstimateError("this module has no .config; pass the model's config.json instead")
        return cfg, getattr(cfg, "_name_or_path", None) or type(model).__name__, model
    if isinstance(model, PretrainedConfig):
        return model, getattr(model, "_name_or_path", None) or model.model_type, None
    if isinstance(model, dict):
        return _config_from_dict(model, "the config dict"), model.get("_name_or_path") or "config", None
    if not isinstance(model, str | os.PathLike):
        raise EstimateError(f"model must be a hub id, a path, a config or a loaded model, not {type(model).__name__}")
    name = str(model)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise EstimateError(f"{path} is not valid JSON ({e})") from None
        label = name if path.name != "config.json" else str(path.parent)
        return _config_from_dict(d, str(path)), d.get("_name_or_path") or label, None
    if path.exists():
        raise EstimateError(f"{path} has no config.json; pass the model folder or its config.json")
    from .loading import _drive_hint, _looks_like_path

    if _looks_like_path(name):
        # a hub lookup would only add "Repo id must be in the form 'namespace/repo_name'"
        parent = next((q for q in path.parents if q.exists()), None)
        near = ""
        if parent is not None and parent != Path("/") and parent.is_dir():
            near = (
                f" {parent.resolve()} exists and holds: "
                f"{', '.join(sorted(c.name for c in parent.iterdir())[:8]) or '(nothing)'}."
            )
        raise EstimateError(
            f"{name} does not exist.{near}{_drive_hint(name)} Pass an existing model folder (with "
            "config.json) or its config.json, a hub id such as 'org/name', or a shipped config name"
        )
    shipped = _shipped(name)
    if shipped is not None:
        return (
            _config_from_dict(json.loads(shipped.read_text()), str(shipped)),
            shipped.stem.replace("--", "/", 1),
            None,
        )
    try:
        return AutoConfig.from_pretrained(name, local_files_only=not _hub_reachable()), name, None
    except Exception as e:
        known = ", ".join(shipped_configs()) or "none"
        raise EstimateError(
            f"could not read the config of {name!r} ({type(e).__name__}: {str(e).splitlines()[0][:160]}). "
            f"Offline or private? Pass a local folder or config.json, or one of the configs in "
            f"{CONFIG_DIR} that work offline: {known}"
        ) from None


def _hub_reachable() -> bool:
    """Whether the hub answers at all: without a network, only the local cache is read (in
    milliseconds, instead of a minute of download retries)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


@dataclass
class _Param:
    name: str
    numel: int
    fixed_bytes: int | None  # element size when the dtype does not follow the load dtype (fp32 buffers)
    linear: tuple[int, int] | None  # (out, in) when this is the weight of a quantizable linear
    module: str


@dataclass
class _Layout:
    params: int
    entries: list[_Param]  # parameters (unique) then buffers
    not_convert: list[str]
    keep_fp32: list[str]
    n_layers: int
    approximate: bool = False
    missing: list[str] = field(default_factory=list)


def _config_key(config) -> str:
    try:
        return config.to_json_string(use_diff=False)
    except Exception:
        return repr(sorted(config.to_dict().items()))


_LAYOUTS: dict[str, _Layout] = {}


def _layout(config, loaded: torch.nn.Module | None = None) -> _Layout:
    """Per-parameter layout, from the meta device (cached per config) or from a loaded model."""
    key = _config_key(config)
    if loaded is None and key in _LAYOUTS:
        return _LAYOUTS[key]
    if loaded is not None:
        lay = _layout_of(loaded, config)
    else:
        try:
            lay = _layout_of(_meta_model(config), config)
        except EstimateError:
            raise
        except Exception as e:
            lay = _dimension_layout(config, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        _LAYOUTS[key] = lay
    return lay


def _meta_model(config):
    import transformers
    from transformers import AutoModelForCausalLM

    if getattr(config, "oomkit_unknown", None):
        raise ValueError(config.oomkit_unknown)

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except ValueError:
            return transformers.AutoModel.from_config(config, dtype=torch.bfloat16)


def _layout_of(model: torch.nn.Module, config) -> _Layout:
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer

    keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    try:
        not_convert = HfQuantizer.get_modules_to_not_convert(model, None, keep_fp32)
    except Exception:
        not_convert = ["lm_head"]
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
        entries.append(_Param(name, numel, None, linear, mod_name))
    for name, b in model.named_buffers():
        if b is None:
            continue
        follows = b.is_floating_point() and b.dtype == torch.bfloat16
        entries.append(_Param(name, b.numel(), None if follows else b.element_size(), None, "buffer"))
    n_layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 0)
    return _Layout(total, entries, not_convert, keep_fp32, n_layers)


def _is_bnb_linear(mod) -> bool:
    return type(mod).__name__ in ("Linear8bitLt", "Linear4bit", "LinearNF4", "LinearFP4")


def _logical_numel(p: torch.Tensor, linear: tuple[int, int] | None) -> int:
    # A loaded 4-bit weight is packed (numel/2 bytes); count the logical matrix.
    if linear is not None and p.dtype in (torch.uint8, torch.int8) and p.numel() != linear[0] * linear[1]:
        return linear[0] * linear[1]
    return p.numel()


def _dimension_layout(config, why: str) -> _Layout:
    """Fallback when the architecture cannot be built: a Llama-shaped count from the dimensions."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    need = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_hidden_layers": ("num_hidden_layers", "n_layer"),
            "vocab_size": ("vocab_size",)}  # fmt: skip
    got, missing = {}, []
    for k, alts in need.items():
        v = next((d[a] for a in alts if d.get(a)), None)
        (got.__setitem__(k, v) if v else missing.append(k))
    if missing:
        raise EstimateError(
            f"cannot build this architecture ({why}) and the config lacks {', '.join(missing)}, "
            "needed for the fallback dimension-based count; pass the model's full config.json"
        )
    h, n, v = got["hidden_size"], got["num_hidden_layers"], got["vocab_size"]
    inter = d.get("intermediate_size") or d.get("n_inner") or 4 * h
    heads = d.get("num_attention_heads") or d.get("n_head") or max(1, h // 64)
    kv = d.get("num_key_value_heads") or heads
    hd = d.get("head_dim") or h // heads
    entries = [_Param("embed", v * h, None, None, "embed")]
    for i in range(n):
        pre = f"layers.{i}"
        for nm, o, k in [("q", heads * hd, h), ("k", kv * hd, h), ("v", kv * hd, h), ("o", h, heads * hd),
                         ("gate", inter, h), ("up", inter, h), ("down", h, inter)]:  # fmt: skip
            entries.append(_Param(f"{pre}.{nm}.weight", o * k, None, (o, k), f"{pre}.{nm}"))
        entries.append(_Param(f"{pre}.norms", 2 * h, None, None, pre))
    entries.append(_Param("norm", h, None, None, "norm"))
    if not d.get("tie_word_embeddings", True):
        entries.append(_Param("lm_head.weight", v * h, None, None, "lm_head"))
    lay = _Layout(sum(e.numel for e in entries), entries, ["lm_head"], [], n, approximate=True)
    lay.missing = [why]
    return lay


# ---------------------------------------------------------------------------------------------
# arithmetic


def _should_convert(module: str, not_convert: list[str]) -> bool:
    from transformers.quantizers.quantizers_utils import should_convert_module

    return should_convert_module(module, not_convert)


def weight_rows(
    lay: _Layout,
    load: str,
    dtype_bytes: int,
    double_quant: bool = True,
    skip_modules: list[str] | None = None,
    blocksize: int = 64,
) -> list[EstimateRow]:
    """The exact bytes of the weights as bitsandbytes/transformers lay them out for ``load``."""
    not_convert = lay.not_convert if skip_modules is None else list(set(skip_modules) | set(lay.keep_fp32))
    q_bytes = state_bytes = plain = buffers = 0
    n_q = 0
    half = 4 if load == "fp32" else dtype_bytes
    for e in lay.entries:
        if e.module == "buffer":
            buffers += e.numel * (e.fixed_bytes or half)
            continue
        keep32 = any(k in e.name for k in lay.keep_fp32)
        size = 4 if keep32 else half
        if load in QUANTIZED and e.linear is not None and _should_convert(e.module, not_convert):
            n_q += 1
            out_f = e.linear[0]
            if load == "int8":
                q_bytes += e.numel  # int8 matrix (CB shares its storage)
                state_bytes += 4 * out_f  # SCB: one fp32 scale per output row
            else:
                q_bytes += (e.numel + 1) // 2  # two 4-bit values per uint8
                blocks = math.ceil(e.numel / blocksize)
                state_bytes += 16 * 4  # the 16-entry fp32 code of nf4/fp4, one per layer
                if double_quant:
                    # absmax quantized to uint8, one fp32 absmax per 256 of them, an fp32 offset, and
                    # the 256-entry fp32 dynamic code of the nested state (a copy per layer)
                    state_bytes += blocks + 4 * math.ceil(blocks / 256) + 4 + 256 * 4
                else:
                    state_bytes += 4 * blocks
            continue
        plain += e.numel * size
    rows = []
    label = {"int8": "int8", "nf4": "4-bit nf4", "fp4": "4-bit fp4"}.get(load)
    if label:
        rows.append(EstimateRow(f"weights: {label} linear layers", q_bytes, "exact", f"{n_q} layers"))
        what = "row scales" if load == "int8" else ("absmax, nested absmax" if double_quant else "fp32 absmax")
        rows.append(EstimateRow("weights: quantization state", state_bytes, "exact", what))
    rows.append(
        EstimateRow(
            "weights: unquantized (embeddings, norms, lm_head)" if label else f"weights: {load}",
            plain,
            "exact",
            "tied embeddings counted once",
        )
    )
    rows.append(EstimateRow("weights: buffers", buffers, "exact", "rotary tables, masks"))
    return rows


def _dims(config) -> dict:
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


def kv_cache_bytes(config, batch: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Keys and values of every layer: 2 x batch x cached tokens x kv_heads x head_dim x bytes."""
    d = _dims(config)
    total = 0
    for t in d["types"][: d["layers"]]:
        cached = min(tokens, d["window"]) if (t == "sliding_attention" and d["window"]) else tokens
        total += 2 * batch * cached * d["kv"] * d["hd"] * dtype_bytes
    return total


def _prefill_bytes(d: dict, batch: int, seq: int, b: int) -> int:
    # Inference forward of one layer at its widest: the residual stream, q/k/v/out, then the MLP's
    # gate, up and their product alive together (SDPA/flash attention: no seq x seq matrix).
    attn = batch * seq * (2 * d["h"] + 2 * d["heads"] * d["hd"] + 2 * d["kv"] * d["hd"]) * b
    mlp = batch * seq * (2 * d["h"] + 3 * d["inter"]) * b
    return max(attn, mlp)


def _training_rows(lay: _Layout, config, load: str, b: int, tr) -> tuple[list[EstimateRow], int]:
    d = _dims(config)
    rows = []
    seq, mb = tr.seq_len, tr.micro_batch
    if isinstance(tr, LoraTraining):
        targets = tr.targets
        n_lora = 0
        adapted = []
        for e in lay.entries:
            if e.linear is None or e.module == "buffer":
                continue
            if not _should_convert(e.module, lay.not_convert):  # peft's all-linear skips the output layer
                if targets == "all-linear":
                    continue
            short = e.module.rsplit(".", 1)[-1]
            if targets == "all-linear" or short in targets or e.module in targets:
                n_lora += tr.r * (e.linear[0] + e.linear[1])
                adapted.append(e)
        if not adapted:
            raise EstimateError(f"LoRA targets {targets!r} match no linear layer of this model")
        trainable = n_lora
        rows.append(EstimateRow("LoRA adapters (fp32)", 4 * n_lora, "exact", f"{n_lora:,} parameters, r={tr.r}"))
        rows.append(EstimateRow("gradients (fp32)", 4 * n_lora, "exact"))
        per_param = OPTIMIZERS.get(tr.optimizer)
        rows.append(
            EstimateRow(
                f"optimizer states ({tr.optimizer})",
                (8 if per_param is None else per_param) * n_lora,
                "formula",
                "AdamW 32-bit 8 bytes/param, 8-bit 2",
            )
        )
        # peft casts each adapted layer's input to the fp32 adapter dtype and, with dropout, keeps the
        # dropped copy (4 B) and its mask (1 B) for backward: per adapted layer, per token.
        lora_in = sum(e.linear[1] for e in adapted) // max(1, d["layers"])
        per_tok_lora = lora_in * ((5 if tr.lora_dropout > 0 else 4) if b < 4 or tr.lora_dropout > 0 else 0)
    else:
        if load in QUANTIZED:
            raise EstimateError(
                f"full fine-tuning cannot train {load} weights; use LoraTraining or load=bf16/fp16/fp32"
            )
        trainable = lay.params
        pb = 4 if load == "fp32" else b
        rows.append(EstimateRow(f"gradients ({load})", pb * trainable, "exact"))
        per_param = OPTIMIZERS.get(tr.optimizer)
        opt = 2 * pb * trainable if per_param is None else per_param * trainable
        rows.append(
            EstimateRow(
                f"optimizer states ({tr.optimizer})", opt, "formula", "torch AdamW: 2 states in the parameter dtype"
            )
        )
        if tr.master_weights and load != "fp32":
            rows.append(EstimateRow("fp32 master weights", 4 * trainable, "exact"))
        per_tok_lora = 0
    # Saved activations per layer (bytes per token) of a Llama-like block: each RMSNorm keeps its
    # fp32 upcast, the normalized fp32 value and the cast-back output; attention keeps q and k before
    # and after rotary, v, the GQA-expanded k/v, its output and the o_proj input; the MLP keeps
    # gate, act(gate), up and their product. Measured on CPU with live-tensor tracking (see
    # bench/estimate_accuracy.py).
    h, inter, heads, kv, hd = d["h"], d["inter"], d["heads"], d["kv"], d["hd"]
    attn = 3 * heads * hd + 3 * kv * hd + (2 * heads * hd if kv < heads else 0) + 2 * h
    per_tok = 2 * (8 * h + b * h) + b * attn + 4 * b * inter + per_tok_lora
    # The loss's peak comes at the start of backward: log-softmax's fp32 output (saved), its incoming
    # gradient and the gradient it returns, each batch x seq x vocab x 4 B (the model's own logits
    # and the fp32 upcast are gone by then: measured with live-tensor tracking).
    logits = mb * seq * d["vocab"] * 12
    # A quantized layer's weight is dequantized to the compute dtype for each matmul (forward and
    # backward): the largest one, twice, is alive at once. The output layer stays unquantized.
    dequant = 0
    if load in QUANTIZED:
        biggest = max(
            (e.linear[0] * e.linear[1] for e in lay.entries if e.linear and _should_convert(e.module, lay.not_convert)),
            default=0,
        )
        dequant = 2 * biggest * b
    if tr.gradient_checkpointing:
        # Only each layer's input is kept; one layer's activations are recomputed at a time during
        # backward, after the loss's buffers are freed, so the peak is the larger of the two.
        saved = d["layers"] * mb * seq * h * b
        rows.append(EstimateRow("activations (gradient checkpointing)", saved, "formula", "one hidden state per layer"))
        layer = mb * seq * per_tok + dequant
        rows.append(
            EstimateRow(
                "backward peak: logits + loss or one recomputed layer",
                max(logits, layer),
                "formula",
                "batch x seq x vocab x 3 fp32 buffers, or one layer's activations",
            )
        )
    else:
        saved = d["layers"] * mb * seq * per_tok
        rows.append(EstimateRow("activations (no checkpointing)", saved, "formula", "tensors kept for backward"))
        rows.append(EstimateRow("logits + loss (fp32)", logits, "formula", "batch x seq x vocab x 3 fp32 buffers"))
    if dequant and not tr.gradient_checkpointing:
        rows.append(EstimateRow("dequantized weight (backward)", dequant, "formula", "largest layer, transient"))
    return rows, trainable


def _compute_bytes(compute_dtype: str, load: str, dev: dict | None) -> tuple[str, int]:
    if compute_dtype == "auto":
        if load in DTYPE_BYTES:
            return load, DTYPE_BYTES[load]
        compute_dtype = "bf16" if (dev or {}).get("bf16") else "fp16"
    if compute_dtype not in DTYPE_BYTES:
        raise EstimateError(f"compute_dtype must be auto, fp16, bf16 or fp32, not {compute_dtype!r}")
    return compute_dtype, DTYPE_BYTES[compute_dtype]


def _device(device: Any) -> tuple[str, dict | None]:
    """(label, {'capacity', 'bf16', 'name'}) for a preset name, a byte count, 'current' or None."""
    if device is None:
        device = DEFAULT_DEVICE
    if isinstance(device, bool):
        raise EstimateError("device must be a preset name, a byte count or 'current'")
    if isinstance(device, int | float):
        if device <= 0:
            raise EstimateError(f"device capacity must be positive bytes, got {device}")
        if device < MiB:
            # 15 or 15.0 is a size in GiB written without its unit, not a 15-byte GPU
            raise EstimateError(
                f"device capacity is in bytes, and {device} bytes is less than 1 MiB; for "
                f"{device:g} GiB pass {device:g} * GiB (helpers.units.GiB) or the string '{device:g}GiB'"
            )
        return format_bytes(int(device)), {"name": format_bytes(int(device)), "capacity": int(device), "bf16": True}
    key = str(device).lower().replace(" ", "").replace("_", "-")
    if key == "current":
        if not torch.cuda.is_available():
            return "cpu", None
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        capacity, name = props.total_memory, props.name
        # a cap set with set_per_process_memory_fraction (e.g. to act as a T4 on a bigger card) is the
        # allocator's real limit: past it, it raises an OOM with the card half empty
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)
        if 0 < fraction < 1:
            capacity = int(capacity * fraction)
            name = f"{props.name}, capped at {fraction:.0%}"
        return name, {"name": name, "capacity": capacity, "bf16": props.major >= 8}
    if key == "cpu":
        return "cpu", None
    if key in DEVICES:
        return key, DEVICES[key]
    if key[:1].isdigit():
        from .units import parse_bytes

        try:
            return _device(parse_bytes(key))  # "24GiB", as the CLI's --device takes it
        except ValueError:
            pass  # the message below lists what is accepted
    raise EstimateError(
        f"unknown device {device!r}; use one of {', '.join(DEVICES)}, 'current', or a size such as 24GiB"
    )


def estimate(
    model: Any,
    *,
    load: str,
    double_quant: bool = True,
    compute_dtype: str = "auto",
    batch_size: int = 1,
    prompt_tokens: int = 512,
    max_new_tokens: int = 256,
    training: LoraTraining | FullTraining | None = None,
    device: Any = None,
    skip_modules: list[str] | None = None,
) -> MemoryEstimate:
    """Predict the GPU memory of ``model`` loaded with ``load`` and used as described.

    Args:
        model: hub id (only its config.json is read), short name or hub id of a shipped config
            (``data/configs``, offline), local folder, config.json path, config object or loaded model.
        load: fp32, fp16, bf16, int8 (LLM.int8), nf4 or fp4 (bitsandbytes 4-bit); "auto" picks the
            widest that fits ``device``.
        double_quant: 4-bit only: quantize the absmax values too (bnb_4bit_use_double_quant).
        compute_dtype: dtype of activations, KV cache and unquantized weights for quantized loads;
            "auto": the load dtype, or bf16 where the device supports it, else fp16.
        batch_size, prompt_tokens, max_new_tokens: generation shape (ignored when ``training``).
        training: :class:`LoraTraining` or :class:`FullTraining` for one training step instead.
        device: preset name (see ``DEVICES``), capacity in bytes, "current" or "cpu" (default T4).
        skip_modules: like ``llm_int8_skip_modules``: module names kept unquantized.
    """
    inputs = dict(load=load, double_quant=double_quant, compute_dtype=compute_dtype, batch_size=batch_size,
                  prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, training=training, device=device,
                  skip_modules=skip_modules)  # fmt: skip
    for k in ("batch_size", "prompt_tokens", "max_new_tokens"):
        v = inputs[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (k == "batch_size" and v < 1):
            raise EstimateError(f"{k} must be an integer >= {1 if k == 'batch_size' else 0}, got {v!r}")
    if training is not None and not isinstance(training, LoraTraining | FullTraining):
        raise EstimateError("training must be LoraTraining(...), FullTraining(...) or None")
    if training is not None:
        for k in ("seq_len", "micro_batch") + (("r",) if isinstance(training, LoraTraining) else ()):
            if not isinstance(getattr(training, k), int) or getattr(training, k) < 1:
                raise EstimateError(f"training.{k} must be an integer >= 1, got {getattr(training, k)!r}")
        if training.optimizer not in OPTIMIZERS:
            raise EstimateError(f"unknown optimizer {training.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    label, dev = _device(device)
    config, name, loaded = resolve_config(model)
    if load == "auto":
        return _auto(model, inputs)
    if load not in LOAD_MODES:
        raise EstimateError(f"unknown load mode {load!r}; use one of {', '.join(LOAD_MODES)} (or 'auto')")
    lay = _layout(config, loaded)
    cdtype, b = _compute_bytes(compute_dtype, load, dev)
    rows = weight_rows(lay, load, b, double_quant, skip_modules)
    warnings = [f"parameter count is approximate (dimension-based): {lay.missing[0]}"] if lay.approximate else []
    d = _dims(config)
    if training is None:
        tokens = prompt_tokens + max_new_tokens
        rows.append(
            EstimateRow(
                "KV cache",
                kv_cache_bytes(config, batch_size, tokens, b),
                "formula",
                f"{d['layers']} layers x 2 x {batch_size} x {tokens} tokens x {d['kv']} kv heads x {d['hd']} x {b} B",
            )
        )
        rows.append(
            EstimateRow(
                "prefill activations",
                _prefill_bytes(d, batch_size, prompt_tokens, b),
                "formula",
                "widest layer of the prompt's forward pass",
            )
        )
        rows.append(
            EstimateRow(
                "logits (last position, fp32 copy)",
                batch_size * d["vocab"] * (b + 4) * 2,
                "formula",
                "generate() keeps logits of the last token only",
            )
        )
    else:
        trows, _ = _training_rows(lay, config, load, b, training)
        rows += trows
    transient = sum(r.bytes for r in rows if not r.name.startswith("weights"))
    n_tensors = sum(1 for e in lay.entries)
    rows.append(
        EstimateRow("allocator rounding", n_tensors * 256, "formula", "512-byte blocks, ~256 B lost per tensor")
    )
    rows.append(
        EstimateRow(
            "fragmentation margin",
            int(transient * FRAGMENTATION),
            "rule of thumb",
            f"{FRAGMENTATION:.0%} of the transient memory",
        )
    )
    if dev is not None:
        rows.append(
            EstimateRow(
                "CUDA context + cuBLAS workspace",
                CUDA_CONTEXT + CUBLAS_WORKSPACE,
                "rule of thumb",
                "outside PyTorch; 300-500 MiB",
            )
        )
    return MemoryEstimate(
        model=str(name),
        load=load,
        rows=rows,
        params=lay.params,
        device=label,
        capacity=(dev or {}).get("capacity"),
        approximate=lay.approximate,
        warnings=warnings,
        inputs=inputs,
        source=model,
    )


def _auto(model, inputs) -> MemoryEstimate:
    """load="auto": the widest load mode that fits the device (the smallest if none does)."""
    _, dev = _device(inputs["device"])
    half = "bf16" if (dev or {}).get("bf16") else "fp16"
    est = None
    for load in (half, "int8", "nf4"):
        est = estimate(model, **{**inputs, "load": load})
        if est.capacity is None or est.total <= est.capacity * TIGHT_FRACTION:
            return est
    return est


# ---------------------------------------------------------------------------------------------
# fit verdicts


@dataclass
class Suggestion:
    """One change that lowers memory, with its saving computed by re-estimating."""

    change: str
    kwargs: dict
    saving: int
    estimate: MemoryEstimate

    def __str__(self) -> str:
        return f"{self.change}: saves {format_bytes(self.saving)} (total {format_bytes(self.estimate.total)})"


@dataclass
class FitVerdict:
    """Whether an estimate fits a device: "fits", "tight" or "does not fit", and what to change."""

    verdict: str
    headroom: int
    capacity: int
    device: str
    estimate: MemoryEstimate
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.verdict != "does not fit"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "headroom": self.headroom, "capacity": self.capacity, "device": self.device,
                "suggestions": [{"change": s.change, "kwargs": _jsonable(s.kwargs), "saving": s.saving,
                                 "total": s.estimate.total} for s in self.suggestions]}  # fmt: skip

    def __str__(self) -> str:
        head = (
            f"{self.verdict.upper()}: {format_bytes(self.estimate.total)} of {format_bytes(self.capacity)} on "
            f"{self.device} (headroom {format_bytes(self.headroom)})"
        )
        return "\n".join([head] + [f"  fix {i}. {s}" for i, s in enumerate(self.suggestions, 1)])

    def _repr_html_(self) -> str:
        status = {"fits": "pass", "tight": "warn", "does not fit": "fail"}[self.verdict]
        html = (
            f"<div>{badge(status)} <b>{self.verdict}</b> on {self.device}: headroom "
            f"{format_bytes(self.headroom)}</div>" + bar(self.estimate.total, self.capacity, self.estimate.model)
        )
        if self.suggestions:
            rows = [
                [
                    i,
                    s.change,
                    format_bytes(s.saving),
                    format_bytes(s.estimate.total),
                    "fits" if s.estimate.total <= self.capacity else "no",
                ]
                for i, s in enumerate(self.suggestions, 1)
            ]
            html += table(["#", "change", "saves", "new total", "fits"], rows, title="fixes")
        return html


def format_params(n: int) -> str:
    """``7.24 B``, ``494.0 M``, ``853.1 K`` parameters."""
    for unit, f in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= f:
            return f"{n / f:.{2 if unit == 'B' else 1}f} {unit}"
    return str(n)


def _jsonable(kw: dict) -> dict:
    return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in kw.items()}


def _verdict(total: int, capacity: int) -> str:
    if total > capacity:
        return "does not fit"
    return "tight" if total > capacity * TIGHT_FRACTION else "fits"


def fit(est: MemoryEstimate, device: Any = None, *, suggest: bool = True) -> FitVerdict:
    """Compare ``est`` with a device ("t4", a preset, "current", or bytes; default: the estimate's).

    When it is tight or does not fit, ``suggestions`` lists changes ranked by whether they make it
    fit and by how much they save, each computed by re-estimating.
    """
    if not isinstance(est, MemoryEstimate):
        raise EstimateError(
            f"fit() compares an estimate with a device, got {type(est).__name__} {est!r:.60}: "
            "call fit(estimate(model, load=...), device)"
        )
    if device is None:
        device = est.inputs.get("device") or DEFAULT_DEVICE
    label, dev = _device(device)
    if dev is None:
        raise EstimateError("no CUDA device here: pass device='t4' (or another preset, or a byte count)")
    if dev.get("bf16") != (_device(est.inputs.get("device"))[1] or {}).get("bf16") and est.source is not None:
        est = est.replace(device=device)  # compute dtype follows the device
    cap = dev["capacity"]
    verdict = _verdict(est.total, cap)
    out = FitVerdict(verdict, cap - est.total, cap, label, est)
    if suggest and verdict != "fits" and est.source is not None:
        out.suggestions = _suggestions(est, device, cap)
    return out


def _candidates(est: MemoryEstimate, device, cap) -> list[tuple[str, dict]]:
    inp = est.inputs
    tr = inp.get("training")
    cands: list[tuple[str, dict]] = []
    order = ["fp32", "bf16", "fp16", "int8", "nf4"]
    if est.load in order:
        for load in order[order.index(est.load) + 1 :]:
            if load == "bf16" and est.load == "fp16":
                continue
            if tr is not None and isinstance(tr, FullTraining) and load in QUANTIZED:
                cands.append(
                    (
                        f"QLoRA: load={load} with LoraTraining()",
                        {"load": load, "training": LoraTraining(seq_len=tr.seq_len, micro_batch=tr.micro_batch)},
                    )
                )
                continue
            cands.append((f"load={load}", {"load": load}))
    if est.load in ("nf4", "fp4") and not inp.get("double_quant"):
        cands.append(("double_quant=True", {"double_quant": True}))
    if tr is None:
        n = max_new_tokens_that_fit(est, device=cap)
        if 0 < n < inp["max_new_tokens"]:
            cands.append((f"max_new_tokens={n}", {"max_new_tokens": n}))
        if inp["batch_size"] > 1:
            bmax = max_batch_that_fits(est, device=cap)
            cands.append((f"batch_size={max(1, bmax)}", {"batch_size": max(1, bmax)}))
        if inp["prompt_tokens"] > 128:
            p = inp["prompt_tokens"] // 2
            cands.append((f"prompt_tokens={p} (truncate inputs)", {"prompt_tokens": p}))
    else:
        if not tr.gradient_checkpointing:
            cands.append(
                ("gradient_checkpointing=True", {"training": dataclasses.replace(tr, gradient_checkpointing=True)})
            )
        if OPTIMIZERS.get(tr.optimizer) in (None, 8):
            cands.append(
                ("optimizer=paged_adamw_8bit", {"training": dataclasses.replace(tr, optimizer="paged_adamw_8bit")})
            )
        if tr.micro_batch > 1:
            cands.append(
                (
                    f"micro_batch=1 (gradient accumulation x{tr.micro_batch})",
                    {"training": dataclasses.replace(tr, micro_batch=1)},
                )
            )
        if tr.seq_len > 128:
            cands.append((f"seq_len={tr.seq_len // 2}", {"training": dataclasses.replace(tr, seq_len=tr.seq_len // 2)}))
        if isinstance(tr, FullTraining) and est.load not in QUANTIZED:
            cands.append(
                (
                    "LoRA instead of full fine-tuning",
                    {
                        "training": LoraTraining(
                            seq_len=tr.seq_len,
                            micro_batch=tr.micro_batch,
                            gradient_checkpointing=tr.gradient_checkpointing,
                        )
                    },
                )
            )
    return cands


def _suggestions(est: MemoryEstimate, device, cap) -> list[Suggestion]:
    out = []
    for change, kw in _candidates(est, device, cap):
        try:
            new = est.replace(**kw)
        except EstimateError:
            continue
        if new.total < est.total:
            out.append(Suggestion(change, kw, est.total - new.total, new))
    smaller = _smaller_model(est, cap)
    if smaller is not None:
        out.append(smaller)
    # Ranked: changes that make it fit first (the least drastic of those: smallest saving that fits),
    # then the rest by saving.
    out.sort(key=lambda s: (s.estimate.total > cap, s.saving if s.estimate.total <= cap else -s.saving))
    return out


def _smaller_model(est: MemoryEstimate, cap: int) -> Suggestion | None:
    """The largest shipped model smaller than this one that fits with the same settings."""
    best = None
    for hub_id in shipped_configs():
        try:
            kw = {k: v for k, v in est.inputs.items()}
            new = estimate(hub_id, **kw)
        except Exception:
            continue
        if new.params < est.params and new.total <= cap * TIGHT_FRACTION and (best is None or new.params > best.params):
            best = new
    if best is None:
        return None
    return Suggestion(
        f"a smaller model: {best.model} ({format_params(best.params)} parameters)",
        {"model": best.model},
        est.total - best.total,
        best,
    )


def _search(est: MemoryEstimate, key: str, cap: int, lo: int, hi: int) -> int:
    """Largest value of ``key`` in [lo, hi] whose estimate fits ``cap`` (lo - 1 when none)."""
    if est.replace(**{key: lo}).total > cap:
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if est.replace(**{key: mid}).total <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _as_estimate(model_or_est, kwargs) -> MemoryEstimate:
    if isinstance(model_or_est, MemoryEstimate):
        return model_or_est.replace(**kwargs) if kwargs else model_or_est
    kwargs.setdefault("load", "fp16")
    return estimate(model_or_est, **kwargs)


def _capacity(device) -> int:
    _, dev = _device(device)
    if dev is None:
        raise EstimateError("no CUDA device here: pass device='t4' (or another preset, or a byte count)")
    return dev["capacity"]


def max_new_tokens_that_fit(model_or_estimate, *, device: Any = DEFAULT_DEVICE, limit: int = 1 << 20, **kwargs) -> int:
    """The largest ``max_new_tokens`` that fits ``device`` (0 if even the prompt alone does not fit: -1)."""
    est = _as_estimate(model_or_estimate, kwargs)
    return _search(est, "max_new_tokens", _capacity(device), 0, limit)


def max_batch_that_fits(model_or_estimate, *, device: Any = DEFAULT_DEVICE, limit: int = 4096, **kwargs) -> int:
    """The largest ``batch_size`` that fits ``device`` (0 when batch 1 does not fit)."""
    est = _as_estimate(model_or_estimate, kwargs)
    return _search(est, "batch_size", _capacity(device), 1, limit)


# ---------------------------------------------------------------------------------------------
# measuring a loaded model


def footprint(model: torch.nn.Module) -> int:
    """Exact bytes held by a loaded model: parameters, buffers and bitsandbytes quantization state.

    Storage shared by several tensors (tied embeddings, int8 CB/weight, the nested code of 4-bit
    layers) is counted once. transformers' ``get_memory_footprint()`` misses the quantization state.
    """
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(
            f"footprint() measures a loaded model (torch.nn.Module), got {type(model).__name__}; "
            "for a hub id or path before loading, use estimate(model, load=...)"
        )
    seen: set[tuple] = set()
    total = 0

    def add(t):
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = (t.device, t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            return
        seen.add(key)
        total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        for attr in ("SCB", "CB"):
            add(getattr(p, attr, None))
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            for attr in ("absmax", "code", "offset"):
                add(getattr(qs, attr, None))
            qs = getattr(qs, "state2", None)
    for b in model.buffers():
        add(b)
    return total


# ---------------------------------------------------------------------------------------------
# preflight hook


def preflight_checks(model: Any, *, load: str = "auto", max_new_tokens: int = 256, snapshot=None) -> list:
    """The "fit" check of :func:`helpers.preflight.preflight`: does ``model`` fit this GPU (or a T4)?"""
    from .preflight import Check

    gpu = snapshot.gpu if snapshot is not None and getattr(snapshot, "backend", None) == "cuda" else None
    if gpu is not None:
        # What this process can still use: free memory plus what it already holds.
        capacity = gpu.free + gpu.allocated
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            capacity += CUDA_CONTEXT + CUBLAS_WORKSPACE  # already paid: free memory excludes it
        device = {"capacity": capacity}
        where = f"{gpu.name} ({format_bytes(capacity)} usable)"
        dev_arg: Any = capacity
        bf16 = bool(gpu.supports_bf16)
    else:
        device = DEVICES[DEFAULT_DEVICE]
        where = f"a T4 ({format_bytes(device['capacity'])}; no GPU here, so checked against Colab's)"
        dev_arg = DEFAULT_DEVICE
        bf16 = False
    half = "bf16" if bf16 else "fp16"
    loads = [half, "int8", "nf4"] if load == "auto" else [load]
    try:
        ests = [estimate(model, load=m, max_new_tokens=max_new_tokens, device=dev_arg,
                         compute_dtype=half if m in QUANTIZED else "auto") for m in loads]  # fmt: skip
    except EstimateError as e:
        return [Check("fit", "info", f"cannot estimate: {e}")]
    cap = device["capacity"]
    chosen = next((e for e in ests if _verdict(e.total, cap) == "fits"), None)
    chosen = chosen or next((e for e in ests if _verdict(e.total, cap) == "tight"), None) or ests[-1]
    v = fit(chosen, dev_arg)
    data = {"load": chosen.load, "total": chosen.total, "weights": chosen.weights, "params": chosen.params,
            "capacity": cap, "verdict": v.verdict, "headroom": v.headroom,
            "all": {e.load: e.total for e in ests}}  # fmt: skip
    summary = (
        f"{chosen.model} ({format_params(chosen.params)} params) with load={chosen.load} and "
        f"max_new_tokens={max_new_tokens}: {format_bytes(chosen.total)} predicted "
        f"(weights {format_bytes(chosen.weights)}) on {where}: {v.verdict}"
    )
    if load == "auto" and len(ests) > 1:
        summary += " [" + ", ".join(f"{e.load} {format_bytes(e.total)}" for e in ests) + "]"
    status = {"fits": "pass", "tight": "warn", "does not fit": "fail"}[v.verdict]
    fix = None
    if v.suggestions:
        fix = f"{v.suggestions[0]}"
    elif load == "auto" and chosen.load != loads[0]:
        fix = f"load with {chosen.load} ({loads[0]} needs {format_bytes(ests[0].total)})"
    return [Check("fit", status, summary, fix, data)]


# ---------------------------------------------------------------------------------------------
# CLI


def _parse_lora(text: str) -> LoraTraining:
    kw: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        if "=" not in part:
            raise EstimateError(f"--lora takes key=value pairs like r=16,optimizer=adamw_8bit, got {part!r}")
        k, v = part.split("=", 1)
        k = k.strip().replace("-", "_")
        fields = {f.name: f for f in dataclasses.fields(LoraTraining)}
        if k not in fields:
            raise EstimateError(f"unknown --lora key {k!r}; use {', '.join(fields)}")
        try:
            if k in ("r", "alpha", "seq_len", "micro_batch"):
                kw[k] = int(v)
            elif k == "lora_dropout":
                kw[k] = float(v)
        except ValueError:
            raise EstimateError(
                f"--lora {k}={v!r}: {k} takes a {'number' if k == 'lora_dropout' else 'whole number'}"
                f", e.g. {'lora_dropout=0.05' if k == 'lora_dropout' else k + '=16'}"
            ) from None
        if k in ("r", "alpha", "seq_len", "micro_batch", "lora_dropout"):
            continue
        if k == "gradient_checkpointing":
            kw[k] = v.lower() in ("1", "true", "yes", "on")
        elif k == "targets":
            kw[k] = v if v == "all-linear" else v.split("+")
        else:
            kw[k] = v
    return LoraTraining(**kw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m helpers estimate",
        description="Estimate the GPU memory a model needs and whether it fits (reads only config.json).",
        epilog=f"Offline configs: {', '.join(shipped_configs())}",
    )
    parser.add_argument("model", help="hub id, shipped config name (e.g. Llama-2-7b-hf), folder or config.json")
    parser.add_argument("--load", default="auto", help=f"{', '.join(LOAD_MODES)} or auto (default)")
    parser.add_argument("--no-double-quant", action="store_true", help="4-bit without double quantization")
    parser.add_argument("--compute-dtype", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--lora", metavar="K=V,...", help="estimate a LoRA training step, e.g. r=16,seq_len=1024")
    parser.add_argument("--full", action="store_true", help="estimate a full fine-tuning step")
    parser.add_argument("--device", default=DEFAULT_DEVICE, help=f"{', '.join(DEVICES)}, current, or bytes like 24GiB")
    parser.add_argument("--json", action="store_true", help="print the breakdown and verdict as JSON")
    args = parser.parse_args(argv)
    try:
        device: Any = args.device
        if device.lower() not in DEVICES and device.lower() not in ("current", "cpu"):
            from .units import parse_bytes

            try:
                device = parse_bytes(device)
            except ValueError:
                pass  # _device() explains the valid names
        training = _parse_lora(args.lora) if args.lora is not None else (FullTraining() if args.full else None)
        est = estimate(args.model, load=args.load, double_quant=not args.no_double_quant,
                       compute_dtype=args.compute_dtype, batch_size=args.batch, prompt_tokens=args.prompt_tokens,
                       max_new_tokens=args.max_new_tokens, training=training, device=device)  # fmt: skip
        verdict = fit(est, device) if est.capacity else None
    except (EstimateError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = est.to_dict()
        out["fit"] = verdict.to_dict() if verdict else None
        print(json.dumps(out, indent=2, default=str))
    else:
        print(est)
        if verdict:
            print(verdict)
    return 0
