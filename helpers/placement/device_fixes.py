"""``fit()``'s fixes past one card: split the model over a machine's GPUs, or offload layers to CPU RAM.

Whether and how either fits is decided by :func:`helpers.plan_devices` (through
:func:`helpers.placement.split.split_plan`, which plans an estimate with its own inputs: load mode, batch,
prompt and new tokens); this module only words the plan's answer as a
:class:`helpers.estimator.DeviceSuggestion`. It lives outside ``helpers.estimator`` because the placement
imports the estimator. :func:`fit` here is ``helpers.fit``: the estimator's verdict with these fixes
ranked among its own (``helpers.estimator.fitting.fit_one_card`` takes the planner as ``place=``, so no import goes upward).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import psutil

from ..core.devices import OFFLOAD_RAM_SHARE, resolve_device
from ..core.errors import OomkitError
from ..core.units import format_bytes
from ..core.vocab import DOES_NOT_FIT, FITS
from ..estimator.core import MemoryEstimate
from ..estimator.fitting import DeviceSuggestion, FitVerdict, fit_one_card, target_cards
from .decision import SPLIT, decide_placement, devices_snapshot
from .device_plan import DevicePlan
from .split import describe_split, split_plan

__all__ = ["device_fixes", "fit", "machine_verdict"]

# a device_map entry that is one block of a ModuleList ("model.layers.29"); the rest are the embeddings,
# the final norm and lm_head
_BLOCK = re.compile(r"\.\d+$")


def fit(est: MemoryEstimate, device: Any = None, *, suggest: bool = True, gpus: int | None = None) -> FitVerdict:
    """Compare ``est`` with a device, as :func:`helpers.estimator.fitting.fit_one_card` does, with the fixes past one card
    (split over a machine's GPUs, else layers offloaded to CPU RAM) ranked among the same-card ones."""
    out = fit_one_card(est, device, suggest=suggest, gpus=gpus, place=device_fixes)
    machine = est.inputs.get("device") if device is None else device
    _, cards, _ = target_cards(machine or out.device, gpus)
    return machine_verdict(out, cards, machine if isinstance(machine, str) else f"{len(cards or [])} GPUs")


def machine_verdict(out: FitVerdict, cards: list[Any] | None, machine: str) -> FitVerdict:
    """On a machine of several GPUs the verdict is where :func:`helpers.load` puts the model
    (:func:`decide_placement`, as preflight and the panels ask it): split over the cards when GPU 0 alone
    cannot hold it. A training estimate keeps the one-card verdict (DDP/FSDP replicate or shard instead)."""
    est = out.estimate
    if out.verdict != DOES_NOT_FIT or not cards or len(cards) < 2 or est.inputs.get("training") is not None:
        return out
    devices = [resolve_device(c)[1] for c in cards]
    try:
        decided = decide_placement(None, est, devices_snapshot(est, devices))
    except (OomkitError, ValueError):  # an architecture the meta device cannot build
        return out
    if decided.where != SPLIT or decided.plan is None:
        return out
    fullest = max(decided.plan.gpus, key=lambda s: s.total)
    where = f"split over {decided.gpus} GPUs, as load() places it: {describe_split(decided.plan)}"
    rest = [s for s in out.suggestions if getattr(s, "kind", "") != "split"] if decided.verdict != FITS else []
    return dataclasses.replace(out, verdict=decided.verdict, headroom=fullest.capacity - fullest.total,
                               capacity=fullest.capacity, device=machine, where=where, used=fullest.total,
                               suggestions=rest)  # fmt: skip


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
    try:
        for n in range(2, len(devices) + 1):
            plan = split_plan(est, devices[:n])
            if plan.fits:
                return [_split_fix(est, plan, len(devices))]
        ram = psutil.virtual_memory().available if host_ram is None else host_ram
        plan = split_plan(est, devices, ram=int(ram * OFFLOAD_RAM_SHARE), offload=True)
    except (OomkitError, ValueError):  # an architecture the meta device cannot build, a prequantized checkpoint
        return []
    if plan.fits and plan.offloaded("cpu"):
        return [_offload_fix(est, plan)]
    return []


def _fullest(plan: DevicePlan) -> int:
    return max(s.total for s in plan.gpus)


def _split_fix(est: MemoryEstimate, plan: DevicePlan, available: int) -> DeviceSuggestion:
    n = len(plan.gpus)
    count = "both GPUs" if n == available == 2 else (f"{n} GPUs" if n == available else f"{n} of the {available} GPUs")
    hop = sum(size for a, b, size in plan.crossings if isinstance(a, int) and isinstance(b, int))
    cost = (
        "no speedup: device_map='auto' places the layers as a pipeline, so the cards run one after the other "
        f"(about one card's speed, plus {format_bytes(hop)} of hidden state per token between them)"
    )
    change = f"use {count}: LoadPlan(..., gpus={n}) (from_pretrained: device_map='auto')"
    return DeviceSuggestion(change, {"device_map": "auto", "gpus": n}, est.total - _fullest(plan), est, cost,
                            kind="split", where=describe_split(plan), plan=plan)  # fmt: skip


def _offload_fix(est: MemoryEstimate, plan: DevicePlan) -> DeviceSuggestion:
    cpu = next(s for s in plan.shares if s.device == "cpu")
    layers = sum(s.layers for s in plan.shares)
    # the rest of what went to the CPU (lm_head: a large share of the bytes); a rotary embedding holds no weights
    others = [name for name, dev in plan.device_map.items()
              if dev == "cpu" and not _BLOCK.search(name) and "rotary" not in name]  # fmt: skip
    what = f"{cpu.layers} of {layers} decoder layers" if cpu.layers else ""
    if others:
        what = f"{what} (with {', '.join(others)})" if what else ", ".join(others)
    cost = f"{plan.slowdown}; {format_bytes(cpu.weights)} of host RAM"
    if plan.quantization_changes:  # from_pretrained needs the flag; load() sets it from the plan
        cost += "; from_pretrained also needs BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True)"
    change = f"offload {what} to CPU RAM: LoadPlan(..., allow_offload=True) (from_pretrained: device_map='auto')"
    return DeviceSuggestion(change, {"device_map": "auto", "allow_offload": True}, est.total - _fullest(plan), est,
                            cost, kind="offload", where=describe_split(plan), plan=plan)  # fmt: skip
