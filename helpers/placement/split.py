"""Loading on a machine with more than one GPU: how many to use, and the split their free memory allows.

``from_pretrained(device_map="auto")`` spreads a model over every GPU it sees, even one that fits on
the first (and Kaggle's 2×T4 then runs it as a two-stage pipeline, no faster). :func:`helpers.load`
keeps a model that fits on GPU 0 there, so the other cards stay free, and splits it only when it
needs them, with the placement :func:`helpers.plan_devices` computes for the GPUs' free memory: the
same map transformers would compute, checked per card (weights, that card's KV cache, activations,
context) before any weight is read. :mod:`helpers.placement.decision` decides; this module holds the
pieces (each card's room, :func:`split_plan`) and the checks of a split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.devices import GPU_MARGIN, OFFLOAD_RAM_SHARE
from ..core.errors import LoadRefused
from ..core.memory import GPUReadout, MemorySnapshot
from ..core.units import MiB, format_bytes
from ..core.vocab import DEFAULTS, MODES, QUANTIZED, half_dtype
from ..estimator.fitting import fit_one_card
from .device_plan import (
    DEVICE_MAP_STRATEGIES,
    PREQUANTIZED_OFFLOAD,
    PREQUANTIZED_OFFLOAD_FIX,
    DeviceMapError,
    DevicePlan,
    PlacementError,
    bnb_prequantized,
    plan_devices,
)

__all__ = [
    "gpu_room", "gpu_device", "usable_gpus", "map_gpus", "max_memory_gpus", "map_gpu", "free_devices", "split_plan",
    "describe_split", "offload_ram", "NO_FIX", "ALLOW_OFFLOAD_FIX", "GpuDecision", "other_gpus_note", "held_hint",
    "first_fix", "offloaded_bytes", "unquantized_note", "map_strategy", "check_strategy", "check_split", "check_given_split", "check_given_max_memory",
]  # fmt: skip


def gpu_room(estimate, g: GPUReadout) -> int:
    """Free memory of GPU ``g`` to compare ``estimate.total`` with. The estimate has a row for the CUDA
    context, which reading the free memory has already created (it is outside the free figure):
    counting it again would refuse or offload about 400 MiB early on a T4."""
    paid = sum(r.bytes for r in estimate.rows if r.key == "overhead.cuda_context")
    return g.free + paid


def gpu_device(g: GPUReadout, capacity: int) -> dict:
    """``g`` as a device for :func:`helpers.fit` and :func:`helpers.plan_devices`: its name, ``capacity``
    (what it has free) and whether it computes in bf16, so no fix suggests bf16 to a T4."""
    return {"name": g.name, "capacity": capacity, "bf16": g.supports_bf16}


def usable_gpus(snap: MemorySnapshot, count: int | None) -> list[GPUReadout]:
    """The GPUs a load may use: the first ``count`` of the snapshot's (all of them for ``None``)."""
    return list(snap.gpus if count is None else snap.gpus[:count])


def map_gpus(device_map: Any) -> set[int]:
    """The GPU indices a ``device_map`` dict names (``0``, ``"cuda:1"``, ``torch.device``); empty otherwise."""
    return _gpu_indices(device_map.values()) if isinstance(device_map, dict) else set()


def max_memory_gpus(max_memory: Any) -> set[int]:
    """The GPU indices a ``max_memory`` dict caps (its keys: ``0``, ``"cuda:1"``); empty otherwise."""
    return _gpu_indices(max_memory.keys()) if isinstance(max_memory, dict) else set()


def _gpu_indices(devices) -> set[int]:
    out = set()
    for dev in devices:
        if isinstance(dev, int) and not isinstance(dev, bool):
            out.add(dev)
        elif getattr(dev, "type", None) == "cuda":  # torch.device
            out.add(dev.index or 0)
        elif str(dev).startswith("cuda"):
            out.add(int(str(dev).partition(":")[2] or 0))
    return out


def free_devices(estimate, gpus: list[GPUReadout], margin: int = 0) -> list[dict]:
    """``gpus`` as devices whose capacity is what each has free now (its context already paid), less ``margin``."""
    return [gpu_device(g, max(0, gpu_room(estimate, g) - margin)) for g in gpus]


def split_plan(
    estimate, devices: list[dict], *, ram: int = 0, offload: bool = False, disk: bool = False,
    device_map: dict | None = None, max_memory: dict | None = None, offload_folder: str | None = None,
    strategy: str = "auto",
) -> DevicePlan:  # fmt: skip
    """The placement of ``estimate``'s model over ``devices`` (:func:`gpu_device` dicts): ``plan_devices``
    with the estimate's own inputs (placed as the ``device_map`` string ``strategy`` places it), or the check
    of a hand-made ``device_map`` or ``max_memory``.

    Raises :class:`PlacementError` when the architecture cannot be planned (the caller falls back
    to transformers' own placement), :class:`DeviceMapError` when the map or caps are wrong."""
    inputs = estimate.inputs
    if estimate.load not in MODES or estimate.source is None:
        raise PlacementError(f"no placement for a {estimate.load} checkpoint")
    return plan_devices(
        estimate.source, load=estimate.load, devices=devices, cpu_offload=offload, disk_offload=disk,
        cpu_memory=ram, compute_dtype=_compute_dtype(estimate, all(d["bf16"] for d in devices)),
        double_quant=inputs.get("double_quant", True),
        batch_size=inputs.get("batch_size", DEFAULTS.batch_size),
        prompt_tokens=inputs.get("prompt_tokens", DEFAULTS.prompt_tokens),
        max_new_tokens=inputs.get("max_new_tokens", DEFAULTS.max_new_tokens), device_map=device_map,
        max_memory=max_memory, offload_folder=offload_folder or "offload", strategy=strategy,
        kv_cache=inputs.get("kv_cache", "dynamic"),
    )  # fmt: skip


def _compute_dtype(estimate, bf16: bool) -> str:
    """The dtype ``estimate``'s model computes in on GPUs that have bf16 (or not): an unquantized load computes
    (and is laid out on the meta device) in its own dtype; int8/4-bit in the plan's compute dtype."""
    compute = estimate.inputs.get("compute_dtype", "auto") if estimate.load in QUANTIZED else estimate.load
    if compute == "auto":
        return half_dtype(bf16)
    return compute


def unquantized_note(estimate, bf16: bool) -> str:
    """Why a quantized load offloads more bytes than its estimate shows, for a refusal or warning to say (load()
    and the split alike); empty for an unquantized load."""
    if estimate.load not in QUANTIZED:
        return ""
    return f" (offloaded bitsandbytes layers stay unquantized, in {_compute_dtype(estimate, bf16)})"


def offloaded_bytes(estimate, overflow: int, bf16: bool) -> int:
    """RAM that ``overflow`` bytes of ``estimate``'s weights (counted at the load's width) take once offloaded:
    bitsandbytes leaves offloaded layers unquantized, in the compute dtype. The placement (:func:`split_plan`)
    counts this module by module; this is the same rule on average, for a model no placement can be built for."""
    if estimate.load not in QUANTIZED or overflow <= 0:
        return max(0, overflow)
    plain = estimate.replace(load=_compute_dtype(estimate, bf16)).weights
    return -(-overflow * plain // estimate.weights)  # rounded up: a refusal, not a kill, at the boundary


def map_gpu(device_map: Any) -> int | None:
    """The one GPU a ``device_map`` names (``0``, ``"cuda:1"``, ``torch.device("cuda", 1)``, ``{"": 1}``);
    None when it names none or several (a strategy such as ``"auto"`` names none)."""
    if isinstance(device_map, dict):
        gpus = map_gpus(device_map)
        return next(iter(gpus)) if len(gpus) == 1 else None
    found = _gpu_indices([device_map]) if map_strategy(device_map) is None and device_map is not None else set()
    return next(iter(found)) if found else None


def map_strategy(device_map: Any) -> str | None:
    """The placement strategy a ``device_map`` string asks transformers for (``"auto"``, ``"balanced"``,
    ``"balanced_low_0"``, ``"sequential"``); None for a map, a device, or nothing."""
    return device_map if isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES else None


def check_strategy(device_map: Any) -> None:
    """Refuse a ``device_map`` string that is neither a strategy nor a device (``"balance"``, ``"gpu"``), before
    transformers does with a traceback."""
    if not isinstance(device_map, str) or map_strategy(device_map) is not None:
        return
    try:
        torch.device(device_map)
    except RuntimeError:
        raise LoadRefused(
            f"device_map={device_map!r} is neither a placement strategy nor a device",
            f"one of {', '.join(map(repr, DEVICE_MAP_STRATEGIES))} (oomkit checks each card of the placement), "
            "a device such as 'cuda:0' or 'cpu', or a dict of module names to devices",
        ) from None


def offload_ram(snap: MemorySnapshot) -> int:
    """RAM that offloaded weights may take (the rest keeps the kernel alive)."""
    return int(snap.ram.available * OFFLOAD_RAM_SHARE)


def describe_split(plan: DevicePlan) -> str:
    """One line for a load report: which layers went where, and what each GPU holds."""
    parts = []
    start = 0
    for s in plan.shares:
        if not s.layers and not s.weights:
            continue
        where = f"GPU {s.device} ({s.label.split(': ', 1)[-1]})" if isinstance(s.device, int) else str(s.device)
        layers = f"layers {start}-{start + s.layers - 1}" if s.layers else "no layers"
        start += s.layers
        of = f" of {format_bytes(s.capacity)}" if s.capacity else ""
        parts.append(f"{where}: {layers}, {format_bytes(s.total)}{of}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- checks of a split (decide_placement calls them)

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
    return first_fix(fit_one_card(est, device=both)) or NO_FIX


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
