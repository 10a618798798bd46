"""Where a model goes: the ONE decision :func:`helpers.load`, the load panel and :func:`helpers.preflight` render.

:func:`decide_placement` takes a plan's placement fields (``device_map``, ``gpus``, ``max_memory``,
``allow_offload``, ``offload_folder``), an estimate and a memory readout, and returns a
:class:`PlacementDecision`: GPU 0 alone (or the one card a map names), split over several GPUs, one card
plus CPU/disk offload, or refused, with the checked :class:`~helpers.DevicePlan`, what is offloaded,
the warnings, and on refusal the reason and the fix. ``load()`` raises the refusal; the panel and preflight
read the same answer from a readout of their devices (:func:`devices_snapshot`), so the three cannot disagree.
"""

from __future__ import annotations

import contextvars
import dataclasses
import re
from dataclasses import dataclass, field
from html import escape
from types import SimpleNamespace
from typing import Any

import psutil
import torch

from ..core.devices import GPU_MARGIN, OFFLOAD_RAM_SHARE, device_set, resolve_device
from ..core.errors import LoadRefused, OomkitError
from ..core.memory import GPUReadout, MemorySnapshot, RAMReadout
from ..core.units import MiB, format_bytes
from ..core.vocab import DEFAULTS, DOES_NOT_FIT, FITS, MODES, QUANTIZED, VERDICTS, half_dtype, lighter_load, verdict
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
from .device_plan import (
    DEVICE_MAP_STRATEGIES,
    PREQUANTIZED_OFFLOAD,
    PREQUANTIZED_OFFLOAD_FIX,
    DeviceMapError,
    DevicePlan,
    PlacementError,
    bnb_prequantized,
    frozen_key,
    once_per_move,
    one_move,
    plan_devices,
)

__all__ = [
    "gpu_room", "gpu_device", "usable_gpus", "map_gpus", "max_memory_gpus", "map_gpu", "free_devices", "split_plan", "describe_split", "offload_ram", "NO_FIX", "ALLOW_OFFLOAD_FIX", "GpuDecision", "other_gpus_note", "held_hint", "first_fix", "offloaded_bytes", "unquantized_note", "map_strategy", "check_strategy", "check_split", "check_given_split", "check_given_max_memory",
    "device_fixes", "fit", "machine_verdict",
    "FIXES_NOT_ASKED",
    "PlacementDecision",
    "decide_placement",
    "devices_snapshot",
    "auto_placing",
    "spill_why",
    "spill_fix",
    "smaller_load_fix",
    "max_memory_for",
    "ALONE",
    "SPLIT",
    "OFFLOAD",
    "REFUSE",
]  # fmt: skip

ALONE, SPLIT, OFFLOAD, REFUSE = "one GPU", "split", "offload", "refuse"
UNPLACED_BNB_OFFLOAD = (
    "bitsandbytes layers are offloaded only along a device map oomkit has checked, and this architecture's "
    "placement cannot be built (transformers' own would keep 4-bit layers quantized in RAM, where they cannot run)"
)


def auto_placing(**changes) -> SimpleNamespace:
    """The placement fields of a default :class:`helpers.LoadPlan` (``device_map="auto"``, no offload) with
    ``changes``: what a caller without a plan (preflight) decides with."""
    fields = {"device_map": "auto", "gpus": None, "max_memory": None, "allow_offload": False, "offload_folder": None}
    return SimpleNamespace(**{**fields, **changes})


@dataclass
class PlacementDecision:
    """Where a model goes (see :func:`decide_placement`): ``where`` is ``ALONE``, ``SPLIT``, ``OFFLOAD`` or
    ``REFUSE``; ``str()`` says it in a line or two, with the warnings and notes."""

    where: str
    verdict: str  # fits / tight / does not fit, of the fullest GPU where it goes
    estimate: Any = field(repr=False, default=None)
    first_verdict: str = FITS  # fit() of the estimate on GPU 0 alone (the card a one-card map names)
    gpus: int = 1  # GPUs placed over (0: a CPU machine); on refusal, the GPUs tried
    plan: DevicePlan | None = None  # the checked placement (on refusal, the one that did not fit, if built)
    max_memory: dict | None = None  # what from_pretrained gets (None: the plan's own)
    offloaded: int = 0  # bytes of weights for CPU RAM or disk
    spill: int = 0  # bytes transformers' placement on GPU 0 alone leaves for the CPU while the estimate fits it
    why: str = ""  # spill_why() where spill
    unplanned: str = ""  # why no placement of oomkit's could be built (transformers places it)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reason: str = ""  # on refusal
    fix: str = ""  # on refusal

    @property
    def refused(self) -> bool:
        return self.where == REFUSE

    def raise_refusal(self) -> None:
        """Raise the refusal as :class:`LoadRefused` (what ``load()`` does with it); nothing otherwise."""
        if self.refused:
            raise LoadRefused(self.reason, self.fix or None)

    def __str__(self) -> str:
        if self.refused:
            return f"refused: {self.reason}" + (f"\nfix: {self.fix}" if self.fix else "")
        where = {ALONE: "on GPU 0 alone" if self.gpus else "in RAM", SPLIT: f"split across {self.gpus} GPUs",
                 OFFLOAD: f"offloading {format_bytes(self.offloaded)} of weights"}[self.where]  # fmt: skip
        return "\n".join([f"{self.verdict} {where}", *self.warnings, *self.notes])

    def _repr_html_(self) -> str:
        lines = str(self).splitlines()
        body = "".join(f"<div>{escape(line)}</div>" for line in lines[1:])
        return f"<div class='oomkit-placement' data-where='{escape(self.where)}'><b>{escape(lines[0])}</b>{body}</div>"


def devices_snapshot(estimate, devices: list[dict], ram: int = 0) -> MemorySnapshot:
    """A readout of GPUs that each have ``devices[i]["capacity"]`` bytes of room for ``estimate`` (their
    CUDA context not yet paid), and ``ram`` bytes of RAM: what the panel and preflight decide on."""
    context = gpu_room(estimate, GPUReadout(0, "", (0, 0), 0, 0, 0, 0, 0, 0))
    gpus = [
        GPUReadout(i, d["name"], (8, 0) if d.get("bf16") else (7, 5), d["capacity"], d["capacity"] - context, 0, 0,
                   0, 0, [])
        for i, d in enumerate(devices)
    ]  # fmt: skip
    return MemorySnapshot("cuda", gpus, RAMReadout(ram, ram, 0, 0))


def decide_placement(plan, estimate, snapshot: MemorySnapshot, *, fixes: bool = True) -> PlacementDecision:
    """Where ``estimate``'s model goes on the machine ``snapshot`` reads, placed as ``plan`` (a
    :class:`helpers.LoadPlan`, or None for load()'s defaults) asks: the answer :func:`helpers.load` raises or
    loads, the panel draws and preflight reports.

    ``device_map="auto"`` keeps a model that fits GPU 0 with room to spare there, when the placement
    transformers computes for that card alone keeps every weight on it (:func:`spill_why`); else it is split
    over the usable GPUs, checked card by card. What does not fit is offloaded to CPU RAM (or the
    ``offload_folder``) only with ``allow_offload``, and never for a checkpoint saved quantized by bitsandbytes.
    ``fixes=False``: a refusal's fix does not re-estimate (it says ``FIXES_NOT_ASKED``), for a caller that
    reads where the model goes and has the fixes from ``fit()`` (``fit()`` itself, the panel)."""
    plan = auto_placing() if plan is None else plan
    asked = _FIXES.set(fixes)
    try:
        with one_move():
            return _decide(plan, estimate, snapshot)
    finally:
        _FIXES.reset(asked)


# whether a refusal's fix may re-estimate (the estimator's fixes: most of a decision's cost where it refuses)
_FIXES: contextvars.ContextVar[bool] = contextvars.ContextVar("oomkit_placement_fixes", default=True)
FIXES_NOT_ASKED = "helpers.fit(estimate, device) lists the fixes"


def _estimator_fix(est, device, default: str = "") -> str:
    """The estimator's top fix for ``est`` on ``device`` (``default``, else ``NO_FIX``, when it has none);
    ``FIXES_NOT_ASKED`` where the caller of :func:`decide_placement` reads where the model goes, not the fix."""
    if not _FIXES.get():
        return FIXES_NOT_ASKED
    return first_fix(_fit_once(est, device)) or default or NO_FIX


def _decide(plan, estimate, snapshot: MemorySnapshot) -> PlacementDecision:
    try:
        check_strategy(plan.device_map)
        if snapshot.gpus:
            decided = _over_gpus(plan, estimate, snapshot)
            if decided is not None:
                return decided
        return _one_card(plan, estimate, snapshot)
    except LoadRefused as e:  # the checks of a map or caps the user wrote, and of a split
        return _refuse(estimate, e.reason, e.fix or "", plan=e.placement, gpus=len(snapshot.gpus))


def _refuse(estimate, reason: str, fix: str, **fields) -> PlacementDecision:
    return PlacementDecision(REFUSE, DOES_NOT_FIT, estimate, reason=reason, fix=fix, **fields)


def _placed(estimate, where: str, split: DevicePlan | None, **fields) -> PlacementDecision:
    """A decision that loads ``split`` (None: transformers places it), with the fullest GPU's verdict."""
    shares = split.gpus if split is not None else []
    fullest = max((verdict(s.total, s.capacity) for s in shares if s.capacity), key=VERDICTS.index, default=FITS)
    offloaded = split.offloaded("cpu") + split.offloaded("disk") if split is not None else 0
    return PlacementDecision(where, fullest, estimate, plan=split, offloaded=offloaded, **fields)


# ----------------------------------------------------------------------------- several GPUs


def _over_gpus(plan, est, snap: MemorySnapshot) -> PlacementDecision | None:
    """The multi-GPU part of the decision; ``None`` when one GPU decides (one card, GPU 0 alone, or a map
    naming one). Raises :class:`LoadRefused` from the checks of a map or caps of the user's."""
    if plan.gpus is not None and plan.gpus > len(snap.gpus):
        return _refuse(est, f"the plan asks for {plan.gpus} GPUs and this machine has {len(snap.gpus)}",
                       "LoadPlan(..., gpus=None) uses what there is; on Kaggle pick the 'GPU T4 x2' accelerator",
                       gpus=len(snap.gpus))  # fmt: skip
    if len(map_gpus(plan.device_map)) > 1:
        return _from_gpu_decision(est, check_given_split(plan, est, snap), len(map_gpus(plan.device_map)))
    strategy = map_strategy(plan.device_map)
    if strategy is not None and len(max_memory_gpus(plan.max_memory)) > 1:
        return _from_gpu_decision(est, check_given_max_memory(plan, est, snap), len(max_memory_gpus(plan.max_memory)))
    gpus = usable_gpus(snap, plan.gpus)
    if strategy is None or plan.max_memory is not None or len(gpus) < 2:
        return None  # on one card every strategy places alike (transformers balances nothing there)
    first_verdict, spill = FITS, 0
    if strategy == "auto" and plan.gpus is None:
        first = free_devices(est, gpus[:1])[0]
        first_verdict = _fit_once(est, first, suggest=False).verdict
        if first_verdict == FITS:
            spill = _first_card_spill(est, first)
            if not spill:
                return None  # GPU 0 alone, with room to spare
    try:
        decided = check_split(plan, est, snap, gpus)
    except LoadRefused as e:
        return _refuse(est, e.reason, e.fix or "", plan=e.placement, gpus=len(gpus),
                       first_verdict=first_verdict, spill=spill, why=spill_why(est) if spill else "")  # fmt: skip
    out = _from_gpu_decision(est, decided, len(gpus))
    out.first_verdict, out.spill, out.why = first_verdict, spill, spill_why(est) if spill else ""
    return out


def _first_card_spill(est, first: dict) -> int:
    """Bytes the placement transformers computes for GPU 0 alone (bitsandbytes' 10 % margin, accelerate's
    largest-layer reserve) leaves off it: ``fit()`` says yes to a 13B int8 on a T4 that this placement
    half-spills to the CPU while GPU 1 sits idle. 0 where the architecture cannot be built on meta."""
    try:
        placed = split_plan(est, [first])
    except PlacementError:
        return 0
    return 0 if placed.fits else max(1, est.weights - sum(s.weights for s in placed.gpus))


def _from_gpu_decision(est, decided, n: int) -> PlacementDecision:
    """gpu_split's checked split (a ``GpuDecision``) as the decision."""
    split = decided.split
    where = OFFLOAD if split is not None and split.offloaded("cpu") + split.offloaded("disk") else SPLIT
    unplanned = decided.notes[0] if split is None and decided.notes else ""  # why transformers places it
    return _placed(est, where, split, gpus=n, max_memory=decided.max_memory, warnings=list(decided.warnings),
                   notes=list(decided.notes), unplanned=unplanned)  # fmt: skip


# ----------------------------------------------------------------------------- one card (or none)


def _one_card(plan, est, snap: MemorySnapshot) -> PlacementDecision:
    """GPU 0 (or the one card a map names) decides; without a GPU, RAM does."""
    g = _mapped_gpu(plan, est, snap)
    if isinstance(g, PlacementDecision):
        return g
    if g is None:
        ram = snap.ram.available
        if est.total > ram:
            return _refuse(est, f"the estimate ({format_bytes(est.total)}) is more than the {format_bytes(ram)} of "
                           "RAM available: the process would be killed",
                           _estimator_fix(est, ram, "Use a smaller model, or a GPU runtime and int8/nf4"),
                           gpus=0, first_verdict=DOES_NOT_FIT)  # fmt: skip
        return PlacementDecision(ALONE, verdict(est.total, ram), est, verdict(est.total, ram), gpus=0)
    room = gpu_room(est, g)
    verdict_ = _fit_once(est, gpu_device(g, room), suggest=False)
    strategy = map_strategy(plan.device_map)
    max_memory = plan.max_memory if plan.max_memory is not None or strategy is None else max_memory_for(est, snap)
    if verdict_.verdict != DOES_NOT_FIT:
        decided = _placement_spill(plan, est, g, room, snap)
        decided.first_verdict = verdict_.verdict
        if decided.where == ALONE:
            decided.verdict, decided.notes = verdict_.verdict, other_gpus_note(plan, snap)
        if not decided.refused:
            decided.max_memory = max_memory
        return decided
    fix = _estimator_fix(est, gpu_device(g, room))  # its fixes: only when refused
    too_big = f"the estimate ({format_bytes(est.total)}) does not fit the {format_bytes(g.free)} free on {g.name}"
    if strategy is None:
        return _refuse(est, too_big, fix, first_verdict=DOES_NOT_FIT)
    runtime = est.total - est.weights
    if runtime > room:
        return _refuse(est, f"the KV cache, activations and overheads alone ({format_bytes(runtime)}) need more "
                       f"than the {format_bytes(g.free)} free on {g.name}; offloading weights cannot help", fix,
                       first_verdict=DOES_NOT_FIT)  # fmt: skip
    decided = _offload(plan, est, g, room, snap, fix, too_big)
    decided.first_verdict = DOES_NOT_FIT
    if not decided.refused:
        decided.max_memory = max_memory
    return decided


def _mapped_gpu(plan, est, snap: MemorySnapshot):
    """The GPU a one-card ``device_map`` names (``{"": 1}``, ``"cuda:1"``), GPU 0 otherwise; None without one."""
    index = map_gpu(plan.device_map) or 0
    if snap.gpus and index >= len(snap.gpus):
        return _refuse(est, f"the device_map puts the model on GPU {index} and this machine has {len(snap.gpus)} "
                       "GPU(s)", "device_map='auto' (GPU 0 first), or {'': 0}")  # fmt: skip
    return snap.gpus[index] if snap.gpus else None


def _offload(plan, est, g: GPUReadout, room: int, snap: MemorySnapshot, fix: str, too_big: str) -> PlacementDecision:
    """The estimate does not fit GPU ``g``: what ``device_map="auto"`` would offload, sized as a split sizes it
    (transformers' placement for the card, offloaded bitsandbytes layers counted unquantized: a Llama-2-13B nf4
    3.4 GiB over a T4's free memory puts 15.7 GiB into RAM). Refused when that does not fit the RAM offload may
    take, or without ``allow_offload``; else the placement to load with: a device map naming the CPU is what
    makes transformers keep the offloaded bitsandbytes layers unquantized, as they were sized."""
    held = held_hint(g)
    if bnb_prequantized(est):
        return _refuse(est, f"{too_big}, and {PREQUANTIZED_OFFLOAD}{held}", f"{fix}; or {PREQUANTIZED_OFFLOAD_FIX}")
    ram, share = snap.ram.available, offload_ram(snap)
    try:
        placed = split_plan(est, [gpu_device(g, room)], ram=share, offload=True, disk=bool(plan.offload_folder),
                            offload_folder=plan.offload_folder)  # fmt: skip
        on_cpu, on_disk, reason = placed.offloaded("cpu"), placed.offloaded("disk"), next(iter(placed.reasons), None)
    except PlacementError:  # an architecture the meta device cannot build: the estimate's overflow, at RAM width
        if est.load in QUANTIZED:
            return _refuse(est, f"{too_big}, and {UNPLACED_BNB_OFFLOAD}{held}", fix)
        placed, reason = None, None
        on_cpu, on_disk = offloaded_bytes(est, est.total - room, g.supports_bf16), 0
        if on_cpu > share and plan.offload_folder:  # what RAM cannot take goes to the folder
            on_cpu, on_disk = share, on_cpu - share
    offload = on_cpu + on_disk
    if on_cpu > share or (on_disk and not plan.offload_folder):
        return _refuse(est, f"{too_big}, and the {format_bytes(offload)} of weights that would be offloaded"
                       f"{unquantized_note(est, g.supports_bf16)} do not fit the {format_bytes(ram)} of RAM available "
                       f"either (offload may take {format_bytes(share)}){held}", fix, plan=placed)  # fmt: skip
    if reason is not None:  # 4-bit weights to disk, a card without room for its runtime
        return _refuse(est, f"{too_big}, and {reason}{held}", fix, plan=placed)
    where = "disk" if on_disk else "CPU RAM"
    if not plan.allow_offload:
        return _refuse(est, f"{too_big}: loading would offload about {format_bytes(offload)} of weights to {where}, "
                       f"and every generated token would be much slower{held}", f"{fix}; or {ALLOW_OFFLOAD_FIX}",
                       plan=placed, offloaded=offload)  # fmt: skip
    warning = (f"about {format_bytes(offload)} of weights will be offloaded to {where}: generation will be much "
               f"slower. Better: {fix}")  # fmt: skip
    decided = _placed(est, OFFLOAD, placed, warnings=[warning])
    decided.offloaded = offload
    return decided


def _placement_spill(plan, est, g: GPUReadout, room: int, snap: MemorySnapshot) -> PlacementDecision:
    """The estimate fits ``g``; the placement transformers computes for it may still push weights to the CPU
    (:func:`spill_why`). Placed with the RAM the load offers: refused before loading, or (``allow_offload``)
    a warning and the placement that was checked; never offloaded silently, never into too little RAM."""
    alone = PlacementDecision(ALONE, FITS, est)
    if map_strategy(plan.device_map) is None or plan.max_memory is not None:
        return alone
    try:
        placed = split_plan(est, [gpu_device(g, room)], ram=offload_ram(snap), offload=True)
    except PlacementError:  # an architecture the meta device cannot build: the estimate decided
        return alone
    spill = placed.offloaded("cpu") + placed.offloaded("disk")
    if not spill:
        return alone
    fix, why = spill_fix(est), spill_why(est)
    said = (f"the estimate ({format_bytes(est.total)}) fits the {format_bytes(g.free)} free on {g.name}, but {why} "
            f"leaves {format_bytes(spill)} of weights for CPU RAM")  # fmt: skip
    if not placed.fits:
        return _refuse(est, f"{said}, and {placed.reasons[0]}", fix, plan=placed, spill=spill, why=why)
    if not plan.allow_offload:
        return _refuse(est, f"{said}: every generated token would be much slower", f"{fix}; or {ALLOW_OFFLOAD_FIX}",
                       plan=placed, spill=spill, why=why)  # fmt: skip
    return _placed(est, OFFLOAD, placed, spill=spill, why=why,
                   warnings=[f"{said}: generation will be much slower. Better: {fix}"])  # fmt: skip


def max_memory_for(estimate, snap: MemorySnapshot) -> dict | None:
    """``max_memory`` for ``device_map="auto"`` that keeps room on the GPU for KV cache and activations."""
    g = snap.gpu
    if g is None:
        return None
    runtime = max(0, estimate.total - estimate.weights)  # KV cache, activations, CUDA context, margins
    gpu_cap = max(0, gpu_room(estimate, g) - runtime - GPU_MARGIN)
    return {g.index: gpu_cap, "cpu": offload_ram(snap)}


# ----------------------------------------------------------------------------- the words, one home each


def spill_why(est) -> str:
    """Why an estimate that fits one card can still be offloaded in part. transformers applies bitsandbytes'
    10 % margin only with a quantizer (an int8/4-bit load: its ``adjust_max_memory``, also on the explicit
    ``max_memory`` load() passes); accelerate's reserve for the largest layer and the room load() keeps for the
    KV cache apply to every load."""
    bnb = ", bitsandbytes 10 % of the card for its buffers" if est.load in QUANTIZED else ""
    return (f"transformers' placement for it (max_memory keeps room for the KV cache and activations, accelerate for "
            f"the largest layer{bnb})")  # fmt: skip


def smaller_load_fix(load: str) -> str:
    """The first fix for a plan transformers would partly offload: the next smaller load mode."""
    smaller = lighter_load(load)
    return f"load={smaller!r}" if smaller else "a smaller model"


def spill_fix(est) -> str:
    """The fix for a plan transformers would partly offload: the next smaller load mode; for a checkpoint
    saved quantized by bitsandbytes (its load mode is the saved one, and it cannot be offloaded), loading
    the original instead."""
    if bnb_prequantized(est):
        return f"a smaller batch or max_new_tokens; or {PREQUANTIZED_OFFLOAD_FIX}"
    if getattr(est, "quantized_by", None):  # GPTQ, AWQ, fp8, mxfp4: it loads as saved, no other load mode applies
        return ("a smaller batch or max_new_tokens; or the original (unquantized) checkpoint with load='nf4', "
                "which bitsandbytes quantizes while loading")  # fmt: skip
    return f"{smaller_load_fix(est.load)}, or a smaller batch or max_new_tokens"


# ----------------------------------------------------------------------------- fit()'s fixes past one card: a split over the machine's GPUs, or layers offloaded to CPU RAM


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


# ----------------------------------------------------------------------------- several GPUs on a memory readout: how many to use, each one's room, the split


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


def _fit_once(est, device, suggest: bool = True) -> FitVerdict:
    """``fit_one_card(est, device)`` once per :func:`one_move` (the decision reads its verdict and top fix only)."""
    return once_per_move(
        "fit_one_card", est, frozen_key((device, suggest)), lambda: fit_one_card(est, device, suggest=suggest)
    )


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
    args = (devices, ram, offload, disk, device_map, max_memory, offload_folder, strategy)
    # a device as the placement reads it (resolve_device): fit()'s presets carry more keys than a readout's GPU
    cards = [
        (d.get("name"), d.get("capacity"), bool(d.get("bf16", True))) if isinstance(d, dict) else d for d in devices
    ]
    return once_per_move("split_plan", estimate, frozen_key((cards, *args[1:])), lambda: _split_plan(estimate, *args))


def _split_plan(estimate, devices, ram, offload, disk, device_map, max_memory, offload_folder, strategy) -> DevicePlan:
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
    return _estimator_fix(est, both)


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
