"""Leak hunting: which variable holds the memory, is it growing, and which pattern is to blame.

- :func:`census` lists every live tensor (views counted once by storage, tensors kept alive by an
  autograd graph included) and names who holds it: ``losses[12]``, ``cache["512x512"]``,
  ``trainer.model.layers[3].mlp.up_proj.weight``, ``Out[7]``.
- :func:`diff` says what appeared and survived between two censuses, by holder.
- :class:`GrowthDetector` / :func:`watch` follow memory step by step and tell a leak (sustained
  growth) from warm-up and from a cache that fills up and then stays flat.
- :func:`checks` looks for the usual culprits and gives the fix for each.
- :func:`record_allocations` (CUDA) records allocation history for PyTorch's memory visualizer and
  summarizes the top allocation sites.

Memory for the detector is ``torch.cuda.memory_allocated()`` on CUDA and, elsewhere, the bytes of
live tensors found by the census (so the detector works the same on a CPU-only machine).
"""

from __future__ import annotations

import gc
import inspect
import itertools
import math
import re
import statistics
import sys
import time
import types
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checks import Check
from .html import Markup, badge, table
from .units import format_bytes

__all__ = [
    "TensorEntry", "TensorGroup", "TensorCensus", "census", "tensor_bytes",
    "CensusDiff", "diff",
    "GrowthReport", "GrowthDetector", "WatchReport", "watch",
    "LeakChecks", "checks",
    "AllocationSites", "record_allocations", "top_allocation_sites",
]  # fmt: skip

# Names IPython (and Python) put in a notebook's namespace that are not the user's variables.
_SKIP_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}
_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice)
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.GeneratorType, property, classmethod, staticmethod)  # fmt: skip
_MODULE_INTERNALS = {"training"}
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_LIBRARY_PREFIXES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "helpers")


# --------------------------------------------------------------------------------------------
# live tensors and their storages


def _storage_key(t: torch.Tensor) -> tuple[tuple, int]:
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


def _gc_tensors() -> list[torch.Tensor]:
    # type(o), not isinstance: no __class__ property runs (some modules warn when touched)
    objs = gc.get_objects()
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


def _graph_tensors(roots: list, seen_nodes: set[int]) -> Iterator[torch.Tensor]:
    stack = [r for r in roots if r is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in seen_nodes:
            continue
        seen_nodes.add(id(fn))
        yield from _saved_tensors(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad: the leaf (a parameter)
        if isinstance(var, torch.Tensor):
            yield var
        stack.extend(n for n, _ in getattr(fn, "next_functions", ()) if n is not None)


@dataclass
class _Live:
    tensor: torch.Tensor
    nbytes: int
    grad_fn: bool
    in_graph: bool  # reached only through an autograd graph


def _live_storages() -> dict[tuple, _Live]:
    """Every storage held by a live tensor, with the largest tensor that views it."""
    live: dict[tuple, _Live] = {}

    def add(t: torch.Tensor, in_graph: bool) -> None:
        if t.device.type == "meta":
            return
        key, nbytes = _storage_key(t)
        cur = live.get(key)
        has_fn = t.grad_fn is not None
        if cur is None:
            live[key] = _Live(t, nbytes, has_fn, in_graph)
        else:
            cur.grad_fn |= has_fn
            cur.in_graph &= in_graph
            if t.numel() > cur.tensor.numel():
                cur.tensor = t

    tensors = _gc_tensors()
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
    for t in _graph_tensors(graph_roots, seen_nodes):
        add(t, True)
    return live


def tensor_bytes() -> int:
    """Bytes of every live tensor storage (each counted once), graphs' saved activations included."""
    return sum(v.nbytes for v in _live_storages().values())


# --------------------------------------------------------------------------------------------
# who holds what: walk the namespace


def _sub(path: str, key) -> str:
    if isinstance(key, str):
        return f'{path}["{key}"]'
    if isinstance(key, torch.Tensor):
        return f"{path}[<tensor {tuple(key.shape)}>]"
    return f"{path}[{key!r}]"


def _module_child(path: str, name: str) -> str:
    return f"{path}[{name}]" if name.isdigit() else f"{path}.{name}"


def _children(obj, path: str) -> Iterator[tuple[str, object]]:
    """(path, child) for what ``obj`` holds, named the way a user would write it."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and obj.is_leaf and obj.grad is not None:
            yield f"{path}.grad", obj.grad
        return
    if isinstance(obj, torch.nn.Module):
        d = obj.__dict__
        for name, t in d.get("_parameters", {}).items():
            if t is not None:
                yield _module_child(path, name), t
        for name, t in d.get("_buffers", {}).items():
            if t is not None:
                yield _module_child(path, name), t
        for name, m in d.get("_modules", {}).items():
            if m is not None:
                yield _module_child(path, name), m
        for name, v in d.items():
            if not name.startswith("_") and name not in _MODULE_INTERNALS:
                yield f"{path}.{name}", v
        return
    if isinstance(obj, torch.optim.Optimizer):
        for i, p in enumerate(obj.state):
            for k, v in obj.state[p].items():
                yield f'{path}.state[<param {i} {tuple(p.shape)}>]["{k}"]', v
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield _sub(path, k), v
        return
    if isinstance(obj, (list, tuple, deque)):
        for i, v in enumerate(list(obj)):
            yield f"{path}[{i}]", v
        return
    if isinstance(obj, (set, frozenset)):
        for v in list(obj):
            yield f"{path}{{…}}", v
        return
    if isinstance(obj, BaseException):
        if obj.__traceback__ is not None:
            yield f"{path}.__traceback__", obj.__traceback__
        return
    if isinstance(obj, types.TracebackType):
        tb = obj
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_locals is not frame.f_globals:  # a module frame's locals are the namespace
                for name, v in list(frame.f_locals.items()):
                    yield f"{path} → {frame.f_code.co_name}() local {name}", v
            tb = tb.tb_next
        return
    if isinstance(obj, _OPAQUE) or isinstance(obj, _ATOMS):
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for name, v in list(d.items()):
            if not name.startswith("__"):
                yield f"{path}.{name}", v


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython ships with the notebook stack
        return None
    return get_ipython()


def _roots(namespace: dict) -> list[tuple[str, object]]:
    roots = [
        (k, v)
        for k, v in namespace.items()
        if not k.startswith("_") and k not in _SKIP_NAMES and not isinstance(v, _OPAQUE)
    ]
    out = namespace.get("Out")
    ip = _ipython()
    if not isinstance(out, dict) and ip is not None and namespace is ip.user_ns:
        out = ip.user_ns.get("Out")
    if isinstance(out, dict):
        roots.append(("Out", out))
    for name in ("last_value", "last_exc", "last_traceback"):
        v = getattr(sys, name, None)
        if v is not None:
            roots.append((f"sys.{name}", v))
    return roots


def _walk(namespace: dict, max_objects: int = 200_000) -> Iterator[tuple[str, object]]:
    """Breadth first from the namespace's names, so each object gets its shortest path first."""
    seen: set[int] = set()
    queue = deque(_roots(namespace))
    visited = 0
    while queue and visited < max_objects:
        path, obj = queue.popleft()
        if isinstance(obj, _ATOMS):
            continue
        if not isinstance(obj, torch.Tensor):  # tensors: every path is a holder name; others: once
            if id(obj) in seen:
                continue
            seen.add(id(obj))
        yield path, obj
        visited += 1
        try:
            queue.extend(_children(obj, path))
        except Exception:  # an object whose attributes cannot be read: skip it, keep walking
            continue


def _caller_namespace(namespace: dict | None, depth: int = 2) -> dict:
    """The namespace of whoever called the public function (the notebook's, in a notebook)."""
    if namespace is not None:
        return namespace
    ip = _ipython()
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back
        ns = frame.f_globals
    finally:
        del frame
    if ip is not None and ns.get("__name__") == "__main__" and "get_ipython" in ns:
        return ip.user_ns
    return ns


# --------------------------------------------------------------------------------------------
# census


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
        lines = [head, *(str(g) for g in self.groups[:limit])]
        if len(self.groups) > limit:
            rest = sum(g.nbytes for g in self.groups[limit:])
            lines.append(f"{format_bytes(rest):>11}  … {len(self.groups) - limit} more groups")
        return "\n".join(lines)

    def _repr_html_(self, limit: int = 15) -> str:
        rows = [
            [
                format_bytes(g.nbytes),
                g.count,
                g.device,
                g.dtype,
                str(list(g.shape)),
                ", ".join(g.holders[:3]) + (f" (+{len(g.holders) - 3})" if len(g.holders) > 3 else "") or "(unnamed)",
                g.with_graph or "",
            ]
            for g in self.groups[:limit]
        ]
        title = f"Tensor census: {len(self.entries)} storages, {format_bytes(self.total)}"
        return table(["bytes", "count", "device", "dtype", "shape", "held by", "grad_fn"], rows, title)


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


def _holders(namespace: dict, max_per_storage: int = 4) -> dict[tuple, list[str]]:
    names: dict[tuple, list[str]] = {}
    graph_roots: list[tuple[str, object]] = []
    for path, obj in _walk(namespace):
        if isinstance(obj, torch.Tensor):
            key, _ = _storage_key(obj)
            lst = names.setdefault(key, [])
            if len(lst) < max_per_storage and path not in lst:
                lst.append(path)
            if obj.grad_fn is not None:
                graph_roots.append((path, obj.grad_fn))
    # activations kept alive by a graph belong to the tensor that carries the graph
    seen_nodes: set[int] = set()
    for path, fn in graph_roots:
        for t in _graph_tensors([fn], seen_nodes):
            key, _ = _storage_key(t)
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
    ns = _caller_namespace(namespace)
    live = _live_storages()
    names = _holders(ns)
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
        g.holders.sort(key=lambda h: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", h)])
    ordered = sorted(groups.values(), key=lambda g: -g.nbytes)
    return TensorCensus(entries, ordered, time.perf_counter() - started)


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


def diff(before: TensorCensus, after: TensorCensus) -> CensusDiff:
    """What appeared and survived between two censuses (memory reused at the same address with the
    same size reads as unchanged, so counts are a lower bound)."""
    old = {e.key for e in before.entries}
    now = {e.key for e in after.entries}
    return CensusDiff([e for e in after.entries if e.key not in old], [e for e in before.entries if e.key not in now])


# --------------------------------------------------------------------------------------------
# growth over steps


def _theil_sen(ys: list[float]) -> float:
    """Median of pairwise slopes: one spike or one jump does not tilt it."""
    slopes = [(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]
    return statistics.median(slopes) if slopes else 0.0


def _measure() -> int:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return tensor_bytes()


def _headroom() -> int | None:
    """Bytes that can still be allocated before an OOM: the GPU's free memory plus PyTorch's cache."""
    try:
        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        import psutil

        return psutil.virtual_memory().available
    except Exception:
        return None


@dataclass
class GrowthReport:
    """The detector's verdict after ``steps`` steps."""

    steps: int
    samples: list[int]
    leaking: bool
    bytes_per_step: float
    accelerating: bool
    predicted_oom_step: int | None
    detected_at: int | None
    verdict: str
    measure: str = "tensor bytes"

    def __str__(self) -> str:
        lines = [f"growth: {self.verdict}"]
        if self.samples:
            lines.append(
                f"  {self.measure}: {format_bytes(self.samples[0])} at step 1 -> "
                f"{format_bytes(self.samples[-1])} at step {self.steps}; trend "
                f"{format_bytes(int(self.bytes_per_step))}/step" + (", accelerating" if self.accelerating else "")
            )
        if self.predicted_oom_step is not None:
            lines.append(f"  at this rate memory runs out at about step {self.predicted_oom_step:,}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        status = "warn" if self.leaking else "pass"
        return (
            f"<div style='font-family:monospace'>{badge(status)} {Markup(_esc(self.verdict))}"
            f"<br>{_sparkline(self.samples)}<br><pre>{_esc(str(self))}</pre></div>"
        )


def _esc(s: str) -> str:
    from html import escape

    return escape(s)


def _sparkline(ys: list[int], width: int = 320, height: int = 60) -> str:
    if len(ys) < 2:
        return ""
    lo, hi = min(ys), max(ys)
    span = (hi - lo) or 1
    pts = " ".join(
        f"{i * width / (len(ys) - 1):.1f},{height - 4 - (y - lo) * (height - 8) / span:.1f}" for i, y in enumerate(ys)
    )
    return (
        f"<svg width='{width}' height='{height}' style='background:#fafafa'>"
        f"<polyline fill='none' stroke='#c0392b' stroke-width='2' points='{pts}'/></svg>"
        f"<br><small>{format_bytes(lo)} … {format_bytes(hi)} over {len(ys)} steps</small>"
    )


class GrowthDetector:
    """Record memory once per step; tell sustained growth (a leak) from warm-up and from caches.

    A leak is growth in at least half of the last ``window`` steps after ``warmup``, with the last
    third of that window entirely above its first third and a robust (Theil-Sen) trend of at least
    ``min_growth`` bytes per step. A cache that fills and then stays flat, or a warm-up spike, fails
    those tests once it has settled.

    Args:
        warmup: steps ignored at the start (optimizer state, allocator warm-up, first-shape caches).
        window: recent steps the verdict is based on.
        min_growth: smallest growth per step worth calling a leak, in bytes.
        capacity: bytes available to the measured quantity in total; default: what is measured now
            plus the free GPU memory (CUDA) or the available RAM.
        measure: a callable returning bytes; default ``torch.cuda.memory_allocated`` on CUDA, else
            :func:`tensor_bytes`.
    """

    def __init__(
        self,
        warmup: int = 4,
        window: int = 10,
        min_growth: int = 1024,
        *,
        capacity: int | None = None,
        measure: Callable[[], int] | None = None,
    ) -> None:
        if window < 3:
            raise ValueError("GrowthDetector(window=...) needs at least 3 steps to see a trend")
        self.warmup, self.window, self.min_growth = warmup, window, min_growth
        self.capacity = capacity
        self.measure = measure or _measure
        self.measure_name = (
            "GPU allocated"
            if measure is None and torch.cuda.is_available()
            else "tensor bytes"
            if measure is None
            else "memory"
        )
        self.samples: list[int] = []
        self._detected_at: int | None = None

    def record(self, nbytes: int | None = None) -> bool:
        """Record one step (measuring now unless ``nbytes`` is given); returns whether it leaks."""
        self.samples.append(int(self.measure() if nbytes is None else nbytes))
        leaking = self._leaking()
        if leaking and self._detected_at is None:
            self._detected_at = len(self.samples)
        elif not leaking:
            self._detected_at = None
        return leaking

    def _recent(self) -> list[int]:
        post = self.samples[self.warmup :]
        return post[-(self.window + 1) :] if len(post) > self.window else []

    def _leaking(self) -> bool:
        w = self._recent()
        if not w:
            return False
        deltas = [b - a for a, b in zip(w, w[1:])]
        ups = sum(d >= self.min_growth / 2 for d in deltas)
        third = max(1, len(w) // 3)
        sustained = min(w[-third:]) > max(w[:third])
        return ups * 2 >= len(deltas) and sustained and _theil_sen(w) >= self.min_growth

    def report(self) -> GrowthReport:
        n = len(self.samples)
        post = self.samples[self.warmup :]
        leaking = self._leaking()
        w = self._recent()
        slope = _theil_sen(w) if w else (_theil_sen(post) if len(post) > 2 else 0.0)
        accelerating, oom = False, None
        if leaking and len(post) >= 6:
            half = len(post) // 2
            s1, s2 = _theil_sen(post[:half]), _theil_sen(post[half:])
            accelerating = s2 > 1.5 * max(s1, 1.0) and s2 - s1 >= self.min_growth
        if leaking and slope > 0:
            level = self.samples[-1]
            room = (self.capacity - level) if self.capacity is not None else _headroom()
            if room is not None:
                oom = n + _steps_until(room, post, slope, accelerating)
        if not w:
            verdict = f"not enough steps yet ({n} of {self.warmup + self.window + 1} needed)"
        elif leaking:
            verdict = f"LEAK: memory grew {format_bytes(int(slope))} per step over the last {self.window} steps" + (
                " and the growth is accelerating" if accelerating else ""
            )
        else:
            verdict = f"no leak: memory is flat over the last {self.window} steps (after {self.warmup} warm-up steps)"
        return GrowthReport(
            n,
            list(self.samples),
            leaking,
            slope,
            accelerating,
            oom,
            self._detected_at if leaking else None,
            verdict,
            self.measure_name,
        )


def _steps_until(room: int, post: list[int], slope: float, accelerating: bool) -> int:
    if room <= 0:
        return 0
    if accelerating and len(post) >= 6:
        # growth per step rising linearly: room = slope*k + accel*k^2/2
        half = len(post) // 2
        accel = (_theil_sen(post[half:]) - _theil_sen(post[:half])) / max(half, 1)
        if accel > 0:
            return int((-slope + math.sqrt(slope * slope + 2 * accel * room)) / accel)
    return int(room / slope)


@dataclass
class WatchReport:
    """What :func:`watch` saw: the growth verdict, what appeared (by holder), and pattern findings."""

    growth: GrowthReport
    new: CensusDiff | None
    findings: LeakChecks | None

    @property
    def leaking(self) -> bool:
        return self.growth.leaking

    @property
    def suspect(self) -> str | None:
        """The holder that gained the most memory during the watch."""
        return self.new.top_holder if self.new is not None else None

    def __str__(self) -> str:
        parts = [str(self.growth)]
        if self.new is not None and self.growth.leaking:
            parts.append(str(self.new))
        if self.findings is not None and self.findings.problems:
            parts.append("\n".join(str(c) for c in self.findings.problems))
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        parts = [self.growth._repr_html_()]
        if self.new is not None and self.growth.leaking:
            parts.append(self.new._repr_html_())
        if self.findings is not None and self.findings.problems:
            parts.append(LeakChecks(self.findings.problems)._repr_html_())
        return "".join(parts)


def watch(
    step_fn: Callable,
    steps: int,
    *,
    namespace: dict | None = None,
    warmup: int = 4,
    window: int = 10,
    min_growth: int = 1024,
    capacity: int | None = None,
    stop_on_leak: bool = False,
) -> WatchReport:
    """Run ``step_fn`` ``steps`` times (it gets the step index if it takes an argument), measure memory
    after each step, and say whether it leaks, who gained memory, and which leak pattern is present.

    >>> report = watch(lambda i: train_step(batch), steps=30)   # doctest: +SKIP
    """
    if not callable(step_fn):
        raise TypeError(
            f"watch() runs a function once per step, got {type(step_fn).__name__}: "
            "pass the step itself, e.g. watch(lambda: train_step(batch), steps=30)"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
    ns = _caller_namespace(namespace)
    try:
        takes_arg = bool(inspect.signature(step_fn).parameters)
    except (TypeError, ValueError):
        takes_arg = False
    det = GrowthDetector(warmup, window, min_growth, capacity=capacity)
    baseline = None
    for i in range(steps):
        try:
            step_fn(i) if takes_arg else step_fn()
        except BaseException as e:  # noqa: BLE001 - re-raised; an interrupt keeps its report too
            # the steps measured so far are the evidence (an OOM here is often the leak itself): keep them
            e.watch_report = WatchReport(det.report(), None, None)
            if hasattr(e, "add_note"):  # Python 3.11+
                first = str(e.watch_report).splitlines()[0]
                e.add_note(
                    f"helpers.leaks.watch: step {i} of {steps} raised this; the {i} steps measured "
                    f"before it are in the exception's .watch_report ({first})"
                )
            raise
        if i + 1 == warmup or (baseline is None and i + 1 == steps):
            baseline = census(ns)
        if det.record() and stop_on_leak:
            break
    growth = det.report()
    return WatchReport(growth, diff(baseline, census(ns)) if baseline else None, checks(ns))


# --------------------------------------------------------------------------------------------
# pattern checks


@dataclass
class LeakChecks:
    """The leak patterns looked for, each ``pass`` or ``warn`` with the finding and the fix."""

    checks: list[Check]

    @property
    def problems(self) -> list[Check]:
        return [c for c in self.checks if c.status != "pass"]

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; checks: {[c.name for c in self.checks]}")

    def __str__(self) -> str:
        return "\n".join(str(c) for c in self.checks)

    def _repr_html_(self) -> str:
        rows = [[badge(c.status), c.name, c.summary, c.fix or ""] for c in self.checks]
        return table(["", "pattern", "finding", "fix"], rows, "Leak patterns")


def _bytes_of(obj, limit: int = 10_000) -> tuple[int, int]:
    """(storage bytes, tensors) reachable from ``obj``, graph activations included."""
    seen: set[tuple] = set()
    total = count = 0
    seen_nodes: set[int] = set()
    for _, o in _walk({"x": obj}, max_objects=limit):
        if isinstance(o, torch.Tensor):
            ts = [o, *(_graph_tensors([o.grad_fn], seen_nodes) if o.grad_fn is not None else [])]
            count += 1
            for t in ts:
                key, nbytes = _storage_key(t)
                if key not in seen:
                    seen.add(key)
                    total += nbytes
    return total, count


def _names(paths: list[str], n: int = 3) -> str:
    return ", ".join(paths[:n]) + (f" (+{len(paths) - n} more)" if len(paths) > n else "")


def _shape_key(k) -> bool:
    if isinstance(k, (torch.Size, int)):
        return True
    if isinstance(k, tuple):
        return bool(k) and all(isinstance(x, (int, torch.Size, tuple)) for x in k)
    return isinstance(k, str) and re.fullmatch(r"\d+([x×,_ -]\d+)*", k) is not None


def _holds_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v))


def _container_of(path: str) -> str:
    return re.sub(r"\[[^\[\]]*\]$", "", path)


def checks(namespace: dict | None = None, *, cache_entries: int = 16) -> LeakChecks:
    """Look for the usual leak patterns in the notebook's namespace (default: the caller's globals).

    Args:
        cache_entries: a dict of tensors keyed by shape with at least this many entries is reported.
    """
    ns = _caller_namespace(namespace)
    graph_holders: dict[str, list] = {}
    hooks: list[tuple[str, str, int]] = []
    caches: list[tuple[str, dict]] = []
    eval_grads: dict[str, list[torch.Tensor]] = {}
    exceptions: list[tuple[str, object]] = []
    seen_params: set[int] = set()
    for path, obj in _walk(ns):
        if isinstance(obj, torch.Tensor):
            if (
                obj.grad_fn is not None and "[" in path and not path.startswith("Out[") and "__traceback__" not in path
            ):  # those belong to the traceback check
                graph_holders.setdefault(_container_of(path), []).append((path, obj))
        elif isinstance(obj, torch.nn.Module):
            for kind in _HOOK_DICTS:
                fns = [
                    f
                    for f in getattr(obj, kind, {}).values()
                    if not (getattr(f, "__module__", None) or "").startswith(_LIBRARY_PREFIXES)
                ]
                if fns:
                    names = sorted({getattr(f, "__qualname__", type(f).__name__) for f in fns})
                    hooks.append(
                        (
                            path,
                            f"{len(fns)} {kind.strip('_').replace('_', ' ')[:-1]}"
                            f"{'s' if len(fns) > 1 else ''} ({', '.join(names)})",
                            len(fns),
                        )
                    )
            if not obj.training:
                for p in obj.parameters():
                    if p.grad is not None and id(p) not in seen_params:
                        seen_params.add(id(p))
                        eval_grads.setdefault(path, []).append(p.grad)
        elif isinstance(obj, dict) and len(obj) >= cache_entries and not path.startswith("Out"):
            items = list(obj.items())
            if all(_shape_key(k) and _holds_tensor(v) for k, v in items):
                caches.append((path, obj))
        elif (
            isinstance(obj, (BaseException, types.TracebackType))
            and not path.startswith("Out[")
            and "__traceback__" not in path
            and " local " not in path
        ):  # outermost holder only
            exceptions.append((path, obj))

    found: list[Check] = []

    if graph_holders:
        rows = []
        for container, items in graph_holders.items():
            nbytes, _ = _bytes_of([t for _, t in items])
            rows.append((nbytes, container, len(items)))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        where = "; ".join(f"{c} holds {n} tensor{'s' if n > 1 else ''} with grad_fn" for _, c, n in rows[:3])
        found.append(
            Check(
                "graph in container",
                "warn",
                f"{where}: their autograd graphs keep {format_bytes(total)} of activations alive",
                "store plain numbers: losses.append(loss.item()) (or loss.detach() to keep a tensor); "
                "run evaluation under torch.no_grad()",
                {"holders": [c for _, c, _ in rows], "bytes": total},
            )
        )
    else:
        found.append(Check("graph in container", "pass", "no list or dict holds tensors that carry a graph"))

    if hooks:
        total = sum(n for _, _, n in hooks)
        found.append(
            Check(
                "hooks",
                "warn",
                f"{total} hook{'s' if total > 1 else ''} still attached: "
                + "; ".join(f"{p}: {d}" for p, d, _ in hooks[:3])
                + (f" (+{len(hooks) - 3} modules)" if len(hooks) > 3 else ""),
                "keep the handle and remove it when done: h = m.register_forward_hook(fn); ...; "
                "h.remove() (re-running the cell adds another hook each time)",
                {"holders": [p for p, _, _ in hooks], "count": total},
            )
        )
    else:
        found.append(Check("hooks", "pass", "no user forward/backward hooks on the models in this namespace"))

    out = ns.get("Out")
    ip = _ipython()
    if not isinstance(out, dict) and ip is not None and ns is ip.user_ns:
        out = ip.user_ns.get("Out")
    held = [(k, v) for k, v in (out or {}).items() if _bytes_of(v, 1000)[1]]
    if held:
        nbytes, _ = _bytes_of([v for _, v in held])
        found.append(
            Check(
                "output history",
                "warn",
                f"IPython's Out keeps {len(held)} displayed value{'s' if len(held) > 1 else ''} with "
                f"tensors alive ({format_bytes(nbytes)}): {_names([f'Out[{k}]' for k, _ in held])}",
                "end cells that return tensors with ';' (or assign them); free it now with "
                "helpers.cleanup(); in a notebook, %config ZMQInteractiveShell.cache_size = 0",
                {"holders": [f"Out[{k}]" for k, _ in held], "bytes": nbytes},
            )
        )
    else:
        found.append(Check("output history", "pass", "no tensors in IPython's output history"))

    by_holder: dict[str, list] = {}  # errors[0], errors[1] -> errors
    for path, obj in exceptions:
        by_holder.setdefault(_container_of(path) if path.endswith("]") else path, []).append(obj)
    tb_rows = []
    for holder, objs in by_holder.items():
        nbytes, n = _bytes_of(objs)
        if n:
            what = f"{holder} ({len(objs)} exceptions)" if len(objs) > 1 else holder
            tb_rows.append((nbytes, holder, what))
    if tb_rows:
        tb_rows.sort(reverse=True)
        total = sum(r[0] for r in tb_rows)
        found.append(
            Check(
                "stored traceback",
                "warn",
                f"{_names([w for _, _, w in tb_rows])} keep{'s' if len(tb_rows) == 1 else ''} frames alive "
                f"with {format_bytes(total)} of tensors in their local variables",
                "keep the message, not the exception: errors.append(repr(e)) or "
                "traceback.format_exc(); after an OOM in a notebook run helpers.cleanup()",
                {"holders": [p for _, p, _ in tb_rows], "bytes": total},
            )
        )
    else:
        found.append(Check("stored traceback", "pass", "no stored exception or traceback holds tensors"))

    if caches:
        rows = [(_bytes_of(c)[0], p, len(c)) for p, c in caches]
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        found.append(
            Check(
                "shape-keyed cache",
                "warn",
                "; ".join(f"{p} holds {n} tensors keyed by shape ({format_bytes(b)})" for b, p, n in rows[:3])
                + ": it grows with every new input shape",
                "bound it (functools.lru_cache(maxsize=...) or evict the oldest), or pad inputs to a "
                "few fixed lengths so few shapes ever occur",
                {"holders": [p for _, p, _ in rows], "bytes": total},
            )
        )
    else:
        found.append(Check("shape-keyed cache", "pass", f"no dict of {cache_entries}+ tensors keyed by shape"))

    if eval_grads:
        rows = []
        for path, grads in eval_grads.items():
            nbytes = sum(_storage_key(g)[1] for g in grads)
            rows.append((nbytes, path, len(grads)))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        found.append(
            Check(
                "grads after eval",
                "warn",
                "; ".join(f"{p}: {n} parameters still hold .grad ({format_bytes(b)})" for b, p, n in rows[:3])
                + " while in eval mode",
                "model.zero_grad(set_to_none=True) after training, and evaluate under torch.inference_mode()",
                {"holders": [p for _, p, _ in rows], "bytes": total},
            )
        )
    else:
        found.append(Check("grads after eval", "pass", "no model in eval mode keeps gradients"))
    return LeakChecks(found)


# --------------------------------------------------------------------------------------------
# CUDA: allocation history for PyTorch's memory visualizer


@dataclass
class AllocationSites:
    """Live allocations in a memory snapshot, summed by the line of user code that made them."""

    sites: list[tuple[str, int, int]]  # (site, bytes, count), largest first
    total: int
    path: Path | None = None

    def __str__(self) -> str:
        head = f"{format_bytes(self.total)} allocated in {sum(c for _, _, c in self.sites)} blocks"
        if self.path is not None:
            head += f"; snapshot {self.path} (drop it on https://pytorch.org/memory_viz)"
        return "\n".join([head, *(f"{format_bytes(b):>11}  {c:>5} x  {s}" for s, b, c in self.sites)])

    def _repr_html_(self) -> str:
        return table(
            ["bytes", "blocks", "allocated at"],
            [[format_bytes(b), c, s] for s, b, c in self.sites],
            f"Top allocation sites ({format_bytes(self.total)} live)",
        )


def _site(frames: list[dict]) -> str:
    """The first frame outside torch and the libraries: the line the user can change."""

    def lib(f):
        fn = f.get("filename", "")
        # Snapshots list C/C++ frames too (allocator, libpython: "??", "Python/ceval.c", a .so path);
        # only Python source can be the user's line. Colab installs packages in dist-packages.
        python = fn.endswith(".py") or (fn.startswith("<") and not fn.startswith("<frozen"))
        return not python or "site-packages" in fn or "dist-packages" in fn or "/torch/" in fn

    pick = next((f for f in frames if not lib(f) and f.get("filename")), None)
    if pick is None:
        pick = next((f for f in frames if f.get("filename", "").endswith(".py")), frames[0] if frames else None)
    if pick is None:
        return "(allocated before recording started)"
    return f"{pick.get('filename')}:{pick.get('line')} {pick.get('name')}"


def top_allocation_sites(snapshot: dict | str | Path, n: int = 10) -> AllocationSites:
    """Sum live blocks of a ``torch.cuda.memory._snapshot()`` (dict or pickle file) by allocation site."""
    path = None
    if not isinstance(snapshot, dict):
        import pickle

        path = Path(snapshot)
        with path.open("rb") as f:
            snapshot = pickle.load(f)
    acc: dict[str, list[int]] = {}
    total = 0
    for seg in snapshot.get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            site = _site(block.get("frames") or [])
            a = acc.setdefault(site, [0, 0])
            a[0] += block.get("size", 0)
            a[1] += 1
            total += block.get("size", 0)
    sites = sorted(((s, b, c) for s, (b, c) in acc.items()), key=lambda r: -r[1])[:n]
    return AllocationSites(sites, total, path)


@dataclass
class _Recording:
    path: Path
    sites: AllocationSites | None = None

    def __str__(self) -> str:
        return str(self.sites) if self.sites is not None else f"recording to {self.path}"


@contextmanager
def record_allocations(
    path: str | Path = "memory_snapshot.pickle", max_entries: int = 100_000, top: int = 10
) -> Iterator[_Recording]:
    """Record every CUDA allocation inside the block, then dump a snapshot for
    https://pytorch.org/memory_viz and summarize the top allocation sites (``rec.sites``).

    >>> with record_allocations("leak.pickle") as rec:   # doctest: +SKIP
    ...     for _ in range(20): train_step()
    >>> print(rec.sites)                                  # doctest: +SKIP
    """
    if not torch.cuda.is_available():
        raise RuntimeError("record_allocations() needs a CUDA GPU; on CPU use census() and watch()")
    rec = _Recording(Path(path))
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield rec
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(rec.path))
            rec.sites = top_allocation_sites(rec.path, top)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
