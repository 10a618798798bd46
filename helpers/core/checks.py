"""The ``Check`` result shared by preflight, load planning and leak checks: a status, one line, the fix."""

from __future__ import annotations

from dataclasses import dataclass, field

from .vocab import STATUSES

__all__ = ["Check"]

_MARKS = {"pass": "ok  ", "info": "info", "warn": "WARN", "fail": "FAIL"}


@dataclass
class Check:
    """One verdict: ``status`` is pass, info, warn or fail; ``fix`` says what to do when it is not pass."""

    name: str
    status: str
    summary: str
    fix: str | None = None
    data: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Check status must be one of {', '.join(STATUSES)}, not {self.status!r}")

    def __str__(self) -> str:
        fix = f"\n        fix: {self.fix}" if self.fix else ""
        return f"[{_MARKS[self.status]}] {self.name}: {self.summary}{fix}"
