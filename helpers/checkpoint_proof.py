"""A checkpoint is proven before a run resumes from it: its files load, as plain tensors only, and fit the model.

:mod:`helpers.checkpoints` checks that a checkpoint's files are whole. Whole files can still be
wrong: another model's ``optimizer.pt``, optimizer and scheduler files swapped, a pickle that would
run code when loaded, an adapter full of NaN (a run that diverged) or shaped for another model.
Resuming from one crashes in the middle of ``Trainer`` with the same raw error on every rerun, or
trains on from wrong weights without a word. :func:`prove` loads each file the way a resume would,
but with ``weights_only`` (a pickle that would run code is refused, never executed), and says in one
sentence what is wrong, naming the file.
"""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import torch

__all__ = ["prove", "adapter_problem", "optimizer_problem"]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


def _load_plain(path: Path) -> tuple[object, str | None]:
    """(what ``path`` holds, None) or (None, why it cannot be loaded as plain tensors and containers)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except pickle.UnpicklingError as e:
        return None, (
            f"{path.name} is not plain tensor data: loading it would build other objects or run code "
            f"({_short(e)[:120]}), so it was not loaded"
        )
    except Exception as e:  # any failure to read is this file's problem, said once with its name
        return None, f"{path.name} does not load ({_short(e)})"


def _nonfinite(name: str, tensor: torch.Tensor) -> str | None:
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        return f"{bad} of {tensor.numel()} values in {name} are NaN or infinite"
    return None


def adapter_problem(folder: Path, model) -> str | None:
    """What is wrong with ``folder``'s adapter for ``model`` (a PEFT model): does not load, other
    weights or shapes than the model's adapter, or NaN/infinite values. None when it fits."""
    if not hasattr(model, "peft_config"):
        return None  # a full fine-tune: Trainer loads the model weights itself
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.exists():
        return None  # an older .bin adapter: checkpoints.problem checked it is whole
    try:
        saved = load_file(str(path))
    except Exception as e:  # safetensors raises its own errors for a damaged header or data
        return f"{path.name} does not load ({_short(e)})"
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        example = (missing or extra)[0]
        return (
            f"{path.name} is not this model's adapter: {len(missing)} of its weights missing, {len(extra)} "
            f"this model has no place for (e.g. {example})"
        )
    for key, tensor in saved.items():
        if tuple(tensor.shape) != expected[key]:
            return f"{path.name} is shaped for another model: {key} is {tuple(tensor.shape)}, this model's is {expected[key]}"
        bad = _nonfinite(key, tensor)
        if bad:
            return f"{path.name} is unusable: {bad} (the run diverged, or the file is damaged)"
    return None


def _optimizer_state(opt: object, trainable: list[torch.Tensor], name: str) -> str | None:
    """What is wrong with an optimizer ``state_dict`` for these trainable parameters."""
    if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
        if isinstance(opt, dict) and ("last_epoch" in opt or "base_lrs" in opt):
            return f"{name} holds a learning-rate scheduler's state, not an optimizer's (swapped with scheduler.pt?)"
        return f"{name} holds no optimizer state (a {type(opt).__name__})"
    try:
        count = sum(len(g["params"]) for g in opt["param_groups"])
        states = list(opt["state"].values())
    except (TypeError, KeyError, AttributeError):
        return f"{name} holds a malformed optimizer state (its param_groups do not list parameters)"
    if count != len(trainable):
        return (
            f"{name} is for {count} trainable tensors, this model trains {len(trainable)} "
            "(another model's or another LoRA setting's optimizer)"
        )
    # each parameter's largest state tensor (Adam's moments; an 8-bit optimizer's quantized state) has its shape
    have = Counter()
    for entry in states:
        tensors = [t for t in (entry.values() if isinstance(entry, dict) else []) if isinstance(t, torch.Tensor)]
        big = max((t for t in tensors if t.dim()), key=torch.Tensor.numel, default=None)
        if big is not None:
            have[tuple(big.shape)] += 1
        for t in tensors:
            if _nonfinite("a moment", t):
                return f"{name} holds NaN or infinite optimizer moments (the run diverged, or the file is damaged)"
    want = Counter(tuple(p.shape) for p in trainable)
    if have - want:
        shape = next(iter(have - want))
        return f"{name} holds state shaped {shape}, which no trainable parameter of this model has (another model's optimizer)"
    return None


def optimizer_problem(folder: Path, model) -> str | None:
    """What is wrong with ``folder``'s ``optimizer.pt`` and ``scheduler.pt`` for ``model``'s trainable parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt_path, sched_path = folder / "optimizer.pt", folder / "scheduler.pt"
    groups = None
    if opt_path.exists():
        opt, why = _load_plain(opt_path)
        why = why or _optimizer_state(opt, trainable, opt_path.name)
        if why:
            return why
        groups = len(opt["param_groups"])
    if sched_path.exists():
        sched, why = _load_plain(sched_path)
        if why:
            return why
        if isinstance(sched, dict) and "state" in sched and "param_groups" in sched:
            return "scheduler.pt holds an optimizer's state, not a scheduler's (swapped with optimizer.pt?)"
        if not isinstance(sched, dict) or "last_epoch" not in sched:
            return f"scheduler.pt holds no learning-rate scheduler state (a {type(sched).__name__})"
        lrs = sched.get("base_lrs")
        if groups is not None and isinstance(lrs, list) and len(lrs) != groups:
            return f"scheduler.pt is for {len(lrs)} parameter groups, optimizer.pt has {groups} (files of two runs)"
    return None


def prove(folder: str | Path, model) -> str | None:
    """Why ``model`` must not resume from ``folder`` (one sentence naming the file), None when it may.

    Loads the adapter (shapes and names as ``model``'s, every value finite) and the optimizer and
    scheduler states (plain tensors only, one state per trainable parameter, of its shape).
    """
    folder = Path(folder)
    return adapter_problem(folder, model) or optimizer_problem(folder, model)
