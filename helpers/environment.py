"""Preflight: before loading anything, check the GPU, versions, RAM, disk and (with a model) the fit.

Every check returns pass / warn / fail / info with a one-line reason and the fix. Device facts
come from a :class:`~helpers.MemorySnapshot`, which tests pass in to simulate a T4, a
busy GPU, Kaggle's two T4s or a small-RAM machine without touching torch. With several GPUs each
one is checked, and a model that does not fit GPU 0 is planned across all of them as
``from_pretrained(device_map="auto")`` splits it (:func:`helpers.plan_devices`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core.arguments import ArgumentError, flag, whole_number
from .core.checks import Check, checks_table
from .core.devices import CUBLAS_WORKSPACE, CUDA_CONTEXT, DEFAULT_DEVICE, DEVICES, bitsandbytes_status
from .core.errors import OomkitError
from .core.html import Markup
from .core.memory import GPUReadout, MemorySnapshot, torch_build
from .core.memory import snapshot as take_snapshot
from .core.session import in_colab, ipython
from .core.sources import checkpoint_size, closest_shipped, hub_offline_reason, looks_like_path, shipped_config
from .core.units import GiB, MiB, format_bytes
from .core.vocab import (
    BF16,
    DEFAULTS,
    DOES_NOT_FIT,
    FITS,
    QUANTIZED,
    STATUS_ORDER,
    TIGHT,
    VERDICT_STATUS,
    auto_load_order,
    half_dtype,
    load_mode_name,
    verdict,
)
from .loading.checks import ram_for_loading, weight_file_check

if TYPE_CHECKING:  # the estimator and placement import torch: the fit check imports them, after the first lines
    from .estimator.core import MemoryEstimate
    from .placement.decision import PlacementDecision
    from .placement.device_plan import DevicePlan

__all__ = ["PreflightReport", "PreflightFailed", "preflight", "versions", "fit_checks"]

COLAB_GPU_FIX = "In Colab: Runtime > Change runtime type > T4 GPU, then re-run this notebook."
PACKAGES = ["torch", "transformers", "accelerate", "peft", "bitsandbytes"]
# Past this size a model needs a GPU: on Colab's 2 CPU cores a 1B model makes a token or two per
# second, and 4-bit loading (bitsandbytes) is what keeps a 7B inside Colab's 12.7 GB of RAM.
CPU_PARAMS_LIMIT = 1_000_000_000

# A fresh CUDA context plus cuBLAS workspace takes a few hundred MiB; more than this outside
# PyTorch means another process (often a previous kernel) holds the card.
FOREIGN_GPU_WARN = 1 * GiB
# held by other processes (or PyTorch's cache) past this, the fit line says how the card's own verdict differs
# (more than a CUDA context, which a simulated readout shows as used before CUDA starts)
HELD_NOTE = 512 * MiB


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
    # the notebook cell whose live output already shows this report (preflight(show=True)); None: not shown
    shown_in_cell: int | None = field(default=None, repr=False, compare=False)

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

    def __repr__(self) -> str:  # the text a notebook keeps beside the HTML (papermill, a terminal): the report
        return str(self)

    def _ipython_display_(self) -> None:
        """Shown as usual, except as the last line of the cell whose live output already is this report
        (``preflight(MODEL, show=True)`` alone in a cell would show it twice)."""
        shell = ipython()
        if shell is not None and self.shown_in_cell is not None and self.shown_in_cell == shell.execution_count:
            return
        from IPython.display import display

        display({"text/plain": str(self), "text/html": self._repr_html_()}, raw=True)

    def _repr_html_(self) -> str:
        return self._table_html() + self.snapshot._repr_html_()

    def _table_html(self, running: bool = False) -> str:
        """The checks (:func:`~helpers.core.checks.checks_table`: each fix under its result, so nothing scrolls
        sideways in Colab's column); ``running`` adds a last row saying the rest is on its way."""
        title = "oomkit preflight" + (f" for {self.model}" if self.model else "")
        pending = [[Markup(""), Markup("<i>…</i>"), Markup("<i>checking the rest…</i>")]] if running else []
        return checks_table(self.checks, title, rows_after=pending)


class _Live:
    """Shows a preflight's checks as they finish: in a notebook kernel one output that grows row by row and
    ends as the report's own HTML; anywhere else a line per check on stdout, then the verdict."""

    def __init__(self, report: PreflightReport):
        self.report = report
        shell = ipython()
        self.handle = None
        if shell is not None and getattr(shell, "kernel", None) is not None:
            from IPython.display import HTML, display

            self.html = HTML
            self.handle = display(HTML(report._table_html(running=True)), display_id=True)
        else:
            print("oomkit preflight" + (f" for {report.model}" if report.model else "") + ": checking", flush=True)

    def add(self, check: Check) -> None:
        if self.handle is not None:
            self.handle.update(self.html(self.report._table_html(running=True)))
        else:
            print(check, flush=True)

    def close(self) -> None:
        if self.handle is not None:
            # raw: the report's own _ipython_display_ would make a new output instead of updating this one
            self.handle.update({"text/plain": str(self.report), "text/html": self.report._repr_html_()}, raw=True)
            self.report.shown_in_cell = getattr(ipython(), "execution_count", None)
        else:
            print(str(self.report).splitlines()[0], flush=True)


def versions() -> dict[str, str | None]:
    """Installed versions of the packages oomkit relies on (``None`` when missing), plus CUDA."""
    out: dict[str, str | None] = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch_build().get("cuda")
    out["python"] = sys.version.split()[0]
    return out


def _check_gpu(snap: MemorySnapshot, colab: bool) -> list[Check]:
    """The GPU(s) this process sees, and whether they compute in bf16."""
    if snap.backend == "mps":
        return [
            Check(
                "GPU",
                "info",
                "Apple MPS backend: bitsandbytes 8-bit/4-bit may not run here",
                "Use fp16 loading, or a CUDA machine for quantized models",
            )
        ]
    gpus = snap.gpus
    if not gpus:
        fix = (
            COLAB_GPU_FIX
            if colab
            else (
                "No CUDA device: everything runs on the CPU (minutes, not seconds). "
                "On Colab: Runtime > Change runtime type > T4 GPU."
            )
        )
        return [Check("GPU", "warn", "no GPU: PyTorch sees no CUDA device", fix)]
    g = gpus[0]
    if len(gpus) == 1:
        named = Check("GPU", "pass", f"{g.name}, compute capability {_capability(g)}, {format_bytes(g.total)}",
                      data={"index": g.index})  # fmt: skip
    else:
        # "index" stays the first GPU (where a model that fits one card goes); "indices" lists them all
        named = Check("GPU", "pass", _gpu_names(gpus),
                      data={"index": g.index, "indices": [x.index for x in gpus], "names": [x.name for x in gpus]})  # fmt: skip
    return [named, _check_bf16(gpus)]


def _capability(g: GPUReadout) -> str:
    return f"{g.capability[0]}.{g.capability[1]}"


def _gpu_names(gpus: list[GPUReadout]) -> str:
    """``2 GPUs: Tesla T4 ×2, 14.74 GiB each, compute capability 7.5``, or each GPU named when they differ."""
    kinds = {(g.name, g.total, tuple(g.capability)) for g in gpus}
    if len(kinds) == 1:
        g = gpus[0]
        return f"{len(gpus)} GPUs: {g.name} ×{len(gpus)}, {format_bytes(g.total)} each, compute capability {_capability(g)}"
    each = [f"GPU {g.index} {g.name} ({format_bytes(g.total)}, compute capability {_capability(g)})" for g in gpus]
    return f"{len(gpus)} GPUs: " + ", ".join(each)


def _check_bf16(gpus: list[GPUReadout]) -> Check:
    """bf16 passes only when every GPU computes in it: a model split across them runs on each."""
    without = [g for g in gpus if not g.supports_bf16]
    if not without:
        return Check("bf16", "pass", "bf16 supported: use bf16 as compute dtype")
    if len(without) == len(gpus) and len({tuple(g.capability) for g in gpus}) == 1:
        g = gpus[0]
        return Check(
            "bf16",
            "info",
            f"sm_{g.capability[0]}{g.capability[1]} has no bf16: compute dtype must be fp16 (oomkit's 'auto' picks it)",
            "Do not pass bf16=True or torch_dtype=bfloat16 on this GPU" if len(gpus) == 1 else
            "Do not pass bf16=True or torch_dtype=bfloat16 on these GPUs",
        )  # fmt: skip
    lacking = ", ".join(f"GPU {g.index} (sm_{g.capability[0]}{g.capability[1]})" for g in without)
    return Check(
        "bf16",
        "info",
        f"{lacking} {'has' if len(without) == 1 else 'have'} no bf16: a model split across these GPUs computes "
        "in fp16 (oomkit's 'auto' picks it)",
        "Do not pass bf16=True or torch_dtype=bfloat16 for a model on these GPUs",
    )


def _check_gpu_memory(snap: MemorySnapshot) -> list[Check]:
    """Free memory and memory held outside this process's PyTorch, per GPU (each check names its GPU when
    there are several)."""
    checks = []
    for g in snap.gpus:
        checks += _gpu_memory_checks(g, len(snap.gpus) > 1)
    return checks


def _gpu_memory_checks(g: GPUReadout, several: bool) -> list[Check]:
    """The two memory checks of one GPU; with several, each name starts with the GPU's index, so a warning
    says which card to free."""
    held_name = f"GPU {g.index} memory held elsewhere" if several else "GPU memory held elsewhere"
    free_name = f"GPU {g.index} free memory" if several else "free GPU memory"
    index = {"index": g.index} if several else {}
    checks = []
    foreign = g.non_pytorch
    others = [p for p in (g.processes or []) if p.pid != _pid()]
    if foreign > FOREIGN_GPU_WARN:
        who = ", ".join(f"PID {p.pid} {p.name} {format_bytes(p.used)}" for p in others) or "unknown processes"
        holder = f"GPU {g.index}" if several else "the GPU"
        checks.append(
            Check(
                held_name,
                "warn",
                f"{format_bytes(foreign)} in use outside this process's PyTorch ({who})",
                f"A previous kernel or another process holds {holder}: Runtime > Restart session, "
                "or kill the process named above",
                data={"bytes": foreign, **index},
            )
        )
    status = "pass"
    fix = None
    if g.free < min(12 * GiB, int(g.total * 0.8)):
        status = "warn"
        fix = "Free memory first: helpers.cleanup() or unload(model); restart the runtime if it does not come back"
    checks.append(
        Check(
            free_name,
            status,
            f"{format_bytes(g.free)} free of {format_bytes(g.total)} "
            f"({format_bytes(g.allocated)} allocated by this process)",
            fix,
            data={"free": g.free, **index},
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
    typo = closest_shipped(name) if offline and shipped_config(name) is None else None
    if typo is not None:
        return Check("model", "fail", f"{name!r} is not a model oomkit knows offline ({offline}); did you mean "
                     f"{typo!r}?", f"pass {typo!r}, or go online once if {name!r} is right")  # fmt: skip
    if offline:
        return Check("model", "warn", f"cannot check {name!r} while offline ({offline}): {error}",
                     "Go online once, or pass a local folder with config.json")  # fmt: skip
    return Check("model", "fail", f"{name!r} cannot be read: {error}",
                 "Check the spelling of the path or hub id (org/name, case-sensitive); a local folder must hold "
                 "config.json")  # fmt: skip


def _usable_memory(gpu: GPUReadout) -> int:
    """Bytes of ``gpu`` this process can still use: free memory plus what it already holds, plus the CUDA
    context once this device has one (free memory excludes a context already paid; the estimate counts one)."""
    usable = gpu.free + gpu.allocated
    if _context_paid():
        usable += CUDA_CONTEXT + CUBLAS_WORKSPACE
    return usable


def _context_paid() -> bool:
    # reading a device's free memory (snapshot() does, for every GPU) starts its context, so once CUDA
    # is initialized every card's context is paid, as load() counts it; before torch is imported none is
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass
class _Option:
    """One way to run the model: a load mode on GPU 0 alone, or split across every GPU."""

    est: MemoryEstimate
    verdict: str
    split: bool = False
    plan: DevicePlan | None = None  # a split's placement; None when the weights alone exceed every GPU
    error: str = ""  # why a split could not be planned
    spill: bool = False  # the estimate fits GPU 0, but transformers' placement there leaves weights for the CPU
    fix: str = ""  # the decision's fix, where it refused


def _compute(load: str, half: str) -> str:
    """The compute dtype preflight estimates ``load`` with: the GPUs' half precision for bitsandbytes."""
    return half if load in QUANTIZED else "auto"


@dataclass
class _Host:
    """What preflight decides placements on beside the GPUs' usable memory: their half dtype, RAM to offload to."""

    half: str
    ram: int = 0


def _decide(est: MemoryEstimate, caps: list[int], host: _Host, gpus: int | None = None) -> PlacementDecision:
    """:func:`decide_placement` of ``est`` on GPUs of ``caps`` usable bytes (a full GPU still counts as one:
    1 MiB, the smallest size a device takes, so the shares keep their GPU's index)."""
    from .placement.decision import auto_placing, decide_placement, devices_snapshot

    devices = [{"name": f"GPU {i}", "capacity": max(c, MiB), "bf16": host.half == BF16} for i, c in enumerate(caps)]
    return decide_placement(auto_placing(gpus=gpus), est, devices_snapshot(est, devices, host.ram))


def _split_option(decided: PlacementDecision) -> _Option:
    """The decision's split across the GPUs as an option (why none could be planned, or the placement)."""
    est = decided.estimate
    if decided.plan is None:
        return _Option(est, DOES_NOT_FIT, split=True, error=decided.unplanned, fix=decided.fix)
    return _Option(est, decided.verdict, True, decided.plan, fix=decided.fix)


def _options(ests: list[MemoryEstimate], caps: list[int], host: _Host):
    """Ways to run the model, in the order load="auto" prefers them: each load mode on GPU 0 alone, then (where
    the decision does not keep it on GPU 0) split across all the GPUs. A generator: a load mode is decided only
    when the options before it did not fit."""
    for e in ests:
        decided = _decide(e, caps, host)
        alone = _Option(e, decided.first_verdict, spill=decided.spill > 0, fix=decided.fix)
        if alone.spill:
            alone.verdict = DOES_NOT_FIT  # transformers' placement on GPU 0 alone would spill to the CPU
        yield alone
        if decided.gpus > 1:
            yield _split_option(decided)


def _choose(options) -> tuple[_Option, list[_Option]]:
    """The first option that fits, else the first tight one, else the last planned (the roomiest);
    with every option looked at."""
    seen: list[_Option] = []
    for option in options:
        seen.append(option)
        if option.verdict == FITS:
            return option, seen
    planned = [o for o in seen if not o.error]
    return next((o for o in planned if o.verdict == TIGHT), planned[-1]), seen


def _prequantized(model: Any) -> bool:
    from .estimator.configs import resolve_config
    from .estimator.prequantized import repo_quantization
    from .estimator.rows import EstimateError

    try:
        return repo_quantization(resolve_config(model)[0]) is not None
    except EstimateError:
        return False  # estimate() says what is wrong with it, below


def fit_checks(model: Any, *, load: str = "auto", max_new_tokens: int = DEFAULTS.max_new_tokens, snapshot=None, batch_size: int = DEFAULTS.batch_size,
               prompt_tokens: int = DEFAULTS.prompt_tokens) -> list[Check]:  # fmt: skip
    """The "fit" check of :func:`preflight`: does ``model`` fit this GPU, split across this machine's GPUs
    (as ``device_map="auto"`` splits it), or (without a GPU) a T4? Generating ``batch_size`` sequences of
    ``prompt_tokens`` + ``max_new_tokens`` tokens (a :class:`helpers.LoadPlan`'s budget, which sizes the KV cache)."""
    # imported here, not at the top: they import torch and transformers, which the checks before this need not wait for
    from .estimator.core import estimate
    from .estimator.fitting import format_params
    from .estimator.rows import EstimateError
    from .placement.gpu_room import offload_ram
    from .placement.split_checks import held_hint

    budget = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "prompt_tokens": prompt_tokens}
    gpus = list(snapshot.gpus) if snapshot is not None and getattr(snapshot, "backend", None) == "cuda" else []
    # What this process can use on each GPU; without one, Colab's T4
    caps = [_usable_memory(g) for g in gpus] or [DEVICES[DEFAULT_DEVICE]["capacity"]]
    bf16 = bool(gpus) and all(g.supports_bf16 for g in gpus)
    half = half_dtype(bf16)
    loads = list(auto_load_order(bf16)) if load == "auto" else [load]
    if load == "auto" and _prequantized(model):
        loads = ["auto"]  # it loads as saved (GPTQ, AWQ, mxfp4 or fp8 kept or dequantized): no mode to choose
    dev_arg: Any = caps[0] if gpus else DEFAULT_DEVICE
    host = _Host(half, offload_ram(snapshot) if snapshot is not None and gpus else 0)
    try:
        ests = [estimate(model, load=m, **budget, device=dev_arg, compute_dtype=_compute(m, half)) for m in loads]
        chosen, seen = _choose(_options(ests, caps, host))
    except EstimateError as e:
        return [_unreadable_model(model, e)]
    if chosen.split:
        checks = _split_check(chosen, ests, gpus, caps, load, budget, host)
    else:
        checks = [_one_gpu_check(chosen.est, ests, gpus, caps, load, budget, seen, chosen.fix if chosen.spill else "")]
    if any(held_hint(g) for g in gpus) and chosen.verdict != DOES_NOT_FIT:
        checks[0] = _held_check(checks[0], _load_now(chosen, gpus, caps, host), gpus)
    if checks[0].status == "fail" and (not gpus or (len(gpus) == 1 and "T4" in gpus[0].name)):
        checks[0] = _two_t4_hint(checks[0], ests)
    params = chosen.est.params
    if not gpus and (snapshot is None or snapshot.backend == "cpu") and params >= CPU_PARAMS_LIMIT:
        checks.append(
            Check("GPU needed", "fail", f"{chosen.est.model} has {format_params(params)} parameters and this "
                  "runtime has no GPU: loading would take RAM the kernel may not survive, and each generated "
                  "token would take seconds", COLAB_GPU_FIX, {"params": params})
        )  # fmt: skip
    return checks


def _two_t4_hint(check: Check, ests: list[MemoryEstimate]) -> Check:
    """A plan that does not fit one T4 (Colab's): where Kaggle's free 2×T4 holds it split, the fix says so,
    in the first load mode that fits there (a split keeps fp16 where one card needs a quantized load)."""
    t4 = DEVICES["t4"]["capacity"]
    for e in ests:
        if _split_option(_decide(e, [t4, t4], _Host("fp16"), gpus=2)).verdict != DOES_NOT_FIT:
            hint = (f"Kaggle's free 2×T4 holds it with load={e.load!r}, split across both cards: "
                    f"load(LoadPlan(model, load={e.load!r}, gpus=2)) (notebook 05)")  # fmt: skip
            fix = f"{check.fix}; or {hint}" if check.fix else hint
            return Check(check.name, check.status, check.summary, fix, {**(check.data or {}), "kaggle_2xt4": e.load})
    return check


def _one_gpu_check(est: MemoryEstimate, ests: list[MemoryEstimate], gpus: list[GPUReadout], caps: list[int],
                   load: str, budget: dict, seen: list[_Option], spill: str = "") -> Check:  # fmt: skip
    """The fit check for ``est`` on GPU 0 alone, or on a T4 without a GPU; ``spill`` is the decision's fix where
    transformers' placement on the card would offload part of it."""
    from .estimator.fitting import fit_one_card, format_params
    from .placement.decision import spill_why

    cap = caps[0]
    if not gpus:
        where = f"a T4 ({format_bytes(cap)}; no GPU here, so checked against Colab's)"
    else:
        where = ("GPU 0 " if len(gpus) > 1 else "") + f"{gpus[0].name} ({format_bytes(cap)} usable)"
    v = fit_one_card(est, cap if gpus else DEFAULT_DEVICE)
    data = {"load": est.load, "total": est.total, "weights": est.weights, "params": est.params,
            "capacity": cap, "verdict": v.verdict, "headroom": v.headroom,
            "all": {e.load: e.total for e in ests}}  # fmt: skip
    card, card_data = _card_note(est, gpus[0], cap, v.verdict) if gpus else ("", {})
    data.update(card_data)
    summary = (
        f"{est.model} ({format_params(est.params)} params) with {_budget_text(est.load, budget)}: "
        f"{format_bytes(est.total)} predicted (weights {format_bytes(est.weights)}) on {where}: {v.verdict}{card}"
    )
    if len(gpus) > 1 and v.verdict == FITS:
        rest = [f"GPU {g.index}" for g in gpus[1:]]
        summary += f" ({', '.join(rest)} {'stays' if len(rest) == 1 else 'stay'} free)"
    if load == "auto" and len(ests) > 1:
        summary += " [" + ", ".join(f"{e.load} {format_bytes(e.total)}" for e in ests) + "]"
    errors = [o.error for o in seen if o.error]
    if errors:
        summary += f" (a split across {len(gpus)} GPUs could not be planned: {errors[0]})"
    fix = None
    if v.suggestions:
        fix = f"{v.suggestions[0]}"
        if card_data:  # the card itself would hold it: freeing it is the first fix
            fix = f"{card_data['free_fix']}; or {fix}"
    elif load == "auto" and est.load != ests[0].load:
        split = next((o for o in seen if o.split and o.est is ests[0]), None)
        also = f"; split across {len(gpus)} GPUs: {split.verdict}" if split is not None else ""
        fix = f"load with {est.load} ({ests[0].load} needs {format_bytes(ests[0].total)}{also})"
    if spill:  # load() refuses it: say why, and what does fit
        summary += f", but {spill_why(est)} would offload part of it to the CPU: load() refuses it"
        return Check(
            "fit",
            "fail",
            summary,
            spill,
            {**data, "verdict": DOES_NOT_FIT, "placement_spill": True},
        )
    return Check("fit", VERDICT_STATUS[v.verdict], summary, fix, data)


def _budget_text(load: str, budget: dict) -> str:
    """``load=fp16 and max_new_tokens=256``, with the batch and prompt length where they are not the default."""
    extra = "" if (budget["batch_size"], budget["prompt_tokens"]) == (1, 512) else (
        f", batch_size={budget['batch_size']}, prompt_tokens={budget['prompt_tokens']}")  # fmt: skip
    return f"load={load}{extra} and max_new_tokens={budget['max_new_tokens']}"


def _plan_args(budget: dict) -> str:
    """The budget as LoadPlan keyword arguments (batch and prompt length only where not the default)."""
    extra = {k: v for k, v in budget.items() if (k, v) not in (("batch_size", 1), ("prompt_tokens", 512))}
    return "".join(f", {k}={v}" for k, v in extra.items())


def _card_note(est: MemoryEstimate, g: GPUReadout, cap: int, now: str) -> tuple[str, dict]:
    """Both verdicts where the card's whole memory (what ``fit(est, "current")`` measures against) gives another
    than the memory usable now, and what holds the difference, so this line and a ``fit()`` in the next cell
    differ in the open. ``("", {})`` where they agree."""
    card = verdict(est.total, g.total)
    # what separates the usable figure from the card's: PyTorch's cache, and the rest outside this process's
    # tensors and its CUDA context (counted usable once paid): other processes. The three add up to the card
    cache = g.reserved_unallocated
    others = max(0, g.total - cap - cache)
    if card == now or others + cache < HELD_NOTE:
        return "", {}
    parts = [f"{format_bytes(others)} held by other processes"] if others else []
    if cache:
        parts.append(f"{format_bytes(cache)} in PyTorch's cache (cleanup() returns it)")
    held = " and ".join(parts)
    note = (f" now ({card} on the card's {format_bytes(g.total)}, which fit(est, 'current') measures against; "
            f"{held} leave {format_bytes(cap)} usable)")  # fmt: skip
    free_fix = ("free what other processes hold on the GPU (an earlier runtime still running? restart it, or kill "
                "the process)" if others >= HELD_NOTE else "cleanup() (gives PyTorch's cache back)")  # fmt: skip
    return note, {"card_verdict": card, "card_capacity": g.total, "held_elsewhere": others, "free_fix": free_fix}


def _load_now(chosen: _Option, gpus: list[GPUReadout], caps: list[int], host: _Host) -> _Option:
    """What load() decides for ``chosen``'s load mode now: the usable caps count this process's own tensors
    as free (what unloading gives back), while load() reads the memory free now."""
    now = [cap - g.allocated for cap, g in zip(caps, gpus)]
    return _choose(_options([chosen.est], now, host))[0]


def _held_check(check: Check, now: _Option, gpus: list[GPUReadout]) -> Check:
    """The fit ``check``, warning where the memory this process still holds changes what load() does now."""
    from .placement.split_checks import held_hint

    if now.verdict == DOES_NOT_FIT:
        happens = "load() would refuse it now"
    elif now.split and not check.data.get("split"):
        happens = f"load() would split it across {len(gpus)} GPUs now instead of keeping it on GPU 0"
    else:
        return check
    if len(gpus) == 1:
        why = held_hint(gpus[0])
    else:
        on = " and ".join(f"{format_bytes(g.allocated)} on GPU {g.index}" for g in gpus if held_hint(g))
        why = f". This process already holds {on}: a model from an earlier cell? unload(model) first"
    summary = f"{check.summary}; counting what this process holds as free: {happens}{why}"
    held_bytes = {g.index: g.allocated for g in gpus if g.allocated}
    return Check(check.name, "warn", summary, "unload(model) (or helpers.cleanup()) before loading the next model",
                 {**(check.data or {}), "held": held_bytes})  # fmt: skip


def _split_check(chosen: _Option, ests: list[MemoryEstimate], gpus: list[GPUReadout], caps: list[int], load: str,
                 budget: dict, host: _Host) -> list[Check]:  # fmt: skip
    """The fit check for a model split across every GPU (each GPU's share, or why no split fits and the
    fix), and the placement's note on what a split costs."""
    from .estimator.fitting import format_params

    est, plan, n = chosen.est, chosen.plan, len(gpus)
    shares = [
        {"index": g.index, "name": g.name, "capacity": s.capacity, "total": s.total, "weights": s.weights,
         "kv_cache": s.kv_cache, "layers": s.layers}
        for g, s in zip(gpus, plan.gpus if plan is not None else [])
    ]  # fmt: skip
    total = sum(s["total"] for s in shares) or est.total
    room = min((s["capacity"] - s["total"] for s in shares), default=sum(caps) - total)  # the fullest GPU's
    data = {"load": est.load, "total": total, "weights": est.weights, "params": est.params, "capacity": sum(caps),
            "verdict": chosen.verdict, "headroom": room, "all": {e.load: e.total for e in ests}, "split": True,
            "gpus": shares, "max_memory": dict(plan.max_memory) if plan is not None else {}}  # fmt: skip
    head = f"{est.model} ({format_params(est.params)} params) with {_budget_text(est.load, budget)}"
    alone = f"on GPU 0 alone {format_bytes(est.total)}: {verdict(est.total, caps[0])}"
    listing = " [one GPU: " + ", ".join(f"{e.load} {format_bytes(e.total)}" for e in ests) + "]"
    listing = listing if load == "auto" and len(ests) > 1 else ""
    smaller = _smaller_load(est, caps, host, ests) if chosen.verdict != FITS else None
    if chosen.verdict == DOES_NOT_FIT:
        weights = f"the weights alone ({format_bytes(est.weights)}) exceed the {n} GPUs together"
        why = weights if plan is None or est.weights > sum(caps) else plan.reasons[0]
        summary = f"{head}: does not fit across {n} GPUs ({format_bytes(sum(caps))} usable): {why} ({alone}){listing}"
        return [Check("fit", "fail", summary, smaller or chosen.fix, data)]
    each = ", ".join(f"GPU {s['index']} {format_bytes(s['total'])} of {format_bytes(s['capacity'])}" for s in shares)
    summary = (f"{head}: {format_bytes(total)} predicted (weights {format_bytes(est.weights)}): {chosen.verdict} "
               f"across {n} GPUs ({each}; {alone}){listing}")  # fmt: skip
    how = (f"load(LoadPlan({est.model!r}, load={est.load!r}{_plan_args(budget)})) splits it so, "
           "each card checked; "
           f"plan_devices({est.model!r}, load={est.load!r}, devices='current') shows the device map")  # fmt: skip
    checks = [Check("fit", VERDICT_STATUS[chosen.verdict], summary, f"{smaller}, or {how}" if smaller else how, data)]
    if plan.notes:  # why two GPUs hold a bigger model but are not faster
        checks.append(Check("GPU split", "info", "; ".join(plan.notes)))
    return checks


def _smaller_load(est: MemoryEstimate, caps: list[int], host: _Host, tried: list[MemoryEstimate]) -> str | None:
    """``"load=nf4: fits GPU 0 alone"`` (or across the GPUs) for the first load mode that load="auto" would
    try, has smaller weights than ``est`` and fits; None when none does."""
    loads = [m for m in auto_load_order(host.half == BF16) if m not in {e.load for e in tried}]
    others = [est.replace(load=m, compute_dtype=_compute(m, host.half)) for m in loads]
    smaller = [e for e in others if e.weights < est.weights]
    if not smaller:
        return None
    alt, _ = _choose(_options(smaller, caps, host))
    if alt.verdict != FITS:
        return None
    return f"load={alt.est.load}: fits " + (f"across {len(caps)} GPUs" if alt.split else "GPU 0 alone")


def _pid() -> int:
    import os

    return os.getpid()


def _check_arguments(model: Any, load: Any, max_new_tokens: Any, batch_size: Any, prompt_tokens: Any) -> None:
    """Refuse a plan preflight cannot check (naming the argument and the value) before any check runs."""
    for name, value, least in (("max_new_tokens", max_new_tokens, 0), ("batch_size", batch_size, 1),
                               ("prompt_tokens", prompt_tokens, 1)):  # fmt: skip
        whole_number(name, value, minimum=least)
    if model is not None and (not isinstance(model, str | os.PathLike) or not str(model).strip()):
        raise ArgumentError(f"model must be a hub id such as 'org/name', a local folder, or None; got {model!r}")
    load_mode_name(load, auto=True, error=ArgumentError)


def _check_stand_ins(snapshot: Any, package_versions: Any, bnb: Any, colab: Any) -> None:
    """The keyword arguments that replace a machine readout must be of the readout's type."""
    if snapshot is not None and not isinstance(snapshot, MemorySnapshot):
        raise ArgumentError(f"snapshot must be a MemorySnapshot (helpers.snapshot()) or None, got {snapshot!r:.60}")
    if package_versions is not None and not isinstance(package_versions, dict):
        raise ArgumentError(
            f"package_versions must be a dict such as {{'torch': '2.4.0'}} or None, got {package_versions!r:.60}"
        )
    if bnb is not None and not (isinstance(bnb, tuple) and len(bnb) == 2 and isinstance(bnb[0], bool)):
        raise ArgumentError(f"bnb must be (usable: bool, why: str) or None, got {bnb!r:.60}")
    if colab is not None:
        flag("colab", colab)


def _checks(report: PreflightReport, load: str, budget: dict, bnb: tuple[bool, str] | None,
            checkpoint: tuple[int | None, int | None, str] | None, allow_pickle: bool,
            calibrate: bool = False) -> Iterator[Check]:  # fmt: skip
    """Preflight's checks one at a time, cheapest first, so a live report shows each as it finishes. The
    bitsandbytes round trip (its import pulls in torch.compile: seconds, tens of seconds on a busy Colab) runs
    only where the plan quantizes, or no model is named (the whole machine is checked)."""
    snap, vers, model = report.snapshot, report.versions, report.model
    yield from _check_gpu(snap, report.colab)
    yield _check_versions(vers)
    yield from _check_gpu_memory(snap)
    total = None
    if model is not None:
        total, largest, source = checkpoint if checkpoint is not None else checkpoint_size(model)
        yield ram_for_loading(snap, total, largest, source)
    else:
        yield Check("RAM", "info", f"{format_bytes(snap.ram.available)} available of {format_bytes(snap.ram.total)}")
    disk = _check_disk(snap, model, total)
    if disk is not None:
        yield disk
    # the checks so far import no torch (seconds in a fresh kernel): opening a weight file as transformers will does
    files = weight_file_check(str(model), allow_pickle=allow_pickle) if model is not None else None
    if files is not None:
        yield files
    fits = fit_checks(model, load=load, snapshot=snap, **budget) if model is not None else []
    yield from fits
    planned = next((c.data.get("load") for c in fits if c.name == "fit"), None)
    quantizes = model is None or load in QUANTIZED or planned in QUANTIZED
    if bnb is not None or (quantizes and vers.get("bitsandbytes") is not None):
        yield _check_bnb(snap, bnb)
    if calibrate:
        yield _check_speed(snap)


def _check_speed(snap: MemorySnapshot) -> Check:
    """This machine's device measured once (:func:`helpers.calibrate`, cached for the process), so the time
    estimates of later cells use it instead of datasheet figures."""
    from .estimator.calibration import calibrate

    cal = calibrate("cuda" if snap.backend == "cuda" and snap.gpus else "cpu")
    what = f"{cal.bandwidth / 1e9:.1f} GB/s memory, {cal.flops / 1e9:.0f} GFLOP/s matmul ({cal.dtype})"
    return Check("speed", "info", f"{cal.device}: {what}; later time estimates use it "
                 f"(measured in {cal.probe_seconds:.1f} s, once per session)", data={"calibration": cal.__dict__})  # fmt: skip


def preflight(
    model: str | None = None,
    load: str = "auto",
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    *,
    batch_size: int = DEFAULTS.batch_size,
    prompt_tokens: int = DEFAULTS.prompt_tokens,
    snapshot: MemorySnapshot | None = None,
    package_versions: dict[str, str | None] | None = None,
    bnb: tuple[bool, str] | None = None,
    colab: bool | None = None,
    checkpoint: tuple[int | None, int | None, str] | None = None,
    allow_pickle: bool = False,
    show: bool = False,
    calibrate: bool = False,
) -> PreflightReport:
    """Check this machine before loading ``model`` (a hub id or a local path; optional).

    ``load``, ``max_new_tokens``, ``batch_size`` and ``prompt_tokens`` are the plan the fit line checks (pass
    the :class:`helpers.LoadPlan`'s, so the next cell's load and panel judge the same budget). The other
    keyword-only arguments replace what would be read from the machine, so any device can be
    simulated: ``snapshot`` (memory readout), ``package_versions``, ``bnb`` (``(usable, why)``),
    ``colab``, and ``checkpoint`` (``(total, largest_file, source)`` bytes). A local ``model`` folder's weight
    files are opened as :func:`helpers.load` will open them (a short or corrupt file, and a pickle ``.bin``
    unless ``allow_pickle``, is a FAIL with the fix).

    ``show=True`` shows each check as it finishes (in a notebook a table that grows row by row and becomes
    the report, so the cell needs no ``display(report)``; elsewhere a line per check on stdout).
    ``calibrate=True`` measures this machine's GPU (else CPU) once (:func:`helpers.calibrate`, a few seconds,
    cached for the session) so later time estimates use it: the notebooks' preflight does.
    """
    _check_arguments(model, load, max_new_tokens, batch_size, prompt_tokens)
    _check_stand_ins(snapshot, package_versions, bnb, colab)
    flag("allow_pickle", allow_pickle)
    flag("show", show)
    flag("calibrate", calibrate)
    snap = snapshot if snapshot is not None else take_snapshot()
    vers = package_versions if package_versions is not None else versions()
    colab = in_colab() if colab is None else colab
    report = PreflightReport(checks=[], snapshot=snap, versions=vers, model=model, colab=colab)
    live = _Live(report) if show else None
    budget = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "prompt_tokens": prompt_tokens}
    try:
        for check in _checks(report, load, budget, bnb, checkpoint, allow_pickle, calibrate):
            report.checks.append(check)
            if live is not None:
                live.add(check)
    finally:  # an interrupted cell keeps the checks that finished, without "checking the rest"
        if live is not None:
            live.close()
    return report
