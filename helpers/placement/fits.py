"""What fits where: :func:`fits_table`, one model's load modes x machines (:class:`ModelFits`) or the README's
Llama 2 table (:class:`FitsTable`). Each cell is :func:`helpers.fit`'s verdict for that load mode on that machine
(placed as ``load()`` places it: :func:`~.decision.decide_placement`), so the table, ``estimate`` and ``preflight``
give one answer, and the speed beside it is :func:`~helpers.estimator.timing.estimate_time`'s.

Every view reads in a narrow column: the text within 80 columns (a grid too wide is stacked, its first column
repeated), the HTML as small tables whose cells wrap, the verdicts coloured as a heatmap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.devices import resolve_devices
from ..core.errors import OomkitError
from ..core.html import COLORS, Markup, escape, share_percent, table
from ..core.units import format_bytes
from ..core.vocab import DEFAULTS, FITS, FITS_TOKENS, LOAD_MODES, TIGHT, TIGHT_FRACTION, VERDICT_STATUS
from ..estimator.configs import resolve_config
from ..estimator.core import estimate
from ..estimator.prequantized import repo_quantization
from .device_map import PlacementError
from .device_plan import reference_configs
from .machine_fit import fit

__all__ = ["FITS_DEVICES", "NOT_PLANNED", "FitsCell", "FitsRow", "ModelFits", "FitsTable", "fits_table", "text_grid",
           "verdict_fill"]  # fmt: skip

FITS_DEVICES = {"T4": ["t4"], "2×T4 (Kaggle)": "kaggle-2xt4", "L4": ["l4"], "A100 40GB": ["a100-40"],
                "A100 80GB": ["a100-80"]}  # fmt: skip
NOT_PLANNED = "n/a"  # a machine the model could not be placed on (the cell's ``why`` says why)
TEXT_WIDTH = 80  # a terminal's columns: every text view fits them
# narrow columns: a cell's padding halved (the shared style's 8 px each side made 6 machines 500 px wide)
# In a column under 480 px (Colab's with its Files pane open is ~330 px: the container's width, not the window's),
# the heatmap's cells take a smaller font and padding and each the width of a 5-letter word, so its 7 columns fit
# with their words whole ("tight", "tok/s"; at 300 px too); overflow-wrap:anywhere stays the last resort
_NARROW = ("<style>.oomkit-fits{container-type:inline-size}"
           ".oomkit-fits .oomkit-table th,.oomkit-fits .oomkit-table td{padding:2px 3px}"
           "@container (max-width: 480px){.oomkit-heatmap .oomkit-table th,.oomkit-heatmap .oomkit-table td{padding:1px}"
           ".oomkit-heatmap .oomkit-fits-cell{font-size:80%;padding:1px 2px !important;min-width:5.2ch}"
           ".oomkit-heatmap .oomkit-table td:first-child{font-size:80%}}</style>")  # fmt: skip
LEGEND = (f"green fits (under {TIGHT_FRACTION:.0%} of the fullest card), amber tight (under 100 %), red does not fit "
          "(placed as load() places it); tokens/s: decoding on that card, estimated (estimate_time)")  # fmt: skip


def verdict_fill(word: str) -> str:
    """The fill of a verdict word: its status's colour as a badge has it (:data:`helpers.core.html.COLORS`, white
    text on each >= 4.5:1 in either theme), grey for none."""
    return COLORS.get(VERDICT_STATUS.get(word, "none"), COLORS["none"])


@dataclass
class FitsCell:
    """One machine for one load mode: fit()'s verdict (``fits``, ``tight``, ``does not fit``; ``n/a``), the
    fullest card's share, and where it fits, the seconds per decode step at the table's batch on its card."""

    word: str
    share: float | None = None  # the fullest GPU's total / capacity
    why: str = ""
    seconds: float | None = None

    def __str__(self) -> str:
        # share_percent: 99.6 % of a card reads 99 %, never "tight (100%)"
        shown = self.share is not None and self.word in (FITS, TIGHT)
        return f"{self.word} ({share_percent(self.share, 1.0)}%)" if shown else self.word

    def rate(self, batch: int) -> str:
        """``~14.7`` tokens/s over the batch, or ``-`` where it does not fit or cannot be timed."""
        return f"~{batch / self.seconds:,.1f}" if self.seconds else "-"

    def html(self, batch: int) -> Markup:
        """The heatmap cell: the verdict on its fill (white text: >= 4.5:1 on each fill), the speed under it."""
        speed = f"<div style='font-size:85%'>{escape(self.rate(batch))} tok/s</div>" if self.seconds else ""
        tip = escape(self.why or str(self), quote=True)
        return Markup(f"<div class='oomkit-fits-cell' title='{tip}' style='background:{verdict_fill(self.word)};color:#ffffff;padding:1px 3px;"
                      f"border-radius:3px;overflow-wrap:anywhere'><span class='oomkit-heat'>{escape(str(self))}</span>{speed}</div>")  # fmt: skip


def _cell(est, devices: Any) -> FitsCell:
    """fit()'s verdict for ``est`` on ``devices`` (a machine), as a cell."""
    try:
        v = fit(est, devices, suggest=False)
    except (OomkitError, ValueError) as e:
        return FitsCell(NOT_PLANNED, why=str(e))
    return FitsCell(v.verdict, v.placed_bytes / v.capacity, seconds=v.seconds if v.fits else None)


def text_grid(header: list[str], rows: list[list[str]], width: int = TEXT_WIDTH) -> str:
    """Rows as aligned text within ``width`` columns: a grid too wide is cut into stacked grids of the columns
    that fit, each repeating the first (the row's name)."""
    grid = [header, *rows]
    widths = [max(len(r[i]) for r in grid) for i in range(len(header))]
    chunks, current, used = [], [], widths[0]
    for i in range(1, len(header)):
        if current and used + 2 + widths[i] > width:
            chunks.append(current)
            current, used = [], widths[0]
        current.append(i)
        used += 2 + widths[i]
    chunks.append(current)
    blocks = []
    for cols in chunks:
        keep = [0, *cols]
        blocks.append("\n".join("  ".join(r[i].ljust(widths[i]) for i in keep).rstrip() for r in grid))
    return "\n\n".join(blocks)


def _heatmap(corner: str, names: list[str], cells: dict[str, list[FitsCell]], batch: int, title: str) -> str:
    """A grid of coloured cells: ``cells`` maps each row's name to its cells under ``names``; the few columns
    are the short names (one model's load modes, or the machines), so a narrow column stays narrow."""
    rows = [[name, *(c.html(batch) for c in row)] for name, row in cells.items()]
    return (f"{_NARROW}<div class='oomkit-fits oomkit-heatmap' style='max-width:100%'><div><b>{escape(title)}</b></div>"
            + table([corner, *names], rows)
            + f"<div style='font-family:monospace;font-size:85%'>{escape(LEGEND)}</div></div>")  # fmt: skip


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
        for word in (FITS, TIGHT):
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
        sizes = text_grid(self.header()[:4], [r[:4] for r in self.table_rows()])
        fits = text_grid(["load", *self.machines], [[r.load, *(str(r.cells[m]) for m in self.machines)]
                                                    for r in self.rows])  # fmt: skip
        speed = text_grid(["load", *self.machines], [[r.load, *(r.cells[m].rate(self.batch_size) for m in self.machines)]
                                                     for r in self.rows])  # fmt: skip
        return "\n\n".join([
            f"{self.title()}\n{sizes}",
            f"on each machine as load() places it (the fullest card's share; tight: over {TIGHT_FRACTION:.0%}):\n{fits}",
            f"decode tokens/s at batch {self.batch_size} where it fits (datasheet x efficiency):\n{speed}",
        ])  # fmt: skip

    def __repr__(self) -> str:  # papermill and terminals show this
        return self.__str__()

    def _repr_html_(self) -> str:
        sizes = table(self.header()[:4], [r[:4] for r in self.table_rows()])
        cells = {m: [r.cells[m] for r in self.rows] for m in self.machines}
        grid = _heatmap("machine", [r.load for r in self.rows], cells, self.batch_size,
                        "where it fits, and decode speed at that batch")  # fmt: skip
        head = f"<div style='font-family:monospace'><b>{escape(self.title())}</b></div>"
        # the sizes in the heatmap's narrow padding too: 4 columns within Colab's column with the Files pane open
        return f"{head}<div class='oomkit-fits oomkit-fits-sizes'>{sizes}</div>{grid}"


@dataclass
class FitsTable:
    """Which model fits which machine in which load mode (each cell :func:`helpers.fit`'s verdict there)."""

    models: list[str]
    loads: list[str]
    machines: list[str]
    cells: dict[tuple[str, str, str], FitsCell]

    def cell(self, model: str, load: str, machine: str) -> str:
        return str(self.cells[(model, load, machine)])

    def rows(self) -> list[list[str]]:
        return [[m.replace("Llama-2-", ""), ld, *(self.cell(m, ld, d) for d in self.machines)]
                for m in self.models for ld in self.loads]  # fmt: skip

    def markdown(self) -> str:
        head = ["model", "load", *self.machines]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.rows()])

    def __str__(self) -> str:
        return text_grid(["model load", *self.machines], [[f"{r[0]} {r[1]}", *r[2:]] for r in self.rows()])

    def __repr__(self) -> str:  # the text a notebook shows without HTML (papermill, a terminal)
        return self.__str__()

    def _repr_html_(self) -> str:
        # 9 model/load rows x 5 machines: rows this way keep the 5 columns within a narrow notebook column
        cells = {f"{m.replace('Llama-2-', '')} {ld}": [self.cells[(m, ld, d)] for d in self.machines]
                 for m in self.models for ld in self.loads}  # fmt: skip
        return _heatmap("model load", self.machines, cells, 1,
                        "Llama 2 generating 512 + 256 tokens, batch 1 (fullest GPU's share)")  # fmt: skip


def _check_table(loads: Any, machines: Any, plan_kwargs: dict) -> None:
    if plan_kwargs:
        raise PlacementError(
            f"fits_table() takes the model, tokens, loads, machines and batch_size, not {', '.join(sorted(plan_kwargs))} "
            "(it sets each load and machine itself); use plan_devices(model, load=..., devices=...) for one placement"
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
    for devices in machines.values():
        resolve_devices(devices)  # an unknown preset is refused here, not shown as "n/a" in every row


def fits_table(
    model: Any = None, *, tokens: int = FITS_TOKENS, loads=None, machines: dict | None = None, batch_size: int = 1,
    **plan_kwargs,
) -> FitsTable | ModelFits:  # fmt: skip
    """What fits where. Without ``model``: Llama 2 7B/13B/70B in fp16, int8 and nf4 on a T4, Kaggle's 2×T4, an
    L4 and an A100 40/80 GB (no offload): the README's table. With ``model`` (hub id, shipped config name,
    folder or config): every load mode's weights, KV cache at ``tokens`` per sequence and total, and the
    verdict on each of those machines and on this GPU (when there is one), as :class:`ModelFits`. Each verdict
    is :func:`helpers.fit`'s (as ``load()`` places the model), with the decode speed where it fits."""
    machines = FITS_DEVICES if machines is None else machines
    if model is None:
        loads = ("fp16", "int8", "nf4") if loads is None else loads
        _check_table(loads, machines, plan_kwargs)
        configs = reference_configs()
        cells = {}
        for name, config in configs.items():
            for load in loads:
                est = estimate(config, load=load, device=None)
                for label, devs in machines.items():
                    cells[(name, load, label)] = _cell(est, devs)
        return FitsTable(list(configs), list(loads), list(machines), cells)
    _check_table(LOAD_MODES if loads is None else loads, machines, plan_kwargs)
    return _model_fits(model, tokens, loads, machines, batch_size)


def _model_fits(model: Any, tokens: int, loads, machines: dict, batch_size: int) -> ModelFits:
    """``loads`` None: every load mode, or for a checkpoint saved quantized (GPTQ, AWQ, bnb, mxfp4, fp8) the one
    it loads as (estimated as saved, kept packed or dequantized on each machine as transformers does)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise PlacementError(f"tokens is the sequence length to plan for (prompt + answer), at least 2; got {tokens!r}")
    machines = dict(machines)
    if torch.cuda.is_available():
        machines["this GPU"] = "current"
    new = max(1, tokens * DEFAULTS.max_new_tokens // FITS_TOKENS)  # split as estimate()'s defaults split theirs
    shape = dict(batch_size=batch_size, prompt_tokens=tokens - new, max_new_tokens=new)
    config, _, _ = resolve_config(model)
    repo = repo_quantization(config)
    if loads is None:
        loads = ["auto"] if repo is not None else LOAD_MODES
    rows = []
    for load in loads:
        est = estimate(config, load=load, device=None, **shape)
        label = f"{repo.method} as saved" if repo is not None and load in ("auto", repo.load) else load
        row = FitsRow(label, est.weights, est.group_bytes("kv_cache"), est.total)
        row.cells = {label: _cell(est, devs) for label, devs in machines.items()}
        rows.append(row)
    name = model if isinstance(model, str) else getattr(config, "_name_or_path", None) or type(model).__name__
    return ModelFits(str(name), tokens, batch_size, list(machines), rows)
