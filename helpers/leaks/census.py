"""Every live tensor, by storage, with the names that hold it; and what changed between two censuses."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from html import escape

import torch

from ..core.html import Markup, table
from ..core.session import caller_namespace
from ..core.units import format_bytes
from .object_walk import MAX_DEPTH, MAX_OBJECTS, walk
from .tensors import MAX_GRAPH_NODES, NodeBudget, graph_tensors, live_storages, storage_key

__all__ = ["TensorEntry", "TensorGroup", "TensorCensus", "census", "CensusDiff", "census_diff"]


@dataclass
class TensorEntry:
    """One storage: the memory, its largest tensor's description, and who holds it."""

    device: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    holders: list[str]
    grad_fn: bool
    key: tuple = field(repr=False, default=())

    @property
    def holder(self) -> str:
        return self.holders[0] if self.holders else "(unnamed)"


@dataclass
class TensorGroup:
    """Tensors of one device, dtype and shape."""

    device: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    nbytes: int
    holders: list[str]
    with_graph: int

    def __str__(self) -> str:
        names = ", ".join(self.holders[:3]) + (f" (+{len(self.holders) - 3})" if len(self.holders) > 3 else "")
        graph = f"  [{self.with_graph} with grad_fn]" if self.with_graph else ""
        return (
            f"{format_bytes(self.nbytes):>11}  {self.count:>4} x {self.device:<6} {self.dtype:<9} "
            f"{str(list(self.shape)):<18} {names or '(unnamed)'}{graph}"
        )


_UNNAMED = "(no name: held by a library, a closure or an autograd graph)"


@dataclass
class TensorCensus:
    """Every live tensor storage, grouped by device/dtype/shape, largest first."""

    entries: list[TensorEntry]
    groups: list[TensorGroup]
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # where the census is incomplete, and why

    @property
    def total(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def by_device(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.device] = out.get(e.device, 0) + e.nbytes
        return out

    def held_by(self, name: str) -> list[TensorEntry]:
        """Entries with a holder path starting with ``name`` (``"losses"``, ``"model.lm_head"``)."""
        return [
            e
            for e in self.entries
            if any(h == name or h.startswith((name + "[", name + ".", name + " ")) for h in e.holders)
        ]

    def by_holder(self) -> list[tuple[str, int, int]]:
        """(holder group, count, bytes), largest first: ``losses[…]`` sums every ``losses[i]``."""
        return _group_by_holder(self.entries)

    def __str__(self, limit: int = 15) -> str:
        devices = ", ".join(f"{d} {format_bytes(b)}" for d, b in self.by_device().items())
        head = f"tensor census: {len(self.entries)} storages, {format_bytes(self.total)} ({devices})"
        lines = [head, *(str(g) for g in self.groups[:limit]), *(f"note: {n}" for n in self.notes)]
        if len(self.groups) > limit:
            rest = sum(g.nbytes for g in self.groups[limit:])
            lines.append(f"{format_bytes(rest):>11}  … {len(self.groups) - limit} more groups")
        return "\n".join(lines)

    def _repr_html_(self, limit: int = 15) -> str:
        # four columns, the tensor's kind in one and its graph under its holder: seven scrolled sideways in
        # Colab's ~420 px column
        rows = [[format_bytes(g.nbytes), g.count, _kind_cell(g), _held_cell(g)] for g in self.groups[:limit]]
        title = f"Tensor census: {len(self.entries)} storages, {format_bytes(self.total)}"
        html = table(["bytes", "count", "tensor", "held by"], rows, title)
        return html + "".join(f"<div>note: {escape(n)}</div>" for n in self.notes)


def _kind_cell(g) -> Markup:
    """``cpu · float32 · [512, 64]``, free to wrap between its parts."""
    return Markup(" · ".join(escape(str(x)) for x in (g.device, g.dtype, list(g.shape))))


def _held_cell(g) -> Markup:
    """The group's holders, and how many of its tensors carry an autograd graph on the line below."""
    held = ", ".join(g.holders[:3]) + (f" (+{len(g.holders) - 3})" if len(g.holders) > 3 else "") or "(unnamed)"
    graph = f"<div>{g.with_graph} with grad_fn</div>" if g.with_graph else ""
    return Markup(f"<div style='overflow-wrap:anywhere'>{escape(held)}</div>{graph}")


_DIGITS = re.compile(r"(\d+)")  # compiled once: a census of 20,000 tensors sorts 20,000 holder names


def _holder_group(path: str) -> str:
    """``losses[12]`` -> ``losses[…]``; ``cache["2x37"]`` -> ``cache[…]``; ``layers[3].w`` -> ``layers[…].w``."""
    path = re.sub(r"\[\d+\]", "[…]", path)
    return re.sub(r"\[(\"[^\"]*\"|\([^\]]*\)|<[^\]]*>|'[^']*')\]", "[…]", path)


def _group_by_holder(entries: list[TensorEntry]) -> list[tuple[str, int, int]]:
    acc: dict[str, list[int]] = {}
    for e in entries:
        g = _holder_group(e.holders[0]) if e.holders else _UNNAMED
        a = acc.setdefault(g, [0, 0])
        a[0] += 1
        a[1] += e.nbytes
    return sorted(((g, c, b) for g, (c, b) in acc.items()), key=lambda r: -r[2])


def _holders(namespace: dict, stats: dict, budget: NodeBudget, max_per_storage: int = 4) -> dict[tuple, list[str]]:
    names: dict[tuple, list[str]] = {}
    graph_roots: list[tuple[str, object]] = []
    for path, obj in walk(namespace, stats=stats):
        if isinstance(obj, torch.Tensor):
            key, _ = storage_key(obj)
            lst = names.setdefault(key, [])
            if len(lst) < max_per_storage and path not in lst:
                lst.append(path)
            if obj.grad_fn is not None:
                graph_roots.append((path, obj.grad_fn))
    # activations kept alive by a graph belong to the tensor that carries the graph
    seen_nodes: set[int] = set()
    for path, fn in graph_roots:
        for t in graph_tensors([fn], seen_nodes, budget):
            key, _ = storage_key(t)
            lst = names.setdefault(key, [])
            if not lst:
                lst.append(f"{path} (autograd graph)")
    return names


def census(namespace: dict | None = None) -> TensorCensus:
    """Every live tensor (CUDA, CPU, MPS; parameters, gradients and graph activations included).

    Args:
        namespace: where to look for holder names; default: the caller's globals (the notebook).
    """
    started = time.perf_counter()
    ns = caller_namespace(namespace)
    walked: dict = {}
    budget = NodeBudget()  # one budget for both walks of the graphs
    live = live_storages(walked, budget)
    names = _holders(ns, stats := {}, budget)
    notes = []
    if stats.get("truncated"):
        notes.append(f"holder names stop after {MAX_OBJECTS:,} objects of the namespace: some tensors show no name")
    if stats.get("too_deep"):
        notes.append(
            f"holder names stop at depth {MAX_DEPTH} (objects nested deeper were not walked): a tensor held only "
            "down there is counted but shows no name"
        )
    if budget.stopped:
        notes.append(
            f"autograd graphs walked up to {MAX_GRAPH_NODES:,} live nodes (PyTorch crashes freeing much deeper "
            "walked chains): activations past that are not counted"
        )
    entries = []
    for key, v in live.items():
        t = v.tensor
        entries.append(
            TensorEntry(
                str(t.device),
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                v.nbytes,
                names.get(key, []),
                v.grad_fn,
                key,
            )
        )
    entries.sort(key=lambda e: -e.nbytes)
    groups: dict[tuple, TensorGroup] = {}
    for e in entries:
        g = groups.get((e.device, e.dtype, e.shape))
        if g is None:
            g = groups[(e.device, e.dtype, e.shape)] = TensorGroup(e.device, e.dtype, e.shape, 0, 0, [], 0)
        g.count += 1
        g.nbytes += e.nbytes
        g.with_graph += e.grad_fn
        if e.holders:
            g.holders.append(e.holders[0])
    for g in groups.values():  # losses[2] before losses[10]
        g.holders.sort(key=lambda h: [int(t) if t.isdigit() else t for t in _DIGITS.split(h)])
    ordered = sorted(groups.values(), key=lambda g: -g.nbytes)
    return TensorCensus(entries, ordered, time.perf_counter() - started, notes)


@dataclass
class CensusDiff:
    """Storages that appeared between two censuses and are still alive, grouped by holder."""

    new: list[TensorEntry]
    freed: list[TensorEntry]

    @property
    def new_bytes(self) -> int:
        return sum(e.nbytes for e in self.new)

    @property
    def freed_bytes(self) -> int:
        return sum(e.nbytes for e in self.freed)

    def by_holder(self) -> list[tuple[str, int, int]]:
        return _group_by_holder(self.new)

    @property
    def top_holder(self) -> str | None:
        rows = self.by_holder()
        return rows[0][0] if rows else None

    def __str__(self) -> str:
        lines = [
            f"new since the first census: {format_bytes(self.new_bytes)} in {len(self.new)} storages, "
            f"freed {format_bytes(self.freed_bytes)}"
        ]
        lines += [f"{format_bytes(b):>11}  {c:>4} x  {g}" for g, c, b in self.by_holder()[:10]]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [[format_bytes(b), c, g] for g, c, b in self.by_holder()[:10]]
        return table(
            ["new bytes", "storages", "held by"], rows, f"Appeared and survived: {format_bytes(self.new_bytes)}"
        )


def census_diff(before: TensorCensus, after: TensorCensus) -> CensusDiff:
    """What appeared and survived between two censuses (memory reused at the same address with the
    same size reads as unchanged, so counts are a lower bound)."""
    for name, value in (("before", before), ("after", after)):
        if not isinstance(value, TensorCensus):
            raise TypeError(f"census_diff() compares two census() results; {name} is {value!r:.60}")
    old = {e.key for e in before.entries}
    now = {e.key for e in after.entries}
    return CensusDiff([e for e in after.entries if e.key not in old], [e for e in before.entries if e.key not in now])
