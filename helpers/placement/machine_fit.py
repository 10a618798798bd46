"""fit(): a plan against a device or a whole machine, with the fixes past one card (a split over the
machine's GPUs, else layers offloaded to CPU RAM) ranked among the same-card ones."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import psutil

from ..core.devices import OFFLOAD_RAM_SHARE, device_set, resolve_device
from ..core.errors import OomkitError
from ..core.units import format_bytes
from ..core.vocab import DOES_NOT_FIT, FITS
from ..estimator.core import MemoryEstimate
from ..estimator.fitting import (
    DeviceSuggestion,
    FitVerdict,
    fit_one_card,
    past_context,
    rank_fixes,
    step_seconds,
    target_cards,
)
from ..estimator.reducers import HOST_RAM
from ..estimator.timing import offload_seconds
from .decision import SPLIT, PlacementDecision, decide_placement, devices_snapshot
from .device_plan import (
    DevicePlan,
    one_move,
)
from .gpu_room import describe_split, split_plan

__all__ = ["fit", "machine_verdict", "device_fixes"]


# a device_map entry that is one block of a ModuleList ("model.layers.29"); the rest are the embeddings,
# the final norm and lm_head
_BLOCK = re.compile(r"\.\d+$")


def fit(est: MemoryEstimate, device: Any = None, *, suggest: bool = True, gpus: int | None = None) -> FitVerdict:
    """Compare ``est`` with a device, as :func:`helpers.estimator.fitting.fit_one_card` does, with the fixes past one card
    (split over a machine's GPUs, else layers offloaded to CPU RAM) ranked among the same-card ones. On a machine
    (a preset, a set, a list of presets) the verdict is where :func:`decide_placement` puts the model, as
    ``load()``, preflight and ``fits_table`` render it: one answer to "will it fit"."""
    with one_move():
        out = fit_one_card(est, device, suggest=suggest, gpus=gpus, place=device_fixes)
        machine = est.inputs.get("device") if device is None else device
        _, cards, _ = target_cards(machine or out.device, gpus)
        out = machine_verdict(out, cards, _machine_name(machine or out.device, cards or []), suggest=suggest)
        return _within_context(out, device, gpus, suggest)


def _within_context(out: FitVerdict, device: Any, gpus: int | None, suggest: bool) -> FitVerdict:
    """Tokens past the model's context do not fit, whatever the memory says (the estimate's note on it and
    this verdict agree); the fixes are those that bring them within it."""
    past = past_context(out.estimate)
    if not past or out.verdict == DOES_NOT_FIT:
        return out
    fixes = out.suggestions
    if suggest and not fixes:
        fixes = fit_one_card(
            out.estimate, device, suggest=True, gpus=gpus, place=device_fixes, spilled=True
        ).suggestions
    fixes = [s for s in fixes if not past_context(s.estimate)]  # memory alone does not help here
    note = "; ".join(filter(None, [past, out.note]))
    return dataclasses.replace(
        out, verdict=DOES_NOT_FIT, note=note, suggestions=rank_fixes(fixes, out.estimate, out.capacity)
    )


def _machine_name(device: Any, cards: list[Any]) -> str:
    """``kaggle-2xt4``, ``2x t4`` (a preset with ``gpus=2``), ``this machine (2 GPUs)`` or ``3 GPUs`` (a list)."""
    if isinstance(device, str) and device_set(device) is not None:
        return device
    if device == "current":
        return f"this machine ({len(cards)} GPUs)"
    if len(cards) > 1 and len({str(c) for c in cards}) == 1 and isinstance(cards[0], str):
        return f"{len(cards)}x {cards[0]}"
    return device if isinstance(device, str) else f"{len(cards)} GPUs"


def machine_verdict(out: FitVerdict, cards: list[Any] | None, machine: str, suggest: bool = True) -> FitVerdict:
    """On a machine the verdict is where :func:`helpers.load` puts the model (:func:`decide_placement`, as
    preflight and the panels ask it): split over the cards when GPU 0 alone cannot hold it, and "does not fit"
    where the placement transformers computes for the card would leave weights for the CPU (load() refuses it).
    A training estimate keeps the one-card verdict (DDP/FSDP replicate or shard instead)."""
    est = out.estimate
    if not cards or est.inputs.get("training") is not None or est.source is None:
        return out
    devices = [resolve_device(c)[1] for c in cards]
    if any(d is None for d in devices):
        return out
    if len(devices) < 2 and out.verdict == DOES_NOT_FIT:
        return out  # one card: the decision is alone, offloaded or refused, never a split, and spills only what fits
    ram = HOST_RAM if "current" not in cards else psutil.virtual_memory().available  # a preset machine: Colab's
    try:
        decided = decide_placement(None, est, devices_snapshot(est, devices, ram), fixes=False)  # fit() has them
    except (OomkitError, ValueError):  # an architecture the meta device cannot build
        return out
    if decided.refused and decided.spill and out.verdict != DOES_NOT_FIT:
        return _spilled(out, decided, cards, suggest)
    if decided.where != SPLIT or decided.plan is None:
        return out
    fullest = max(decided.plan.gpus, key=lambda s: s.total)
    where = f"split over {decided.gpus} GPUs, as load() places it: {describe_split(decided.plan)}"
    rest = [s for s in out.suggestions if getattr(s, "kind", "") != "split"] if decided.verdict != FITS else []
    return dataclasses.replace(out, verdict=decided.verdict, headroom=fullest.capacity - fullest.total,
                               capacity=fullest.capacity, device=machine, where=where, used=fullest.total,
                               suggestions=rest)  # fmt: skip


def _spilled(out: FitVerdict, decided: PlacementDecision, cards: list[Any], suggest: bool) -> FitVerdict:
    """The estimate fits the card, but transformers' placement there leaves weights for the CPU and load()
    refuses it: "does not fit", with the decision's reason and the fixes ranked as for any plan that does not fit."""
    fixes = out.suggestions
    if suggest and not fixes:  # it fitted: no fixes were ranked
        fixes = fit_one_card(out.estimate, cards[0], suggest=True, place=device_fixes, spilled=True).suggestions
    devices = [resolve_device(c)[1] for c in cards]
    for s in fixes:  # a fix that keeps the weights (a shorter prompt, a smaller KV cache) still spills
        if not isinstance(s, DeviceSuggestion) and "model" not in s.kwargs:
            placed = decide_placement(None, s.estimate, devices_snapshot(s.estimate, devices, HOST_RAM), fixes=False)
            s.placed = DOES_NOT_FIT if placed.refused else None
    fixes = rank_fixes(fixes, out.estimate, out.capacity)
    note = "; ".join(filter(None, [decided.reason, out.note]))
    return dataclasses.replace(out, verdict=DOES_NOT_FIT, note=note, suggestions=fixes)


def device_fixes(est: MemoryEstimate, cards: list[Any], *, host_ram: int | None = None) -> list[DeviceSuggestion]:
    """What places ``est`` past one card: the split over the fewest of ``cards`` (two or more) that holds it,
    else (no split holds it) the offload to CPU RAM beside all of them; ``[]`` when neither fits or the
    architecture cannot be placed.

    Args:
        est: a generation estimate (its inputs are what the placement sizes each card's KV cache for).
        cards: the machine's GPUs, first to last: presets (``"t4"``), sizes or described GPUs.
        host_ram: the machine's RAM (a preset machine: Colab's); ``None``: what this machine has available.
            Offloaded weights may take ``OFFLOAD_RAM_SHARE`` of it (the process and the kernel need the rest).
    """
    devices = [resolve_device(c)[1] for c in cards]
    if any(d is None for d in devices):
        return []
    step = step_seconds(est, cards[0])  # a pipeline runs at one card's speed
    # a placement holds every weight somewhere it fits (offloaded bitsandbytes layers even unquantized, larger):
    # weights beyond the cards' (and the RAM's) capacity added up place nowhere, with no need to plan them
    ram = int((psutil.virtual_memory().available if host_ram is None else host_ram) * OFFLOAD_RAM_SHARE)
    try:
        for n in range(2, len(devices) + 1):
            if est.weights > sum(d["capacity"] for d in devices[:n]):
                continue
            plan = split_plan(est, devices[:n])
            if plan.fits:
                return [_split_fix(est, plan, len(devices), step)]
        if est.weights > sum(d["capacity"] for d in devices) + ram:
            return []
        plan = split_plan(est, devices, ram=ram, offload=True)
    except (OomkitError, ValueError):  # an architecture the meta device cannot build, a prequantized checkpoint
        return []
    if plan.fits and plan.offloaded("cpu"):
        return [_offload_fix(est, plan, step)]
    return []


def _fullest(plan: DevicePlan) -> int:
    return max(s.total for s in plan.gpus)


def _split_fix(est: MemoryEstimate, plan: DevicePlan, available: int, step: float | None) -> DeviceSuggestion:
    n = len(plan.gpus)
    count = "both GPUs" if n == available == 2 else (f"{n} GPUs" if n == available else f"{n} of the {available} GPUs")
    hop = sum(size for a, b, size in plan.crossings if isinstance(a, int) and isinstance(b, int))
    cost = (
        "no speedup: device_map='auto' places the layers as a pipeline, so the cards run one after the other "
        f"(about one card's speed, plus {format_bytes(hop)} of hidden state per token between them)"
    )
    change = f"use {count}: LoadPlan(..., gpus={n}) (from_pretrained: device_map='auto')"
    return DeviceSuggestion(change, {"device_map": "auto", "gpus": n}, est.total - _fullest(plan), est, cost, step,
                            kind="split", where=describe_split(plan), plan=plan)  # fmt: skip


def _offload_fix(est: MemoryEstimate, plan: DevicePlan, step: float | None) -> DeviceSuggestion:
    """Layers offloaded to CPU RAM: each decode step also copies them over PCIe (``offload_seconds``)."""
    cpu = next(s for s in plan.shares if s.device == "cpu")
    layers = sum(s.layers for s in plan.shares)
    # the rest of what went to the CPU (lm_head: a large share of the bytes); a rotary embedding holds no weights
    others = [name for name, dev in plan.device_map.items()
              if dev == "cpu" and name and not _BLOCK.search(name) and "rotary" not in name]  # fmt: skip
    what = f"{cpu.layers} of {layers} decoder layers" if cpu.layers else ""
    if others:
        what = f"{what} (with {', '.join(others)})" if what else ", ".join(others)
    cost = f"{plan.slowdown}; {format_bytes(cpu.weights)} of host RAM"
    if plan.quantization_changes:  # from_pretrained needs the flag; load() sets it from the plan
        cost += "; from_pretrained also needs BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True)"
    change = f"offload {what} to CPU RAM: LoadPlan(..., allow_offload=True) (from_pretrained: device_map='auto')"
    seconds = None if step is None else step + offload_seconds(plan.offloaded("cpu"), plan.offloaded("disk"))
    return DeviceSuggestion(change, {"device_map": "auto", "allow_offload": True}, est.total - _fullest(plan), est,
                            cost, seconds, kind="offload", where=describe_split(plan), plan=plan)  # fmt: skip
