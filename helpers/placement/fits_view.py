"""What fits for one model: every load mode's weights, KV cache at the chosen tokens and total, and
the verdict on each machine (T4, Kaggle's 2×T4, L4, A100 40/80 GB, this GPU). Presentation only:
:func:`helpers.fits_table` computes the figures (each machine cell a ``plan_devices`` plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.html import Markup, colored, table
from ..core.units import format_bytes

__all__ = ["FitsCell", "FitsRow", "ModelFits"]

_STATUS = {"fits": "ok", "tight": "tight", "no": "fail", "n/a": "none"}


@dataclass
class FitsCell:
    """One machine for one load mode: ``fits``, ``tight``, ``no`` (or ``n/a``) and the fullest card's share."""

    word: str
    share: float | None = None  # the fullest GPU's total / capacity
    why: str = ""

    def __str__(self) -> str:
        return f"{self.word} ({self.share:.0%})" if self.share is not None and self.word != "no" else self.word


@dataclass
class FitsRow:
    load: str
    weights: int
    kv_cache: int
    total: int
    cells: dict[str, FitsCell] = field(default_factory=dict)


@dataclass
class ModelFits:
    """Load modes × (weights, KV cache, total) × machines for one model, ``tokens`` per sequence."""

    model: str
    tokens: int
    batch_size: int
    machines: list[str]
    rows: list[FitsRow]

    def header(self) -> list[str]:
        return ["load", "weights", f"KV @ {self.tokens} tok", "total", *self.machines]

    def table_rows(self) -> list[list[str]]:
        return [[r.load, format_bytes(r.weights), format_bytes(r.kv_cache), format_bytes(r.total),
                 *(str(r.cells[m]) for m in self.machines)] for r in self.rows]  # fmt: skip

    def best(self, machine: str) -> str | None:
        """The widest load mode that fits ``machine`` comfortably (else tightly), or None."""
        for word in ("fits", "tight"):
            for r in self.rows:
                if r.cells[machine].word == word:
                    return r.load
        return None

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header()) + " |", "|" + "---|" * len(self.header())]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.table_rows()])

    def title(self) -> str:
        return f"What fits for {self.model}: {self.tokens} tokens per sequence, batch {self.batch_size}"

    def __str__(self) -> str:
        rows = [self.header(), *self.table_rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        body = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
        return f"{self.title()}\n{body}"

    def __repr__(self) -> str:  # papermill and terminals show this
        return self.__str__()

    def _repr_html_(self) -> str:
        rows = []
        for r in self.rows:
            cells = [colored(str(r.cells[m]), _STATUS.get(r.cells[m].word, "none")) for m in self.machines]
            rows.append([r.load, format_bytes(r.weights), format_bytes(r.kv_cache), format_bytes(r.total), *cells])
        note = Markup("<div style='font-family:monospace'>estimated; fits: under 85 % of the fullest card, "
                      "tight: under 100 %</div>")  # fmt: skip
        return table(self.header(), rows, title=self.title()) + note
