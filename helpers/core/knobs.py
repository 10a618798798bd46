"""This notebook's knobs: the names an OOM fix can tell the user to change.

A knob is a kind of setting that decides memory (``max_new_tokens``, ``batch_size``, ``micro_batch``,
``seq_len``, ``load``) and the names a notebook gives it: a variable of its parameters cell
(``MAX_NEW_TOKENS``) and the controls that set it (the load panel's ``max_new_tokens`` slider). The
notebooks' names are registered here by default; a notebook adds its own with :func:`register_knob`,
and a panel names its control with :func:`register_control`. :func:`knob_fixes` turns the knobs a
namespace holds into fixes with a value to try ("set MAX_NEW_TOKENS = 256 (now 512) in the parameters cell").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .vocab import lighter_load

__all__ = ["Knob", "KNOBS", "register_knob", "register_control", "knob_fixes", "smaller"]

# the kinds whose smaller value needs less memory, and how the fix words each one
_HELPS = {
    "micro_batch": "fewer examples per step (gradient accumulation keeps the effective batch)",
    "batch_size": "fewer sequences at once",
    "max_new_tokens": "a shorter KV cache",
    "seq_len": "shorter sequences",
}


@dataclass
class Knob:
    """One kind of setting, the variable names that hold it and the controls that set it."""

    kind: str
    names: list[str] = field(default_factory=list)
    controls: list[str] = field(default_factory=list)


KNOBS: dict[str, Knob] = {
    "micro_batch": Knob("micro_batch", ["MICRO_BATCH"]),
    "batch_size": Knob("batch_size", ["BATCH_SIZE", "BATCH"]),
    "max_new_tokens": Knob("max_new_tokens", ["MAX_NEW_TOKENS"]),
    "seq_len": Knob("seq_len", ["SEQ_LEN", "MAX_LENGTH"]),
    "load": Knob("load", ["LOAD"]),
}


def register_knob(kind: str, name: str) -> Knob:
    """Name a notebook variable (``"GEN_TOKENS"``) as a knob of ``kind`` (``"max_new_tokens"``)."""
    knob = KNOBS.setdefault(kind, Knob(kind))
    if name not in knob.names:
        knob.names.insert(0, name)
    return knob


def register_control(kind: str, description: str) -> Knob:
    """Name a control that sets ``kind`` (``"the load panel's max_new_tokens slider"``) for the fixes."""
    knob = KNOBS.setdefault(kind, Knob(kind))
    if description not in knob.controls:
        knob.controls.append(description)
    return knob


def smaller(kind: str, value: object) -> object | None:
    """The value to try next for ``kind``: half a count (at least 1), the next lighter load mode; None if none."""
    if kind == "load":
        return lighter_load(str(value))
    if isinstance(value, bool) or not isinstance(value, int) or value <= 1:
        return None
    return max(1, value // 2)


def knob_fixes(namespace: dict) -> list[str]:
    """Fixes naming the knobs ``namespace`` holds (a notebook's variables), each with a value to try."""
    fixes = []
    for kind in (*_HELPS, "load"):
        knob = KNOBS.get(kind)
        name = next((n for n in knob.names if n in namespace), None) if knob else None
        if name is None:
            continue
        value = namespace[name]
        target = smaller(kind, value)
        if target is None:
            continue
        where = " or ".join(["the parameters cell", *knob.controls])
        why = _HELPS.get(kind, "smaller weights")
        fixes.append(f"This notebook: set {name} = {target!r} (now {value!r}) in {where}, then rerun: {why}")
    return fixes
