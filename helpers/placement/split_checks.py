"""The checks of a split that :func:`~helpers.placement.decision.decide_placement` runs (over several GPUs, a
given device_map or max_memory), and the estimator's fix a refusal names, asked once per move."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from ..core.devices import GPU_MARGIN
from ..core.errors import LoadRefused
from ..core.memory import GPUReadout, MemorySnapshot
from ..core.units import MiB, format_bytes
from ..estimator.fitting import (
    FitVerdict,
    fit_one_card,
)
from .device_map import PlacementError
from .device_plan import (
    PREQUANTIZED_OFFLOAD,
    PREQUANTIZED_OFFLOAD_FIX,
    DeviceMapError,
    DevicePlan,
    bnb_prequantized,
    frozen_key,
    once_per_move,
)
from .gpu_room import (
    describe_split,
    free_devices,
    gpu_device,
    gpu_room,
    map_gpus,
    map_strategy,
    max_memory_gpus,
    offload_ram,
    offloaded_bytes,
    split_plan,
    unquantized_note,
)

__all__ = [
    "FIXES_ASKED",
    "FIXES_NOT_ASKED",
    "estimator_fix",
    "fit_once",
    "HELD_HINT",
    "NO_FIX",
    "ALLOW_OFFLOAD_FIX",
    "held_hint",
    "first_fix",
    "GpuDecision",
    "other_gpus_note",
    "check_split",
    "STRATEGY_SPILLS",
    "check_given_max_memory",
    "check_given_split",
]


# whether a refusal's fix may re-estimate (the estimator's fixes: most of a decision's cost where it refuses)
FIXES_ASKED: contextvars.ContextVar[bool] = contextvars.ContextVar("oomkit_placement_fixes", default=True)


FIXES_NOT_ASKED = "helpers.fit(estimate, device) lists the fixes"


def estimator_fix(est, device, default: str = "") -> str:
    """The estimator's top fix for ``est`` on ``device`` (``default``, else ``NO_FIX``, when it has none);
    ``FIXES_NOT_ASKED`` where the caller of :func:`decide_placement` reads where the model goes, not the fix."""
    if not FIXES_ASKED.get():
        return FIXES_NOT_ASKED
    return first_fix(fit_once(est, device)) or default or NO_FIX


def fit_once(est, device, suggest: bool = True) -> FitVerdict:
    """``fit_one_card(est, device)`` once per :func:`one_move` (the decision reads its verdict and top fix only)."""
    return once_per_move(
        "fit_one_card", est, frozen_key((device, suggest)), lambda: fit_one_card(est, device, suggest=suggest)
    )


HELD_HINT = 512 * MiB  # holding this much GPU memory before a load usually means an earlier model is still loaded


NO_FIX = "Use int8 or nf4, a smaller batch or max_new_tokens, or a smaller model"


ALLOW_OFFLOAD_FIX = "accept the slowdown: LoadPlan(..., allow_offload=True)"


def held_hint(g: GPUReadout) -> str:
    """When this process already holds GPU memory, the likeliest reason a plan stopped fitting."""
    if g.allocated < HELD_HINT:
        return ""
    return (
        f". This process already holds {format_bytes(g.allocated)} on the GPU: a model from an earlier cell? "
        "unload(model) first"
    )


def first_fix(verdict) -> str | None:
    """The top suggestion of a :func:`helpers.fit` verdict, as one line."""
    sugg = getattr(verdict, "suggestions", None) or []
    return f"{sugg[0].change} (saves {format_bytes(sugg[0].saving)})" if sugg else None


@dataclass
class GpuDecision:
    """How a load uses a machine's GPUs when it may use more than one (a piece of :func:`helpers.decide_placement`)."""

    split: DevicePlan | None = None  # the checked placement; None where transformers places it
    max_memory: dict | None = None  # what from_pretrained gets (None: the plan's own)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def other_gpus_note(plan, snap: MemorySnapshot) -> list[str]:
    """Say so when GPUs stay idle because the model fits on the first (transformers alone would split it)."""
    n = len(snap.gpus)
    if n < 2 or plan.device_map != "auto" or plan.max_memory is not None or plan.gpus is not None:
        return []
    others = "the other GPU stays" if n == 2 else f"the other {n - 1} GPUs stay"
    return [f"fits on GPU 0 alone: {others} free (for a second model, or DDP); "
            f"LoadPlan(..., gpus={n}) splits it across all {n}"]  # fmt: skip


def _with_split(split: DevicePlan, warnings: list[str]) -> GpuDecision:
    notes = [f"split: {describe_split(split)}", *split.notes]
    return GpuDecision(split, dict(split.max_memory), warnings, notes)


def _fix_across(est, gpus: list[GPUReadout]) -> str:
    """The estimator's top fix for the GPUs' free memory added up, in a dtype every one of them computes in."""
    both = gpu_device(gpus[0], sum(gpu_room(est, g) for g in gpus))
    both["bf16"] = all(g.supports_bf16 for g in gpus)
    return estimator_fix(est, both)


def check_split(plan, est, snap: MemorySnapshot, gpus: list[GPUReadout]) -> GpuDecision:
    """The split of ``plan`` over ``gpus``' free memory, checked card by card; refuses what does not fit."""
    ram = offload_ram(snap)
    folder, strategy = plan.offload_folder, map_strategy(plan.device_map) or "auto"
    try:
        split = split_plan(est, free_devices(est, gpus), ram=ram, offload_folder=folder, strategy=strategy)
        offloaded = None
        if not split.fits and plan.allow_offload:
            offloaded = split_plan(est, free_devices(est, gpus), ram=ram, offload=True, disk=bool(folder),
                                   offload_folder=folder, strategy=strategy)  # fmt: skip
    except PlacementError as e:
        return _transformers_places(plan, est, snap, gpus, e)
    if split.fits:
        held = held_hint(gpus[0]) if strategy == "auto" else ""  # another strategy splits because it was asked to
        return _with_split(split, [f"split because it does not fit GPU 0 alone{held}"] if held else [])
    if offloaded is not None and offloaded.fits:
        return _with_split(offloaded, [f"the model does not fit the {len(gpus)} GPUs: {offloaded.slowdown}"])
    fix = _fix_across(est, gpus)
    spill = split.offloaded("cpu") + split.offloaded("disk")
    if bnb_prequantized(est):
        fix += f"; or {PREQUANTIZED_OFFLOAD_FIX}"
    elif not plan.allow_offload and 0 < spill <= ram:
        fix += f"; or {ALLOW_OFFLOAD_FIX}"
    reason = (offloaded or split).reasons[0]
    free = " + ".join(format_bytes(g.free) for g in gpus)
    asked = f" with device_map={strategy!r}" if strategy != "auto" else ""
    refusal = LoadRefused(f"{est.model} as {est.load} does not fit split across {len(gpus)} GPUs{asked} ({free} free): "
                          f"{reason}", _auto_fix(est, gpus, ram, strategy, fix))  # fmt: skip
    refusal.placement = offloaded or split  # the split that did not fit, for the decision to show
    raise refusal


# why a strategy can spill what device_map="auto" keeps on the same cards
STRATEGY_SPILLS = {
    "balanced_low_0": "'balanced_low_0' gives GPU 0 only what the other cards cannot hold, and accelerate keeps room "
                      "for the largest layer there, so a model the other cards cannot hold alone spills",
    "sequential": "'sequential' fills each card up to its cap in turn, so the last one gets whatever is left",
}  # fmt: skip


def _auto_fix(est, gpus: list[GPUReadout], ram: int, strategy: str, fix: str) -> str:
    """``fix``, led by ``device_map='auto'`` where another strategy was refused and the balanced split fits."""
    if strategy == "auto":
        return fix
    auto = split_plan(est, free_devices(est, gpus), ram=ram)
    if not auto.fits:
        return fix
    why = f" ({STRATEGY_SPILLS[strategy]})" if strategy in STRATEGY_SPILLS else ""
    return f"device_map='auto' fits these cards: {describe_split(auto)}{why}; or {fix}"


def _transformers_places(plan, est, snap: MemorySnapshot, gpus: list[GPUReadout], error: Exception) -> GpuDecision:
    """No placement of our own (an architecture the meta device cannot build): caps for every card that
    keep each one's runtime free, RAM only with ``allow_offload``, and the whole checked."""
    runtime = max(0, est.total - est.weights)
    caps: dict[Any, int] = {g.index: max(0, gpu_room(est, g) - runtime - GPU_MARGIN) for g in gpus}
    offload, ram = plan.allow_offload and not bnb_prequantized(est), offload_ram(snap)
    overflow = max(0, est.weights - sum(caps.values()))
    if overflow and not offload:
        why = f"; {PREQUANTIZED_OFFLOAD}" if plan.allow_offload else ""
        raise LoadRefused(f"{est.model} as {est.load} has {format_bytes(est.weights)} of weights and the "
                          f"{len(gpus)} GPUs have room for {format_bytes(sum(caps.values()))}{why}",
                          _fix_across(est, gpus))  # fmt: skip
    bf16 = all(g.supports_bf16 for g in gpus)
    needed = offloaded_bytes(est, overflow, bf16)
    if needed > ram:
        raise LoadRefused(f"{est.model} as {est.load} would offload {format_bytes(needed)} of weights to CPU RAM"
                          f"{unquantized_note(est, bf16)}, more than the {format_bytes(ram)} offered",
                          _fix_across(est, gpus))  # fmt: skip
    if offload:
        caps["cpu"] = ram
    why = str(error).split(" (", 1)[0]
    return GpuDecision(None, caps, [], [f"split by transformers within max_memory ({why}: not checked card by card)"])


def check_given_max_memory(plan, est, snap: MemorySnapshot) -> GpuDecision:
    """A ``max_memory`` of the user's over several GPUs: the placement transformers computes within those
    caps, each card then checked against what it has free."""
    named = sorted(max_memory_gpus(plan.max_memory))
    if named[-1] >= len(snap.gpus):
        raise LoadRefused(
            f"max_memory caps GPU {named[-1]} and this machine has {len(snap.gpus)} GPU(s)",
            "drop that key, or leave max_memory=None: load() then plans the split for this machine",
        )
    gpus = snap.gpus[: named[-1] + 1]
    try:
        split = split_plan(est, free_devices(est, gpus), ram=offload_ram(snap), max_memory=plan.max_memory,
                           disk=bool(plan.offload_folder), offload_folder=plan.offload_folder,
                           strategy=map_strategy(plan.device_map) or "auto")  # fmt: skip
    except DeviceMapError as e:
        raise LoadRefused(str(e), "write max_memory as {0: '13GiB', 1: '13GiB', 'cpu': '20GiB'}") from None
    except PlacementError as e:
        return _transformers_places(plan, est, snap, gpus, e)
    if not split.fits:
        raise LoadRefused(f"within this max_memory, {split.reasons[0]}",
                          "lower that card's cap so layers move to the others, or max_memory=None: load() plans "
                          "the split for what each card has free")  # fmt: skip
    return _with_split(split, [f"max_memory offloads weights: {split.slowdown}"] if split.slowdown else [])


def check_given_split(plan, est, snap: MemorySnapshot) -> GpuDecision:
    """Check a hand-made ``device_map`` over several GPUs card by card (``plan_devices`` computed it, or
    the user wrote it), each card keeping the same margin a planned split keeps; refuses a card that
    would overflow and a map that leaves a weight out."""
    wanted = max(map_gpus(plan.device_map)) + 1
    if wanted > len(snap.gpus):
        raise LoadRefused(
            f"the device_map uses GPU {wanted - 1} and this machine has {len(snap.gpus)} GPU(s)",
            "plan it for this machine: plan_devices(model, load=..., devices='current'), or LoadPlan(...) "
            "with device_map='auto'",
        )
    devices = free_devices(est, snap.gpus[:wanted], margin=GPU_MARGIN)
    try:
        split = split_plan(est, devices, ram=offload_ram(snap), device_map=plan.device_map,
                           disk=bool(plan.offload_folder), offload_folder=plan.offload_folder)  # fmt: skip
    except DeviceMapError as e:
        raise LoadRefused(str(e), "device_map='auto' (load() plans the split and checks every card)") from None
    except PlacementError as e:
        return GpuDecision(None, None, [], [f"the device_map is passed on as it is ({str(e).split(' (', 1)[0]})"])
    if not split.fits:
        fix = "move layers off that card in the map, or device_map='auto' (load() plans the split for what each card has free)"
        raise LoadRefused(f"the device_map does not fit this machine: {split.reasons[0]}", fix)
    return _with_split(split, [f"the device_map offloads weights: {split.slowdown}"] if split.slowdown else [])
