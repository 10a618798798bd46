"""LoRA adapters on a loaded model: :func:`prepare_qlora` attaches them (and makes a 4-bit model
trainable), :func:`save_adapter` writes only their weights (swapped in whole, a different one kept
aside), :func:`merge_adapter` folds them into the base.
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.attention import keep_attention_fused
from ..core.units import format_bytes
from ..loading.loader import keep_4bit_layout
from .plan import FinetuneError, TrainPlan, need_model, need_plan

__all__ = ["prepare_qlora", "TrainableParams", "save_adapter", "AdapterReport", "AdapterSaveError", "merge_adapter"]

ROUNDING_NOTE = re.compile(r"Merge lora module to (\d+-bit) linear")  # peft's per-layer warning


@dataclass
class TrainableParams:
    """What ``prepare_qlora`` made trainable."""

    trainable: int
    total: int
    targets: list[str]
    gradient_checkpointing: bool
    note: str = ""  # e.g. that the adapters were already attached and the model came back as is

    def __str__(self) -> str:
        return (
            f"trainable parameters: {self.trainable:,} of {self.total:,} ({100 * self.trainable / self.total:.3f} %)"
            f" in LoRA adapters on {', '.join(self.targets)}; gradient checkpointing "
            f"{'on (non-reentrant)' if self.gradient_checkpointing else 'off'}"
            + (f"; {self.note}" if self.note else "")
        )


def prepare_qlora(model: torch.nn.Module, plan: TrainPlan):
    """Make a loaded (usually 4-bit) model trainable with LoRA.

    ``prepare_model_for_kbit_training`` (norms in fp32, input gradients on), gradient checkpointing
    with the non-reentrant variant, then ``get_peft_model`` (adapters initialised from ``plan.seed``).

    A model that already has the plan's LoRA adapters (the cell run again) comes back as is, its
    adapter weights kept; :class:`FinetuneError` when its adapters differ from the plan's or are frozen.

    Returns:
        ``(peft_model, TrainableParams)``.
    """
    need_model(model, "prepare_qlora")
    need_plan(plan, "prepare_qlora")
    from peft import get_peft_model, prepare_model_for_kbit_training

    if hasattr(model, "peft_config"):
        # before anything changes it: a second prepare_model_for_kbit_training would freeze the adapters
        # and get_peft_model would then wrap their base_layer, leaving nothing to train
        return _already_prepared(model, plan)
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    keep_4bit_layout(model)  # a model loaded elsewhere and generated with may have been repacked
    keep_attention_fused(model)  # packed (unmasked) GQA batches on a T4 would save seq x seq fp32 scores
    ckpt_kwargs = {"use_reentrant": False}
    with warnings.catch_warnings():
        # peft still calls transformers' old name for it (gradient_checkpointing_enable): same feature
        warnings.filterwarnings("ignore", message=".*checkpointing.* is deprecated", category=FutureWarning)
        if quantized:
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=plan.gradient_checkpointing, gradient_checkpointing_kwargs=ckpt_kwargs
            )
        elif plan.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
            model.enable_input_require_grads()
        if plan.gradient_checkpointing:
            model.config.use_cache = False  # the cache is useless in training and conflicts with checkpointing
        config = plan.lora_config(model)
        torch.manual_seed(plan.seed)  # LoRA's A matrices start random: the same seed gives the same run
        peft_model = get_peft_model(model, config)
    _frozen_inputs_need_no_grad(peft_model.get_base_model())
    trainable, total = peft_model.get_nb_trainable_parameters()
    return peft_model, TrainableParams(trainable, total, sorted(config.target_modules), plan.gradient_checkpointing)


def _frozen_inputs_need_no_grad(model: torch.nn.Module) -> int:
    """Take ``enable_input_require_grads``' hooks back from the frozen parts (Whisper's audio encoder, a VLM's
    vision tower): transformers (and peft, for a model not quantized) hook every sub-model's input embeddings,
    the encoder's conv and the tower's patch embedding included, so the frozen part would keep its
    activations and backward would run through it, for gradients nothing trains on. Without the hook it runs
    without a graph, as the estimator counts it (``helpers.estimator.family_training``). The hooks are
    told by their function's name (transformers' ``make_inputs_require_grads``, peft's
    ``make_inputs_require_grad``). Returns how many were removed."""
    from ..estimator.families import frozen_modules

    removed = 0
    for name in frozen_modules(model):
        for module in model.get_submodule(name).modules():
            for key, hook in list(module._forward_hooks.items()):
                if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
                    del module._forward_hooks[key]
                    removed += 1
    return removed


def _already_prepared(model, plan: TrainPlan) -> tuple[Any, TrainableParams]:
    """``model`` as is when its LoRA adapters are the plan's and train, else a :class:`FinetuneError`."""
    keep_4bit_layout(model)
    reload = "load the base model again (rerun the load cell) and call prepare_qlora on it"
    trainable, total = model.get_nb_trainable_parameters()
    if trainable == 0:
        raise FinetuneError(
            "this model already has LoRA adapters, but none of their weights trains (loaded for inference, "
            f"e.g. load(LoadPlan(..., adapter=...))): to train, {reload} (without adapter=)"
        )
    config = model.peft_config[model.active_adapter]
    have_targets = [config.target_modules] if isinstance(config.target_modules, str) else config.target_modules
    want = plan.lora_config(model)
    # what transformers' is_gradient_checkpointing reads (renamed is_activation_checkpointing in 5.x)
    checkpointing = any(getattr(m, "gradient_checkpointing", None) is True for m in model.modules())
    pairs = [
        ("r", getattr(config, "r", None), want.r),
        ("alpha", getattr(config, "lora_alpha", None), want.lora_alpha),
        ("dropout", getattr(config, "lora_dropout", None), want.lora_dropout),
        ("targets", sorted(have_targets or []), sorted(want.target_modules)),
        ("gradient_checkpointing", checkpointing, plan.gradient_checkpointing),
    ]
    differ = [f"{name} {have!r} (the plan: {wanted!r})" for name, have, wanted in pairs if have != wanted]
    if differ:
        raise FinetuneError(
            f"this model already has LoRA adapters ({type(config).__name__}) with other settings: "
            f"{'; '.join(differ)}. Adapters cannot be changed in place: {reload}, or set the plan back"
        )
    note = "the model already had these LoRA adapters (prepare_qlora ran on it before): returned as is, weights kept"
    return model, TrainableParams(trainable, total, sorted(have_targets), checkpointing, note)


@dataclass
class AdapterReport:
    path: Path
    files: dict[str, int]
    previous: Path | None = None  # where a different adapter that was at ``path`` was moved

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def __str__(self) -> str:
        return (
            f"adapter saved to {self.path}: {format_bytes(self.bytes)} in {', '.join(sorted(self.files))} "
            "(LoRA weights and config only; load it on the base model with "
            f"helpers.load(LoadPlan(<base>, load=..., adapter='{self.path}')))"
        ) + (f"; the different adapter that was there is kept in {self.previous}" if self.previous else "")


def save_adapter(model, path: str | Path, tokenizer=None) -> AdapterReport:
    """Save only the LoRA adapter (and the tokenizer when given), not the base model's weights."""
    if not hasattr(model, "peft_config"):
        raise TypeError("save_adapter needs the PEFT model returned by prepare_qlora (it has the adapter)")
    if not isinstance(path, str | os.PathLike) or not str(path).strip():
        raise FinetuneError(f"save_adapter() takes a folder path, got {path!r:.60}")
    path = Path(path)
    # written beside, then swapped in: a crash mid-save leaves the old adapter whole, and a different
    # one (another run's, FRESH=True) is moved aside instead of overwritten
    staging = path.with_name(path.name + ".saving")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    except OSError as e:  # a read-only folder, a full disk: nothing half-written is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise AdapterSaveError(
            f"could not save the adapter to {path} ({type(e).__name__}: {e.strerror or e}); nothing was written "
            f"and {'the adapter already there is untouched' if path.exists() else 'no folder was left'}. Save to a "
            "writable folder with free space (df -h shows it), e.g. save_adapter(model, '/content/adapter')"
        ) from None
    previous = None
    if path.exists():
        if _same_files(path, staging):
            shutil.rmtree(path)
        else:
            previous = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}.previous")
            path.rename(previous)
    staging.rename(path)
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    return AdapterReport(path, files, previous)


class AdapterSaveError(FinetuneError, OSError):
    """``save_adapter`` could not write (a read-only folder, a full disk); nothing half-written is left."""


def _same_files(a: Path, b: Path) -> bool:
    """Whether two folders hold the same files with the same bytes (a re-save of the same adapter)."""
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    if names != sorted(p.name for p in b.iterdir() if p.is_file()):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def merge_adapter(model):
    """Fold the LoRA weights into the base model (``merge_and_unload``) for adapter-free inference.

    With a 4-bit base the merged weights are quantized again, which rounds them: outputs shift a
    little. For the exact merge, load the base in fp16/bf16, attach the adapter, then merge.
    """
    if not callable(getattr(model, "merge_and_unload", None)):
        raise FinetuneError(
            f"merge_adapter() folds a LoRA adapter into its base; {type(model).__name__} has none: pass the model "
            "prepare_qlora() returned, or one loaded with LoadPlan(adapter=...)"
        )
    # peft warns once per layer ("Merge lora module to 4-bit linear may get different generations due to
    # rounding errors"): a pink block per module in a notebook; said once here as an oomkit note instead
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = model.merge_and_unload()
    rounded = sorted({m.group(1) for w in caught if (m := ROUNDING_NOTE.search(str(w.message)))})
    for w in caught:
        if not ROUNDING_NOTE.search(str(w.message)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if rounded:
        print(
            f"[oomkit] note: merged into a {' and '.join(rounded)} base, the weights were quantized again, which "
            "rounds them: answers may differ a little from the adapter's (load the base in fp16 for an exact merge)"
        )
    return merged
