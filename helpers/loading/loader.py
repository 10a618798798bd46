"""Load a model by plan: check first, refuse with the reason and the fix, then report what landed where.

A :class:`LoadPlan` (:mod:`helpers.loading.plan`) says what to load and how (load mode, compute dtype,
generation budget, placement). ``plan.from_pretrained_kwargs()`` turns it into the current transformers
API (``quantization_config=BitsAndBytesConfig(...)``, ``dtype=``). :func:`load` checks the plan against
this machine before touching any weights (:mod:`helpers.loading.checks`: the model exists, bitsandbytes can
run, the estimate fits, RAM can hold the largest weight file) and returns ``(model, tokenizer,
LoadReport)`` (:mod:`helpers.loading.report`).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.attention import keep_attention_fused
from ..core.compat import library_notes_silenced
from ..core.devices import (
    device_kind,
)
from ..core.errors import LoadError, LoadRefused  # defined there so gpu_split can refuse
from ..core.memory import MemorySnapshot, allocated
from ..core.phases import phase
from ..core.reducers import use_kv_cache
from ..core.sources import (
    SourceError,
    read_json,
    shipped_config,
)
from ..estimator.configs import resolve_config
from ..estimator.families import auto_class
from ..estimator.footprint import footprint
from ..estimator.layout import quantization_skip_modules
from ..estimator.rows import EstimateError
from ..placement.decision import spill_fix
from ..placement.device_plan import PREQUANTIZED_OFFLOAD, PREQUANTIZED_OFFLOAD_FIX, bnb_prequantized
from ..placement.gpu_room import map_strategy
from .checks import (
    PlanCheck,
    check_adapter,
    check_bitsandbytes,
    check_model_source,
    check_plan,
    check_prequantized_backend,
    check_prequantized_map,
    check_weight_files,
    find_token,
)
from .fingerprint import loaded_mode
from .plan import LoadPlan, check_fields
from .report import LoadReport, offload_warnings, placement

# the plan (load_plan), the checks (load_checks) and the report (load_report) are re-exported: one import loads
__all__ = [
    "load",
    "setup_tokenizer",
    "keep_4bit_layout",
    "LOAD_NOTES",
]  # fmt: skip

# What transformers logs about a load oomkit planned: bitsandbytes' replacement finding no linear layer to quantize
# on a CPU device map (in a message that names another backend, eetq); the load report says what stayed unquantized
LOAD_NOTES = (r"but no linear modules were found in your model",)


# ----------------------------------------------------------------------------- loading


def setup_tokenizer(tokenizer, model=None):
    """Make a tokenizer ready for batched generation: a pad token and left padding (decoder-only).

    Returns a one-line note of what was changed.
    """
    notes = []
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            notes.append("added a <pad> token")
        else:
            tokenizer.pad_token = fallback
            notes.append(f"pad token = {fallback!r} (it had none)")
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if not encoder_decoder and tokenizer.padding_side != "left":
        # right padding puts pad tokens between a prompt and its continuation
        tokenizer.padding_side = "left"
        notes.append("left padding for batched generation")
    if model is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return "; ".join(notes) or "ready (pad token and padding side already set)"


def model_class(model: str, trust_remote_code: bool = False, token: str | None = None):
    """The transformers Auto class that loads ``model``: AutoModelForCausalLM, AutoModelForSeq2SeqLM (T5,
    BART), AutoModelForSpeechSeq2Seq (Whisper) or AutoModelForImageTextToText (LLaVA, Qwen2-VL), as
    :func:`helpers.estimator.families.auto_class` decides from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, token=token)
    except Exception:  # from_pretrained itself then says what is wrong with the checkpoint
        return AutoModelForCausalLM
    return auto_class(config)


def _attn_supported(model: str, attn: str | None, trust_remote_code: bool) -> str | None:
    """Keep ``attn`` (``"sdpa"``) when the architecture supports it, else let transformers pick."""
    if attn != "sdpa":
        return attn
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        cls = auto_class(config)._model_mapping[type(config)]
        return "sdpa" if getattr(cls, "_supports_sdpa", False) else None
    except Exception:
        return None


def load(
    plan: LoadPlan | str,
    *,
    check: bool = True,
    snapshot: MemorySnapshot | None = None,
    bnb: tuple[bool, str] | None = None,
    **plan_changes,
):
    """Check ``plan``, load the model and tokenizer, and report estimated vs measured memory.

    Args:
        plan: a :class:`LoadPlan` (or a model id/path, with ``plan_changes`` as its fields).
        check: run the pre-load checks (model exists, bitsandbytes, fit, RAM); ``False`` skips
            the fit and RAM refusals (you accept the risk) but still checks paths and bitsandbytes.
        snapshot, bnb: simulate a device (see :func:`check_plan`).

    Returns:
        ``(model, tokenizer, LoadReport)``.

    Raises:
        LoadError (``ModelNotFoundError`` or ``LoadRefused``) with the reason and the fix.
    """
    from transformers import AutoTokenizer

    if isinstance(plan, str | os.PathLike):
        check_fields(plan_changes)
        plan = LoadPlan(str(plan), **plan_changes)
    elif not isinstance(plan, LoadPlan):
        raise TypeError(
            f"load() takes a LoadPlan or a model id/path, got {type(plan).__name__} {plan!r:.60}: "
            "e.g. load('Qwen/Qwen2.5-0.5B', load='nf4') or load(LoadPlan(...))"
        )
    elif plan_changes:
        plan = plan.replace(**plan_changes)
    checked = _checked(plan, check, snapshot, bnb)
    est = checked.estimate
    kwargs, token = _run_kwargs(plan, checked)
    cuda = torch.cuda.is_available()
    before = allocated("all") if cuda else 0
    started = time.perf_counter()
    with phase("load"):  # shaded on a running MemoryMonitor's chart
        model = _from_pretrained(plan.model, kwargs, est)
        keep_4bit_layout(model)  # what footprint() measures now is what generation and training see
        use_kv_cache(model, plan.kv_cache)
        attention = keep_attention_fused(model)
        tokenizer = AutoTokenizer.from_pretrained(plan.model, token=token, trust_remote_code=plan.trust_remote_code)
        measured = footprint(model)
        where = placement(model)
        model, adapter_bytes = _with_adapter(model, plan.adapter, measured)
    seconds = time.perf_counter() - started
    note = setup_tokenizer(tokenizer, model)
    model.eval()
    report = LoadReport(
        plan=plan,
        estimated_weights=est.weights,
        measured_weights=measured,
        estimated_total=est.total,
        load_seconds=seconds,
        placement=where,
        cuda_allocated=(allocated("all") - before) if cuda else None,
        adapter_bytes=adapter_bytes,
        warnings=[*checked.warnings, *offload_warnings(where)],
        estimate=est,
        tokenizer_note=note,
        split=checked.split,
        notes=[*checked.notes, *([attention] if attention else [])],
        loaded_as=loaded_mode(model),
    )
    return model, tokenizer, report


def _checked(plan: LoadPlan, check: bool, snapshot: MemorySnapshot | None, bnb) -> PlanCheck:
    """The pre-load checks (all of them, or with ``check=False`` only paths, adapter and the quantization backends)."""
    if check:
        return check_plan(plan, snapshot=snapshot, bnb=bnb)
    token = plan.token or find_token()
    checked = PlanCheck(plan, check_model_source(plan.model, token), plan.estimate("current"))
    check_weight_files(plan.model, allow_pickle=plan.allow_pickle)  # a bad file is a certain raw error, not a risk
    if plan.adapter:
        check_adapter(plan.adapter)
    check_bitsandbytes(plan.load, device_kind(), bnb)
    check_prequantized_backend(plan)
    check_prequantized_map(plan, checked.estimate)  # a certain failure, not a risk to accept
    return checked


def _run_kwargs(plan: LoadPlan, checked: PlanCheck) -> tuple[dict[str, Any], str | None]:
    """``from_pretrained`` keyword arguments for the checked plan, and the hub token to use."""
    run_plan = plan.replace(
        max_memory=checked.max_memory,
        attn_implementation=_attn_supported(plan.model, plan.attn_implementation, plan.trust_remote_code),
    )
    if run_plan.token is None:
        run_plan.token = find_token()
    # a split loads the map that was checked card by card (transformers would compute the same one)
    kwargs = (
        run_plan.from_pretrained_kwargs() if checked.split is None else checked.split.from_pretrained_kwargs(run_plan)
    )
    _keep_vision_unquantized(plan, kwargs)
    if checked.estimate.quantized_by is not None:  # the checkpoint's own config decides (transformers warns)
        # nor is llm_int8_enable_fp32_cpu_offload passed another way: the checks refused any offload of a
        # bitsandbytes checkpoint, which transformers cannot load (placement.PREQUANTIZED_OFFLOAD)
        kwargs.pop("quantization_config", None)
    if device_kind() != "cuda" and (map_strategy(kwargs.get("device_map")) or checked.split is not None):
        # nothing to place on a CPU-only machine (a split here was planned for a simulated one)
        kwargs["device_map"] = None
        kwargs.pop("max_memory", None)
    return kwargs, run_plan.token


def _keep_vision_unquantized(plan: LoadPlan, kwargs: dict[str, Any]) -> None:
    """A VLM's vision tower and projector stay in 16 bits in an int8/4-bit load, as the estimate counts them."""
    qc = kwargs.get("quantization_config")
    if qc is None:
        return
    try:
        skip = quantization_skip_modules(resolve_config(plan.model)[0])
    except (EstimateError, OSError, ValueError):
        return
    if skip:
        qc.llm_int8_skip_modules = skip


def _from_pretrained(model: str, kwargs: dict[str, Any], est):
    """``from_pretrained`` of the model's family class (:func:`model_class`); the refusal transformers gives
    when its own placement offloads part of a checkpoint saved quantized by bitsandbytes (a ``max_memory``
    with a CPU share: the checks predicted no offload) becomes oomkit's, with the fix."""
    cls = model_class(model, kwargs.get("trust_remote_code", False), kwargs.get("token"))
    try:
        with library_notes_silenced(*LOAD_NOTES):
            return cls.from_pretrained(model, **kwargs)
    except ValueError as e:
        if "llm_int8_enable_fp32_cpu_offload" not in str(e):
            raise
        if bnb_prequantized(est):
            raise LoadRefused(
                f"transformers' placement put part of {model} on the CPU or disk, and {PREQUANTIZED_OFFLOAD}",
                "free GPU memory (unload an earlier model), a smaller batch or max_new_tokens; "
                f"or {PREQUANTIZED_OFFLOAD_FIX}",
            ) from None
        raise LoadRefused(  # the checks predicted no offload; transformers' own placement disagrees
            f"transformers' placement would put part of {model} on the CPU or disk, which the checks did not "
            "predict (they refuse or announce every offload)",
            f"free GPU memory (unload an earlier model); or {spill_fix(est)}",
        ) from None


def _with_adapter(model, adapter: str | None, base_bytes: int):
    """``model`` with the PEFT adapter at ``adapter`` attached (if any), and the adapter's bytes."""
    if not adapter:
        return model, 0
    from peft import PeftModel

    _check_adapter_base(model, adapter)
    with warnings.catch_warnings():
        # peft still calls transformers' old name (is_gradient_checkpointing): same feature
        warnings.filterwarnings("ignore", message=".*checkpointing.* is deprecated", category=FutureWarning)
        try:
            model = PeftModel.from_pretrained(model, adapter)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # peft's own words are kept, shortened
            base = _adapter_base(adapter)
            raise LoadError(
                f"Adapter {adapter} does not fit this model{f' (it was trained on {base!r})' if base else ''}: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                "load the base model the adapter was trained on, or train an adapter for this one",
            ) from None
    return model, footprint(model) - base_bytes


# the config fields that tell one base model from another (an adapter is tied to its base's shapes and words)
BASE_IDENTITY = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")


def _check_adapter_base(model, adapter: str) -> None:
    """Refuse an adapter whose adapter_config.json names a base model (a local folder or a shipped config)
    that differs from ``model`` in architecture or size: its weights would load silently where shapes match
    (a qwen2 adapter on a llama) and mean nothing."""
    base = _adapter_base(adapter)
    if not base:
        return
    folder = Path(base).expanduser()
    source = folder / "config.json" if (folder / "config.json").is_file() else shipped_config(base)
    if source is None:
        return  # a hub id not at hand: its config cannot be compared offline
    try:
        base_config = read_json(source, "config.json")
    except SourceError:
        return
    ours = model.config.to_dict() if hasattr(model, "config") else {}
    differ = [
        f"{k} {base_config[k]!r} (adapter's base) vs {ours[k]!r} (this model)"
        for k in BASE_IDENTITY
        if k in base_config and k in ours and base_config[k] != ours[k]
    ]
    if differ:
        raise LoadError(
            f"Adapter {adapter} was trained on {base!r}, another base model: {'; '.join(differ)}",
            f"load {base!r} (the base the adapter was trained on) with adapter={adapter!r}, or train an adapter "
            "for this model",
        )


def _adapter_base(adapter: str) -> str | None:
    try:
        return json.loads((Path(adapter).expanduser() / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
    except (OSError, ValueError, AttributeError):
        return None


def keep_4bit_layout(model: torch.nn.Module) -> int:
    """Keep bitsandbytes' 4-bit layers in the layout they were loaded in, on CPU; the layers restored.

    On CPUs with AVX512-bf16, bitsandbytes repacks a ``Linear4bit``'s weight for a faster CPU kernel
    at its first inference forward and keeps it that way: the absmax goes to bf16 (rounded, and the
    double-quantized state expanded, so the footprint changes under the estimate), and the kernel
    (``gemv_4bit``) has no autograd, so a later training step passes no gradient through the frozen
    layer ("an autograd kernel was not registered ... silently incorrect") and the adapters below
    it get none. This turns the repacking off for these layers and undoes any that already happened
    (bitsandbytes' own inverse). GPUs never repack; there it changes nothing.
    """
    restored = 0
    for module in model.modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        state = getattr(module.weight, "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, state
            )
            restored += 1
    return restored
