"""Loading on a machine with more than one GPU: how many to use, and the split their free memory allows.

``from_pretrained(device_map="auto")`` spreads a model over every GPU it sees, even one that fits on
the first (and Kaggle's 2×T4 then runs it as a two-stage pipeline, no faster). :func:`helpers.load`
keeps a model that fits on GPU 0 there, so the other cards stay free, and splits it only when it
needs them, with the placement :func:`helpers.plan_devices` computes for the GPUs' free memory: the
same map transformers would compute, checked per card (weights, that card's KV cache, activations,
context) before any weight is read.
"""

from __future__ import annotations

from typing import Any

from .devices import OFFLOAD_RAM_SHARE
from .memory import GPUReadout, MemorySnapshot
from .placement import DevicePlan, PlacementError, plan_devices
from .units import format_bytes

__all__ = ["gpu_room", "gpu_device", "usable_gpus", "map_gpus", "max_memory_gpus", "split_plan", "describe_split"]


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
        elif str(dev).startswith("cuda"):
            out.add(int(str(dev).partition(":")[2] or 0))
    return out


def split_plan(
    estimate, gpus: list[GPUReadout], *, ram: int, offload: bool = False, disk: bool = False,
    device_map: dict | None = None,
) -> DevicePlan:  # fmt: skip
    """The placement of ``estimate``'s model over ``gpus``' free memory (``plan_devices`` with the
    estimate's own inputs), or the check of a hand-made ``device_map``.

    Raises :class:`PlacementError` when the architecture cannot be planned (the caller falls back
    to transformers' own placement)."""
    inputs = estimate.inputs
    if estimate.load not in ("fp32", "fp16", "bf16", "int8", "nf4", "fp4") or estimate.source is None:
        raise PlacementError(f"no placement for a {estimate.load} checkpoint")
    compute = inputs.get("compute_dtype", "auto")
    if compute == "auto" and estimate.load in ("int8", "nf4", "fp4"):
        compute = "bf16" if all(g.supports_bf16 for g in gpus) else "fp16"
    devices = [gpu_device(g, gpu_room(estimate, g)) for g in gpus]
    return plan_devices(
        estimate.source, load=estimate.load, devices=devices, cpu_offload=offload, disk_offload=disk,
        cpu_memory=ram, compute_dtype=compute, double_quant=inputs.get("double_quant", True),
        batch_size=inputs.get("batch_size", 1), prompt_tokens=inputs.get("prompt_tokens", 512),
        max_new_tokens=inputs.get("max_new_tokens", 256), device_map=device_map,
    )  # fmt: skip


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
