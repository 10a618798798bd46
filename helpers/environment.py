"""Preflight: before loading anything, check the GPU, versions, RAM, disk and (with a model) the fit.

Every check returns pass / warn / fail / info with a one-line reason and the fix. Device facts
come from a :class:`~helpers.memory.MemorySnapshot`, which tests pass in to simulate a T4, a
busy GPU or a small-RAM machine without touching torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .checks import Check
from .devices import CUBLAS_WORKSPACE, CUDA_CONTEXT, DEFAULT_DEVICE, DEVICES, bitsandbytes_status
from .errors import OomkitError
from .estimator import EstimateError, estimate, fit, format_params
from .html import badge, table
from .loading import ram_for_loading
from .memory import MemorySnapshot
from .memory import snapshot as take_snapshot
from .session import in_colab
from .sources import checkpoint_size, hub_offline_reason, looks_like_path
from .units import GiB, format_bytes
from .vocab import FITS, QUANTIZED, STATUS_ORDER, TIGHT, VERDICT_STATUS, auto_load_order, verdict

__all__ = ["PreflightReport", "PreflightFailed", "preflight", "versions", "fit_checks"]

COLAB_GPU_FIX = "In Colab: Runtime > Change runtime type > T4 GPU, then re-run this notebook."
PACKAGES = ["torch", "transformers", "accelerate", "peft", "bitsandbytes"]
# Past this size a model needs a GPU: on Colab's 2 CPU cores a 1B model makes a token or two per
# second, and 4-bit loading (bitsandbytes) is what keeps a 7B inside Colab's 12.7 GB of RAM.
CPU_PARAMS_LIMIT = 1_000_000_000

# A fresh CUDA context plus cuBLAS workspace takes a few hundred MiB; more than this outside
# PyTorch means another process (often a previous kernel) holds the card.
FOREIGN_GPU_WARN = 1 * GiB


class PreflightFailed(OomkitError, RuntimeError):
    """A preflight check failed; the message lists each failure with its fix."""


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

    def raise_for_failures(self) -> None:
        """Stop here (a notebook's "Run all" too) when a check failed, with every failure and its fix."""
        failed = [c for c in self.checks if c.status == "fail"]
        if failed:
            raise PreflightFailed("preflight failed:\n" + "\n".join(str(c) for c in failed))

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


def _unreadable_model(model: Any, error: Exception) -> Check:
    """A model that cannot be found or read fails preflight: loading it would fail a minute later. A hub
    id that cannot be checked because this machine is offline only warns."""
    name = str(model)
    offline = None if Path(name).expanduser().exists() or looks_like_path(name) else hub_offline_reason()
    if offline:
        return Check("model", "warn", f"cannot check {name!r} while offline ({offline}): {error}",
                     "Go online once, or pass a local folder with config.json")  # fmt: skip
    return Check("model", "fail", f"{name!r} cannot be read: {error}",
                 "Check the spelling of the path or hub id (org/name, case-sensitive); a local folder must hold "
                 "config.json")  # fmt: skip


def fit_checks(model: Any, *, load: str = "auto", max_new_tokens: int = 256, snapshot=None) -> list:
    """The "fit" check of :func:`preflight`: does ``model`` fit this GPU (or a T4)?"""
    gpu = snapshot.gpu if snapshot is not None and getattr(snapshot, "backend", None) == "cuda" else None
    if gpu is not None:
        # What this process can still use: free memory plus what it already holds.
        capacity = gpu.free + gpu.allocated
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            capacity += CUDA_CONTEXT + CUBLAS_WORKSPACE  # already paid: free memory excludes it
        device = {"capacity": capacity}
        where = f"{gpu.name} ({format_bytes(capacity)} usable)"
        dev_arg: Any = capacity
        bf16 = bool(gpu.supports_bf16)
    else:
        device = DEVICES[DEFAULT_DEVICE]
        where = f"a T4 ({format_bytes(device['capacity'])}; no GPU here, so checked against Colab's)"
        dev_arg = DEFAULT_DEVICE
        bf16 = False
    half = "bf16" if bf16 else "fp16"
    loads = list(auto_load_order(bf16)) if load == "auto" else [load]
    try:
        ests = [estimate(model, load=m, max_new_tokens=max_new_tokens, device=dev_arg,
                         compute_dtype=half if m in QUANTIZED else "auto") for m in loads]  # fmt: skip
    except EstimateError as e:
        return [_unreadable_model(model, e)]
    cap = device["capacity"]
    chosen = next((e for e in ests if verdict(e.total, cap) == FITS), None)
    chosen = chosen or next((e for e in ests if verdict(e.total, cap) == TIGHT), None) or ests[-1]
    v = fit(chosen, dev_arg)
    data = {"load": chosen.load, "total": chosen.total, "weights": chosen.weights, "params": chosen.params,
            "capacity": cap, "verdict": v.verdict, "headroom": v.headroom,
            "all": {e.load: e.total for e in ests}}  # fmt: skip
    summary = (
        f"{chosen.model} ({format_params(chosen.params)} params) with load={chosen.load} and "
        f"max_new_tokens={max_new_tokens}: {format_bytes(chosen.total)} predicted "
        f"(weights {format_bytes(chosen.weights)}) on {where}: {v.verdict}"
    )
    if load == "auto" and len(ests) > 1:
        summary += " [" + ", ".join(f"{e.load} {format_bytes(e.total)}" for e in ests) + "]"
    status = VERDICT_STATUS[v.verdict]
    fix = None
    if v.suggestions:
        fix = f"{v.suggestions[0]}"
    elif load == "auto" and chosen.load != loads[0]:
        fix = f"load with {chosen.load} ({loads[0]} needs {format_bytes(ests[0].total)})"
    checks = [Check("fit", status, summary, fix, data)]
    if gpu is None and (snapshot is None or snapshot.backend == "cpu") and chosen.params >= CPU_PARAMS_LIMIT:
        checks.append(
            Check("GPU needed", "fail", f"{chosen.model} has {format_params(chosen.params)} parameters and this "
                  "runtime has no GPU: loading would take RAM the kernel may not survive, and each generated "
                  "token would take seconds", COLAB_GPU_FIX, {"params": chosen.params})
        )  # fmt: skip
    return checks


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
        checks.append(ram_for_loading(snap, total, largest, source))
    else:
        checks.append(
            Check("RAM", "info", f"{format_bytes(snap.ram.available)} available of {format_bytes(snap.ram.total)}")
        )
    disk = _check_disk(snap, model, total)
    if disk is not None:
        checks.append(disk)
    if model is not None:
        checks += fit_checks(model, load=load, max_new_tokens=max_new_tokens, snapshot=snap)
    return PreflightReport(checks=checks, snapshot=snap, versions=vers, model=model, colab=colab)
