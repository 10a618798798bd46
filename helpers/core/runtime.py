"""Settings that only count before CUDA starts, and telling the user when a restart is needed.

``PYTORCH_CUDA_ALLOC_CONF`` (``expandable_segments:True`` cuts fragmentation OOMs) is read once,
when PyTorch initializes CUDA. Set later, it does nothing until the runtime restarts, silently.
:func:`configure_allocator` (the first cell of a notebook) sets it while that still works;
:func:`needs_restart_for` says whether a setting in the environment really took effect;
:func:`gpu_notice` tells a user on a CPU-only runtime where the GPU switch is.

Layer: beside ``memory`` and ``sources`` (imports only the bottom layer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import OomkitError

__all__ = [
    "ALLOC_CONF", "EXPANDABLE", "RESTART_MENU", "GPU_MENU", "AllocatorSetup", "RestartCheck",
    "cuda_initialized", "configure_allocator", "needs_restart_for", "gpu_notice", "check_allocator_setting",
    "AllocatorSettingError", "ALLOCATOR_OPTIONS",
]  # fmt: skip

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"
RESTART_MENU = "Runtime > Restart session"  # Colab's menu; locally: restart the kernel
GPU_MENU = "Runtime > Change runtime type > T4 GPU"

_set_before_cuda: set[str] = set()  # settings configure_allocator put in place while CUDA was not initialized


def _is_bool_word(v: str) -> bool:
    return v in ("True", "False")


def _is_count(v: str) -> bool:
    return v.isdigit() and int(v) > 0


def _is_fraction(v: str) -> bool:
    try:
        return 0 < float(v) < 1
    except ValueError:
        return False


# The allocator options PyTorch reads from PYTORCH_CUDA_ALLOC_CONF, each with what its value must be
ALLOCATOR_OPTIONS = {
    "expandable_segments": (_is_bool_word, "True or False"),
    "max_split_size_mb": (lambda v: v.isdigit() and int(v) > 20, "a whole number of MiB above 20"),
    "garbage_collection_threshold": (_is_fraction, "a fraction between 0 and 1, e.g. 0.6"),
    "roundup_power2_divisions": (lambda v: _is_count(v) or v.startswith("["), "a power of 2, e.g. 4"),
    "backend": (lambda v: v in ("native", "cudaMallocAsync"), "native or cudaMallocAsync"),
    "pinned_use_cuda_host_register": (_is_bool_word, "True or False"),
    "pinned_num_register_threads": (_is_count, "a whole number, e.g. 8"),
    "release_lock_on_cudamalloc": (_is_bool_word, "True or False"),
    "pinned_use_background_threads": (_is_bool_word, "True or False"),
}


class AllocatorSettingError(OomkitError, ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` entry PyTorch would refuse (or silently ignore)."""


def check_allocator_setting(setting: object) -> str:
    """``setting`` when it is one ``option:value`` entry PyTorch's CUDA allocator takes; otherwise an
    :class:`AllocatorSettingError` naming the entry and the options (a bad entry makes CUDA's first
    allocation fail, long after the cell that set it)."""
    example = f"e.g. {EXPANDABLE!r} or 'max_split_size_mb:128'"
    if not isinstance(setting, str) or ":" not in setting or "," in setting:
        raise AllocatorSettingError(
            f"allocator setting {setting!r} is not one option:value entry; pass one at a time, {example}"
        )
    key, _, value = (part.strip() for part in setting.partition(":"))
    if key not in ALLOCATOR_OPTIONS:
        raise AllocatorSettingError(
            f"allocator setting {setting!r}: unknown option {key!r}; use one of {', '.join(ALLOCATOR_OPTIONS)}"
        )
    valid, what = ALLOCATOR_OPTIONS[key]
    if not valid(value):
        raise AllocatorSettingError(f"allocator setting {setting!r}: {key} takes {what}, got {value!r}")
    return setting


def cuda_initialized() -> bool:
    """True once this process has initialized CUDA (always False without a CUDA build or GPU)."""
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a torch build without CUDA support at all
        return False


def _entries(value: str | None) -> list[str]:
    return [e.strip() for e in (value or "").split(",") if e.strip()]


def _key(entry: str) -> str:
    return entry.split(":", 1)[0].strip()


def _start_environment() -> dict[str, str]:
    """The environment this process was started with (Linux ``/proc``; empty where unreadable)."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


@dataclass(frozen=True)
class AllocatorSetup:
    """What :func:`configure_allocator` did: ``action`` is ``"set"``, ``"already set"`` or ``"too late"``."""

    action: str
    value: str
    needs_restart: bool
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class RestartCheck:
    """Whether ``setting`` is in effect, or needs a restart (``needed``), and what to do."""

    setting: str
    needed: bool
    reason: str
    fix: str = ""

    def __bool__(self) -> bool:
        return self.needed

    def __str__(self) -> str:
        return f"restart needed: {self.reason}. Fix: {self.fix}" if self.needed else self.reason


def configure_allocator(setting: str = EXPANDABLE) -> AllocatorSetup:
    """Put ``setting`` into ``PYTORCH_CUDA_ALLOC_CONF`` if CUDA is not initialized yet (the first cell).

    Other entries already in the variable are kept. After CUDA has started, nothing is changed and
    the result says a restart is needed (unless the setting was already there from the start).
    """
    check_allocator_setting(setting)
    current = os.environ.get(ALLOC_CONF, "")
    entries = _entries(current)
    if setting in entries:
        check = needs_restart_for(setting)
        action = "too late" if check.needed else "already set"
        return AllocatorSetup(action, current, check.needed, f"{ALLOC_CONF}={current} ({check})")
    if cuda_initialized():
        return AllocatorSetup(
            "too late",
            current,
            True,
            f"CUDA is already initialized, so {ALLOC_CONF}={setting} would have no effect: "
            f"{RESTART_MENU}, then run this cell first",
        )
    value = ",".join([e for e in entries if _key(e) != _key(setting)] + [setting])
    os.environ[ALLOC_CONF] = value
    _set_before_cuda.add(setting)
    return AllocatorSetup("set", value, False, f"{ALLOC_CONF}={value} (set before CUDA started: in effect)")


def needs_restart_for(setting: str = EXPANDABLE) -> RestartCheck:
    """Whether ``setting`` (an ``PYTORCH_CUDA_ALLOC_CONF`` entry) needs a restart to take effect.

    A restart is needed when CUDA is already initialized and the setting is missing from the
    environment, or was put there during this session without :func:`configure_allocator` seeing
    CUDA uninitialized (so it most likely came after CUDA started and is ignored).
    """
    check_allocator_setting(setting)
    fix = f"put it in the first cell (from helpers.core.runtime import configure_allocator; configure_allocator()), then {RESTART_MENU} and run that cell first"
    present = setting in _entries(os.environ.get(ALLOC_CONF))
    if not cuda_initialized():
        if present:
            return RestartCheck(setting, False, f"{setting} is set and CUDA has not started yet: it will apply")
        return RestartCheck(setting, False, f"{setting} is not set, and CUDA has not started: there is still time")
    if not present:
        return RestartCheck(setting, True, f"CUDA is initialized and {ALLOC_CONF} does not hold {setting}", fix)
    at_start = setting in _entries(_start_environment().get(ALLOC_CONF))
    if at_start or setting in _set_before_cuda:
        return RestartCheck(setting, False, f"{setting} was set before CUDA started: in effect")
    return RestartCheck(
        setting,
        True,
        f"{ALLOC_CONF}={os.environ[ALLOC_CONF]} was set during this session, apparently after CUDA initialized, "
        "so the allocator never read it",
        fix,
    )


def gpu_notice() -> str | None:
    """A statement for a runtime without a GPU (where to switch one on), ``None`` when CUDA is available."""
    if torch.cuda.is_available():
        return None
    return (
        f"No GPU in this runtime: everything runs on the CPU (slowly; only small models). "
        f"For a GPU in Colab: {GPU_MENU}, then run the notebook again from the top."
    )
