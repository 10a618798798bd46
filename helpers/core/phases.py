"""Named phases of a run (load, prefill, decode, train step, eval batch) for whoever records memory.

oomkit's own code marks its phases here (``with phase("prefill"):``) without knowing who listens: a
running :class:`helpers.MemoryMonitor` registers itself, and its chart shades each phase. With
no recorder running, a phase costs one list lookup. A recorder is any object with
``start_phase(label) -> handle`` and ``end_phase(handle)``; pass one explicitly to record into it
alone, whether it is registered or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["PhaseRecorder", "register", "unregister", "recorders", "begin", "end", "phase", "PHASES"]

# the phases oomkit's own code emits, in the order a run meets them
PHASES = ("load", "prefill", "decode", "train step", "eval batch")

_active: list[PhaseRecorder] = []  # recorders running now (MemoryMonitor.start registers, stop unregisters)


class PhaseRecorder(Protocol):
    def start_phase(self, label: str) -> Any: ...

    def end_phase(self, handle: Any) -> None: ...


def register(recorder: PhaseRecorder) -> None:
    """Record every phase from now on into ``recorder`` (once, however often it is registered)."""
    if not any(r is recorder for r in _active):
        _active.append(recorder)


def unregister(recorder: PhaseRecorder) -> None:
    """Stop recording into ``recorder`` (a no-op when it is not registered)."""
    _active[:] = [r for r in _active if r is not recorder]


def recorders(recorder: PhaseRecorder | None = None) -> list[PhaseRecorder]:
    """``[recorder]`` when one is given, else every registered one."""
    return [recorder] if recorder is not None else list(_active)


def begin(label: str, recorder: PhaseRecorder | None = None) -> list[tuple[PhaseRecorder, Any]]:
    """Open phase ``label`` in ``recorder`` (default: every registered one); pass the result to :func:`end`."""
    return [(r, r.start_phase(label)) for r in recorders(recorder)]


def end(opened: list[tuple[PhaseRecorder, Any]]) -> None:
    """Close what :func:`begin` opened (an empty list: nothing to do)."""
    for r, handle in opened:
        r.end_phase(handle)


@contextlib.contextmanager
def phase(label: str, recorder: PhaseRecorder | None = None) -> Iterator[None]:
    """The block as phase ``label`` (closed when it ends, an exception included)."""
    opened = begin(label, recorder)
    try:
        yield
    finally:
        end(opened)
