"""One unit policy for all of oomkit: bytes are ints, GiB = 1024**3 as in PyTorch's messages."""

from __future__ import annotations

import math
import numbers
import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

MAX_BYTES = 1 << 60  # 1 EiB: past any machine, and still exact as a float
_UNITS = [("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)]
_PARSE_FACTORS = {
    "b": 1, "bytes": 1, "byte": 1,
    "kib": KiB, "kb": KiB, "k": KiB,
    "mib": MiB, "mb": MiB, "m": MiB,
    "gib": GiB, "gb": GiB, "g": GiB,
    "tib": TiB, "tb": TiB, "t": TiB,
}  # fmt: skip
_PARSE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def format_bytes(n: int | float | None, precision: int = 2) -> str:
    """Format a byte count the way PyTorch's OOM messages do: ``1.50 GiB``, ``512.00 MiB``.

    ``None`` (an unknown figure) formats as ``n/a``; negative counts keep their sign.
    """
    if n is None:
        return "n/a"
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(
            f"format_bytes() takes a byte count (int), got {type(n).__name__} {n!r}; "
            "for text such as '1.5 GiB' use parse_bytes()"
        )
    if isinstance(precision, bool) or not isinstance(precision, int) or not 0 <= precision <= 12:
        raise ValueError(f"precision is the digits after the point, a whole number from 0 to 12; got {precision!r}")
    if isinstance(n, numbers.Integral) and abs(n) >= 1 << 1000:  # past a float's range: exact integer arithmetic
        return _format_huge(int(n), precision)
    if not math.isfinite(n):
        raise ValueError(f"format_bytes() takes a finite byte count, got {n!r}")
    sign = "-" if n < 0 else ""
    n = abs(n)
    for name, factor in _UNITS:
        if n >= factor:
            return f"{sign}{n / factor:.{precision}f} {name}"
    return f"{sign}{int(n)} B"


def _format_huge(n: int, precision: int) -> str:
    """An int too large for a float, in TiB (the largest unit), rounded half up with integers only."""
    scaled = str((abs(n) * 10**precision + TiB // 2) // TiB)
    whole, frac = scaled[: len(scaled) - precision] or "0", scaled[len(scaled) - precision :] if precision else ""
    return f"{'-' if n < 0 else ''}{whole}{'.' + frac if precision else ''} TiB"


def parse_bytes(text: str) -> int:
    """Parse ``"1.23 GiB"``, ``"118.00 MiB"``, ``"512 bytes"`` or ``"2GB"`` into bytes.

    Decimal-looking units (GB, MB) are read as binary, as PyTorch writes them; a leading minus is
    kept (a difference such as ``"-5 GiB"`` parses to a negative count, as format_bytes writes it). Raises
    ``ValueError`` naming the accepted units when the text is not a size.
    """
    if isinstance(text, numbers.Real) and not isinstance(text, bool):
        raise TypeError(
            f"parse_bytes() reads text such as '1.5 GiB'; {text!r} is already a number "
            "(bytes need no parsing; for GiB multiply by helpers.GiB)"
        )
    if not isinstance(text, str):
        raise TypeError(f"parse_bytes() reads text such as '1.5 GiB', got {type(text).__name__}")
    m = _PARSE_RE.match(text)
    unit = (m.group(2) if m else "").lower() or "b"
    if not m or unit not in _PARSE_FACTORS:
        raise ValueError(f"not a memory size: {text!r} (expected a number and one of B, KiB, MiB, GiB, TiB)")
    value = float(m.group(1)) * _PARSE_FACTORS[unit]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"memory size {text[:40]!r} is too large to be real (the limit is 1 EiB)")
    return int(round(value))


def percent(part: int | float | None, whole: int | float | None) -> float | None:
    """``part / whole`` in percent, or ``None`` when either is unknown or ``whole`` is 0."""
    if part is None or not whole:
        return None
    return 100.0 * part / whole
