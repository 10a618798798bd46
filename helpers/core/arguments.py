"""Checking a public function's arguments at its edge: one home for "a whole number >= 1", "a flag",
"a fraction", "a namespace dict", each refusal naming the argument, the value and what to pass.

Each check takes the error class to raise (a module's own ``OomkitError``, say ``EstimateError``), so a
caller's ``except`` keeps catching what it caught; by default ``ArgumentError``.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

from .errors import OomkitError

__all__ = ["ArgumentError", "MAX_COUNT", "whole_number", "number", "flag", "namespace_dict", "text", "regular_file"]

# The largest count (tokens, batch rows, samples) an argument may hold: int32's, which torch's indices
# and every real GPU stay far below; 10**30 is a typo or a hostile value, not a plan.
MAX_COUNT = 2**31 - 1


class ArgumentError(OomkitError, ValueError):
    """A public function got an argument of the wrong type or out of range; the message says what to pass."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def whole_number(
    name: str,
    value: Any,
    *,
    minimum: int = 1,
    maximum: int = MAX_COUNT,
    none_ok: bool = False,
    error: type[Exception] = ArgumentError,
) -> int | None:
    """``value`` when it is an ``int`` (not a bool) in ``minimum..maximum`` (``None`` too when ``none_ok``)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be a whole number >= {minimum}, got {_show(value)} ({type(value).__name__})")
    if value < minimum:
        raise error(f"{name} must be a whole number >= {minimum}, got {_show(value)}")
    if value > maximum:
        raise error(f"{name} must be a whole number <= {maximum:,} (larger is a typo, not a plan), got {_show(value)}")
    return value


def number(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    none_ok: bool = False,
    error: type[Exception] = ArgumentError,
) -> float | None:
    """``value`` when it is a finite ``int``/``float`` (not a bool) within ``low``..``high`` (open ends as asked)."""
    if value is None and none_ok:
        return None
    lo, hi = "(" if low_open else "[", ")" if high_open else "]"
    where = f"in {lo}{low:g}, {high:g}{hi}"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise error(f"{name} must be a finite number {where}, got {_show(value)} ({type(value).__name__})")
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        raise error(f"{name} must be a number {where}, got {_show(value)}")
    return value


def flag(name: str, value: Any, *, error: type[Exception] = ArgumentError) -> bool:
    """``value`` when it is ``True`` or ``False``: a string such as ``'no'`` is truthy, so it is refused."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {_show(value)} ({type(value).__name__})")
    return value


def namespace_dict(name: str, value: Any, *, error: type[Exception] = ArgumentError) -> dict | None:
    """``value`` when it is ``None`` or a dict (a namespace such as ``globals()``)."""
    if value is not None and not isinstance(value, dict):
        raise error(f"{name} must be a dict such as globals() (or None: the calling notebook's), got {_show(value)}")
    return value


def text(name: str, value: Any, *, what: str, error: type[Exception] = ArgumentError) -> str:
    """``value`` when it is a non-blank ``str``; ``what`` says what it names (for the message)."""
    if not isinstance(value, str) or not value.strip():
        raise error(f"{name} must be {what}, got {_show(value)}")
    return value


# A path argument is read or written: a FIFO blocks a read forever, a device such as /dev/zero never ends
# (or, as /dev/full, swallows every write), so only regular files (or folders, for the caller) pass.
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


def regular_file(path: str | os.PathLike, what: str, error: type[Exception]) -> Path:
    """``path`` with ``~`` expanded, when it is a regular file, a folder or not there yet (the caller
    handles those); ``error`` naming what it is instead (a FIFO, a device, a socket)."""
    p = Path(os.path.expanduser(os.fspath(path)))
    try:
        mode = os.stat(p).st_mode
    except OSError:  # missing or unreadable: the caller's own open says so
        return p
    for test, kind in _KINDS:
        if test(mode):
            raise error(
                f"{what} {p} is {kind}, not a regular file: reading it would block or never end, and writing "
                "to it loses what is written. Pass the path of an ordinary file"
            )
    return p
