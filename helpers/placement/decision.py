"""Where a model goes: the ONE decision :func:`helpers.load`, the load panel and :func:`helpers.preflight` render.

:func:`decide_placement` takes a plan's placement fields (``device_map``, ``gpus``, ``max_memory``,
``allow_offload``, ``offload_folder``), an estimate and a memory readout, and returns a
:class:`PlacementDecision`: GPU 0 alone (or the one card a map names), split over several GPUs, one card
plus CPU/disk offload, or refused, with the checked :class:`~helpers.DevicePlan`, what is offloaded,
the warnings, and on refusal the reason and the fix. ``load()`` raises the refusal; the panel and preflight
read the same answer from a readout of their devices (:func:`devices_snapshot`), so the three cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from types import SimpleNamespace
from typing import Any

from ..core.devices import GPU_MARGIN
from ..core.errors import LoadRefused
from ..core.memory import GPUReadout, MemorySnapshot, RAMReadout
from ..core.units import format_bytes
from ..core.vocab import DOES_NOT_FIT, FITS, QUANTIZED, VERDICTS, lighter_load, verdict
from .device_map import PlacementError
from .device_plan import PREQUANTIZED_OFFLOAD, PREQUANTIZED_OFFLOAD_FIX, DevicePlan, bnb_prequantized, one_move
from .gpu_room import (
    check_strategy,
    free_devices,
    gpu_device,
    gpu_room,
    map_gpu,
    map_gpus,
    map_strategy,
    max_memory_gpus,
    offload_ram,
    offloaded_bytes,
    split_plan,
    unquantized_note,
    usable_gpus,
)
from .split_checks import (
    ALLOW_OFFLOAD_FIX,
    FIXES_ASKED,
    check_given_max_memory,
    check_given_split,
    check_split,
    estimator_fix,
    fit_once,
    held_hint,
    other_gpus_note,
)

__all__ = [
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
]

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
    asked = FIXES_ASKED.set(fixes)
    try:
        with one_move():
            return _decide(plan, estimate, snapshot)
    finally:
        FIXES_ASKED.reset(asked)


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
        first_verdict = fit_once(est, first, suggest=False).verdict
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
                           estimator_fix(est, ram, "Use a smaller model, or a GPU runtime and int8/nf4"),
                           gpus=0, first_verdict=DOES_NOT_FIT)  # fmt: skip
        return PlacementDecision(ALONE, verdict(est.total, ram), est, verdict(est.total, ram), gpus=0)
    room = gpu_room(est, g)
    verdict_ = fit_once(est, gpu_device(g, room), suggest=False)
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
    fix = estimator_fix(est, gpu_device(g, room))  # its fixes: only when refused
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
