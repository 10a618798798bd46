"""The estimate's vocabulary: its error and its rows, each keyed so no code matches on the text users read."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import OomkitError

__all__ = ["EstimateError", "EstimateRow", "ROW_GROUPS", "HOST", "LOWER_BOUND"]

# A row's key is "<group>.<what>" (or just "<group>"); code selects rows by key or group, and the
# label (``name``) is free to change. Groups in the order the panel's bar shows them:
ROW_GROUPS = ("weights", "kv_cache", "activations", "training", "overhead")
# Host RAM rows ("host.<what>": what a reducer offloads to the CPU) are kept apart from the GPU's rows:
# MemoryEstimate.host_rows, never in its total.
HOST = "host"
# A row's kind when its formula leaves out what it cannot size: the estimate is then at least its total, and no
# verdict on it may say "fits" with the headroom it shows (MemoryEstimate.lower_bounds; fit_one_card)
LOWER_BOUND = "lower bound"


class EstimateError(OomkitError, ValueError):
    """Bad input to the estimator; the message says what to pass instead."""


@dataclass
class EstimateRow:
    """One line of the breakdown: ``key`` identifies it, ``name`` is its label, ``kind`` is "exact",
    "formula", "rule of thumb" or "lower bound"."""

    key: str
    name: str
    bytes: int
    kind: str
    note: str = ""

    def __post_init__(self):
        if self.group not in (*ROW_GROUPS, HOST):
            raise ValueError(f"row key {self.key!r} must start with one of {', '.join((*ROW_GROUPS, HOST))}")

    @property
    def group(self) -> str:
        return self.key.split(".", 1)[0]
