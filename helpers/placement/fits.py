"""What fits where: :func:`fits_table` (the README's Llama 2 table, or any model's :class:`ModelFits`), each
machine cell a :func:`plan_devices` plan; :func:`reference_configs`, the models it knows.

The planner itself, :func:`plan_devices` (the device map ``from_pretrained(device_map="auto")`` will use
across GPUs and CPU/disk offload, per-device memory), lives in :mod:`helpers.placement.device_plan` and is
re-exported here, so ``from helpers.placement.fits import X`` works for every name in ``__all__``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import OomkitError
from ..core.html import table
from ..core.vocab import DEFAULTS, FITS, FITS_TOKENS, LOAD_MODES, verdict
from ..estimator.configs import resolve_config
from ..estimator.core import estimate
from .device_plan import (
    DevicePlan,
    PlacementError,
    plan_devices,
)
from .fits_view import FitsCell, FitsRow, ModelFits

__all__ = [
    "reference_configs",
    "FitsTable",
    "fits_table",
]  # fmt: skip

# ----------------------------------------------------------------------------- what fits where

# Llama 2's published dimensions (Touvron et al. 2023, table 1 and the hub configs); 7B ships in helpers/data
_LLAMA2 = {
    "Llama-2-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        intermediate_size=13824),
    "Llama-2-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=28672),
}  # fmt: skip
FITS_DEVICES = {"T4": ["t4"], "2×T4 (Kaggle)": "kaggle-2xt4", "L4": ["l4"], "A100 40GB": ["a100-40"],
                "A100 80GB": ["a100-80"]}  # fmt: skip


def reference_configs() -> dict[str, Any]:
    """Llama-2 7B (the shipped config), 13B and 70B (its config with the published dimensions)."""
    base, _, _ = resolve_config("meta-llama/Llama-2-7b-hf")
    out = {"Llama-2-7b": base}
    for name, dims_ in _LLAMA2.items():
        c = copy.deepcopy(base)
        for k, v in dims_.items():
            setattr(c, k, v)
        c._name_or_path = f"meta-llama/{name}-hf"
        out[name] = c
    return out


@dataclass
class FitsTable:
    """Which model fits which machine in which load mode (each cell a :func:`plan_devices` plan)."""

    models: list[str]
    loads: list[str]
    machines: list[str]
    cells: dict[tuple[str, str, str], DevicePlan]

    def cell(self, model: str, load: str, machine: str) -> str:
        p = self.cells[(model, load, machine)]
        if not p.fits:
            return "no"
        fullest = max(p.gpus, key=lambda s: s.total / s.capacity)
        return f"{verdict(fullest.total, fullest.capacity)} ({fullest.total / fullest.capacity:.0%})"  # fits / tight

    def rows(self) -> list[list[str]]:
        return [[m.replace("Llama-2-", ""), ld, *(self.cell(m, ld, d) for d in self.machines)]
                for m in self.models for ld in self.loads]  # fmt: skip

    def markdown(self) -> str:
        head = ["model", "load", *self.machines]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.rows()])

    def __str__(self) -> str:
        head = ["model", "load", *self.machines]
        rows = [head, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def __repr__(self) -> str:  # the text a notebook shows without HTML (papermill, a terminal)
        return self.__str__()

    def _repr_html_(self) -> str:
        title = "Llama 2 generating 512 + 256 tokens, batch 1 (fullest GPU's share of its memory)"
        return table(["model", "load", *self.machines], self.rows(), title=title)


def _check_table(loads: Any, machines: Any, plan_kwargs: dict) -> None:
    taken = {"model", "load", "devices"} & set(plan_kwargs)
    if taken:
        raise PlacementError(
            f"fits_table() sets {', '.join(sorted(taken))} itself (each load, each machine); pass the model as its first argument, or "
            "use plan_devices(model, load=..., devices=...) for one model"
        )
    if (
        isinstance(loads, str)
        or not isinstance(loads, list | tuple)
        or not loads
        or any(m not in LOAD_MODES for m in loads)
    ):
        raise PlacementError(f"loads must be a list of load modes from {', '.join(LOAD_MODES)}, got {loads!r:.60}")
    if not isinstance(machines, dict) or not machines:
        raise PlacementError(
            f"machines must be a dict of label -> devices such as {{'T4': 't4', '2xT4': ['t4', 't4']}}, got "
            f"{machines!r:.60}"
        )


def fits_table(
    model: Any = None, *, tokens: int = FITS_TOKENS, loads=None, machines: dict | None = None, batch_size: int = 1,
    **plan_kwargs,
) -> FitsTable | ModelFits:  # fmt: skip
    """What fits where. Without ``model``: Llama 2 7B/13B/70B in fp16, int8 and nf4 on a T4, Kaggle's 2×T4, an
    L4 and an A100 40/80 GB (no offload): the README's table. With ``model`` (hub id, shipped config name,
    folder or config): every load mode's weights, KV cache at ``tokens`` per sequence and total, and the
    verdict on each of those machines and on this GPU (when there is one), as :class:`ModelFits`."""
    machines = FITS_DEVICES if machines is None else machines
    if model is None:
        loads = ("fp16", "int8", "nf4") if loads is None else loads
        _check_table(loads, machines, plan_kwargs)
        configs = reference_configs()
        cells = {}
        for name, config in configs.items():
            for load in loads:
                for label, devs in machines.items():
                    cells[(name, load, label)] = plan_devices(config, load=load, devices=devs, **plan_kwargs)
        return FitsTable(list(configs), list(loads), list(machines), cells)
    loads = LOAD_MODES if loads is None else loads
    _check_table(loads, machines, plan_kwargs)
    return _model_fits(model, tokens, loads, machines, batch_size, plan_kwargs)


def _model_fits(model: Any, tokens: int, loads, machines: dict, batch_size: int, plan_kwargs: dict) -> ModelFits:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise PlacementError(f"tokens is the sequence length to plan for (prompt + answer), at least 2; got {tokens!r}")
    machines = dict(machines)
    if torch.cuda.is_available():
        machines["this GPU"] = "current"
    new = max(1, tokens * DEFAULTS.max_new_tokens // FITS_TOKENS)  # split as estimate()'s defaults split theirs
    shape = dict(batch_size=batch_size, prompt_tokens=tokens - new, max_new_tokens=new)
    config, _, _ = resolve_config(model)
    rows = []
    for load in loads:
        est = estimate(config, load=load, device=None, **shape)
        row = FitsRow(load, est.weights, est.group_bytes("kv_cache"), est.total)
        for label, devs in machines.items():
            try:
                plan = plan_devices(config, load=load, devices=devs, **shape, **plan_kwargs)
            except (OomkitError, ValueError) as e:
                row.cells[label] = FitsCell("n/a", why=str(e))
                continue
            if not plan.fits:
                row.cells[label] = FitsCell("no")
                continue
            fullest = max(plan.gpus, key=lambda s: s.total / s.capacity)
            share = fullest.total / fullest.capacity
            row.cells[label] = FitsCell("fits" if verdict(fullest.total, fullest.capacity) == FITS else "tight", share)
        rows.append(row)
    name = model if isinstance(model, str) else getattr(config, "_name_or_path", None) or type(model).__name__
    return ModelFits(str(name), tokens, batch_size, list(machines), rows)
