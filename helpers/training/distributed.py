"""Training on more than one GPU: per-GPU memory of each strategy, and a DDP QLoRA run through accelerate.

:func:`training_memory` counts the model states one GPU holds under each strategy: parameters,
gradients and optimizer states, replicated (DDP) or sharded over ``world_size`` GPUs (ZeRO-1/2/3,
FSDP), as the ZeRO paper (Rajbhandari et al. 2020, section 5) counts them for mixed-precision Adam:
16-bit parameters (2Ψ) and gradients (2Ψ), and K = 12 bytes of fp32 optimizer state per parameter
(master weights, momentum, variance). DDP: 16Ψ on every GPU; ZeRO-2: 2Ψ + 14Ψ/N; ZeRO-3 and FSDP
``FULL_SHARD``: 16Ψ/N plus the working set of the largest layer while it is gathered.
DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``, ``..._zero3_...``) add the
fp32 gradient partition its optimizer keeps (18Ψ/N instead of 14Ψ/N or 16Ψ/N):
:attr:`TrainingMemory.deepspeed_gpu_bytes` reproduces them.

QLoRA differs: the base model is frozen in 4 bits and only the LoRA adapters train, so the model
states are tiny and the 4-bit base is the bulk. DDP, ZeRO-1 and ZeRO-2 replicate that base on every
GPU (each rank loads the whole quantized model); only FSDP (or ZeRO-3) with
``bnb_4bit_quant_storage=torch.bfloat16`` shards it (FSDP-QLoRA).

:func:`launch` starts a function on N processes: accelerate's ``notebook_launcher`` on GPUs,
``debug_launcher`` on a CPU (gloo backend), so the same notebook cell runs on Kaggle's 2×T4 and in
the tests. :func:`run_ddp_qlora` launches :func:`ddp_qlora_worker` and collects each rank's report.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import psutil
import torch

from ..core.arguments import flag
from ..core.devices import resolve_device
from ..core.errors import OomkitError
from ..core.html import progress_bar, table
from ..core.units import format_bytes
from ..core.vocab import DEFAULTS
from ..estimator.configs import resolve_config
from ..estimator.core import estimate
from ..estimator.layout import layout
from ..estimator.training import FullTraining, LoraTraining

__all__ = [
    "STRATEGIES", "TrainingMemory", "training_memory", "DistributedError", "launch", "ddp_qlora_worker",
    "worker_args", "collect_ranks", "clear_ranks", "free_port",
    "RankReport", "DDPRun", "run_ddp_qlora", "largest_layer_params", "choose_launcher", "other_threads",
]  # fmt: skip

# which of (parameters, gradients, optimizer states) each strategy shards over the GPUs
STRATEGIES: dict[str, tuple[bool, bool, bool]] = {
    "single": (False, False, False),
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp": (True, True, True),  # FULL_SHARD; SHARD_GRAD_OP is zero2's sharding
}
# a model state's rows: full training's own, and the trained adapters' under QLoRA (the estimator's keys)
STATE_KEYS = {"params": ("states.params", "training.adapters"), "grads": ("states.grads", "training.gradients"),
              "optimizer": ("states.optimizer", "training.optimizer")}  # fmt: skip


class DistributedError(OomkitError, ValueError):
    """A strategy, world size or launch that cannot work; the message says what to pass instead."""


@dataclass
class TrainingMemory:
    """Per-GPU bytes of one training step under a strategy: model states, working set, activations."""

    model: str
    strategy: str
    world_size: int
    params: int  # Ψ: every parameter of the model
    trainable: int
    rows: list[tuple[str, str, int, str]]  # (key, label, bytes, note)
    capacity: int | None = None
    notes: list[str] = field(default_factory=list)
    deepspeed_gpu_bytes: int | None = None  # DeepSpeed's estimator for the same (zero2/zero3 only)

    def bytes(self, group: str) -> int:
        return sum(b for k, _, b, _ in self.rows if k == group or k.startswith(group + "."))

    def state_bytes(self, kind: str) -> int:
        """Bytes of one kind of model state on one GPU: ``"params"``, ``"grads"`` or ``"optimizer"`` (full
        training's rows, or the trained adapters' under QLoRA, as the estimator keys them)."""
        return sum(self.bytes(key) for key in STATE_KEYS[kind])

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states on one GPU (the ZeRO paper's model states)."""
        return sum(self.state_bytes(kind) for kind in STATE_KEYS)

    @property
    def total(self) -> int:
        return sum(b for _, _, b, _ in self.rows)

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def _title(self) -> str:
        cap = f" of {format_bytes(self.capacity)}" if self.capacity else ""
        return (f"{self.model}: {self.strategy} on {self.world_size} GPU(s), Ψ={self.params:,}, "
                f"trainable {self.trainable:,}: {format_bytes(self.total)} per GPU{cap}")  # fmt: skip

    def __str__(self) -> str:
        w = max(len(label) for _, label, _, _ in self.rows)
        lines = [self._title()] + [f"  {label:<{w}}  {format_bytes(b):>11}  {n}" for _, label, b, n in self.rows]
        if self.deepspeed_gpu_bytes is not None:
            lines.append(f"  DeepSpeed's estimator for these model states: {format_bytes(self.deepspeed_gpu_bytes)}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def __repr__(self) -> str:  # the text a notebook shows without HTML (papermill, a terminal)
        return self.__str__()

    def _repr_html_(self) -> str:
        html = table(["", "bytes per GPU", "note"], [[label, format_bytes(b), n] for _, label, b, n in self.rows],
                     title=self._title())  # fmt: skip
        return html + "".join(f"<div>note: {escape(n)}</div>" for n in self.notes)


def largest_layer_params(config) -> int:
    """Parameters of the largest unit ZeRO-3/FSDP gathers at once: a decoder layer, or the embedding."""
    per_layer: dict[str, int] = {}
    for e in layout(config).entries:
        if e.module == "buffer":
            continue
        m = re.match(r"(.*?\.\d+)\.", e.name)
        key = m.group(1) if m else e.name
        per_layer[key] = per_layer.get(key, 0) + e.numel
    return max(per_layer.values())


def _states(est, n: int, shard: tuple[bool, bool, bool], half: bool) -> list[tuple]:
    """The model states of the estimator's full fine-tuning rows, each divided where the strategy shards it: the
    ZeRO paper's K (optimizer bytes per parameter, the fp32 master copy included) is the estimator's optimizer
    and master-weight rows (mixed-precision AdamW: 12)."""
    psi = est.params
    opt = sum(r.bytes for r in est.rows if r.key in ("training.optimizer", "training.master_weights"))
    parts = [("states.params", f"parameters ({'16-bit' if half else 'fp32'})", est.weights, shard[0]),
             ("states.grads", f"gradients ({'16-bit' if half else 'fp32'})", est.row("training.gradients").bytes,
              shard[1]),
             ("states.optimizer", f"optimizer states (K={opt / max(1, psi):g} bytes/param)", opt, shard[2])]  # fmt: skip
    return [(key, label, b // n if s else b, f"/{n} (sharded)" if s and n > 1 else "") for key, label, b, s in parts]


def _deepspeed(strategy: str, psi: int, n: int, largest: int) -> int | None:
    # deepspeed/runtime/zero/stage_1_and_2.py and stage3.py (0.19): estimate_zero{2,3}_model_states_mem_needs,
    # cpu_offload=False: 2Ψ + 18Ψ/N and 4·largest + 18Ψ/N
    if strategy == "zero2":
        return 2 * psi + int(18 * psi / n)
    if strategy in ("zero3", "fsdp"):
        return 4 * largest + int(18 * psi / n)
    return None


def training_memory(
    model: Any,
    *,
    strategy: str = "single",
    world_size: int = 1,
    qlora: bool = False,
    optimizer: str = "adamw",
    mixed_precision: bool = True,
    quant_storage_sharded: bool = False,
    seq_len: int = DEFAULTS.seq_len,
    micro_batch: int = DEFAULTS.micro_batch,
    r: int = 16,
    device: Any = None,
) -> TrainingMemory:
    """Per-GPU bytes of a training step of ``model`` under ``strategy`` on ``world_size`` GPUs.

    Args:
        strategy: "single", "ddp", "zero1", "zero2", "zero3" or "fsdp" (FULL_SHARD).
        qlora: LoRA adapters on a frozen nf4 base instead of full fine-tuning.
        optimizer: "adamw" (K=12 with mixed precision), "adamw_8bit" (K=6) or "sgd" (K=4).
        quant_storage_sharded: QLoRA under FSDP/ZeRO-3 with ``bnb_4bit_quant_storage=torch.bfloat16``,
            which lets the 4-bit base be sharded too (FSDP-QLoRA).
        seq_len, micro_batch, r: activations per micro-batch (each GPU runs its own) and LoRA rank.
        device: a preset or bytes to compare against (default: none).
    """
    if strategy not in STRATEGIES:
        raise DistributedError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DistributedError(f"world_size is the number of GPUs, a whole number >= 1, got {world_size!r}")
    if strategy == "single" and world_size != 1:
        raise DistributedError("strategy='single' runs on one GPU; use 'ddp', 'zero2', 'zero3' or 'fsdp' for more")
    if optimizer not in ESTIMATOR_OPTIMIZER:
        raise DistributedError(f"unknown optimizer {optimizer!r}; use one of {', '.join(ESTIMATOR_OPTIMIZER)}")
    for name, value in (("qlora", qlora), ("mixed_precision", mixed_precision),
                        ("quant_storage_sharded", quant_storage_sharded)):  # fmt: skip
        flag(name, value, error=DistributedError)
    config, name, _ = resolve_config(model)
    _, dev = resolve_device(device) if device is not None else (None, None)
    shard, n = STRATEGIES[strategy], world_size
    largest = largest_layer_params(config)
    if qlora:
        est = _qlora_estimate(config, optimizer, seq_len, micro_batch, r, device)
        psi, trainable = est.params, _lora_params(est)
        rows = _qlora_rows(est, n, shard, quant_storage_sharded)
    else:
        tr = FullTraining(seq_len=seq_len, micro_batch=micro_batch, optimizer=ESTIMATOR_OPTIMIZER[optimizer],
                          master_weights=mixed_precision)  # fmt: skip
        est = estimate(config, load="bf16" if mixed_precision else "fp32", training=tr)
        psi = trainable = est.params
        rows = _states(est, n, shard, mixed_precision)
    if shard[0] and n > 1 and not qlora:
        rows.append(("working", "gathered largest layer (16-bit params + grads)", 4 * largest,
                     f"{largest:,} parameters, gathered for its forward/backward"))  # fmt: skip
    if strategy == "ddp" and n > 1:
        grads = next(b for key, _, b, _ in rows if key in ("states.grads", "training.gradients"))
        rows.append(("comm", "DDP gradient buckets", grads, "a copy of the gradients; 0 with gradient_as_bucket_view"))
    if not qlora:
        rows += [("activations", r_.name, r_.bytes, r_.note) for r_ in est.rows if r_.group == "activations"]
    mem = TrainingMemory(str(name), strategy, n, psi, trainable, rows, (dev or {}).get("capacity"))
    mem.deepspeed_gpu_bytes = None if qlora else _deepspeed(strategy, psi, n, largest)
    if qlora and strategy != "single":
        mem.notes.append("QLoRA: the frozen 4-bit base is replicated under DDP/ZeRO-1/2 (only adapter states shard); "
                         "FSDP/ZeRO-3 shard it only with bnb_4bit_quant_storage=torch.bfloat16")  # fmt: skip
    return mem


# training_memory's optimizer names -> the estimator's (whose OPTIMIZERS table prices their states)
ESTIMATOR_OPTIMIZER = {"adamw": "adamw_torch", "adamw_8bit": "adamw_8bit", "sgd": "sgd"}
# the estimator's rows that are per-parameter states of the trained adapters -> which ZeRO shard splits them
_SHARDED_STATES = {"training.adapters": 0, "training.gradients": 1, "training.optimizer": 2}


def _qlora_estimate(config, optimizer: str, seq_len: int, micro_batch: int, r: int, device: Any):
    """The one QLoRA budget: the estimator's, as ``TrainPlan.estimate`` asks for it (compute dtype by the card)."""
    tr = LoraTraining(r=r, seq_len=seq_len, micro_batch=micro_batch, optimizer=ESTIMATOR_OPTIMIZER[optimizer])
    return estimate(config, load="nf4", compute_dtype="auto", training=tr, device=device)


def _qlora_rows(est, n: int, shard: tuple[bool, bool, bool], base_sharded: bool) -> list[tuple]:
    """Every row of the one-GPU estimate; only what sharding changes is divided by the number of GPUs."""
    rows = []
    for row in est.rows:
        index = _SHARDED_STATES.get(row.key)
        base = row.group == "weights" or row.key == "training.fp32_upcast"
        split = shard[index] if index is not None else base and shard[0] and base_sharded
        if split and n > 1:
            note = "bnb_4bit_quant_storage=bf16 lets FSDP shard it" if base else f"/{n} (sharded)"
            rows.append((row.key, row.name, row.bytes // n, note))
        else:
            rows.append((row.key, row.name, row.bytes, row.note))
    return rows


def _lora_params(est) -> int:
    row = est.row("training.adapters")
    return row.bytes // 4  # fp32 adapters


# ----------------------------------------------------------------------------- launching


# Threads a notebook kernel runs for itself (ipykernel's IOPub, heartbeat, control and shell channels, its
# output-pipe watchers and parent poller; IPython's history saver; Colab's kernel; a debugger): every Jupyter
# kernel has about nine, and accelerate's notebook_launcher forks beside them, as it is meant to
KERNEL_THREAD_MODULES = ("ipykernel", "IPython", "jupyter_client", "zmq", "tornado", "google.colab", "debugpy",
                         "pydevd", "_pydevd_bundle")  # fmt: skip
STDERR_TAIL = 8  # lines of the processes' stderr a failed torchrun launch quotes


def other_threads() -> list[str]:
    """Names of the threads running beside this one that a notebook kernel did not start for itself (a memory
    sampler, tqdm's monitor): a fork can copy a lock one of them holds, and leave a child deadlocked."""
    out = []
    for t in threading.enumerate():
        if t is threading.main_thread() or t is threading.current_thread():
            continue
        target = getattr(t, "_target", None)
        origin = getattr(target, "__module__", None) or type(t).__module__ or ""
        if not any(origin == m or origin.startswith(m + ".") for m in KERNEL_THREAD_MODULES):
            out.append(t.name)
    return out


def choose_launcher() -> tuple[str, str]:
    """``(via, why)``: what ``launch(via="auto")`` runs here. Both of accelerate's launchers fork this process:
    ``notebook`` needs CUDA untouched, bitsandbytes not imported and no Accelerator made; ``debug`` (no GPU) and
    ``notebook`` alike need no thread of ours running. Otherwise ``subprocess`` (torchrun)."""
    others = other_threads()
    reasons = [f"threads {', '.join(others)} are running (a fork could deadlock)"] if others else []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        reasons.append("CUDA is initialized in this process (a forked child cannot use it)")
    if "bitsandbytes" in sys.modules and torch.cuda.is_available():  # without a GPU it initializes nothing
        reasons.append("bitsandbytes is imported (it initializes CUDA)")
    if _accelerator_made():
        reasons.append("an Accelerator was made in this process (notebook_launcher refuses that)")
    if reasons:
        return "subprocess", "; ".join(reasons)
    return ("notebook" if torch.cuda.is_available() else "debug"), "nothing in this process makes a fork unsafe"


def _accelerator_made() -> bool:
    state = getattr(sys.modules.get("accelerate.state"), "AcceleratorState", None)
    return bool(getattr(state, "_shared_state", None))


def launch(function, args: tuple = (), *, num_processes: int = 2, via: str = "auto") -> None:
    """Run ``function(*args)`` on ``num_processes`` processes, one per GPU (or gloo on CPU).

    ``via``: ``"notebook"`` is accelerate's ``notebook_launcher`` (GPUs; it forks, so nothing in this
    kernel may have touched CUDA yet), ``"debug"`` its ``debug_launcher`` (CPU processes joined by
    gloo: the DDP code path at CPU speed), ``"subprocess"`` runs ``torchrun`` on
    ``python -m helpers.training.distributed`` (any state of this kernel; ``function`` must be importable from a module,
    not defined in the notebook, and ``args`` JSON). ``"auto"``: :func:`choose_launcher` (a forking launcher
    where this process allows a fork, a notebook kernel's own threads included; torchrun otherwise).

    Raises :class:`DistributedError` before starting anything when torchrun could not import ``function``,
    and with the failing rank's error when torchrun fails.
    """
    from accelerate import debug_launcher, notebook_launcher

    if not callable(function):
        raise DistributedError(f"launch() runs a function on each process, got {function!r:.60}")
    if not isinstance(args, tuple | list):
        raise DistributedError(f"args must be a tuple of the function's arguments, got {args!r:.60}")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise DistributedError(f"num_processes must be a whole number >= 1, got {num_processes!r}")
    cores = max(2, psutil.cpu_count() or 1)
    if not torch.cuda.is_available() and num_processes > cores:  # with GPUs: one process per GPU, checked below
        raise DistributedError(
            f"num_processes={num_processes} without a GPU: each process is a gloo rank holding its own copy of the "
            f"model, and this machine has {psutil.cpu_count()} CPU core(s); use at most {cores}"
        )
    if via not in ("auto", "notebook", "debug", "subprocess"):
        raise DistributedError(f"unknown launcher {via!r}; use auto, notebook, debug or subprocess")
    why = f"via={via!r}"
    if via == "auto":
        via, why = choose_launcher()
    if torch.cuda.is_available() and num_processes > torch.cuda.device_count():
        raise DistributedError(f"{num_processes} processes but {torch.cuda.device_count()} GPU(s); one process per GPU")
    if via == "debug":  # its ranks meet in a temporary file, not on a port
        debug_launcher(function, args, num_processes=num_processes)
    elif via == "notebook":  # not accelerate's fixed 29500: two launches at once on a host would meet there
        notebook_launcher(function, args, num_processes=num_processes, use_port=str(free_port()))
    else:
        _torchrun(_importable(function, why), _json_args(args), num_processes)


def _importable(function, why: str) -> str:
    """``module:qualname`` of ``function`` for torchrun's processes, which import it by name; refused (before a
    process starts) for a function they cannot import: one defined in the notebook, inside a function, a lambda."""
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
    if module and module != "__main__" and name and "<" not in name and "." not in name:
        return f"{module}:{name}"
    if module == "__main__":
        where = "in __main__ (the notebook, or the script run)"
    else:
        where = "inside another function" if "<locals>" in str(name) else "as a lambda or a method"
    short = str(name).rsplit(".", 1)[-1]
    short = short if short.isidentifier() else "my_step"
    raise DistributedError(
        f"{name or repr(function)} is defined {where}, and the torchrun launch ({why}) starts fresh processes that "
        "import the function by name: they cannot import this one. Fix: move it into a module (a .py file: "
        f"%%writefile my_steps.py in a cell, then from my_steps import {short}) and launch that; or "
        "restart the kernel and call launch() before anything touches CUDA or imports bitsandbytes, so "
        "accelerate's notebook_launcher can fork this kernel (a forked process has the notebook's functions)"
    )


def _json_args(args: tuple) -> str:
    try:
        return json.dumps(list(args))
    except (TypeError, ValueError) as e:
        raise DistributedError(f"the torchrun launch passes args as JSON and {e}: pass strings, numbers, lists "
                               "or dicts (a path as str(path)), and load models or data inside the function") from None  # fmt: skip


def free_port() -> int:
    """A TCP port nothing listens on now, for one launch's rendezvous on this machine (as torchrun's
    ``--standalone`` picks one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(target: str, args_json: str, num_processes: int) -> None:
    """``torchrun`` on ``python -m helpers.training.distributed target args``; its stderr goes on to this process's as it
    comes (a notebook shows it) and its last lines make the :class:`DistributedError` of a failed run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
           "-m", "helpers.training.distributed", target, args_json]  # fmt: skip
    run = run_streaming(cmd, desc=f"torchrun, {num_processes} processes")
    if run.code != 0:
        raise DistributedError(_failure(target, run.code, run.tail))


@dataclass
class StreamedRun:
    """How a launcher process ended: its exit code, its last stderr lines, whether the timeout stopped it."""

    code: int
    tail: list[str]
    timed_out: bool = False


def run_streaming(cmd: list[str], *, timeout: float | None = None, tail_lines: int = 400, desc: str = "launch",
                  echo: bool = False) -> StreamedRun:  # fmt: skip
    """Run a launcher (torchrun, accelerate launch) and wait for it. Its ranks' stderr is collapsed into one
    progress line (``desc``, the time so far and the latest line any rank wrote: its loss, a load) instead of every
    rank's lines interleaved; ``echo=True`` passes each line on as it comes. The last ``tail_lines`` are kept
    for the error of a failed run; an interrupted cell, or ``timeout`` seconds passed, terminates it (the
    launcher passes SIGTERM on to its ranks), so no rank is left running."""
    tail: deque[str] = deque(maxlen=tail_lines)
    # text mode reads a "\r" as a line end: a rank's tqdm redraw is one line here
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        proc.terminate()

    watchdog = threading.Timer(timeout, stop) if timeout else None
    if watchdog:
        watchdog.start()
    status = None if echo else _launch_line(desc)
    try:
        for line in proc.stderr:
            if echo:
                sys.stderr.write(line)
            elif line.strip():
                status.set_postfix_str(_latest(line), refresh=False)
                status.update()
            tail.append(line.rstrip("\n"))
        code = proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    finally:
        if watchdog:
            watchdog.cancel()
        if status is not None:
            status.set_postfix_str("done" if proc.poll() == 0 else f"exited with status {proc.poll()}")
            status.close()
    return StreamedRun(code, list(tail), fired.is_set())


def _launch_line(desc: str):
    """The one progress line of a launch: how long it has run, and the latest thing a rank said."""
    return progress_bar(desc=desc, bar_format="{desc}: {elapsed}{postfix}", mininterval=0.5)


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s*")


def _latest(line: str, width: int = 72) -> str:
    """A rank's line as the launch line's postfix: its rank prefix dropped, cut to ``width``."""
    text = " ".join(_RANK_PREFIX.sub("", line.strip()).split())
    return text if len(text) <= width else text[: width - 1] + "…"


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt)\b.*)$")


def _failure(target: str, code: int, lines: list[str]) -> str:
    """What a failed torchrun run says: the ranks' exceptions (deduplicated), then the last lines the ranks wrote
    (torchrun's own summary after them, its ChildFailedError traceback and failure table, is left out)."""
    agent = next((i for i, line in enumerate(lines) if "torch/distributed/elastic" in line
                  or "torch.distributed.elastic" in line), len(lines))  # fmt: skip
    ranks = lines[:agent] or lines
    # two ranks write to one pipe: their lines can interleave mid-line ("Error:  Expecting"), so the
    # spacing is normalised before the same error of each rank is said once
    errors = list(dict.fromkeys(" ".join(m.group(1).split()) for m in map(_ERROR_LINE.match, ranks) if m))
    head = f"torchrun running {target} on each process exited with status {code}"
    said = f": {'; '.join(errors[-3:])}" if errors else ""
    last = "\n".join(f"  {line}" for line in ranks[-STDERR_TAIL:])
    return f"{head}{said}\nthe processes' last lines:\n{last}" if last else head + said


@dataclass
class RankReport:
    """What one process did: its losses, its memory (RSS on CPU, peak allocated on a GPU), its adapters' checksum."""

    rank: int
    world_size: int
    backend: str
    device: str
    losses: list[float]
    rss: list[int]
    cuda_peak: int | None
    seconds: float
    trainable: int
    checksum: float
    distributed_type: str = ""  # accelerate's: MULTI_CPU / MULTI_GPU for DDP, FSDP, DEEPSPEED

    @property
    def peak_rss(self) -> int:
        return max(self.rss)

    def __str__(self) -> str:
        gpu = f", GPU peak {format_bytes(self.cuda_peak)}" if self.cuda_peak is not None else ""
        return (f"rank {self.rank}/{self.world_size} ({self.backend}, {self.device}): loss {self.losses[0]:.3f} -> "
                f"{self.losses[-1]:.3f} in {len(self.losses)} steps, {self.seconds:.1f} s; RSS peak "
                f"{format_bytes(self.peak_rss)}{gpu}")  # fmt: skip


def ddp_qlora_worker(model: str, out_dir: str, steps: int = 8, seq_len: int = 64, micro_batch: int = 2,
                     r: int = 8, learning_rate: float = 1e-3, load: str = "nf4") -> None:  # fmt: skip
    """One rank of a DDP QLoRA run (what :func:`launch` starts): load, prepare, train its data shard,
    write ``rank<N>.json`` to ``out_dir``. Everything is imported and loaded here, inside the process."""
    from accelerate import Accelerator

    from ..loading.loader import load as load_model
    from .adapters import prepare_qlora
    from .data import build_dataset, collate, load_instructions
    from .plan import TrainPlan

    _quiet_rank()  # before the Accelerator, whose thread-count warning each rank would print
    acc = Accelerator(cpu=not torch.cuda.is_available())
    if acc.device.type == "cpu":
        torch.set_num_threads(1)  # N processes share the cores: one thread each is faster than oversubscribing
    plan = TrainPlan(model, load=load, r=r, alpha=2 * r, seq_len=seq_len, batch_size=micro_batch,
                     micro_batch=micro_batch, max_steps=steps, learning_rate=learning_rate, precision="fp32"
                     if acc.device.type == "cpu" else "auto")  # fmt: skip
    placement = {"": acc.local_process_index} if acc.device.type == "cuda" else None
    base, tokenizer, _ = load_model(plan.load_plan(device_map=placement), check=False)
    peft_model, params = prepare_qlora(base, plan)
    rows = load_instructions()
    data = build_dataset(tokenizer, rows, seq_len)[acc.process_index :: acc.num_processes]
    pad = tokenizer.pad_token_id or 0
    batches = [collate(data[i : i + micro_batch], pad) for i in range(0, len(data) - micro_batch + 1, micro_batch)]
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=learning_rate)
    ddp_model, optimizer = acc.prepare(peft_model, optimizer)
    proc = psutil.Process()
    losses, rss, started = [], [], time.perf_counter()
    ddp_model.train()
    bar = _rank_bar(acc, steps)
    for step in range(steps):
        batch = {k: v.to(acc.device) for k, v in batches[step % len(batches)].items()}
        loss = ddp_model(**batch).loss
        acc.backward(loss)  # DDP all-reduces the adapters' gradients here
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(acc.reduce(loss.detach(), reduction="mean").item())
        rss.append(proc.memory_info().rss)
        bar.set_postfix_str(f"loss {losses[-1]:.3f}", refresh=False)
        bar.update()
    bar.close()
    checksum = sum(p.detach().double().abs().sum().item() for p in peft_model.parameters() if p.requires_grad)
    report = RankReport(acc.process_index, acc.num_processes, str(acc.state.backend), str(acc.device), losses, rss,
                        torch.cuda.max_memory_allocated() if acc.device.type == "cuda" else None,
                        time.perf_counter() - started, params.trainable, checksum,
                        str(acc.distributed_type.value))  # fmt: skip
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{acc.process_index}.json").write_text(json.dumps(report.__dict__))
    acc.wait_for_everyone()
    acc.end_training()


def _quiet_rank() -> None:
    """In a rank, no progress bar of transformers' (each rank's weight-loading bar, interleaved with the others')
    and no warning repeated once per rank: the launch shows one progress line, rank 0's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _rank_bar(acc, steps: int):
    """Rank 0's bar of the training steps (the other ranks keep step with it: DDP syncs every step)."""
    from tqdm import tqdm  # plain text: a forked rank cannot drive the kernel's widgets; a "\r" redraw is one line

    # under torchrun our stderr is the launch's pipe, which the launching process folds into its one line; a
    # rank forked from a notebook kernel writes to the kernel's streams, where stderr is a red warning block
    forked = type(sys.stderr).__module__.split(".")[0] == "ipykernel"
    return tqdm(total=steps, desc=f"DDP QLoRA, {acc.num_processes} processes, rank 0",
                file=sys.stdout if forked else sys.stderr, disable=acc.process_index != 0, ncols=80,
                mininterval=0.5)  # fmt: skip


@dataclass
class DDPRun:
    """Every rank's report of a :func:`run_ddp_qlora` run."""

    ranks: list[RankReport]

    @property
    def loss_fell(self) -> bool:
        return all(r.losses[-1] < r.losses[0] for r in self.ranks)

    @property
    def in_sync(self) -> bool:
        """The adapters are the same on every rank (DDP averaged the gradients)."""
        sums = [r.checksum for r in self.ranks]
        return max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0]))

    def __str__(self) -> str:
        head = f"DDP QLoRA on {len(self.ranks)} processes: loss {'fell' if self.loss_fell else 'did NOT fall'}, " + (
            "adapters identical on every rank" if self.in_sync else "adapters DIFFER across ranks"
        )
        return "\n".join([head, *(f"  {r}" for r in self.ranks)])

    def __repr__(self) -> str:
        return self.__str__()

    def _repr_html_(self) -> str:
        rows = [[r.rank, r.backend, r.device, f"{r.losses[0]:.3f} → {r.losses[-1]:.3f}", format_bytes(r.peak_rss),
                 format_bytes(r.cuda_peak) if r.cuda_peak is not None else "-", f"{r.seconds:.1f} s"] for r in self.ranks]  # fmt: skip
        return table(["rank", "backend", "device", "loss", "RSS peak", "GPU peak", "time"], rows,
                     title=escape(str(self).splitlines()[0]))  # fmt: skip


def worker_args(model: str, out_dir: str | Path, **worker_kwargs) -> tuple:
    """:func:`ddp_qlora_worker`'s arguments, its defaults filled in (tiny-model sized: 8 steps of 64 tokens)."""
    kwargs = {
        "steps": 8,
        "seq_len": 64,
        "micro_batch": 2,
        "r": 8,
        "learning_rate": 1e-3,
        "load": "nf4",
        **worker_kwargs,
    }
    return (str(model), str(out_dir), *kwargs.values())


def collect_ranks(out_dir: str | Path, num_processes: int) -> DDPRun:
    """The reports the ranks of a DDP QLoRA run wrote to ``out_dir``; an error when one is missing."""
    files = sorted(Path(out_dir).glob("rank*.json"))
    if len(files) != num_processes:
        raise DistributedError(
            f"{len(files)} of {num_processes} ranks wrote a report to {out_dir}; see the output above"
        )
    return DDPRun([RankReport(**json.loads(f.read_text())) for f in files])


def clear_ranks(out_dir: str | Path) -> Path:
    """``out_dir`` without an earlier run's rank reports (a rank that fails must not be read from an old file)."""
    out = Path(out_dir)
    for old in out.glob("rank*.json"):
        old.unlink()
    return out


def run_ddp_qlora(
    model: str, out_dir: str | Path, *, num_processes: int = 2, via: str = "auto", **worker_kwargs
) -> DDPRun:
    """Launch :func:`ddp_qlora_worker` on ``num_processes`` processes and collect their reports."""
    out = clear_ranks(out_dir)
    launch(ddp_qlora_worker, worker_args(model, out, **worker_kwargs), num_processes=num_processes, via=via)
    return collect_ranks(out, num_processes)


def _main(argv: list[str]) -> None:
    """``python -m helpers.training.distributed module:function '<json args>'``: one rank, as torchrun starts it."""
    module, _, name = argv[0].partition(":")
    # a rank stopped at a launch's timeout writes where each of its threads was, for the launch's error
    faulthandler.register(signal.SIGTERM, chain=True)
    getattr(importlib.import_module(module), name)(*json.loads(argv[1]))


if __name__ == "__main__":
    _main(sys.argv[1:])
