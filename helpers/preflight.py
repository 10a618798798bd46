"""Preflight: before loading anything, check the GPU, versions, RAM, disk and (with a model) the fit.

Every check returns pass / warn / fail / info with a one-line reason and the fix. Device facts
come from a :class:`~helpers.memory.MemorySnapshot`, which tests pass in to simulate a T4, a
busy GPU or a small-RAM machine without touching torch.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .html import badge, table
from .memory import MemorySnapshot, in_colab
from .memory import snapshot as take_snapshot
from .units import GiB, format_bytes

__all__ = ["Check", "PreflightReport", "preflight", "checkpoint_size", "versions", "bitsandbytes_status"]

COLAB_GPU_FIX = "In Colab: Runtime > Change runtime type > T4 GPU, then re-run this notebook."
PACKAGES = ["torch", "transformers", "accelerate", "peft", "bitsandbytes"]
STATUS_ORDER = {"pass": 0, "info": 0, "warn": 1, "fail": 2}

# A fresh CUDA context plus cuBLAS workspace takes a few hundred MiB; more than this outside
# PyTorch means another process (often a previous kernel) holds the card.
FOREIGN_GPU_WARN = 1 * GiB
T4_USABLE = 14 * GiB  # a T4 reports 14.74 GiB; the seeds' "warn under 12 GB free" rule sits below it


@dataclass
class Check:
    """One preflight verdict."""

    name: str
    status: str  # pass | warn | fail | info
    summary: str
    fix: str | None = None
    data: dict = field(default_factory=dict)

    def __str__(self) -> str:
        mark = {"pass": "ok  ", "info": "info", "warn": "WARN", "fail": "FAIL"}[self.status]
        fix = f"\n        fix: {self.fix}" if self.fix else ""
        return f"[{mark}] {self.name}: {self.summary}{fix}"


@dataclass
class PreflightReport:
    """All checks, the readout they were based on, and the package versions."""

    checks: list[Check]
    snapshot: MemorySnapshot
    versions: dict[str, str | None]
    model: str | None = None
    colab: bool = False

    @property
    def status(self) -> str:
        """The worst status of any check."""
        worst = max((c for c in self.checks), key=lambda c: STATUS_ORDER[c.status], default=None)
        return "pass" if worst is None or STATUS_ORDER[worst.status] == 0 else worst.status

    @property
    def ok(self) -> bool:
        """False when any check failed (warnings still allow loading)."""
        return self.status != "fail"

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; checks: {[c.name for c in self.checks]}")

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "model": self.model,
            "colab": self.colab,
            "checks": [asdict(c) for c in self.checks],
            "versions": self.versions,
            "snapshot": self.snapshot.to_dict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def __str__(self) -> str:
        head = f"oomkit preflight: {self.status.upper()}" + (f" for {self.model}" if self.model else "")
        return "\n".join([head, *map(str, self.checks)])

    def _repr_html_(self) -> str:
        rows = [[badge(c.status), c.name, c.summary, c.fix or ""] for c in self.checks]
        title = "oomkit preflight" + (f" for {self.model}" if self.model else "")
        return table(["", "check", "result", "fix"], rows, title=title) + self.snapshot._repr_html_()


def versions() -> dict[str, str | None]:
    """Installed versions of the packages oomkit relies on (``None`` when missing), plus CUDA."""
    out: dict[str, str | None] = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch.version.cuda
    out["python"] = sys.version.split()[0]
    return out


def bitsandbytes_status(device: str) -> tuple[bool, str]:
    """Whether bitsandbytes can really quantize on ``device``: a 4-bit round trip, not just an import."""
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


def checkpoint_size(model: str) -> tuple[int | None, int | None, str]:
    """``(total_bytes, largest_file_bytes, source)`` of a checkpoint's weight files.

    Local directories are measured on disk; hub ids ask the hub for file sizes (no download).
    Returns ``(None, None, reason)`` when it cannot be known (offline, private model).
    """
    path = Path(model).expanduser()
    if path.exists():
        files = [f for pat in ("*.safetensors", "*.bin") for f in path.glob(pat)] if path.is_dir() else [path]
        if not files:
            return None, None, f"no *.safetensors or *.bin files in {path}"
        sizes = [f.stat().st_size for f in files if f.suffix == ".safetensors"] or [f.stat().st_size for f in files]
        return sum(sizes), max(sizes), "local files"
    from .loading import _looks_like_path

    if _looks_like_path(model):  # asking the hub would only say it is not a valid repo id
        return None, None, f"{model} does not exist; check the path (on Colab: is Drive mounted?)"
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(model, files_metadata=True, timeout=10)
        weights = [s for s in info.siblings or [] if s.rfilename.endswith(".safetensors")]
        weights = weights or [s for s in info.siblings or [] if s.rfilename.endswith(".bin")]
        sizes = [s.size for s in weights if s.size]
        if not sizes:
            return None, None, "the hub lists no weight files for this model"
        return sum(sizes), max(sizes), "hub file list"
    except Exception as e:
        return None, None, f"could not ask the hub ({type(e).__name__}); pass a local path to measure it"


def _check_gpu(snap: MemorySnapshot, colab: bool) -> list[Check]:
    if snap.backend == "mps":
        return [
            Check(
                "GPU",
                "info",
                "Apple MPS backend: bitsandbytes 8-bit/4-bit may not run here",
                "Use fp16 loading, or a CUDA machine for quantized models",
            )
        ]
    g = snap.gpu
    if g is None:
        fix = (
            COLAB_GPU_FIX
            if colab
            else (
                "No CUDA device: everything runs on the CPU (minutes, not seconds). "
                "On Colab: Runtime > Change runtime type > T4 GPU."
            )
        )
        return [Check("GPU", "warn", "no GPU: PyTorch sees no CUDA device", fix)]
    checks = [
        Check(
            "GPU",
            "pass",
            f"{g.name}, compute capability {g.capability[0]}.{g.capability[1]}, {format_bytes(g.total)}",
            data={"index": g.index},
        )
    ]
    if g.supports_bf16:
        checks.append(Check("bf16", "pass", "bf16 supported: use bf16 as compute dtype"))
    else:
        checks.append(
            Check(
                "bf16",
                "info",
                f"sm_{g.capability[0]}{g.capability[1]} has no bf16: compute dtype "
                "must be fp16 (oomkit's 'auto' picks it)",
                "Do not pass bf16=True or torch_dtype=bfloat16 on this GPU",
            )
        )
    return checks


def _check_gpu_memory(snap: MemorySnapshot) -> list[Check]:
    g = snap.gpu
    if g is None:
        return []
    checks = []
    foreign = g.non_pytorch
    others = [p for p in (g.processes or []) if p.pid != _pid()]
    if foreign > FOREIGN_GPU_WARN:
        who = ", ".join(f"PID {p.pid} {p.name} {format_bytes(p.used)}" for p in others) or "unknown processes"
        checks.append(
            Check(
                "GPU memory held elsewhere",
                "warn",
                f"{format_bytes(foreign)} in use outside this process's PyTorch ({who})",
                "A previous kernel or another process holds the GPU: Runtime > Restart session, "
                "or kill the process named above",
                data={"bytes": foreign},
            )
        )
    status = "pass"
    fix = None
    if g.free < min(12 * GiB, int(g.total * 0.8)):
        status = "warn"
        fix = "Free memory first: helpers.cleanup() or unload(model); restart the runtime if it does not come back"
    checks.append(
        Check(
            "free GPU memory",
            status,
            f"{format_bytes(g.free)} free of {format_bytes(g.total)} "
            f"({format_bytes(g.allocated)} allocated by this process)",
            fix,
            data={"free": g.free},
        )
    )
    return checks


def _check_versions(vers: dict[str, str | None]) -> Check:
    missing = [p for p in PACKAGES if vers.get(p) is None]
    listing = ", ".join(f"{p} {vers.get(p) or 'missing'}" for p in PACKAGES) + f", CUDA {vers.get('cuda') or 'none'}"
    if missing:
        return Check(
            "versions",
            "fail" if "torch" in missing or "transformers" in missing else "warn",
            listing,
            f"pip install {' '.join(missing)}",
        )
    return Check("versions", "pass", listing)


def _check_bnb(snap: MemorySnapshot, status: tuple[bool, str] | None) -> Check:
    device = "cuda" if snap.backend == "cuda" else "cpu"
    ok, why = status if status is not None else bitsandbytes_status(device)
    if ok:
        return Check("bitsandbytes", "pass", why)
    return Check(
        "bitsandbytes",
        "warn",
        why + ": 8-bit and 4-bit loading will not work",
        "pip install -U bitsandbytes (then restart the runtime)",
    )


def _check_ram(snap: MemorySnapshot, total: int | None, largest: int | None, source: str) -> Check:
    avail = snap.ram.available
    if total is None:
        return Check(
            "RAM for loading", "info", f"{format_bytes(avail)} RAM available; checkpoint size unknown: {source}"
        )
    # Loading streams one shard at a time through RAM (low_cpu_mem_usage); a shard larger than
    # free RAM is what kills a Colab kernel without a message.
    need = int(largest * 1.2)
    data = {"available": avail, "checkpoint": total, "largest_shard": largest}
    if avail < need:
        return Check(
            "RAM for loading",
            "fail",
            f"{format_bytes(avail)} RAM available, the largest weight file is "
            f"{format_bytes(largest)}: the kernel would die while loading",
            "Use a checkpoint with smaller shards (e.g. a -sharded variant), free RAM (helpers.cleanup()), "
            "or a High-RAM runtime",
            data,
        )
    if avail < total:
        return Check(
            "RAM for loading",
            "warn",
            f"{format_bytes(avail)} RAM available, checkpoint is "
            f"{format_bytes(total)}: fine for GPU loading, but offloading layers to CPU will not fit",
            "Keep device_map on the GPU; quantize instead of offloading",
            data,
        )
    return Check(
        "RAM for loading",
        "pass",
        f"{format_bytes(avail)} RAM available for a {format_bytes(total)} checkpoint ({source})",
        data=data,
    )


def _check_disk(snap: MemorySnapshot, model: str | None, total: int | None) -> Check | None:
    cache = next((d for d in snap.disks if d.label == "HF cache"), None)
    if cache is None:
        return None
    local = model is not None and Path(model).expanduser().exists()
    if model is None or local or total is None:
        return Check("disk", "info", f"{format_bytes(cache.free)} free in the Hugging Face cache ({cache.path})")
    if cache.free < total * 1.1:
        return Check(
            "disk",
            "fail",
            f"{format_bytes(cache.free)} free in {cache.path}, the download is {format_bytes(total)}",
            "Delete old models (huggingface-cli delete-cache) or set HF_HOME to a larger disk",
            {"free": cache.free, "download": total},
        )
    return Check("disk", "pass", f"{format_bytes(cache.free)} free for a {format_bytes(total)} download")


def _fit_checks(model: str, load: str, max_new_tokens: int, snap: MemorySnapshot) -> list[Check]:
    """Will the named model fit, and with which load mode (needs :mod:`helpers.estimate`)."""
    try:
        from .estimate import preflight_checks
    except ImportError:
        return []
    return preflight_checks(model, load=load, max_new_tokens=max_new_tokens, snapshot=snap)


def _pid() -> int:
    import os

    return os.getpid()


def preflight(
    model: str | None = None,
    load: str = "auto",
    max_new_tokens: int = 256,
    *,
    snapshot: MemorySnapshot | None = None,
    package_versions: dict[str, str | None] | None = None,
    bnb: tuple[bool, str] | None = None,
    colab: bool | None = None,
    checkpoint: tuple[int | None, int | None, str] | None = None,
) -> PreflightReport:
    """Check this machine before loading ``model`` (a hub id or a local path; optional).

    Keyword-only arguments replace what would be read from the machine, so any device can be
    simulated: ``snapshot`` (memory readout), ``package_versions``, ``bnb`` (``(usable, why)``),
    ``colab``, and ``checkpoint`` (``(total, largest_file, source)`` bytes).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    snap = snapshot if snapshot is not None else take_snapshot()
    vers = package_versions if package_versions is not None else versions()
    colab = in_colab() if colab is None else colab
    checks = _check_gpu(snap, colab)
    checks.append(_check_versions(vers))
    if vers.get("bitsandbytes") is not None or bnb is not None:
        checks.append(_check_bnb(snap, bnb))
    checks += _check_gpu_memory(snap)
    total = largest = None
    source = "no model named"
    if model is not None:
        total, largest, source = checkpoint if checkpoint is not None else checkpoint_size(model)
        checks.append(_check_ram(snap, total, largest, source))
    else:
        checks.append(
            Check("RAM", "info", f"{format_bytes(snap.ram.available)} available of {format_bytes(snap.ram.total)}")
        )
    disk = _check_disk(snap, model, total)
    if disk is not None:
        checks.append(disk)
    if model is not None:
        checks += _fit_checks(model, load, max_new_tokens, snap)
    return PreflightReport(checks=checks, snapshot=snap, versions=vers, model=model, colab=colab)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m helpers preflight", description="Check GPU, RAM, disk and versions before loading a model."
    )
    parser.add_argument("--model", help="hub id or local path of the model you plan to load")
    parser.add_argument("--load", default="auto", help="load mode: auto, fp16, bf16, fp32, int8, nf4, fp4")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        parser.error("--max-new-tokens must be >= 0")
    from .estimate import LOAD_MODES

    if args.load not in ("auto", *LOAD_MODES):
        parser.error(f"--load {args.load!r}: use auto, {', '.join(LOAD_MODES)}")
    report = preflight(args.model, load=args.load, max_new_tokens=args.max_new_tokens)
    print(report.to_json() if args.json else report)
    return 0
