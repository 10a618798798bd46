"""Fingerprints of what makes a generated result: the weights loaded, the adapter, the load mode as
loaded, the tokenizer and the generation settings (objects included).

A resume may reuse a result only when the same of each made it; names and paths are not enough (a
merged adapter or a checkpoint replaced at the same path keep both). Weights are read as a fixed
sample of every tensor's bytes: up to :data:`SAMPLE` evenly spaced elements, gathered on the
tensor's own device and copied back in one transfer per device, so a 7B costs about as much as a
few hundred tiny reads, never a pass over its gigabytes. Adapter tensors are small and are hashed
whole (an edit anywhere in them, e.g. a negated ``lora_B``, changes the fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import types
from typing import Any

import torch

from ..core.errors import FingerprintError

__all__ = [
    "SAMPLE",
    "weights_fingerprint",
    "adapter_fingerprint",
    "adapters_disabled",
    "loaded_mode",
    "tokenizer_identity",
    "describe",
    "model_identity",
    "identity_changes",
]

SAMPLE = 1024  # elements read per weight tensor (evenly spaced; smaller tensors are read whole)
ADAPTER_WHOLE = 1 << 22  # adapter tensors up to this many elements are hashed whole (a LoRA matrix is far smaller)
IDENTITY_VERSION = 2  # records of version 1 (name, load, adapter only) cannot be checked against a model
_ADAPTER_MARKS = ("lora_", "modules_to_save")
_PROBE = "Hello world! 123 Ünïcødé\n\tend"  # tokenized to catch normalisation and BOS/EOS settings


# ---------------------------------------------------------------------------------------------
# tensors


def _is_adapter(name: str) -> bool:
    return any(mark in name for mark in _ADAPTER_MARKS)


def _sample(t: torch.Tensor, whole_up_to: int, count: int) -> torch.Tensor:
    """A fixed sample of ``t``'s elements as bytes, still on its device (the whole tensor when small)."""
    flat = t.detach().reshape(-1)
    if flat.numel() > whole_up_to:
        # integer steps: float positions round past the end on tensors of tens of millions of elements
        idx = torch.arange(count, device=flat.device, dtype=torch.int64) * (flat.numel() - 1) // (count - 1)
        flat = flat[idx]
    flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)


def _quant_header(t: torch.Tensor) -> tuple[str, list[torch.Tensor]]:
    """What a bitsandbytes parameter needs besides its packed bytes: the quant type (fp4 is not nf4),
    block size and scales (4-bit ``quant_state``, 8-bit ``SCB``)."""
    extra: list[torch.Tensor] = []
    parts = []
    state = getattr(t, "quant_state", None)
    while state is not None:
        parts.append(
            f"{getattr(state, 'quant_type', '?')}/{getattr(state, 'blocksize', '?')}/{getattr(state, 'dtype', '?')}"
        )
        for attr in ("absmax", "code", "offset"):
            value = getattr(state, attr, None)
            if isinstance(value, torch.Tensor):
                extra.append(value)
        state = getattr(state, "state2", None)
    scb = getattr(t, "SCB", None)
    if isinstance(scb, torch.Tensor):
        extra.append(scb)
    return ";".join(parts), extra


def _tensors(model) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer once (tied weights once), an offloaded one read from its
    accelerate hook's weights map instead of the empty ``meta`` placeholder the module holds."""
    out, seen = [], set()
    for prefix, module in model.named_modules():
        hook_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        skip = getattr(module, "_non_persistent_buffers_set", set())  # recomputed at load: not weights
        local = list(module.named_parameters(recurse=False))
        local += [(n, b) for n, b in module.named_buffers(recurse=False) if n not in skip]
        for name, t in local:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if t.is_meta and hook_map is not None:
                try:
                    t = hook_map[name]
                except (KeyError, RuntimeError, OSError):
                    pass  # not readable: its name, shape and dtype still count
            out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


def _digest_tensors(named: list[tuple[str, torch.Tensor]], whole_up_to: int, count: int) -> tuple[str, int]:
    """(hex digest, tensors not readable) over names, shapes, dtypes, quant headers and sampled bytes."""
    h = hashlib.sha256()
    pieces: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    headers: list[bytes] = []
    unread = 0
    for name, t in named:
        quant, extra = _quant_header(t)
        headers.append(f"{name}|{t.dtype}|{tuple(t.shape)}|{quant}".encode())
        for k, part in enumerate([t, *extra]):
            if part.is_meta:
                unread += 1
                continue
            pieces.setdefault(part.device, []).append((len(headers) * 16 + k, _sample(part, whole_up_to, count)))
    data: dict[int, bytes] = {}
    for parts in pieces.values():  # one copy to the CPU per device, not one per tensor
        joined = torch.cat([p for _, p in parts]).cpu().numpy().tobytes()
        pos = 0
        for key, p in parts:
            data[key] = joined[pos : pos + p.numel()]
            pos += p.numel()
    for i, header in enumerate(headers, start=1):
        h.update(header)
        for k in range(16):
            if (i * 16 + k) in data:
                h.update(data[i * 16 + k])
    return h.hexdigest()[:16], unread


def weights_fingerprint(model) -> str:
    """A content hash of the base weights as loaded (adapter tensors excluded: see :func:`adapter_fingerprint`).

    Reads :data:`SAMPLE` evenly spaced elements of every tensor (tensors at most that big whole),
    with names, shapes, dtypes and bitsandbytes quantization states. Weights offloaded to the CPU
    or disk are read through accelerate's hook; a tensor that cannot be read counts by name, shape
    and dtype only, and the fingerprint then ends in ``+meta<count>``.
    """
    named = [(n, t) for n, t in _tensors(model) if not _is_adapter(n)]
    digest, unread = _digest_tensors(named, SAMPLE, SAMPLE)
    return digest + (f"+meta{unread}" if unread else "")


def adapter_fingerprint(model) -> str | None:
    """The attached PEFT adapters (kind, rank, active ones) and a hash of their whole weights; None without any."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    named = [(n, t) for n, t in _tensors(model) if _is_adapter(n)]
    digest, _ = _digest_tensors(named, ADAPTER_WHOLE, 1 << 16)
    settings = {name: describe(getattr(c, "to_dict", dict)(), f"peft_config[{name!r}]") for name, c in configs.items()}
    active = getattr(model, "active_adapters", None)
    active = list(active) if isinstance(active, list | tuple) else [str(getattr(model, "active_adapter", "?"))]
    config_digest = hashlib.sha256(json.dumps([settings, active], sort_keys=True).encode()).hexdigest()[:8]
    kinds = ", ".join(
        f"{name}: {getattr(getattr(c, 'peft_type', None), 'value', '?')} r={getattr(c, 'r', '?')}"
        for name, c in configs.items()
    )
    # under model.disable_adapter() the base model generates: its results are not the adapter's
    off = " (adapter disabled: the base model ran)" if adapters_disabled(model) else ""
    return f"{kinds} #{digest}{config_digest}{off}"


def adapters_disabled(model) -> bool:
    """Whether the model's adapter layers are switched off (``with model.disable_adapter():``): then the
    base model computes, though the adapter's weights are attached."""
    return any(getattr(m, "_disable_adapters", False) is True for m in model.modules())  # peft's tuner layers


# ---------------------------------------------------------------------------------------------
# load mode and tokenizer


# bitsandbytes' quantized linear layers (a load that quantized nothing has none)
_BNB_LINEARS = ("Linear4bit", "Linear8bitLt", "LinearNF4", "LinearFP4")


def loaded_mode(model) -> str:
    """The load mode as loaded: ``nf4``/``fp4`` (``+dq`` with double quantization), ``int8``, or the dtype.

    A bitsandbytes config with no layer quantized (every layer mapped to the CPU, where bitsandbytes leaves
    layers unquantized; a model without linear layers it takes) loaded as its dtype, whatever the config says."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    if any(type(m).__name__ in _BNB_LINEARS for m in model.modules()):  # else the config quantized nothing
        if getattr(model, "is_loaded_in_4bit", False) or get("load_in_4bit", False):
            mode = str(get("bnb_4bit_quant_type", "nf4") or "nf4")
            return mode + ("+dq" if get("bnb_4bit_use_double_quant", False) else "")
        if getattr(model, "is_loaded_in_8bit", False) or get("load_in_8bit", False):
            return "int8"
    dtype = getattr(model, "dtype", None)
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def tokenizer_identity(tokenizer) -> dict:
    """What of the tokenizer changes the prompts' ids or their padding: padding side, special tokens,
    vocabulary size and a hash of a probe text's ids (normalisation, BOS/EOS insertion)."""
    special = getattr(tokenizer, "special_tokens_map", {}) or {}
    try:
        probe = list(tokenizer(_PROBE)["input_ids"])
    except Exception:  # a tokenizer that cannot encode the probe: the other fields still count
        probe = []
    return {
        "padding_side": getattr(tokenizer, "padding_side", None),
        "special": {k: str(v) for k, v in sorted(special.items())},
        "pad_token_id": getattr(tokenizer, "pad_token_id", None),
        "size": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
        "probe": hashlib.sha256(json.dumps(probe).encode()).hexdigest()[:12],
    }


# ---------------------------------------------------------------------------------------------
# generation settings: any value, made JSON (tensors, configs and callables by content)


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    for const in code.co_consts:  # nested functions by their code, not their repr (which holds an address)
        h.update((_code_digest(const) if isinstance(const, types.CodeType) else repr(const)).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:12]


def _refuse(value: Any, where: str) -> FingerprintError:
    return FingerprintError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__} that oomkit cannot fingerprint, so a "
        "resume could not tell results made with another one from this run's. Pass plain values (numbers, "
        "strings, lists, dicts, tensors, a GenerationConfig, logits processors or functions whose attributes "
        "are such values), or give the object a method oomkit_fingerprint() returning a string that changes "
        "whenever its behaviour does"
    )


def describe(value: Any, where: str = "value", _depth: int = 0) -> Any:
    """``value`` as JSON that changes whenever it would change a generation; tensors by a hash of their
    bytes, a ``GenerationConfig`` by its settings, callables by their code, closure and attributes.

    Raises:
        FingerprintError: for an object with no readable state (the message names ``where`` and the fix).
    """
    if _depth > 12:
        raise FingerprintError(f"{where} nests deeper than 12 levels: pass a simpler value, or an object "
                               "with a method oomkit_fingerprint() returning a string")  # fmt: skip
    d = _depth + 1
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [describe(v, f"{where}[{i}]", d) for i, v in enumerate(items)]
    if isinstance(value, dict):
        return {str(k): describe(v, f"{where}[{k!r}]", d) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.Tensor):
        digest, _ = _digest_tensors([("", value)], 1 << 24, 1 << 16)
        return {"tensor": f"{value.dtype} {tuple(value.shape)} #{digest}"}
    if callable(getattr(value, "oomkit_fingerprint", None)) and not isinstance(value, type):
        return {"type": _type_name(value), "fingerprint": str(value.oomkit_fingerprint())}
    if isinstance(value, torch.nn.Module):
        return {"type": _type_name(value), "weights": weights_fingerprint(value), "adapter": adapter_fingerprint(value)}
    if callable(getattr(value, "to_diff_dict", None)):  # a GenerationConfig: what differs from the defaults
        settings = {k: v for k, v in value.to_diff_dict().items() if k != "transformers_version"}
        return {"type": _type_name(value), "settings": describe(settings, where, d)}
    if hasattr(value, "special_tokens_map") and callable(value):  # a tokenizer (stop_strings needs one)
        return {"type": _type_name(value), "tokenizer": tokenizer_identity(value)}
    return _describe_object(value, where, d)


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code (and the code nested in it) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _globals_read(fn: types.FunctionType, where: str, d: int) -> dict:
    """The module globals ``fn`` reads, by value: a threshold kept in a global changes the function's output
    as much as its code does. Modules, functions and classes count by name (their own code is theirs to
    change); a value with no readable state by its type (it was accepted before globals counted)."""
    found = {}
    for name in sorted(_names(fn.__code__) & set(fn.__globals__)):
        value = fn.__globals__[name]
        if isinstance(value, types.ModuleType):
            continue
        if isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
            found[name] = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', name)}"
            continue
        try:
            found[name] = describe(value, f"{where} global {name}", d)
        except FingerprintError:
            found[name] = {"type": _type_name(value)}
    return found


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _describe_object(value: Any, where: str, d: int) -> Any:
    """Functions by code, defaults and closure; methods by function and owner; objects by attributes."""
    if isinstance(value, types.MethodType):
        return {"method": describe(value.__func__, where, d), "self": describe(value.__self__, f"{where}.__self__", d)}
    if isinstance(value, types.FunctionType):
        cells = [c.cell_contents for c in (value.__closure__ or ())]
        return {
            "function": f"{value.__module__}.{value.__qualname__}",
            "code": _code_digest(value.__code__),
            "defaults": describe(list(value.__defaults__ or ()), f"{where} defaults", d),
            "closure": describe(cells, f"{where} closure", d),
            "globals": _globals_read(value, where, d),
        }
    if isinstance(value, type):
        return {"class": f"{value.__module__}.{value.__qualname__}"}
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and not isinstance(value, types.ModuleType):
        public = {k: v for k, v in state.items() if not k.startswith("__")}
        return {"type": _type_name(value), "state": describe(public, f"{where}.__dict__", d)}
    raise _refuse(value, where)


# ---------------------------------------------------------------------------------------------
# the identity of a model, and what changed between two


def model_identity(model, tokenizer=None) -> dict:
    """What made a result: name, load mode as loaded, adapter, base-weights fingerprint and tokenizer."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    identity = {
        "name": str(name),
        "load": loaded_mode(model),
        "adapter": adapter_fingerprint(model),
        "weights": weights_fingerprint(model),
        "identity": IDENTITY_VERSION,
    }
    if tokenizer is not None:
        identity["tokenizer"] = tokenizer_identity(tokenizer)
    return identity


_WHY = {
    "weights": "the weights differ (same name, other content: a merged adapter, a checkpoint replaced at the "
    "same path, or edited weights)",
    "adapter": "the adapter differs",
    "load": "the load mode differs",
}


def identity_changes(recorded: Any, current: dict) -> list[str]:
    """What differs between a record's identity and this run's, in words (empty: the same)."""
    if not isinstance(recorded, dict) or recorded.get("identity") != IDENTITY_VERSION:
        return [
            "made by an older oomkit that did not record the weights' fingerprint, so whether this model "
            "made them cannot be checked"
        ]
    out = []
    if recorded.get("name") != current.get("name"):
        out.append(f"another model {recorded.get('name')!r} (this run: {current.get('name')!r})")
    for key in ("load", "adapter", "weights"):
        if recorded.get(key) != current.get(key):
            out.append(f"{_WHY[key]}: {recorded.get(key)!r} (this run: {current.get(key)!r})")
    old, new = recorded.get("tokenizer") or {}, current.get("tokenizer") or {}
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            out.append(f"tokenizer {key} {old.get(key)!r} (this run: {new.get(key)!r})")
    return out
