"""Host RAM for the processes of one machine before a multi-process launch.

Every rank of a DDP, FSDP or ZeRO run is its own Python process that loads its own copy of the model
before anything is sharded or quantized, so a machine needs the load-time RAM of one process as many
times as it starts processes (Kaggle's 2×T4 has about 29 GB; the source documents' 3-GPU box had
12 GB, and its kernel died there). What one rank holds:

- its runtime: Python, torch, transformers, peft and accelerate imported (measured on CPU: about 376 MiB
  of RSS; a CUDA process adds the driver's host side, not counted here until the GPU check measures it);
- the checkpoint while it loads: a ``.bin`` shard is unpickled whole into each process (×1.2, the copy
  ``load_checks`` measures), while safetensors are memory-mapped: the page cache of one file is shared
  by every rank and can be dropped, so it is not held per rank;
- what the strategy offloads to CPU RAM for the whole run (ZeRO/FSDP optimizer states or parameters):
  :attr:`helpers.training.launch_config.LaunchConfig.offloaded_bytes` per process.

The low-RAM path when they do not fit: safetensors shards (memory-mapped, shared), fewer processes per
machine, or no CPU offload.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.arguments import whole_number
from ..core.checks import Check
from ..core.devices import MACHINE_RAM
from ..core.errors import OomkitError
from ..core.html import escape, table
from ..core.memory import ram_readout
from ..core.sources import checkpoint_size, memory_mapped
from ..core.units import MAX_BYTES, MiB, format_bytes
from .checks import PICKLE_LOAD_FACTOR

__all__ = ["PROCESS_RUNTIME_RAM", "RankRam", "RankRamError", "rank_ram"]

# RSS of a process that imported torch, transformers, peft and accelerate, measured on CPU (torch 2.13).
PROCESS_RUNTIME_RAM = 376 * MiB
# Leave this share of the machine's RAM to the OS, the notebook kernel and the launcher itself.
RAM_SHARE = 0.9


class RankRamError(OomkitError, ValueError):
    """A process count or machine that cannot be checked; the message says what to pass."""


@dataclass
class RankRam:
    """The host RAM ``processes`` ranks need on one machine while they load and train, against its RAM."""

    model: str
    processes: int
    runtime: int  # per process
    checkpoint: int  # per process while loading (0 for memory-mapped safetensors)
    offloaded: int  # per process, for the whole run (ZeRO/FSDP CPU offload)
    available: int  # the machine's RAM this check is against
    source: str  # the checkpoint's files, as checkpoint_size() describes them
    machine: str  # "this machine" or a MACHINE_RAM name

    @property
    def per_rank(self) -> int:
        return self.runtime + self.checkpoint + self.offloaded

    @property
    def total(self) -> int:
        return self.processes * self.per_rank

    @property
    def fits(self) -> bool:
        return self.total <= self.available * RAM_SHARE

    @property
    def fix(self) -> str | None:
        """What to change when the ranks do not fit: the low-RAM path, most effective first."""
        if self.fits:
            return None
        ways = []
        if self.checkpoint:
            ways.append("a safetensors checkpoint (memory-mapped: one page cache shared by every rank, not a copy "
                        "each); save_pretrained(..., safe_serialization=True) converts a .bin one")  # fmt: skip
        if self.offloaded:
            ways.append(f"no CPU offload (it keeps {format_bytes(self.offloaded)} per process in RAM)")
        fewer = max(1, int(self.available * RAM_SHARE // self.per_rank))
        if fewer < self.processes:
            ways.append(f"{fewer} process(es) on this machine instead of {self.processes}")
        return "; or ".join(ways) or "a machine with more RAM"

    def check(self) -> Check:
        """This result as a preflight-style :class:`~helpers.core.checks.Check`."""
        status = "pass" if self.fits else "fail"
        return Check("RAM per process", status, self._summary(), self.fix,
                     {"per_rank": self.per_rank, "total": self.total, "available": self.available})  # fmt: skip

    def _summary(self) -> str:
        verdict = "fit" if self.fits else "do not fit"
        unknown = "" if self.checkpoint or memory_mapped(self.source) else f" (checkpoint not counted: {self.source})"
        return (f"{self.processes} processes × {format_bytes(self.per_rank)} = {format_bytes(self.total)} of "
                f"{format_bytes(self.available)} RAM ({self.machine}): {verdict}{unknown}")  # fmt: skip

    def __str__(self) -> str:
        lines = [
            f"host RAM for {self.model}: {self._summary()}",
            f"  per process: runtime {format_bytes(self.runtime)} + checkpoint while loading "
            f"{format_bytes(self.checkpoint)} ({self.source}) + CPU offload {format_bytes(self.offloaded)}",
        ]
        return "\n".join(lines + ([f"  fix: {self.fix}"] if self.fix else []))

    def _repr_html_(self) -> str:
        rows = [["runtime", format_bytes(self.runtime)], ["checkpoint while loading", format_bytes(self.checkpoint)],
                ["CPU offload", format_bytes(self.offloaded)], ["per process", format_bytes(self.per_rank)],
                [f"× {self.processes} processes", format_bytes(self.total)],
                [f"RAM on {self.machine}", format_bytes(self.available)]]  # fmt: skip
        fix = f"<p>fix: {escape(self.fix)}</p>" if self.fix else ""
        return f"<p>{escape(self._summary())}</p>" + table(["host RAM", "bytes"], rows) + fix

    def __repr__(self) -> str:
        return self.__str__()


def _machine_ram(machine: str | int | None) -> tuple[int, str]:
    if machine is None or machine == "current":
        return ram_readout().total, "this machine"
    if isinstance(machine, int) and not isinstance(machine, bool) and machine > 0:
        return machine, f"a machine of {format_bytes(machine)}"
    if isinstance(machine, str) and machine in MACHINE_RAM:
        return MACHINE_RAM[machine], machine
    raise RankRamError(f"machine is 'current', one of {', '.join(MACHINE_RAM)} or its RAM in bytes, got {machine!r}")


def rank_ram(model: str, processes: int, *, machine: str | int | None = "current", offloaded: int = 0) -> RankRam:
    """Whether ``processes`` ranks, each loading ``model`` (hub id or local folder) and keeping ``offloaded``
    bytes in CPU RAM, fit the RAM of ``machine`` ("current", ``"kaggle-2xt4"``, ``"colab"``, or bytes)."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise RankRamError(f"processes is how many ranks this machine starts (1 or more), got {processes!r}")
    whole_number("offloaded", offloaded, minimum=0, maximum=MAX_BYTES, error=RankRamError)  # bytes kept in RAM
    available, name = _machine_ram(machine)
    total, largest, source = checkpoint_size(model)
    if largest is None or memory_mapped(source):
        held = 0  # safetensors: the ranks share one page cache the kernel can drop; unknown: not counted
    else:
        held = int(largest * PICKLE_LOAD_FACTOR)
    return RankRam(str(model), processes, PROCESS_RUNTIME_RAM, held, int(offloaded), available, source, name)
