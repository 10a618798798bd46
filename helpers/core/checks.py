"""The ``Check`` result shared by preflight, load planning and leak checks: a status, one line, the fix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from .html import Markup, badge, table
from .vocab import STATUSES

__all__ = ["Check", "checks_table"]

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


def checks_table(checks: Sequence[Check], title: str, name: str = "check", rows_after: Sequence = ()) -> str:
    """Checks as an HTML table of three columns, each fix under its result (labelled as in the text): a fourth
    column for the fix scrolled off-screen in Colab's ~420 px column. ``rows_after``: more rows of three cells."""
    rows = [[badge(c.status), c.name, _result_cell(c)] for c in checks]
    return table(["", name, "result and fix"], [*rows, *rows_after], title=title)


def _result_cell(check: Check) -> Markup:
    fix = f"<div style='margin-top:2px'><b>fix:</b> {escape(check.fix)}</div>" if check.fix else ""
    return Markup(f"<div style='overflow-wrap:anywhere'>{escape(check.summary)}</div>{fix}")
