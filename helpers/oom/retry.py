"""The one OOM-retry step: run a step, turn an out-of-memory error into a result, give the memory back.

``attempt(step, *args)`` runs ``step(*args)``. An OOM (``helpers.is_oom``: ``torch.OutOfMemoryError``,
``MemoryError``, cuBLAS/cuDNN/CPU allocator failures, also wrapped) becomes ``Attempt(ok=False)``
with the error's first line; any other exception propagates unchanged. After an OOM it calls
:func:`helpers.oom.reclaim.release_after_oom` *after* the ``except`` block: inside it the interpreter
still holds the exception, and through its traceback every tensor of the failed call, so cleaning
up there frees nothing. The full ``gc.collect()`` (0.1-0.3 s once transformers is imported) runs
only when the failed call is provably still alive: a :class:`Watch` of its inputs did not die, or
CUDA memory allocated stayed above the figure before the call. ``find_max_batch_size``,
``@adaptive_batch`` and ``safe_generate`` all retry through it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.memory import allocated
from .messages import is_oom
from .reclaim import release_after_oom

__all__ = ["Attempt", "Watch", "attempt"]


@dataclass(frozen=True)
class Attempt:
    """One run of a step: ``ok`` and its ``value``, or an OOM with its ``error`` (one line).

    ``elapsed`` is the step's wall time in seconds (for a failure, including the release);
    ``collected`` is True when the failed call was still alive, so the full collector ran.
    """

    ok: bool
    value: Any = None
    error: str | None = None
    elapsed: float = 0.0
    collected: bool = False

    @property
    def oom(self) -> bool:
        return not self.ok


class Watch:
    """Weak references to what a step allocates (its input tensors), to tell whether it is still alive.

    The failed call's frames hold its inputs; once they are gone, so are its activations and KV
    cache. ``watch.add(tensor)`` inside the step; ``watch()`` returns a still-alive one or None
    (the probe protocol of :func:`helpers.oom.reclaim.release_after_oom`).
    """

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def add(self, obj: Any) -> Any:
        self._refs.append(weakref.ref(obj))
        return obj

    def __len__(self) -> int:
        return len(self._refs)

    def __call__(self) -> Any:
        for ref in self._refs:
            obj = ref()
            if obj is not None:
                return obj
        return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _allocated(device: torch.device | None) -> int | None:
    """CUDA memory allocated now on every card (what a failed step is checked against: a model split over
    two cards leaves the failed step's tensors on either); None off CUDA."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    return allocated("all") if torch.cuda.is_available() else None


def attempt(
    step: Callable[..., Any],
    *args: Any,
    watch: Watch | None = None,
    device: torch.device | str | int | None = None,
) -> Attempt:
    """Run ``step(*args)``; an OOM becomes ``Attempt(ok=False)`` and its memory is given back.

    Args:
        step: the function to try (pass keyword arguments with ``functools.partial``).
        watch: a :class:`Watch` the step adds its inputs to; without one, or when the step failed
            before adding any (and off CUDA), the full collector always runs after an OOM, since
            nothing tells whether the failed call is gone.
        device: where the step runs: a CPU device skips the comparison of CUDA memory with the figure
            before the step (None or a CUDA device: every card's memory is compared).

    Returns:
        An :class:`Attempt`. Exceptions other than out-of-memory propagate as they are.
    """
    started = time.perf_counter()
    baseline = _allocated(device)
    error = None
    try:
        value = step(*args)
    except BaseException as e:  # noqa: BLE001 - re-raised unless it is an OOM
        if not is_oom(e):
            raise
        error = _one_line(e)
    if error is None:
        return Attempt(True, value, elapsed=time.perf_counter() - started)
    # Outside the except block: the exception (whose traceback pins the failed step's tensors) is
    # no longer held by the interpreter, so refcounting has already freed what nothing else holds.
    collected = release_after_oom(watch or None, baseline=baseline, device="all")
    return Attempt(False, error=error, elapsed=time.perf_counter() - started, collected=collected)
