"""Past one card with the engine the user already runs: the accelerate config (and, for ZeRO, the DeepSpeed JSON)
that realise a :class:`~helpers.TrainPlan` on several GPUs, and ``accelerate launch`` on it.

oomkit never re-implements distribution. :func:`write_launch_config` writes what ``accelerate config`` would have
written for this plan (``distributed_type`` MULTI_GPU for DDP, FSDP, or DEEPSPEED with a ``deepspeed_config_file``),
the mixed precision the cards allow (fp16 on a T4, bf16 from sm_80, none on a CPU: the one rule of
:func:`helpers.core.devices.compute_dtype_rule`), the batch split so that ``micro_batch × accumulation × processes``
is the plan's ``batch_size``, and the per-GPU memory of that strategy from
:func:`helpers.training_memory` for N machines × M GPUs. :func:`launch_plan` runs
``accelerate launch --config_file <written> -m <module> ...`` and raises a :class:`DistributedError` with the
ranks' errors when it fails.

On a machine without a GPU the config is written for processes joined by gloo: ``accelerate launch`` runs
``use_cpu: true`` configs as one process (several only through mpirun), so a CPU config keeps
``use_cpu: false`` and lets torchrun start the processes, which find no GPU and take gloo.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from ..core.devices import MACHINE_RAM, compute_dtype_rule, resolve_devices
from ..core.memory import ram_readout
from ..core.units import format_bytes
from ..core.vocab import (
    BF16,
    FP16,
    FP32,
    QUANTIZED,  # a frozen quantized base: training_memory's QLoRA count
    half_dtype,
)
from ..loading.host_ram import RankRam, rank_ram
from .distributed import (
    DDPRun,
    DistributedError,
    TrainingMemory,
    clear_ranks,
    collect_ranks,
    free_port,
    run_streaming,
    training_memory,
    worker_args,
)

if TYPE_CHECKING:
    from .plan import TrainPlan

__all__ = ["LAUNCH_STRATEGIES", "OFFLOADS", "LaunchConfig", "write_launch_config", "launch_plan", "launch_qlora"]

# what accelerate calls each strategy oomkit writes a config for
LAUNCH_STRATEGIES = {"ddp": "MULTI_GPU", "fsdp": "FSDP", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}
OFFLOADS = ("optimizer", "params")
TAIL_LINES = 400  # lines of the launch's stderr kept for the error of a failed run
TIMEOUT_LINES = 40  # of them, shown when a launch is stopped at its timeout (each stopped rank dumps its stacks)


@dataclass
class LaunchConfig:
    """What :func:`write_launch_config` wrote: the accelerate config, the DeepSpeed JSON (ZeRO only), and the
    per-GPU memory of the plan under that strategy."""

    strategy: str
    config_file: Path
    deepspeed_file: Path | None
    num_machines: int
    processes_per_machine: int
    mixed_precision: str  # accelerate's word: "fp16", "bf16" or "no"
    micro_batch: int
    accumulation: int
    memory: TrainingMemory
    on_cpu: bool = False
    notes: list[str] = field(default_factory=list)
    offloads: tuple[str, ...] = ()
    host_ram: RankRam | None = None  # the processes of one machine against its RAM (checked again at launch)
    main_process_port: int | None = None  # as written; None on one machine: a free port at each launch

    @property
    def offloaded_bytes(self) -> int:
        """Bytes per process the offload keeps in CPU RAM instead of the GPU: the optimizer states, the parameters
        (FSDP's offload moves their gradients with them)."""
        groups = {"optimizer": ["optimizer"], "params": ["params", "grads"] if self.strategy == "fsdp" else ["params"]}
        return sum(self.memory.state_bytes(kind) for o in self.offloads for kind in groups[o])

    @property
    def gpu_bytes(self) -> int:
        """Per-GPU bytes of a training step under this config: training_memory's, less what is offloaded."""
        return self.memory.total - self.offloaded_bytes

    @property
    def world_size(self) -> int:
        return self.num_machines * self.processes_per_machine

    @property
    def effective_batch(self) -> int:
        """Examples per optimizer step over every process: micro-batch × accumulation × world size."""
        return self.micro_batch * self.accumulation * self.world_size

    def command(self, module: str, args: list[str] | tuple = ()) -> list[str]:
        """The ``accelerate launch`` command line that runs ``python -m module args`` on every process.

        On one machine without a written port it names a free one: accelerate's default, 29500, is every
        launch's; accelerate moves off it when it is taken, but two launches starting together on a host
        (two notebooks, a notebook and a script) both found it free and met in one rendezvous, where they
        hung or broke off with "Connection closed by peer"."""
        port = []
        if self.num_machines == 1 and self.main_process_port is None:
            port = ["--main_process_port", str(free_port())]
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(self.config_file), *port,
                "-m", module, *map(str, args)]  # fmt: skip

    def __str__(self) -> str:
        where = "CPU processes (gloo)" if self.on_cpu else "GPUs"
        files = f"{self.config_file}" + (f" and {self.deepspeed_file}" if self.deepspeed_file else "")
        lines = [
            f"{self.strategy} on {self.num_machines} machine(s) × {self.processes_per_machine} {where}, "
            f"mixed precision {self.mixed_precision}: micro-batch {self.micro_batch} × accumulation "
            f"{self.accumulation} × {self.world_size} processes = {self.effective_batch} examples per step",
            f"written: {files}",
            f"per GPU: {format_bytes(self.gpu_bytes)} ({self.memory.strategy} over {self.num_machines} machine(s) × "
            f"{self.processes_per_machine} GPU(s)"
            + (f", {format_bytes(self.memory.capacity)} each" if self.memory.capacity else "")
            + ")",
            f"launch: accelerate launch --config_file {self.config_file} train.py",
        ]
        if self.offloads:
            lines.insert(
                3, f"  and {format_bytes(self.offloaded_bytes)} per process in CPU RAM ({' and '.join(self.offloads)})"
            )
        if self.host_ram is not None:
            lines.append(f"host RAM: {self.host_ram.check().summary}")
            if self.host_ram.fix:
                lines.append(f"  fix: {self.host_ram.fix}")
        if self.num_machines > 1:
            lines.append("  on every machine, with its own --machine_rank (0 on the main one, at the address written)")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def __repr__(self) -> str:
        return self.__str__()


def _targets(devices: Any) -> tuple[int, list[dict] | None]:
    """``(processes per machine, GPU dicts or None for CPU processes)`` for ``devices``: a count (this machine's
    GPUs, or CPU processes without one), a set name such as ``"kaggle-2xt4"``, a list of presets, ``"current"``."""
    if isinstance(devices, bool):
        raise DistributedError(f"devices is a count, a set such as 'kaggle-2xt4' or a list of GPUs, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise DistributedError(f"devices={devices}: pass the number of processes, a whole number >= 1")
        if not torch.cuda.is_available():
            return devices, None
        found = torch.cuda.device_count()
        if devices > found:
            raise DistributedError(f"devices={devices} but this machine has {found} GPU(s): one process per GPU; "
                                   f"pass devices={found} or fewer")  # fmt: skip
        return devices, [dev for _, dev in resolve_devices("current")[:devices]]
    try:
        gpus = [dev for _, dev in resolve_devices(devices)]
    except Exception as e:
        raise DistributedError(f"devices: {e}") from None
    return len(gpus), gpus


def _mixed_precision(plan: TrainPlan, gpus: list[dict] | None) -> str:
    """accelerate's ``mixed_precision`` for the plan on these cards: the plan's own precision when it names one,
    else what ``auto`` means on the weakest card (fp16 on a T4, bf16 from sm_80), ``no`` on CPU processes."""
    if gpus is None:
        return "no"
    auto = half_dtype(all(compute_dtype_rule(g) == BF16 for g in gpus))  # the weakest card decides
    chosen = auto if plan.precision == "auto" else plan.precision
    if chosen == BF16 and auto == FP16:
        raise DistributedError("the plan asks for bf16 but a card here computes in fp16 only (bf16 starts with "
                               "sm_80, a T4 is sm_75): pass precision='auto' or 'fp16'")  # fmt: skip
    return "no" if chosen == FP32 else chosen


def _offloads(strategy: str, offload: Any) -> tuple[str, ...]:
    """The offloads asked for (``None``, ``"optimizer"``, ``"params"`` or both), checked against the strategy."""
    if strategy not in LAUNCH_STRATEGIES:
        raise DistributedError(f"unknown strategy {strategy!r}; use one of {', '.join(LAUNCH_STRATEGIES)}")
    asked = () if offload in (None, False) else (offload,) if isinstance(offload, str) else tuple(offload)
    bad = [o for o in asked if o not in OFFLOADS]
    if bad:
        raise DistributedError(f"unknown offload {bad[0]!r}; use None, 'optimizer', 'params' or both as a list")
    if asked and strategy == "ddp":
        raise DistributedError("DDP keeps every state on every GPU and offloads nothing: use strategy='zero2' "
                               "(offload='optimizer'), 'zero3' or 'fsdp' (offload='params') to move states to CPU")  # fmt: skip
    if "params" in asked and strategy == "zero2":
        raise DistributedError("ZeRO-2 does not partition parameters, so it cannot offload them: use "
                               "strategy='zero3' for offload='params', or offload='optimizer' with ZeRO-2")  # fmt: skip
    if asked == ("optimizer",) and strategy == "fsdp":
        raise DistributedError("FSDP offloads the parameters, and with them the gradients and the optimizer step, "
                               "together: pass offload='params' with FSDP, or use strategy='zero2' or 'zero3'")  # fmt: skip
    return tuple(dict.fromkeys(asked))


def _batch_split(plan: TrainPlan, world: int) -> tuple[int, int, list[str]]:
    """``(micro_batch, accumulation, notes)`` so that micro × accumulation × world is the plan's batch_size."""
    if plan.micro_batch is None:
        raise DistributedError("the plan has no micro_batch yet: run find_micro_batch(plan) or pass "
                               "TrainPlan(micro_batch=...) before writing a launch config")  # fmt: skip
    micro, per_step = plan.micro_batch, plan.micro_batch * world
    accumulation = max(1, round(plan.batch_size / per_step))
    notes = []
    if accumulation * per_step != plan.batch_size:
        notes.append(f"batch_size {plan.batch_size} is not a multiple of micro_batch {micro} × {world} processes: "
                     f"each step sees {accumulation * per_step} examples")  # fmt: skip
    return micro, accumulation, notes


def _deepspeed_json(strategy: str, offloads: tuple[str, ...], mixed: str, micro: int, accumulation: int) -> dict:
    """The DeepSpeed config (its documented schema); ``train_batch_size`` is ``auto``: accelerate fills it as
    micro × accumulation × world size at launch, so the same file serves any number of machines."""
    zero: dict[str, Any] = {"stage": 3 if strategy == "zero3" else 2, "overlap_comm": True,
                            "contiguous_gradients": True, "reduce_bucket_size": 50_000_000}  # fmt: skip
    if "optimizer" in offloads:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if "params" in offloads:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if strategy == "zero3":
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    fp16: dict[str, Any] = {"enabled": mixed == FP16}
    if mixed == FP16:  # dynamic loss scaling: fp16's range is narrow (DeepSpeed's documented defaults)
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "fp16": fp16,
        "bf16": {"enabled": mixed == BF16},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def _fsdp_config(offloads: tuple[str, ...]) -> dict:
    """accelerate's ``fsdp_config`` (FSDP2, as ``accelerate config`` offers it): every decoder layer wrapped."""
    return {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_offload_params": "params" in offloads,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
    }


def _cluster(strategy, mixed, per_machine, machines, rank, ip, port, deepspeed_file, offloads) -> dict:
    """The accelerate config's keys, as ``accelerate config`` writes them (``ClusterConfig``'s fields)."""
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": LAUNCH_STRATEGIES[strategy],
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": rank,
        "main_training_function": "main",
        "mixed_precision": mixed,
        "num_machines": machines,
        "num_processes": per_machine * machines,  # accelerate counts every process of every machine
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if ip is not None:
        out["main_process_ip"] = ip
    if port is not None:
        out["main_process_port"] = port
    if strategy == "fsdp":
        out["fsdp_config"] = _fsdp_config(offloads)
    if deepspeed_file is not None:
        out["deepspeed_config"] = {
            "deepspeed_config_file": str(deepspeed_file),
            "deepspeed_multinode_launcher": "standard",
        }
        # the precision is the JSON's fp16/bf16 blocks: accelerate refuses a mixed_precision beside a
        # deepspeed_config_file (DeepSpeedPlugin's config checks), and ``accelerate config`` leaves it out
        del out["mixed_precision"]
    return out


def _check_machines(num_machines: Any, machine_rank: Any, ip: Any, port: Any) -> None:
    for name, value, low in (("num_machines", num_machines, 1), ("machine_rank", machine_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DistributedError(f"{name} must be a whole number >= {low}, got {value!r}")
    if machine_rank >= num_machines:
        raise DistributedError(
            f"machine_rank {machine_rank} of {num_machines} machine(s): ranks are 0 to {num_machines - 1}"
        )
    if num_machines > 1 and (ip is None or port is None):
        raise DistributedError(f"{num_machines} machines meet at the main machine: pass main_process_ip "
                               "(its address, reachable from the others) and main_process_port (e.g. 29500)")  # fmt: skip
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise DistributedError(f"main_process_port must be a TCP port 1-65535, got {port!r}")


def write_launch_config(
    plan: TrainPlan,
    out_dir: str | Path,
    *,
    devices: Any = "kaggle-2xt4",
    strategy: str = "ddp",
    offload: Any = None,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
) -> LaunchConfig:
    """Write ``accelerate_config.yaml`` (and ``deepspeed_config.json`` for ZeRO) into ``out_dir`` for ``plan``.

    Args:
        devices: the GPUs of one machine: ``"kaggle-2xt4"``, a list such as ``["t4", "t4"]``, ``"current"``, or a
            count (this machine's GPUs; CPU processes joined by gloo on a machine without one).
        strategy: ``"ddp"``, ``"fsdp"`` (FULL_SHARD), ``"zero2"`` or ``"zero3"`` (DeepSpeed).
        offload: ``None``, ``"optimizer"`` (ZeRO-2/3), ``"params"`` (ZeRO-3, FSDP) or both as a list.
        num_machines, machine_rank, main_process_ip, main_process_port: multi-node; every machine runs the same
            config with its own ``machine_rank``.
    """
    offloads = _offloads(strategy, offload)
    _check_machines(num_machines, machine_rank, main_process_ip, main_process_port)
    per_machine, gpus = _targets(devices)
    mixed = _mixed_precision(plan, gpus)
    world = per_machine * num_machines
    micro, accumulation, notes = _batch_split(plan, world)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ds_file = None
    if strategy.startswith("zero"):
        ds_file = out / "deepspeed_config.json"
        ds_file.write_text(json.dumps(_deepspeed_json(strategy, offloads, mixed, micro, accumulation), indent=2) + "\n")
    config_file = out / "accelerate_config.yaml"
    cluster = _cluster(strategy, mixed, per_machine, num_machines, machine_rank, main_process_ip,
                       main_process_port, ds_file, offloads)  # fmt: skip
    config_file.write_text(yaml.safe_dump(cluster, sort_keys=True))
    memory = training_memory(plan.model, strategy=strategy, world_size=world, qlora=plan.load in QUANTIZED,
                             mixed_precision=mixed != "no", seq_len=plan.seq_len, micro_batch=micro, r=plan.r,
                             device=gpus[0] if gpus else None)  # fmt: skip
    if gpus is None and strategy == "fsdp":  # accelerate/state.py: FSDP is entered from MULTI_GPU-like types only
        notes.append(
            "on CPU processes accelerate runs this config as DDP (MULTI_CPU): it shards with FSDP on GPUs only"
        )
    if plan.load not in QUANTIZED:
        notes.append("per-GPU memory counts full fine-tuning of the base (LoRA on it needs less)")
    config = LaunchConfig(strategy, config_file, ds_file, num_machines, per_machine, mixed, micro, accumulation,
                          memory, gpus is None, notes, offloads, main_process_port=main_process_port)  # fmt: skip
    machine = devices if isinstance(devices, str) and devices in MACHINE_RAM else "current"
    config.host_ram = rank_ram(plan.model, per_machine, machine=machine, offloaded=config.offloaded_bytes)
    return config


def launch_plan(
    config: LaunchConfig, module: str, args: list[str] | tuple = (), *, timeout: float | None = None
) -> None:
    """Run ``accelerate launch --config_file <config> -m module args`` and wait for it. Its stderr goes on to this
    process's as it comes; a failure raises :class:`DistributedError` with the ranks' last lines."""
    if not isinstance(config, LaunchConfig):
        raise DistributedError(f"launch_plan runs what write_launch_config wrote, got {config!r:.60}")
    if not isinstance(module, str) or not module.replace(".", "_").isidentifier():
        raise DistributedError(
            f"module is a dotted module name such as 'helpers.training.distributed', got {module!r:.60}"
        )
    if not config.on_cpu and not torch.cuda.is_available():
        raise DistributedError(f"{config.config_file} was written for GPUs and this machine has none: write one "
                               "with devices=<number of processes> here, or launch it where the GPUs are")  # fmt: skip
    if not config.on_cpu and config.processes_per_machine > torch.cuda.device_count():
        raise DistributedError(f"{config.config_file} starts {config.processes_per_machine} processes per machine "
                               f"and this one has {torch.cuda.device_count()} GPU(s): one process per GPU")  # fmt: skip
    if config.deepspeed_file is not None and importlib.util.find_spec("deepspeed") is None:
        raise DistributedError(f"{config.strategy} runs on DeepSpeed, which is not installed here: pip install deepspeed "
                               "(it builds its CUDA ops on first use), or write the config with strategy='fsdp'")  # fmt: skip
    if config.host_ram is not None:  # written for another machine, perhaps: against this one's RAM now
        here = replace(config.host_ram, available=ram_readout().total, machine="this machine")
        if not here.fits:
            raise DistributedError(f"not launched: {here.check().summary} (every rank loads its own copy before "
                                   f"sharding). Fix: {here.fix}")  # fmt: skip
    run = run_streaming(config.command(module, args), timeout=timeout, tail_lines=TAIL_LINES,
                        desc=f"accelerate launch, {config.world_size} processes")  # fmt: skip
    if run.timed_out:
        last = "\n".join(f"  {line}" for line in list(run.tail)[-TIMEOUT_LINES:])
        raise DistributedError(f"accelerate launch of {module} ran past timeout={timeout} s and was stopped; "
                               f"the last lines (a stopped rank writes where it was):\n{last}")  # fmt: skip
    code, tail = run.code, run.tail
    if code != 0:
        errors = [line for line in tail if "Error" in line or "Exception" in line][-3:]
        last = "\n".join(f"  {line}" for line in list(tail)[-8:])
        raise DistributedError(f"accelerate launch of {module} ({config.strategy}, {config.world_size} processes) "
                               f"exited with status {code}: {'; '.join(errors)}\nthe last lines:\n{last}")  # fmt: skip


def launch_qlora(config: LaunchConfig, model: str, out_dir: str | Path, *, timeout: float | None = None,
                 **worker_kwargs) -> DDPRun:  # fmt: skip
    """The DDP QLoRA run of :func:`helpers.training.distributed.run_ddp_qlora`, launched through the accelerate config
    :func:`write_launch_config` wrote (``accelerate launch --config_file ...``): one process per GPU it names
    (CPU processes joined by gloo without one), each rank's report collected."""
    out = clear_ranks(out_dir)
    worker = ["helpers.training.distributed:ddp_qlora_worker", json.dumps(worker_args(model, out, **worker_kwargs))]
    launch_plan(config, "helpers.training.distributed", worker, timeout=timeout)
    return collect_ranks(out, config.world_size)
