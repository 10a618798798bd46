"""A checkpoint is proven before a run resumes from it: its files load, as plain tensors only, and fit the model.

:mod:`helpers.training.checkpoints` checks that a checkpoint's files are whole. Whole files can still be
wrong: another model's ``optimizer.pt``, optimizer and scheduler files swapped, a pickle that would
run code when loaded, an adapter full of NaN (a run that diverged) or shaped for another model.
A ``trainer_state.json`` or ``scheduler.pt`` of another step or run, a broken random-number state or
an ``adapter_config.json`` that is no adapter's are whole files too. Resuming from one crashes in the
middle of ``Trainer`` with the same raw error on every rerun, or trains on from wrong weights (or not
at all) without a word. :func:`prove` loads each file the way a resume would,
but with ``weights_only`` (a pickle that would run code is refused, never executed), and says in one
sentence what is wrong, naming the file.
"""

from __future__ import annotations

import json
import math
import pickle
import random
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .checkpoints import checkpoint_step

__all__ = ["prove", "adapter_problem", "optimizer_problem", "state_problem", "rng_problem"]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


def _numpy_globals() -> list:
    """The numpy classes an ``rng_state.pth`` holds (Trainer allows these same ones when it loads it)."""
    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load_plain(path: Path, *, numpy: bool = False) -> tuple[object, str | None]:
    """(what ``path`` holds, None) or (None, why it cannot be loaded as plain tensors and containers)."""
    try:
        if numpy:
            with torch.serialization.safe_globals(_numpy_globals()):
                return torch.load(path, map_location="cpu", weights_only=True), None
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

    found = _adapter_config_problem(folder, model)
    if found:
        return found
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


def _adapter_config_problem(folder: Path, model) -> str | None:
    """``adapter_config.json`` must be a PEFT config of this model's adapter type and rank."""
    from peft import PeftConfig

    path = folder / "adapter_config.json"
    if not path.exists():
        return "adapter_config.json is missing (the adapter cannot be loaded without it)"
    try:
        saved = PeftConfig.from_pretrained(str(folder))
    except Exception as e:  # peft raises several types for a config that is not one
        return f"adapter_config.json is no PEFT adapter config ({_short(e)})"
    if getattr(saved, "peft_type", None) is None:
        return "adapter_config.json is no PEFT adapter config (it names no peft_type)"
    mine = model.peft_config.get(getattr(model, "active_adapter", None)) or next(iter(model.peft_config.values()))
    for key in ("peft_type", "r"):
        theirs, ours = (getattr(getattr(c, key, None), "value", getattr(c, key, None)) for c in (saved, mine))
        if theirs != ours:
            return f"adapter_config.json is for another adapter: {key} {theirs}, this model's is {ours}"
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
        return _scheduler_of_this_run(sched, opt if groups is not None else None, checkpoint_step(folder))
    return None


def _scheduler_of_this_run(sched: dict, opt: dict | None, step: int | None) -> str | None:
    """A scheduler never ahead of its checkpoint (behind it is fine: fp16 skips steps) and started from
    the optimizer's learning rates."""
    last = sched.get("last_epoch")
    if step is not None and isinstance(last, int) and last > step:
        return f"scheduler.pt is at step {last}, ahead of this checkpoint's {step} (another run's scheduler)"
    initial = [g.get("initial_lr") for g in (opt or {}).get("param_groups", [])]
    lrs = sched.get("base_lrs")
    if isinstance(lrs, list) and all(isinstance(x, int | float) for x in [*initial, *lrs]) and len(initial) == len(lrs):
        if any(not math.isclose(a, b, rel_tol=1e-6) for a, b in zip(lrs, initial, strict=True)):
            return (
                f"scheduler.pt starts from learning rate {lrs[0]:g}, optimizer.pt from {initial[0]:g} "
                "(files of two runs)"
            )
    return None


def state_problem(folder: Path) -> str | None:
    """``trainer_state.json`` must be at the step the folder is named after (Trainer names it so)."""
    step = checkpoint_step(folder)
    try:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # missing or not JSON: checkpoints.problem names it
    got = state.get("global_step") if isinstance(state, dict) else None
    if step is None or not isinstance(got, int) or got == step:
        return None
    effect = "train fewer steps than asked, or none" if got > step else "repeat steps already trained"
    return (
        f"trainer_state.json says global step {got}, the folder is {folder.name} (another step's or run's "
        f"state: resuming would {effect})"
    )


def rng_problem(folder: Path) -> str | None:
    """Each ``rng_state*.pth`` must hold python, numpy and torch random states that can be set."""
    for path in sorted(folder.glob("rng_state*.pth")):
        state, why = _load_plain(path, numpy=True)
        if why:
            return why
        if not isinstance(state, dict) or not {"python", "numpy", "cpu"} <= set(state):
            found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            return f"{path.name} holds no random-number states (python, numpy and cpu expected, found {found})"
        try:  # on fresh generators: the process's own states stay as they are
            random.Random().setstate(state["python"])
            np.random.RandomState().set_state(state["numpy"])
            torch.Generator().set_state(state["cpu"])
        except Exception as e:  # each library raises its own type for a state it cannot take
            return f"{path.name} holds a broken random-number state ({_short(e)})"
    return None


def prove(folder: str | Path, model) -> str | None:
    """Why ``model`` must not resume from ``folder`` (one sentence naming the file), None when it may.

    Loads the adapter (its config of this model's type and rank, shapes and names as ``model``'s,
    every value finite), the optimizer and scheduler states (plain tensors only, one state per
    trainable parameter, of its shape; the scheduler not ahead of the step and from the optimizer's
    learning rates), the trainer state (at the folder's step) and the random-number states.
    """
    folder = Path(folder)
    return (
        adapter_problem(folder, model)
        or optimizer_problem(folder, model)
        or state_problem(folder)
        or rng_problem(folder)
    )
