"""Memory readouts: GPU (CUDA or MPS), system RAM, this process, and disk where models land.

Every figure is bytes as an ``int`` (``None`` when it cannot be known here); formatting happens
in :mod:`helpers.core.units`. ``snapshot()`` is the one call a notebook makes; ``allocated()`` and
``reserved()`` are the cheap readouts for loops.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from .arguments import ArgumentError, flag
from .html import Markup, bar, table
from .session import in_colab
from .units import format_bytes
from .vocab import supports_bf16

if TYPE_CHECKING:  # imported where used: `import helpers` must not import torch (seconds)
    import torch

__all__ = [
    "GPUProcess", "GPUReadout", "MPSReadout", "RAMReadout", "DiskReadout", "MemorySnapshot",
    "snapshot", "gpu_readouts", "ram_readout", "disk_readouts", "allocated", "reserved", "peak_allocated",
    "reset_peak_allocated",
    "peak_resets",
    "hf_cache_dir", "driver_gpu_readouts", "torch_build",
]  # fmt: skip


@dataclass
class GPUProcess:
    """One process using a GPU, as NVML sees it."""

    pid: int
    used: int | None
    name: str = ""


@dataclass
class GPUReadout:
    """One CUDA device, seen by PyTorch's allocator and by the driver."""

    index: int
    name: str
    capability: tuple[int, int]
    total: int
    free: int
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    processes: list[GPUProcess] | None = None  # None: NVML not available

    @property
    def used(self) -> int:
        """Everything in use on the device, by anyone (driver view)."""
        return self.total - self.free

    @property
    def reserved_unallocated(self) -> int:
        """Cached by PyTorch but holding no tensor: fragmentation, or cache ``empty_cache()`` returns."""
        return max(0, self.reserved - self.allocated)

    @property
    def non_pytorch(self) -> int:
        """In use outside this process's PyTorch allocator: CUDA context, cuBLAS, other processes."""
        return max(0, self.total - self.free - self.reserved)

    @property
    def supports_bf16(self) -> bool:
        return supports_bf16(self.capability)


@dataclass
class MPSReadout:
    """Apple-silicon GPU memory as PyTorch's MPS backend reports it."""

    allocated: int
    driver_allocated: int
    recommended_max: int | None


@dataclass
class RAMReadout:
    total: int
    available: int
    used: int
    process_rss: int


@dataclass
class DiskReadout:
    label: str
    path: str
    total: int
    free: int


@dataclass
class MemorySnapshot:
    """What is in use where, at one moment. ``backend`` is ``cuda``, ``mps`` or ``cpu``."""

    backend: str
    gpus: list[GPUReadout]
    ram: RAMReadout
    disks: list[DiskReadout] = field(default_factory=list)
    mps: MPSReadout | None = None
    taken_at: float = field(default_factory=time.time)

    @property
    def gpu(self) -> GPUReadout | None:
        """The first CUDA device, the one a notebook on Colab has."""
        return self.gpus[0] if self.gpus else None

    def to_dict(self) -> dict:
        d = asdict(self)
        for g, gd in zip(self.gpus, d["gpus"]):
            gd.update(used=g.used, reserved_unallocated=g.reserved_unallocated, non_pytorch=g.non_pytorch)
        return d

    def __str__(self) -> str:
        f = format_bytes
        lines = []
        if not self.gpus and self.mps is None:
            lines.append("GPU: none (PyTorch sees no CUDA or MPS device; running on CPU)")
        for g in self.gpus:
            lines.append(
                f"GPU {g.index}: {g.name} (sm_{g.capability[0]}{g.capability[1]}), "
                f"{f(g.used)} used of {f(g.total)}, {f(g.free)} free"
            )
            lines.append(
                f"  PyTorch: {f(g.allocated)} allocated, {f(g.reserved)} reserved "
                f"({f(g.reserved_unallocated)} reserved but unallocated)"
            )
            lines.append(
                f"  peak: {f(g.peak_allocated)} allocated, {f(g.peak_reserved)} reserved; "
                f"outside PyTorch: {f(g.non_pytorch)}"
            )
            for p in g.processes or []:
                lines.append(f"  process {p.pid} {p.name}: {f(p.used)}")
        if self.mps is not None:
            m = self.mps
            lines.append(
                f"MPS: {f(m.allocated)} allocated, {f(m.driver_allocated)} held by the driver, "
                f"recommended max {f(m.recommended_max)}"
            )
        r = self.ram
        lines.append(
            f"RAM: {f(r.total - r.available)} used of {f(r.total)}, {f(r.available)} available; "
            f"this process {f(r.process_rss)}"
        )
        for d in self.disks:
            lines.append(f"Disk ({d.label}, {d.path}): {f(d.free)} free of {f(d.total)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = []
        if not self.gpus and self.mps is None:
            parts.append("<div style='font-family:monospace'>GPU: none (running on CPU)</div>")
        for g in self.gpus:
            parts.append(bar(g.used, g.total, f"GPU {g.index} {g.name}"))
            parts.append(
                table(
                    ["allocated", "reserved", "reserved unallocated", "peak allocated", "outside PyTorch"],
                    [
                        [
                            format_bytes(x)
                            for x in (g.allocated, g.reserved, g.reserved_unallocated, g.peak_allocated, g.non_pytorch)
                        ]
                    ],
                )
            )
        if self.mps is not None and self.mps.recommended_max:
            parts.append(bar(self.mps.driver_allocated, self.mps.recommended_max, "MPS"))
        r = self.ram
        parts.append(bar(r.total - r.available, r.total, "System RAM"))
        parts.append(Markup(f"<div style='font-family:monospace'>this process: {format_bytes(r.process_rss)}</div>"))
        for d in self.disks:
            parts.append(bar(d.total - d.free, d.total, f"Disk ({d.label})"))
        return "<div>" + "".join(parts) + "</div>"


def hf_cache_dir() -> Path:
    """Where Hugging Face downloads land (honours ``HF_HOME`` / ``HF_HUB_CACHE``)."""
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - huggingface_hub is a dependency of transformers
        return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def allocated(device: int | torch.device | str | None = None) -> int:
    """Bytes held by tensors on a CUDA device, or on every GPU with ``"all"`` (a model split over two
    cards fills both); 0 without CUDA. Cheap: for use inside loops."""
    import torch

    return _per_device(torch.cuda.memory_allocated, device)


def reserved(device: int | torch.device | str | None = None) -> int:
    """Bytes reserved by PyTorch's CUDA caching allocator on a device, or on every GPU with ``"all"``
    (0 without CUDA)."""
    import torch

    return _per_device(torch.cuda.memory_reserved, device)


def peak_allocated(device: int | torch.device | str | None = None) -> int:
    """``max_memory_allocated`` of a device, or the sum of every GPU's with ``"all"`` (0 without CUDA)."""
    import torch

    return _per_device(torch.cuda.max_memory_allocated, device)


def reset_peak_allocated(device: int | torch.device | str | None = None) -> None:
    """Start ``peak_allocated`` over on a device, or on every GPU with ``"all"`` (``reset_peak_memory_stats()``
    alone resets the current card only); nothing without CUDA."""
    import torch

    global _peak_resets
    if not torch.cuda.is_available():
        return
    _peak_resets += 1
    for d in range(torch.cuda.device_count()) if device == "all" else [device]:
        torch.cuda.reset_peak_memory_stats(d)


_peak_resets = 0


def peak_resets() -> int:
    """How many times :func:`reset_peak_allocated` ran in this process: a reader of ``peak_allocated``
    that sees it change knows the peak it reads covers only the time since then."""
    return _peak_resets


def _cuda_index(device) -> int | None:
    """The CUDA index ``device`` names (``None`` for the current one); an ArgumentError for anything else."""
    import torch

    if device is None:
        return None
    try:
        if isinstance(device, bool) or not isinstance(device, int | str | torch.device):
            raise ValueError
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (ValueError, RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise ArgumentError(
            f"device must be a CUDA device such as 0, 'cuda:1' or torch.device('cuda', 0), 'all', or None (the "
            f"current one); got {device!r}"
        )
    return dev.index


def _per_device(read, device) -> int:
    import torch

    if device != "all":
        index = _cuda_index(device)
    if not torch.cuda.is_available():
        return 0
    if device == "all":
        return sum(read(i) for i in range(torch.cuda.device_count()))
    if index is not None and index >= torch.cuda.device_count():
        raise ArgumentError(f"device {device!r}: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0")
    return read(device)


def nvml_handle(index: int):
    """``(pynvml, handle)`` for CUDA device ``index`` as PyTorch numbers it, or ``(None, None)``.

    NVML numbers devices in PCI order and ignores ``CUDA_VISIBLE_DEVICES``; PyTorch's index 0 can be
    NVML's 1. The device's UUID is the same in both, so it is matched by that; the index is only the
    fallback (a MIG slice, or a torch that reports no UUID).
    """
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library, driver or permission: the driver view stays unknown
        return None, None
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode())
    except Exception:
        pass
    try:
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None, None


def _nvml_processes(index: int) -> list[GPUProcess] | None:
    pynvml, handle = nvml_handle(index)
    if handle is None:
        return None
    try:
        procs = []
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            try:
                name = psutil.Process(p.pid).name()
            except (psutil.Error, OSError):
                name = ""
            procs.append(GPUProcess(pid=p.pid, used=p.usedGpuMemory, name=name))
        return procs
    except Exception:  # NVML missing from the driver, or no permission: figures stay unknown
        return None


def gpu_readouts(processes: bool = True) -> list[GPUReadout]:
    """One :class:`GPUReadout` per visible CUDA device; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out.append(
            GPUReadout(
                index=i,
                name=props.name,
                capability=(props.major, props.minor),
                total=total,
                free=free,
                allocated=torch.cuda.memory_allocated(i),
                reserved=torch.cuda.memory_reserved(i),
                peak_allocated=torch.cuda.max_memory_allocated(i),
                peak_reserved=torch.cuda.max_memory_reserved(i),
                processes=_nvml_processes(i) if processes else None,
            )
        )
    return out


def _mps_readout() -> MPSReadout | None:
    import torch

    mps = getattr(torch, "mps", None)
    if mps is None or not torch.backends.mps.is_available():
        return None
    rec = getattr(mps, "recommended_max_memory", None)
    return MPSReadout(
        allocated=mps.current_allocated_memory(),
        driver_allocated=mps.driver_allocated_memory(),
        recommended_max=rec() if rec else None,
    )


def ram_readout() -> RAMReadout:
    vm = psutil.virtual_memory()
    return RAMReadout(
        total=vm.total, available=vm.available, used=vm.used, process_rss=psutil.Process().memory_info().rss
    )


def disk_readouts(paths: dict[str, str | Path] | None = None) -> list[DiskReadout]:
    """Free space where models are cached and where the notebook works (``/content`` on Colab)."""
    if paths is not None and (
        not isinstance(paths, dict) or not all(isinstance(p, str | os.PathLike) for p in paths.values())
    ):
        raise ArgumentError(
            f"disks must be a dict of label -> folder such as {{'models': '/content'}}, got {paths!r:.60}"
        )
    if paths is None:
        paths = {"HF cache": hf_cache_dir(), "working dir": "/content" if in_colab() else os.getcwd()}
    out = []
    for label, path in paths.items():
        p = Path(path)
        while not p.exists() and p != p.parent:  # the cache dir may not exist before a first download
            p = p.parent
        usage = shutil.disk_usage(p)
        out.append(DiskReadout(label=label, path=str(path), total=usage.total, free=usage.free))
    return out


def snapshot(*, processes: bool = True, disks: dict[str, str | Path] | None = None) -> MemorySnapshot:
    """Read GPU, RAM and disk now. ``processes=False`` skips the NVML per-process list. Before anything imports
    torch the GPUs come from the driver (:func:`driver_gpu_readouts`), so a first cell's readout does not wait for
    torch's import."""
    flag("processes", processes)
    # while nothing has imported torch (seconds), the driver's view where it is the one PyTorch will have
    early = None if "torch" in sys.modules else driver_gpu_readouts(processes)
    gpus = early if early is not None else gpu_readouts(processes)
    mps = None if gpus or early is not None else _mps_readout()
    backend = "cuda" if gpus else ("mps" if mps is not None else "cpu")
    return MemorySnapshot(backend=backend, gpus=gpus, ram=ram_readout(), disks=disk_readouts(disks), mps=mps)


# ----------------------------------------------------------------------------- before torch is imported


def torch_build() -> dict[str, str | None]:
    """torch's build, ``{"cuda": "12.4", "hip": None}`` (both None: a CPU build), without importing torch where
    nothing has yet (seconds): its ``version.py`` read as text. ``{}`` without torch; imported where the file
    is not as expected."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            spec = importlib.util.find_spec("torch")
            if spec is None:
                return {}
            tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
            values = {
                node.target.id: ast.literal_eval(node.value)
                for node in tree.body
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
            }
            if {"cuda", "hip"} <= set(values):
                return {"cuda": values["cuda"], "hip": values["hip"]}
        except Exception:  # noqa: BLE001 - a torch laid out otherwise: ask it below
            pass
        import torch
    return {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}


def driver_gpu_readouts(processes: bool = True) -> list[GPUReadout] | None:
    """The GPUs PyTorch will number 0, 1, ..., read from NVML before torch is imported (so this process holds
    nothing on them: allocated and reserved 0, no CUDA context yet); [] for a CPU build of torch. None where
    only torch can tell: macOS (MPS), ROCm, no NVML, MIG slices, a ``CUDA_VISIBLE_DEVICES`` NVML cannot follow,
    or different GPUs in CUDA's default fastest-first order."""
    build = torch_build()
    if sys.platform == "darwin" or build.get("hip"):
        return None
    if build.get("cuda") is None:
        return []  # a CPU build, or no torch: PyTorch sees no GPU
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = _visible_handles(
            pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        )
        return None if handles is None else [_driver_readout(pynvml, i, h, processes) for i, h in enumerate(handles)]
    except Exception:  # noqa: BLE001 - no NVML library, driver or permission: torch reads them
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _visible_handles(pynvml, handles: list) -> list | None:
    """NVML's devices in PyTorch's order under ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-`` UUIDs), or None."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    chosen = handles if env is None else []
    for item in [] if env is None else [x.strip() for x in env.split(",")]:
        if item.isdigit() and int(item) < len(handles):
            chosen.append(handles[int(item)])
            continue
        match = [h for h in handles if item.startswith("GPU-") and _text(pynvml.nvmlDeviceGetUUID(h)).startswith(item)]
        if len(match) != 1:
            return None  # MIG-..., -1, an index past the last: CUDA's own rules decide
        chosen += match
    if (
        len({_text(pynvml.nvmlDeviceGetName(h)) for h in chosen}) > 1
        and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
    ):
        return None  # CUDA numbers the fastest first, NVML by PCI bus
    for h in chosen:
        try:
            if pynvml.nvmlDeviceGetMigMode(h)[0]:
                return None
        except pynvml.NVMLError:  # a card without MIG
            pass
    return chosen


def _driver_readout(pynvml, index: int, handle, processes: bool) -> GPUReadout:
    """One GPU from NVML: its memory as CUDA reports it (the total less what the driver reserves)."""
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except Exception:  # noqa: BLE001 - a driver before the v2 call
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        procs = [GPUProcess(p.pid, p.usedGpuMemory, _process_name(p.pid))
                 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)] if processes else None  # fmt: skip
    except pynvml.NVMLError:
        procs = None
    total = mem.total - getattr(mem, "reserved", 0)
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    return GPUReadout(
        index, _text(pynvml.nvmlDeviceGetName(handle)), (major, minor), total, mem.free, 0, 0, 0, 0, procs
    )


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return ""
