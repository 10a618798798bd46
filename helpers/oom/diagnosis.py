"""Diagnosis of an out-of-memory error: ``explain_oom(error_or_text) -> OOMReport``.

What ran out, by how much, why, and the fixes in the order to try them. The causes are data
(``CAUSES``, each with its fixes); the message is read by :mod:`helpers.oom.messages`. On a live
error the report adds a snapshot, the largest live tensors, and the room on the machine's other GPUs.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

import torch

from ..core.knobs import knob_fixes
from ..core.runtime import ALLOC_CONF, EXPANDABLE, cuda_initialized, needs_restart_for
from ..core.session import user_namespace
from ..core.units import format_bytes
from ..estimator.core import MemoryEstimate
from ..estimator.fitting import fit_one_card
from ..leaks.census import census
from ..leaks.tensors import storage_key
from .causes import CAUSES, GENERATION_STEADY
from .messages import is_oom_text, parse_message

__all__ = [
    "OOMReport",
    "explain_oom",
    "named_tensors",
]


@dataclass
class OOMReport:
    """What ran out, by how much, why, and what to do, in that order.

    Every figure is bytes, or None when the message does not state it (``unknown`` lists those).
    """

    form: str
    source: str
    cause: str
    fixes: list[str]
    causes: list[str] = field(default_factory=list)
    device: int | None = None
    requested: int | None = None
    requested_at_least: int | None = None  # "Tried to allocate more than 1EB": only a lower bound is printed
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    reserved_unallocated: int | None = None
    this_process: int | None = None
    held_elsewhere: int | None = None
    processes: list[tuple[int, int]] = field(default_factory=list)
    mps_allocated: int | None = None
    other_allocations: int | None = None
    max_allowed: int | None = None
    process_cap: int | None = None
    kv_cache_needed: int | None = None  # vLLM: the KV cache one request of max_model_len needs, bytes
    kv_cache_available: int | None = None  # ... and what its budget left for the KV cache, bytes
    max_seq_len: int | None = None  # vLLM's max_model_len, tokens
    kv_cache_tokens: int | None = None  # tokens the KV cache can hold
    max_len_that_fits: int | None = None  # vLLM's own estimate of the max_model_len that fits, tokens
    unknown: list[str] = field(default_factory=list)
    message: str = ""
    exception_type: str | None = None
    snapshot: object | None = None
    tensors: list[tuple[str, int, str]] = field(default_factory=list)
    other_gpus: list[tuple[int, int]] = field(default_factory=list)  # (index, free bytes) of the other cards, live
    notes: list[str] = field(default_factory=list)  # what this message shows beyond its figures, in words
    generating: bool = False  # it ran out inside generate(): the steady state is a KV cache, not an optimizer

    @property
    def explanation(self) -> str:
        if self.cause == "steady_state" and self.generating:
            return GENERATION_STEADY[0]
        return CAUSES[self.cause][0]

    def figures(self) -> list[tuple[str, str]]:
        """(label, value) for every figure, 'unknown' where the message lacks it."""
        names = [
            ("requested", "tried to allocate"),
            ("total", "GPU capacity" if self.form != "cpu" else "capacity"),
            ("free", "free"),
            ("allocated", "allocated by PyTorch"),
            ("reserved_unallocated", "reserved but unallocated"),
            ("reserved", "reserved by PyTorch"),
            ("this_process", "this process in total"),
            ("held_elsewhere", "held outside this process's PyTorch"),
        ]
        if self.form == "mps":
            names = [
                ("requested", "tried to allocate"),
                ("mps_allocated", "MPS allocated"),
                ("other_allocations", "other allocations"),
                ("max_allowed", "max allowed"),
            ]
        if self.form in ("cpu", "colab_ram"):
            names = [("requested", "tried to allocate")]
        if self.form in _DEATH_FORMS:  # a death reports no figures: listing them all as unknown says nothing
            names = []
        if self.form == "vllm":
            names = [("requested", "gpu_memory_utilization x capacity"), ("total", "GPU capacity"), ("free", "free")]
        if self.form in _REQUEST_ONLY_FORMS:
            names = [("requested", "tried to allocate")]
        if self.form in ("vllm_kv", "quantized_offload"):
            names = [(n, label) for n, label in _KV_BYTES if getattr(self, n) is not None]
        if self.process_cap is not None:
            names.insert(2, ("process_cap", "allowed for this process (its cap)"))
        if self.requested_at_least is not None:  # only "more than 1EB" is printed: no other figure is worth a row
            names = [n for n in names if getattr(self, n[0]) is not None and n[0] != "requested"]
        rows = [
            (label, format_bytes(getattr(self, n)) if getattr(self, n) is not None else "unknown") for n, label in names
        ]
        if self.requested_at_least is not None:
            rows.insert(0, ("tried to allocate", f"more than {self.requested_at_least >> 60} EiB"))
        rows += [(label, f"{getattr(self, n):,} tokens") for n, label in _KV_COUNTS if getattr(self, n) is not None]
        return rows + [(f"free on GPU {index} now", format_bytes(free)) for index, free in self.other_gpus]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["snapshot"] = None if self.snapshot is None else str(self.snapshot)
        d["explanation"] = self.explanation
        return d

    @property
    def not_oom(self) -> bool:
        """True when nothing in the message (or exception) reads as running out of memory."""
        return (
            self.form == "unknown"
            and self.cause == "unknown"
            and not is_oom_text(self.message)
            and "outofmemoryerror" not in self.message.lower()
            and self.requested is None
            and self.total is None
        )

    def _not_oom_text(self) -> str:
        first = self.message.splitlines()[0][:200] if self.message else "(empty message)"
        return (
            f"Not an out-of-memory error: {first}\nexplain_oom only explains OOMs; this error's own message "
            "and traceback say what went wrong (for an OOM, pass its exception or full message text)."
        )

    def __str__(self) -> str:
        if self.not_oom:
            return self._not_oom_text() + (f"\nNow: {self.snapshot}" if self.snapshot is not None else "")
        where = f" on GPU {self.device}" if self.device is not None else ""
        lines = [f"Out of memory{where}: {self.source}", f"Cause: {self.explanation}"]
        lines += [f"  {note}" for note in self.notes]
        lines += [f"  {label}: {value}" for label, value in self.figures()]
        for pid, used in self.processes:
            lines.append(f"  process {pid}: {format_bytes(used)}")
        if self.unknown:
            lines.append(f"  (the message does not state: {', '.join(self.unknown)})")
        lines.append("Fixes, in order:")
        lines += [f"  {i}. {fix}" for i, fix in enumerate(self.fixes, 1)]
        if self.tensors:
            lines.append("Largest live tensors:")
            lines += [f"  {format_bytes(n):>11}  {name}  {desc}" for name, n, desc in self.tensors]
        if self.snapshot is not None:
            lines.append(f"Now: {self.snapshot}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from html import escape

        from ..core.html import bar, table

        if self.not_oom:
            return "<pre>" + escape(self._not_oom_text()) + "</pre>"
        parts = [
            f"<div><b>Out of memory{escape(f' on GPU {self.device}' if self.device is not None else '')}"
            f"</b>: {escape(self.source)}<br><b>Cause</b>: {escape(self.explanation)}</div>"
        ]
        if self.notes:  # notes quote PIDs and sizes from the message: outside data, escaped
            parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in self.notes) + "</ul>")
        if self.total and self.free is not None:
            parts.append(bar(self.total - self.free, self.total, "GPU in use when it failed"))
        # what to do first, at a glance; the figures, the live tensors and memory now folded below
        parts.append("<b>Fixes, in order</b><ol>" + "".join(f"<li>{escape(f)}</li>" for f in self.fixes) + "</ol>")
        rows = [[label, value] for label, value in self.figures()]
        rows += [[f"process {pid}", format_bytes(used)] for pid, used in self.processes]
        folded = [table(["figure", "value"], rows, title="What the message says")]
        if self.tensors:
            folded.append(
                table(
                    ["tensor", "size", "shape / dtype / device"],
                    [[name, format_bytes(n), desc] for name, n, desc in self.tensors],
                    title="Largest live tensors",
                )
            )
        if self.snapshot is not None and hasattr(self.snapshot, "_repr_html_"):
            folded.append(self.snapshot._repr_html_())
        what = ", ".join(["the message's figures", *(["the largest live tensors"] if self.tensors else []),
                          *(["memory now"] if self.snapshot is not None else [])])  # fmt: skip
        parts.append(f"<details><summary>{escape(what)}</summary>{''.join(folded)}</details>")
        return "<div>" + "".join(parts) + "</div>"


def _exception_text(exc: BaseException) -> str:
    """The message of the outermost OOM in ``exc``'s chain, alone; else every message, outermost first.

    A retry that runs out of memory again raises inside the handler of the first OOM, so both are in
    the chain: the one raised last is the one to explain, not the earlier (larger) request that the
    parser would find last in the joined text.
    """
    texts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        own = f"{type(exc).__name__}: {exc}"
        if is_oom_text(own):
            return own
        texts.append(own)
        exc = exc.__cause__ or exc.__context__
    return "\n".join(texts)


# Forms whose cause the form itself settles (a death or a refusal outside PyTorch's allocators).
_FORM_CAUSES = {
    "cpu": "system_ram", "colab_ram": "system_ram", "pagefile": "page_file", "shm": "shared_memory",
    "dataloader_killed": "dataloader_worker_killed", "kernel_died": "kernel_died", "killed": "killed_by_os",
    "ggml": "gguf_buffer", "vllm": "vllm_reservation", "quantized_offload": "quantized_offload",
    "vllm_kv": "vllm_kv_cache", "directml": "device_memory", "tensorflow": "device_memory", "xla": "device_memory",
}  # fmt: skip
# Other frameworks' allocators: their messages state the request (and at most the device), nothing else
_REQUEST_ONLY_FORMS = ("directml", "tensorflow", "xla")
_KV_BYTES = (("kv_cache_needed", "KV cache needed"), ("kv_cache_available", "KV cache available"))
_KV_COUNTS = (("max_seq_len", "max seq len (max_model_len)"), ("kv_cache_tokens", "tokens the KV cache holds"),
              ("max_len_that_fits", "max_model_len that fits (vLLM's estimate)"))  # fmt: skip
# The first fix for a framework whose settings differ from PyTorch's
_FORM_TIPS = {
    "tensorflow": "TensorFlow: tf.config.experimental.set_memory_growth(gpu, True) before building the model, so TF "
    "does not take the whole card up front; report_tensor_allocations_upon_oom in RunOptions lists what held it",
    "xla": "JAX preallocates 75 % of the card: XLA_PYTHON_CLIENT_PREALLOCATE=false (or XLA_PYTHON_CLIENT_MEM_FRACTION) "
    "lets it share the card with another process; the BufferAssignment stats after the message name the largest buffers",
    "directml": "DirectML shares video memory with the desktop and other programs: close those, and use smaller "
    "batches or images (a UI's --lowvram / --medvram option)",
}
_DEATH_FORMS = ("pagefile", "shm", "dataloader_killed", "kernel_died", "killed")
# No machine has a petabyte of memory to ask for: a request that large is a corrupted size, not a shortage.
ABSURD_REQUEST = 1 << 50
XPU_ALLOCATION_LIMIT = 4 << 30  # Intel GPUs (Level Zero) refuse a single allocation this large


def _classify(f: dict) -> list[str]:
    """Every cause the figures support, most likely first."""
    form = f["form"]
    if f.get("requested_at_least") is not None or (f.get("requested") or 0) >= ABSURD_REQUEST:
        return ["corrupted_size"]
    if form in _FORM_CAUSES:
        return [_FORM_CAUSES[form]]
    causes = _allocator_causes(f)
    if form == "xpu" and (f.get("requested") or 0) >= XPU_ALLOCATION_LIMIT:
        free, req = f.get("free"), f["requested"]
        if free is None or free >= req:  # the card had room: the per-allocation limit alone refused it
            causes = [c for c in causes if c != "steady_state"]
        causes.insert(0, "xpu_allocation_limit")
    if f.get("other_processes") is not None and "held_elsewhere" not in causes:  # else that cause names them
        at = causes.index("steady_state") if "steady_state" in causes else len(causes)
        causes.insert(at, "other_processes")
    if _contradictions(f):  # after a request larger than the card: that holds whatever the accounting says
        causes.insert(1 if causes[:1] == ["request_too_large"] else 0, "impossible_figures")
    return list(dict.fromkeys(causes))


def _allocator_causes(f: dict) -> list[str]:
    """The causes a PyTorch (or library) allocator message's figures support, most likely first."""
    form = f["form"]
    causes = []
    req, total = f.get("requested"), f.get("total")
    if form == "mps":
        total = f.get("max_allowed")
    if req is not None and total is not None and req > total:
        causes.append("request_too_large")
    if req is not None and f.get("reserved_unallocated") is not None and f["reserved_unallocated"] >= req:
        causes.append("fragmentation")
    if (
        form == "cuda_legacy"
        and req is not None
        and f.get("reserved") is not None
        and f.get("allocated") is not None
        and f["reserved"] - f["allocated"] >= req
    ):
        causes.append("fragmentation")
    held = f.get("held_elsewhere")
    minor_held = False
    if held is not None and total and held >= max(req or 0, 0.05 * total):
        # a quarter of the card in someone else's hands outranks how this process's cache is cut up;
        # less may be the CUDA context and library workspaces: then it comes after the other causes
        if held >= 0.25 * total:
            causes.insert(0, "held_elsewhere")
        else:
            minor_held = True
    if form == "mps" and f.get("other_allocations") and total and f["other_allocations"] >= 0.25 * total:
        causes.append("held_elsewhere")
    if form in ("cublas", "cudnn", "cuda_error", "nccl"):
        causes.append("library_workspace")
    cap = f.get("process_cap")
    if cap is not None and total is not None and cap < total:
        # the card may have room; this process's cap is what refused (first when the card had the room)
        free = f.get("free")
        causes.insert(0 if free is None or req is None or free >= req else len(causes), "process_cap")
    if "request_too_large" not in causes and (
        total is not None or form in ("cuda", "hip", "xpu", "mps", "cuda_legacy", "bitsandbytes", "npu")
    ):
        causes.append("steady_state")
    if minor_held:
        causes.append("held_elsewhere")
    if not causes:
        causes.append("unknown")
    return causes


def _contradictions(f: dict) -> list[str]:
    """The figures that cannot all be true (each in words): more allocated, reserved or in use than the
    card's total, or more allocated than reserved."""
    total, out = f.get("total"), []
    for name, label in (("allocated", "allocated"), ("reserved", "reserved"), ("this_process", "in use"),
                        ("free", "free")):  # fmt: skip
        if total and f.get(name) is not None and f[name] > total * 1.01:  # rounding of printed figures
            out.append(f"{format_bytes(f[name])} {label} of a {format_bytes(total)} card")
    allocated, reserved = f.get("allocated"), f.get("reserved")
    if allocated is not None and reserved is not None and allocated > reserved * 1.01 + (2 << 20):
        out.append(f"{format_bytes(allocated)} allocated but only {format_bytes(reserved)} reserved")
    return out


def _other_processes(f: dict, pid: int | None) -> list[tuple[int, int]]:
    """The processes the message lists that are not this one.

    NVML may list this process under a second PID (a container's PID namespace: Kaggle, some Colab
    images), beside or instead of PyTorch's "this process has ..." line. So an entry holding more than
    the card has outside this process (``held_elsewhere``, with 1 % slack for rounding) is this process;
    with no such figure, the largest entry holding at least PyTorch's own share is, unless PyTorch named
    this process itself. ``pid`` (this process, when explaining a live error) is never another process.
    """
    listed = [(p, n) for p, n in f.get("processes", []) if p != pid and p != _probably_this(f)]
    held, total = f.get("held_elsewhere"), f.get("total") or 0
    if held is not None:
        return [(p, n) for p, n in listed if n <= held + total // 100]
    if f.get("this_process") is not None or not listed:
        return listed
    own = (f.get("allocated") or 0) + (f.get("reserved_unallocated") or 0)
    biggest = max(listed, key=lambda p: p[1])
    return [p for p in listed if p is not biggest] if own and biggest[1] >= own else listed


# the share of the memory in use that one listed process holds for a cut message to be read as this process
ONE_PROCESS_SHARE = 0.9


def _probably_this(f: dict) -> int | None:
    """The PID of a message cut after "Process N has X memory in use." that is probably this process: the
    only one listed, holding nearly all the memory in use (total - free), with none of PyTorch's own
    figures left to tell. On Colab or in any container NVML lists the notebook under such a PID."""
    listed, total, free = f.get("processes", []), f.get("total"), f.get("free")
    if len(listed) != 1 or total is None or free is None or f.get("this_process") is not None:
        return None
    if f.get("allocated") is not None or f.get("reserved") is not None:
        return None
    used = total - free
    return listed[0][0] if used > 0 and listed[0][1] >= ONE_PROCESS_SHARE * used else None


def _notes(f: dict, others: list[tuple[int, int]], pid: int | None) -> list[str]:
    """What the message shows beyond its figures: contradictions, and who else holds the card."""
    notes = [f"impossible: {c}" for c in _contradictions(f)]
    if others:
        held = sum(n for _, n in others)
        req = f.get("requested")
        ratio = f", {held / req:.1f}x the failed request" if req else ""
        who = ", ".join(f"{p} ({format_bytes(n)})" for p, n in others)
        me = f" (this process is {pid})" if pid is not None else ""
        notes.append(f"other processes on this GPU{me}: {who}; {format_bytes(held)} in all{ratio}")
    for p, n in f.get("processes", []):
        if (p, n) not in others and p != pid and p == _probably_this(f):
            notes.append(
                f"process {p} ({format_bytes(n)}) is probably this process (the notebook itself): it holds nearly all "
                "the memory in use, and on Colab or in a container the notebook is listed under a PID of its own; the "
                "message is cut before PyTorch's figures, so if nvidia-smi shows another process holding it, stop that"
            )
        elif (p, n) not in others:
            why = (
                "its own PID"
                if p == pid
                else "seen under a container's PID: it holds more than the card has outside this process"
            )
            notes.append(f"process {p} ({format_bytes(n)}) is this process ({why})")
    if f["form"] == "vllm" and f.get("free") and f.get("total"):
        notes.append(f"at most gpu_memory_utilization={int(100 * f['free'] / f['total']) / 100:.2f} fits what was free")
    fits = f.get("max_len_that_fits") or f.get("kv_cache_tokens")
    if f["form"] == "vllm_kv" and fits:
        notes.append(f"max_model_len={fits} fits this budget (the model's max seq len is {f.get('max_seq_len')})")
    return notes


def _held_elsewhere(f: dict) -> int | None:
    total, free = f.get("total"), f.get("free")
    if total is None or free is None:
        return None
    this, ours = f.get("this_process"), (f.get("allocated") or 0) + (f.get("reserved_unallocated") or 0)
    if this is not None and this >= ours:  # current wording: everything not in this process
        return max(0, total - free - this)
    # (less than PyTorch's own share: NVML cannot see this process, e.g. in a container; read "reserved")
    if f.get("reserved") is not None:  # older wording: CUDA context and other processes included
        return max(0, total - free - f["reserved"])
    return None


def _room(f: dict) -> int | None:
    """The memory this process could have had when it ran out: its cap or the card, less what others held."""
    if f["form"] == "mps":
        cap, others = f.get("max_allowed"), f.get("other_allocations")
    else:
        cap, others = f.get("process_cap") or f.get("total"), f.get("held_elsewhere")
    return None if not cap else max(cap - (others or 0), 1)


def _estimator_fixes(memory_estimate, f: dict) -> list[str]:
    """The estimator's fixes for what ran (``fit()``'s suggestions, each re-estimated), ranked for the
    memory this process had when it ran out (``_room``); nothing without an estimate."""
    if memory_estimate is None:
        return []
    if not isinstance(memory_estimate, MemoryEstimate):
        raise TypeError(
            f"explain_oom(memory_estimate=...) takes a helpers.MemoryEstimate (from estimate(model, ...)), "
            f"got {type(memory_estimate).__name__}"
        )
    room = _room(f)
    try:
        verdict = fit_one_card(memory_estimate, room if room and room >= (1 << 20) else None)
    except Exception:  # noqa: BLE001 - an optional hint must never break a diagnosis
        return []
    return [f"From the estimate of {verdict.estimate.model}: {s}" for s in verdict.suggestions]


def _traceback_names(tb) -> dict[tuple, str]:
    """``storage key -> "function().name"`` for the tensors local to the traceback's function frames."""
    names: dict[tuple, str] = {}
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name != "<module>":
            local = frame.f_locals
            for var, value in local.items():
                if isinstance(value, torch.Tensor):
                    names.setdefault(storage_key(value)[0], f"{frame.f_code.co_name}().{var}")
            # reading f_locals caches a dict of the locals on the frame: drop it, or it pins them
            # (Python 3.13+ hands out a write-through proxy instead, which caches nothing and has no clear())
            if isinstance(local, dict):
                local.clear()
            del local
        tb = tb.tb_next
    return names


def explain_oom(
    error_or_text: BaseException | str, *, live: bool | None = None, memory_estimate=None, namespace: dict | None = None
) -> OOMReport:
    """Explain an out-of-memory error or message: what ran out, why, and the fixes in order.

    Args:
        error_or_text: the exception (also when the OOM is wrapped inside another one) or its text,
            e.g. pasted from a log. Every PyTorch/CUDA/HIP/MPS/XPU/CPU/cuBLAS/cuDNN/NCCL/bitsandbytes/
            Colab form in ``OOM_FORMS`` is understood, and so are llama.cpp's and vLLM's, Windows'
            page file and the system-RAM deaths (Killed, exit code 137, a DataLoader worker killed or
            out of shared memory, a Jupyter kernel that died); figures the message lacks are unknown.
        live: add a current ``snapshot()`` and the largest live tensors (default: when given an
            exception). On a machine with several GPUs it also tells when another card has room.
        memory_estimate: the ``estimate(...)`` of what was running, if at hand: when the cause is the
            steady state, the estimator's fixes for the memory this process had (re-estimated, ranked)
            follow the general ones.
        namespace: a notebook's variables; where they hold a knob (:mod:`helpers.core.knobs`: ``MAX_NEW_TOKENS``,
            ``BATCH_SIZE``, ``LOAD``...), the fixes for the steady state name it with a value to try, first.
            Default: the notebook's own when given a live exception, none for a text.

    Only the last OOM message of a long log is read (found with plain ``str.rfind``s, then a bounded
    window is parsed), so a diagnosis takes milliseconds whatever the input.
    """
    if isinstance(error_or_text, BaseException):
        text, exc = _exception_text(error_or_text), error_or_text
    elif isinstance(error_or_text, str):
        text, exc = error_or_text, None
    else:
        raise TypeError(f"explain_oom() takes an exception or its message text, got {type(error_or_text).__name__}")
    if live is not None and not isinstance(live, bool):
        raise TypeError(f"live must be True, False or None (when given an exception), got {live!r:.60}")
    f = parse_message(text)
    if exc is not None and f["form"] == "unknown" and isinstance(exc, MemoryError):
        f.update(form="cpu", source="Python MemoryError (system RAM)")
    if f.get("reserved") is None and f.get("allocated") is not None and f.get("reserved_unallocated") is not None:
        f["reserved"] = f["allocated"] + f["reserved_unallocated"]  # stated as its two parts
    f["held_elsewhere"] = _held_elsewhere(f)
    pid = os.getpid() if exc is not None else None  # a live error is this process's: its PID is known
    others = _other_processes(f, pid)
    if others and sum(n for _, n in others) >= (f.get("requested") or 1 << 62):
        f["other_processes"] = sum(n for _, n in others)
    snap = None
    if live if live is not None else exc is not None:
        from ..core.memory import snapshot

        snap = snapshot()
    other_gpus = _other_gpus(f, snap)
    causes = _classify(f)
    moved: dict[str, list[str]] = {}
    if _other_card_helps(f, other_gpus, causes):
        # after what this process cannot fix by moving layers (another holder, fragmentation, its own cap)
        at = causes.index("steady_state") if "steady_state" in causes else len(causes)
        causes.insert(at, "other_gpu_room")
        moved["other_gpu_room"] = _move_fixes(f, other_gpus, len(snap.gpus))
    if f["form"] in _FORM_TIPS:
        moved["device_memory"] = [_FORM_TIPS[f["form"]], *CAUSES["device_memory"][1]]
    if "fragmentation" in causes and snap is not None and f["form"] in ("cuda", "cuda_legacy"):
        moved["fragmentation"] = _fragmentation_fixes()
    generating = _generating(exc, text)
    if generating:
        moved["steady_state"] = list(GENERATION_STEADY[1])
    if exc is not None and namespace is None:
        namespace = user_namespace()
    named = knob_fixes(namespace or {}) if {"steady_state", "request_too_large"} & set(causes) else []
    report = _report(f, causes, text, exc, _estimator_fixes(memory_estimate, f), moved)
    report.fixes = named + [x for x in report.fixes if x not in named]
    report.other_gpus = other_gpus
    report.generating = generating
    report.notes = _notes(f, others, pid)
    simulated = SIMULATED.search(text)
    if simulated:  # the figures are a T4's, the failure this machine's: say so before a user reads "GPU 0"
        report.notes.insert(
            0,
            f"simulated for a T4 by helpers.simulated_budget ({simulated[1]}): the figures are "
            "what a T4 would print for this call",
        )
    if snap is not None:
        report.snapshot = snap
        report.tensors = named_tensors(exc, namespace if namespace is not None else user_namespace())
    return report


def _generating(exc: BaseException | None, text: str) -> bool:
    """It ran out inside a ``generate()`` call: a frame of that name in the traceback (transformers', a
    wrapper's), a pasted traceback's ``in generate`` line, or simulated_budget's message (it only wraps generate)."""
    if SIMULATED.search(text) or any(
        m.start() == 0 or not _WORD.match(text, m.start() - 1) for m in _IN_GENERATE.finditer(text)
    ):
        return True
    while exc is not None:
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "generate":
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


# a literal start lets the regex engine skip to each candidate (a leading \b made it scan 1 MB in 28 ms)
_IN_GENERATE, _WORD = re.compile(r"in generate\b"), re.compile(r"\w")
# how simulated_budget (helpers.testing) marks the T4-shaped message it raises on a CPU
SIMULATED = re.compile(r"\(simulated on this machine for a T4: ([^)]*)\)")
LARGEST_SHOWN = 5  # live tensors a card lists


def named_tensors(exc: BaseException | None, namespace: dict, n: int = LARGEST_SHOWN) -> list[tuple[str, int, str]]:
    """The ``n`` largest live storages as ``(name, bytes, "shape dtype device")``, named as ``census()``
    names them (``model.model.layers[0].mlp.up_proj.weight``), or by the failed function's local that
    held them; ``"(unnamed)"`` only for what nothing in the namespace or the traceback reaches."""
    local = _traceback_names(exc.__traceback__) if exc is not None else {}
    found = []
    for e in census(namespace).entries:
        if e.nbytes and len(found) < n:
            desc = f"{e.shape} {e.dtype} {e.device}"
            found.append((local.get(e.key) or e.holder, e.nbytes, desc))
    return found


def _fragmentation_fixes() -> list[str]:
    """On a live OOM: without the expandable-segments fix when this process already runs with it (every
    notebook's first cell sets it), so nobody restarts a runtime for a setting already in force."""
    fixes = list(CAUSES["fragmentation"][1])
    check = needs_restart_for(EXPANDABLE)
    if EXPANDABLE in os.environ.get(ALLOC_CONF, "") and not check.needed and cuda_initialized():
        fixes[0] = (
            f"{EXPANDABLE} is already in effect here, so what is left is the cache itself: call "
            "helpers.cleanup(), then retry"
        )
        del fixes[1]
    return fixes


# the allocator messages that name the card that ran out (a cuBLAS or driver error names none)
_CARD_FORMS = ("cuda", "cuda_legacy", "hip")


def _other_gpus(f: dict, snap) -> list[tuple[int, int]]:
    """(index, bytes this process could still use) of the machine's other GPUs: free, plus its own cache
    there; none when the card that ran out is unknown, or under DDP (each card is another process's)."""
    if snap is None or f.get("device") is None or len(getattr(snap, "gpus", [])) < 2 or _distributed():
        return []
    return [(g.index, g.free + g.reserved_unallocated) for g in snap.gpus if g.index != f["device"]]


def _distributed() -> bool:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _other_card_helps(f: dict, others: list[tuple[int, int]], causes: list[str]) -> bool:
    """Another card could take work: it has the request free and a tenth of a card besides (a single
    tensor larger than the card is not helped by a second one)."""
    if f["form"] not in _CARD_FORMS or "request_too_large" in causes or not others:
        return False
    return any(room >= _room_worth_moving(f) for _, room in others)


def _room_worth_moving(f: dict) -> int:
    return max(f.get("requested") or 0, (f.get("total") or 0) // 10, 256 << 20)


def _move_fixes(f: dict, others: list[tuple[int, int]], count: int) -> list[str]:
    """The fixes for a card that ran out beside one with room, naming both."""
    full = f["device"]
    spare, room = max(others, key=lambda o: o[1])
    need = 2 * (f.get("requested") or 0) or 1 << 30
    return [
        f"Split the model by each card's free memory: helpers.load(LoadPlan(model, gpus={count})) places its "
        "layers so every card keeps room for its share of the KV cache and activations, checked before loading",
        f"Or place it yourself: from_pretrained(..., device_map='sequential', max_memory={{...}}) with GPU {full}'s "
        f"cap at least {format_bytes(need)} (twice the request) below what it holds now, and GPU {spare}'s up to "
        f"its {format_bytes(room)} of room: 'sequential' fills the cards in order up to each cap, so the layers "
        f"GPU {full} loses go to GPU {spare} ('auto' balances the weights alone, leaving generation no room)",
        f"If the model sits on GPU {full} alone, split it as above, or move it to GPU {spare} "
        f"(device_map={{'': {spare}}}) if it fits there",
    ]


def _report(f: dict, causes: list[str], text: str, exc: BaseException | None, estimated: list[str],
            named: dict[str, list[str]]) -> OOMReport:  # fmt: skip
    """The report of parsed figures ``f``: the fixes of every cause in order (``named``: a cause's fixes
    written for this machine, in place of the generic ones), and what the message lacks."""
    fixes: list[str] = []
    for c in causes:
        fixes += [x for x in named.get(c, CAUSES[c][1]) if x not in fixes]
    if "steady_state" in causes:
        fixes += [x for x in estimated if x not in fixes]
    if "quantized_offload" in causes:  # the fixes for the model in hand come first
        fixes = estimated + [x for x in fixes if x not in estimated]
    wanted = {"cpu": ["requested"], "colab_ram": [], "mps": ["requested", "mps_allocated", "max_allowed"],
              "ggml": ["requested"], "vllm": ["requested", "total", "free"], **dict.fromkeys(_DEATH_FORMS, []),
              "quantized_offload": [], "vllm_kv": [], **dict.fromkeys(_REQUEST_ONLY_FORMS, ["requested"])}.get(
        f["form"], ["requested", "total", "free", "allocated", "reserved_unallocated"]
    )  # fmt: skip
    if f["form"] in ("cuda_error", "cublas", "cudnn", "nccl", "unknown", "bitsandbytes") and "total" not in f:
        wanted = ["requested", "total", "free"]
    if f.get("requested_at_least") is not None:
        wanted = [w for w in wanted if w != "requested"]
    unknown = [w.replace("_", " ") for w in wanted if f.get(w) is None]
    if f["form"] == "cuda_legacy":
        unknown = [u for u in unknown if u != "reserved unallocated"]
    figures = ("device", "requested", "requested_at_least", "total", "free", "allocated", "reserved", "reserved_unallocated",
               "this_process", "held_elsewhere", "mps_allocated", "other_allocations", "max_allowed", "process_cap",
               "kv_cache_needed", "kv_cache_available", "max_seq_len", "kv_cache_tokens", "max_len_that_fits")  # fmt: skip
    return OOMReport(
        form=f["form"],
        source=f["source"],
        cause=causes[0],
        causes=causes,
        fixes=fixes,
        unknown=unknown,
        message=text.strip(),
        exception_type=type(exc).__name__ if exc is not None else None,
        **{k: f.get(k) for k in figures},
        processes=f.get("processes", []),
    )
