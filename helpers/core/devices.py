"""Device presets and what a device is: capacity, name, bf16 support; resolving ``"current"``.

Capacities are ``torch.cuda.get_device_properties().total_memory`` as each card reports it (what
OOM messages call "total capacity"), so a plan for "t4" on a laptop matches Colab's T4 to the byte.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .errors import OomkitError
from .units import MAX_BYTES, GiB, KiB, MiB, format_bytes, parse_bytes
from .vocab import FP16, FP32, half_dtype, supports_bf16

if TYPE_CHECKING:  # imported where used: `import helpers` must not import torch (seconds)
    pass

__all__ = [
    "MACHINE_RAM",
    "DEVICES", "DEFAULT_DEVICE", "CUDA_CONTEXT", "CUBLAS_WORKSPACE", "CUBLAS_WORKSPACE_HOPPER",
    "CUBLAS_WORKSPACE_HOPPER_MAJORS", "DeviceError", "resolve_device",
    "cuda_capability", "device_kind", "bitsandbytes_status", "compute_dtype_rule", "DEVICE_SETS", "resolve_devices",
    "capacity_range", "device_set",
]  # fmt: skip

# RAM of the machines people launch on first, as their own readouts state it.
MACHINE_RAM = {
    "colab": int(12.7 * GiB),  # Colab's free runtime: "System RAM 12.7 GB"
    "kaggle-2xt4": 29 * 10**9,  # Kaggle's "GPU T4 x2" sessions: about 29 GB
}

DEVICES: dict[str, dict[str, Any]] = {
    # The T4's total depends on driver and VM: 14.74 GiB (the preset, byte-exact from a Colab T4) in
    # earlier messages, 14.56 GiB in recent Colab and GCP ones (helpers/data/t4_capacity.jsonl, cited).
    # Plans keep the larger reading; a plan between the two is "tight" and says why (``capacity_low``).
    "t4": {
        "name": "Tesla T4 (Colab free)",
        "capacity": 15_828_320_256,
        "capacity_low": 15_633_680_957,
        "capacity_low_seen": "recent Colab and GCP T4s",
        "bf16": False,
        "capability": (7, 5),
    },
    "l4": {"name": "NVIDIA L4", "capacity": 23_580_639_232, "bf16": True, "capability": (8, 9)},
    "v100": {"name": "Tesla V100 16 GB", "capacity": 16_935_682_048, "bf16": False, "capability": (7, 0)},
    "v100-32": {"name": "Tesla V100 32 GB", "capacity": 34_089_730_048, "bf16": False, "capability": (7, 0)},
    "a100-40": {"name": "NVIDIA A100 40 GB", "capacity": 42_481_811_456, "bf16": True, "capability": (8, 0)},
    "a100-80": {"name": "NVIDIA A100 80 GB", "capacity": 85_051_572_224, "bf16": True, "capability": (8, 0)},
    "rtx3090": {"name": "NVIDIA GeForce RTX 3090", "capacity": 25_438_126_080, "bf16": True, "capability": (8, 6)},
    "rtx4090": {"name": "NVIDIA GeForce RTX 4090", "capacity": 25_386_352_640, "bf16": True, "capability": (8, 9)},
    "h100": {"name": "NVIDIA H100 80GB HBM3", "capacity": 85_045_477_376, "bf16": True, "capability": (9, 0)},
}
# Machines with more than one GPU, as the presets above: what `plan_devices(devices=...)` takes by name
DEVICE_SETS: dict[str, tuple[str, ...]] = {
    "kaggle-2xt4": ("t4", "t4"),  # Kaggle's free "GPU T4 x2" accelerator
    "2xl4": ("l4", "l4"),
    "2xa100-80": ("a100-80", "a100-80"),
    "4xa100-80": ("a100-80",) * 4,
    "8xh100": ("h100",) * 8,
}
DEFAULT_DEVICE = "t4"  # oomkit plans for the free Colab GPU unless told otherwise

# What lives on the GPU outside PyTorch's allocator (not counted by memory_allocated()), a rule of
# thumb until `make gpu-check` measures it: the driver context and torch's kernels take 300-500 MiB
# depending on GPU and version.
CUDA_CONTEXT = 400 * MiB
# torch's default cuBLAS workspace, one per (device, stream) and shared with cuBLASLt, allocated
# through the caching allocator on the first matmul (so inside memory_reserved(), not outside it).
# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize(): CUBLAS_WORKSPACE_CONFIG
# ":4096:2:16:8" (4096 KiB x 2 + 16 KiB x 8 = 8,519,680 bytes) below Hopper, ":4096:8" (32 MiB) on
# compute capability 9.x, 10.x and 12.x (Hopper, Blackwell).
CUBLAS_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8
CUBLAS_WORKSPACE_HOPPER = 4096 * KiB * 8
CUBLAS_WORKSPACE_HOPPER_MAJORS = (9, 10, 12)
# Leave this much of the GPU free beyond the estimate when capping device_map's GPU share: the
# allocator's rounding and the first kernels' workspaces are not in the weights.
GPU_MARGIN = 256 * MiB
# Offloaded weights cross PCIe on every forward pass; a T4 in Colab sees roughly this much.
PCIE_BYTES_PER_S = 8 * GiB
DISK_BYTES_PER_S = 300 * MiB
# Offloaded weights may take this share of available RAM: the rest is for the tokenizer, the
# Python process and Colab itself, which dies without a message when RAM runs out.
OFFLOAD_RAM_SHARE = 0.8


class DeviceError(OomkitError, ValueError):
    """An unknown device preset or a capacity that cannot be right."""


def device_kind() -> str:
    """``"cuda"``, ``"mps"`` or ``"cpu"``: where tensors go on this machine."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else "cpu"


def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, ``None`` without one (never starts CUDA otherwise)."""
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def compute_dtype_rule(device: dict | str | None) -> str:
    """What "auto" compute dtype means, for every caller (estimate and load agree): a resolved device
    dict (``None`` = CPU) or a kind (``"cuda"``, ``"mps"``, ``"cpu"``). bf16 where the GPU computes in
    it, fp16 on older GPUs and MPS, fp32 on CPU (CPU kernels for half precision are slow or missing)."""
    import torch

    if isinstance(device, str):
        if device == "cuda":
            return half_dtype(supports_bf16(torch.cuda.get_device_capability()))
        return FP16 if device == "mps" else FP32
    if device is None:
        return FP32
    return half_dtype(bool(device.get("bf16")))


def _current() -> tuple[str, dict | None]:
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    capacity, name = props.total_memory, props.name
    # a cap set with set_per_process_memory_fraction (e.g. to act as a T4 on a bigger card) is the
    # allocator's real limit: past it, it raises an OOM with the card half empty
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)
    if 0 < fraction < 1:
        capacity = int(capacity * fraction)
        name = f"{props.name}, capped at {fraction:.0%}"
    return name, {"name": name, "capacity": capacity, "bf16": supports_bf16((props.major, getattr(props, "minor", 0)))}


def _size(device: int | float) -> tuple[str, dict]:
    if device > MAX_BYTES or not math.isfinite(device):
        raise DeviceError(f"device capacity {str(device)[:40]} is not a real size in bytes; pass e.g. 16 * GiB")
    if device <= 0:
        raise DeviceError(f"device capacity must be positive bytes, got {device}")
    if device < MiB:
        # 15 or 15.0 is a size in GiB written without its unit, not a 15-byte GPU
        raise DeviceError(
            f"device capacity is in bytes, and {device} bytes is less than 1 MiB; for "
            f"{device:g} GiB pass {device:g} * GiB (helpers.GiB) or the string '{device:g}GiB'"
        )
    label = format_bytes(int(device))
    return label, {"name": label, "capacity": int(device), "bf16": True}


def capacity_range(dev: dict) -> tuple[int, int]:
    """``(lowest, preset)`` capacity a device's cards report: equal unless the preset carries a
    ``capacity_low`` (a card whose total varies with driver and VM, such as the T4)."""
    return min(dev.get("capacity_low", dev["capacity"]), dev["capacity"]), dev["capacity"]


def resolve_device(device: Any) -> tuple[str, dict | None]:
    """``(label, {'name', 'capacity', 'bf16'})`` for a preset name, a byte count, a size such as
    ``"24GiB"``, such a dict itself (a GPU as read, its free memory as the capacity), ``"current"``
    (this process's GPU, honouring a per-process cap) or ``None`` (the default preset). CPU
    (``"cpu"``, or ``"current"`` without a GPU) gives ``("cpu", None)``."""
    if device is None:
        device = DEFAULT_DEVICE
    if isinstance(device, bool):
        raise DeviceError("device must be a preset name, a byte count or 'current'")
    if isinstance(device, int | float):
        return _size(device)
    if isinstance(device, dict) and "capacity" in device:  # a described GPU: what a memory readout says of it
        label, dev = _size(device["capacity"])
        name = str(device.get("name") or label)
        return name, {"name": name, "capacity": dev["capacity"], "bf16": bool(device.get("bf16", True))}
    key = str(device).lower().replace(" ", "").replace("_", "-")
    if key == "current":
        return _current()
    if key == "cpu":
        return "cpu", None
    if key in DEVICES:
        return key, DEVICES[key]
    if key[:1].isdigit():
        try:
            size = parse_bytes(key)  # "24GiB", as the CLI's --device takes it
        except ValueError as e:
            raise DeviceError(f"{e}; pass a preset ({', '.join(DEVICES)}) or a size such as 24GiB") from None
        return _size(size)
    raise DeviceError(
        f"unknown device {str(device)[:60]!r}; use one of {', '.join(DEVICES)}, 'current', or a size such as 24GiB"
    )


def _current_gpus() -> list[tuple[str, dict]]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        cap = (props.major, getattr(props, "minor", 0))
        out.append(
            (f"{i}: {props.name}", {"name": props.name, "capacity": props.total_memory, "bf16": supports_bf16(cap)})
        )
    return out


def device_set(name: Any) -> tuple[str, ...] | None:
    """The presets of a machine named in ``DEVICE_SETS`` (``"kaggle-2xt4"``, ``"Kaggle_2×T4"``); None for
    anything else (one preset, a size, a list)."""
    if not isinstance(name, str):
        return None
    return DEVICE_SETS.get(name.lower().replace("_", "-").replace("×", "x"))


def resolve_devices(devices: Any) -> list[tuple[str, dict]]:
    """One ``(label, {'name', 'capacity', 'bf16'})`` per GPU, in index order, for a set of devices.

    ``devices`` is ``"current"`` (every GPU this process sees; none on a CPU-only machine), a name
    from ``DEVICE_SETS`` (``"kaggle-2xt4"``), one preset or size (one GPU), a list of presets or sizes
    (``["t4", "t4"]``), or ``{index: bytes}`` (``{0: 15 * GiB, 1: 15 * GiB}``).
    """
    if isinstance(devices, str) and devices.lower().replace("_", "-") == "current":
        return _current_gpus()
    if device_set(devices) is not None:
        devices = list(device_set(devices))
    if isinstance(devices, dict):
        if sorted(devices) != list(range(len(devices))) or not devices:
            raise DeviceError(f"a device dict is keyed 0, 1, ... (GPU indices), got keys {list(devices)}")
        devices = [devices[i] for i in range(len(devices))]
    if not isinstance(devices, list | tuple):
        devices = [devices]
    out = []
    for i, d in enumerate(devices):
        label, dev = resolve_device(d)
        if dev is None:
            raise DeviceError(f"device {i} is {d!r}: list GPUs only (CPU offload is plan_devices(cpu_offload=True))")
        out.append((f"{i}: {label}", dev))
    if not out:
        raise DeviceError(
            f"no GPU in {devices!r}; use {', '.join(DEVICE_SETS)}, a list such as ['t4', 't4'] or 'current'"
        )
    return out


def bitsandbytes_status(device: str) -> tuple[bool, str]:
    """Whether bitsandbytes can really quantize on ``device``: a 4-bit round trip, not just an import."""
    import torch

    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        return False, "bitsandbytes is not installed"
    except Exception as e:  # a broken native library surfaces here on some machines
        return False, f"bitsandbytes failed to import: {str(e).splitlines()[0]}"
    try:
        x = torch.randn(64, 64, device=device)
        q, state = bnbf.quantize_4bit(x, quant_type="nf4")
        err = (bnbf.dequantize_4bit(q, state).float() - x).abs().mean().item()
        if not err < 0.2:
            return False, f"bitsandbytes 4-bit round trip on {device} is wrong (mean error {err:.3f})"
    except Exception as e:
        return False, f"bitsandbytes cannot run on {device}: {str(e).splitlines()[0][:200]}"
    return True, f"bitsandbytes quantizes on {device}"
