"""Several GPUs on a memory readout: which to use, each one's room, the split over them, and the device_map
and max_memory a plan names."""

from __future__ import annotations

from typing import Any

import torch

from ..core.devices import OFFLOAD_RAM_SHARE
from ..core.errors import LoadRefused
from ..core.memory import GPUReadout, MemorySnapshot
from ..core.units import format_bytes
from ..core.vocab import DEFAULTS, MODES, QUANTIZED, half_dtype
from .device_map import PlacementError
from .device_plan import DEVICE_MAP_STRATEGIES, DevicePlan, frozen_key, once_per_move, plan_devices

__all__ = [
    "gpu_room",
    "gpu_device",
    "usable_gpus",
    "map_gpus",
    "max_memory_gpus",
    "free_devices",
    "split_plan",
    "unquantized_note",
    "offloaded_bytes",
    "map_gpu",
    "map_strategy",
    "check_strategy",
    "offload_ram",
    "describe_split",
]


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
