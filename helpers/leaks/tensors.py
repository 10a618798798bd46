"""The one walk over live tensors: every storage held by a tensor, graphs' saved activations included.

Used by the OOM report (largest tensors), leak hunting (census) and per-cell accounting. Autograd
graphs are walked node by node to find the activations they keep for backward, within a budget of
node wrappers (:data:`MAX_GRAPH_NODES`): reading ``grad_fn`` or ``next_functions`` creates a Python
wrapper per node, PyTorch keeps it as long as the node lives, and freeing a chain of ~42,000 wrapped
nodes overflows the C stack (torch 2.13 segfaults; tests/test_tensors.py). The budget counts the
wrappers already alive, from earlier walks too, and a walk it stops says so.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..core.session import user_namespace

__all__ = [
    "LiveStorage",
    "live_storages",
    "storage_key",
    "tensor_bytes",
    "largest_tensors",
    "graph_tensors",
    "NodeBudget",
    "MAX_GRAPH_NODES",
]

# Live node wrappers allowed in the process: about half of the ~42,000 wrapped nodes in a chain whose
# release overflows the default 8 MiB stack (measured: 40,000 of a 50,000 chain freed, 45,000 crashed).
MAX_GRAPH_NODES = 20_000


def storage_key(t: torch.Tensor) -> tuple[tuple, int]:
    """(key, bytes) of the memory behind ``t``; views of one storage share the key."""
    try:
        s = t.untyped_storage()
        return (str(t.device), s.data_ptr(), s.nbytes()), s.nbytes()
    except Exception:  # sparse, nested or other storage-less tensors
        return (str(t.device), "id", id(t)), t.element_size() * t.numel()


class _IsTensorType(dict):
    """type -> is it a Tensor subclass; lookups stay in C for types already seen."""

    def __missing__(self, tp):
        self[tp] = r = issubclass(tp, torch.Tensor)
        return r


_IS_TENSOR = _IsTensorType()


class _IsNodeType(dict):
    """type -> is it an autograd node (wrapper); a type lookup, so no ABC hook runs per object."""

    def __missing__(self, tp):
        self[tp] = r = issubclass(tp, torch.autograd.graph.Node)
        return r


_IS_NODE = _IsNodeType()


def _gc_tensors(objs: list | None = None) -> list[torch.Tensor]:
    # type(o), not isinstance: no __class__ property runs (some modules warn when touched)
    objs = gc.get_objects() if objs is None else objs
    return list(itertools.compress(objs, map(_IS_TENSOR.__getitem__, map(type, objs))))


_SAVED_ATTRS: dict[type, list[str]] = {}


def _saved_tensors(fn) -> list[torch.Tensor]:
    """Tensors an autograd node keeps for backward (activations): invisible to ``gc``."""
    names = _SAVED_ATTRS.get(type(fn))
    if names is None:
        names = _SAVED_ATTRS[type(fn)] = [a for a in dir(fn) if a.startswith("_saved_")]
    out = []
    for a in names:
        try:
            v = getattr(fn, a)
        except Exception:  # freed by backward, or not a tensor we can unpack
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


class NodeBudget:
    """How many autograd-node wrappers a walk may still create: the alive ones count against
    :data:`MAX_GRAPH_NODES` (one ``gc`` scan), and so does each node a walk touches."""

    def __init__(self, limit: int = MAX_GRAPH_NODES, objs: list | None = None) -> None:
        objs = gc.get_objects() if objs is None else objs  # a caller's own scan saves one (tens of ms)
        self.alive = set(map(id, itertools.compress(objs, map(_IS_NODE.__getitem__, map(type, objs)))))
        del objs
        self.limit = limit
        self.stopped = False  # True: the budget ran out and some graph nodes were not walked

    def take(self, node) -> bool:
        if id(node) in self.alive:
            return True
        if len(self.alive) >= self.limit:
            self.stopped = True
            return False
        self.alive.add(id(node))
        return True


def graph_tensors(roots: list, seen_nodes: set[int], budget: NodeBudget | None = None) -> Iterator[torch.Tensor]:
    """Tensors kept by the autograd graphs behind ``roots`` (nodes): saved activations and the leaves
    they accumulate into, as far as ``budget`` allows (a fresh one by default)."""
    budget = budget or NodeBudget()
    stack = [r for r in roots if r is not None and budget.take(r)]
    while stack:
        fn = stack.pop()
        if id(fn) in seen_nodes:
            continue
        seen_nodes.add(id(fn))
        yield from _saved_tensors(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad: the leaf (a parameter)
        if isinstance(var, torch.Tensor):
            yield var
        if budget.limit > len(budget.alive):  # reading next_functions wraps every input node
            stack.extend(n for n, _ in getattr(fn, "next_functions", ()) if n is not None and budget.take(n))
        else:
            budget.stopped = True
        del fn


@dataclass
class LiveStorage:
    tensor: torch.Tensor
    nbytes: int
    grad_fn: bool
    in_graph: bool  # reached only through an autograd graph


def live_storages(stats: dict | None = None, budget: NodeBudget | None = None) -> dict[tuple, LiveStorage]:
    """Every storage held by a live tensor, with the largest tensor that views it. ``stats`` (a dict) gets
    ``graph_nodes`` walked and ``graph_truncated`` when :data:`MAX_GRAPH_NODES` stopped the walk."""
    live: dict[tuple, LiveStorage] = {}

    def add(t: torch.Tensor, in_graph: bool) -> None:
        if t.device.type == "meta":
            return
        key, nbytes = storage_key(t)
        cur = live.get(key)
        has_fn = t.grad_fn is not None
        if cur is None:
            live[key] = LiveStorage(t, nbytes, has_fn, in_graph)
        else:
            cur.grad_fn |= has_fn
            cur.in_graph &= in_graph
            if t.numel() > cur.tensor.numel():
                cur.tensor = t

    objs = gc.get_objects()  # one scan for the tensors and the graph budget: watch() measures every step
    tensors = _gc_tensors(objs)
    graph_roots = []
    for t in tensors:
        add(t, False)
        if t.grad_fn is not None:
            graph_roots.append(t.grad_fn)
        elif t.requires_grad and t.is_leaf:
            g = t.grad  # a .grad has no Python object until asked for
            if g is not None:
                add(g, False)
    seen_nodes: set[int] = set()
    if graph_roots:  # the budget's scan of node wrappers costs as much as the tensor scan: only when a graph is alive
        budget = budget or NodeBudget(objs=objs)
        for t in graph_tensors(graph_roots, seen_nodes, budget):
            add(t, True)
    del objs
    if stats is not None:  # how much of the autograd graphs was walked
        stats.update(graph_nodes=len(seen_nodes), graph_truncated=bool(budget and budget.stopped))
    return live


def tensor_bytes() -> int:
    """Bytes of every live tensor storage (each counted once), graphs' saved activations included."""
    return sum(v.nbytes for v in live_storages().values())


def largest_tensors(n: int = 5, names: dict[int, str] | None = None) -> list[tuple[str, int, str]]:
    """The ``n`` largest live storages as ``(name, bytes, "shape dtype device")``, each counted once.

    Names come from ``names`` (``id(tensor) -> name``, e.g. from a traceback's frames), then the
    notebook's namespace (its variables; none outside IPython), else ``"(unnamed)"``.
    """
    names = dict(names or {})
    for var, value in list(user_namespace().items()):
        if isinstance(value, torch.Tensor) and not var.startswith("_"):
            names.setdefault(id(value), var)
    found = []
    for live in live_storages().values():
        t = live.tensor
        if live.nbytes == 0:
            continue
        desc = f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.device}"
        found.append((names.get(id(t), "(unnamed)"), live.nbytes, desc))
    return sorted(found, key=lambda e: -e[1])[:n]
