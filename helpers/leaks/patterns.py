"""The usual culprits of a leak, each with its fix: kept losses, growing caches, hooks, history."""

from __future__ import annotations

import re
import types
from dataclasses import dataclass, field

import torch

from ..core.arguments import whole_number
from ..core.checks import Check, checks_table
from ..core.session import caller_namespace, ipython
from ..core.units import format_bytes
from .object_walk import walk
from .tensors import graph_tensors, storage_key

__all__ = ["LeakChecks", "leak_checks"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_LIBRARY_PREFIXES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "helpers")


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
        return checks_table(self.checks, "Leak patterns", name="pattern")  # each fix under its finding


def _bytes_of(obj, limit: int = 10_000) -> tuple[int, int]:
    """(storage bytes, tensors) reachable from ``obj``, graph activations included."""
    seen: set[tuple] = set()
    total = count = 0
    seen_nodes: set[int] = set()
    for _, o in walk({"x": obj}, max_objects=limit):
        if isinstance(o, torch.Tensor):
            ts = [o, *(graph_tensors([o.grad_fn], seen_nodes) if o.grad_fn is not None else [])]
            count += 1
            for t in ts:
                key, nbytes = storage_key(t)
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


@dataclass
class _Findings:
    """What one walk of the namespace turned up, for the checks below to judge."""

    graph_holders: dict[str, list] = field(default_factory=dict)
    hooks: list[tuple[str, str, int]] = field(default_factory=list)
    caches: list[tuple[str, dict]] = field(default_factory=list)
    eval_grads: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    exceptions: list[tuple[str, object]] = field(default_factory=list)


def _user_hooks(obj: torch.nn.Module) -> list[tuple[str, int]]:
    out = []
    for kind in _HOOK_DICTS:
        fns = [
            f
            for f in getattr(obj, kind, {}).values()
            if not (getattr(f, "__module__", None) or "").startswith(_LIBRARY_PREFIXES)
        ]
        if fns:
            names = sorted({getattr(f, "__qualname__", type(f).__name__) for f in fns})
            what = (
                f"{len(fns)} {kind.strip('_').replace('_', ' ')[:-1]}{'s' if len(fns) > 1 else ''} ({', '.join(names)})"
            )
            out.append((what, len(fns)))
    return out


def _scan(ns: dict, cache_entries: int) -> _Findings:
    f = _Findings()
    seen_params: set[int] = set()
    for path, obj in walk(ns):
        if isinstance(obj, torch.Tensor):
            if (
                obj.grad_fn is not None and "[" in path and not path.startswith("Out[") and "__traceback__" not in path
            ):  # those belong to the traceback check
                f.graph_holders.setdefault(_container_of(path), []).append((path, obj))
        elif isinstance(obj, torch.nn.Module):
            f.hooks += [(path, what, n) for what, n in _user_hooks(obj)]
            if not obj.training:
                for p in obj.parameters():
                    if p.grad is not None and id(p) not in seen_params:
                        seen_params.add(id(p))
                        f.eval_grads.setdefault(path, []).append(p.grad)
        elif isinstance(obj, dict) and len(obj) >= cache_entries and not path.startswith("Out"):
            if all(_shape_key(k) and _holds_tensor(v) for k, v in obj.items()):
                f.caches.append((path, obj))
        elif (
            isinstance(obj, (BaseException, types.TracebackType))
            and not path.startswith("Out[")
            and "__traceback__" not in path
            and " local " not in path
            and not path.endswith(("__cause__", "__context__"))
        ):  # outermost holder only (its chain is counted with it)
            f.exceptions.append((path, obj))
    return f


def _graph_check(f: _Findings) -> Check:
    graph_holders = f.graph_holders
    if graph_holders:
        rows = []
        for container, items in graph_holders.items():
            nbytes, _ = _bytes_of([t for _, t in items])
            rows.append((nbytes, container, len(items)))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        where = "; ".join(f"{c} holds {n} tensor{'s' if n > 1 else ''} with grad_fn" for _, c, n in rows[:3])
        return Check(
            "graph in container",
            "warn",
            f"{where}: their autograd graphs keep {format_bytes(total)} of activations alive",
            "store plain numbers: losses.append(loss.item()) (or loss.detach() to keep a tensor); "
            "run evaluation under torch.no_grad()",
            {"holders": [c for _, c, _ in rows], "bytes": total},
        )
    else:
        return Check("graph in container", "pass", "no list or dict holds tensors that carry a graph")


def _hook_check(f: _Findings) -> Check:
    hooks = f.hooks
    if hooks:
        total = sum(n for _, _, n in hooks)
        return Check(
            "hooks",
            "warn",
            f"{total} hook{'s' if total > 1 else ''} still attached: "
            + "; ".join(f"{p}: {d}" for p, d, _ in hooks[:3])
            + (f" (+{len(hooks) - 3} modules)" if len(hooks) > 3 else ""),
            "keep the handle and remove it when done: h = m.register_forward_hook(fn); ...; "
            "h.remove() (re-running the cell adds another hook each time)",
            {"holders": [p for p, _, _ in hooks], "count": total},
        )
    else:
        return Check("hooks", "pass", "no user forward/backward hooks on the models in this namespace")


def _history_check(ns: dict) -> Check:
    out = ns.get("Out")
    ip = ipython()
    if not isinstance(out, dict) and ip is not None and ns is ip.user_ns:
        out = ip.user_ns.get("Out")
    held = [(k, v) for k, v in (out or {}).items() if _bytes_of(v, 1000)[1]]
    if held:
        nbytes, _ = _bytes_of([v for _, v in held])
        return Check(
            "output history",
            "warn",
            f"IPython's Out keeps {len(held)} displayed value{'s' if len(held) > 1 else ''} with "
            f"tensors alive ({format_bytes(nbytes)}): {_names([f'Out[{k}]' for k, _ in held])}",
            "end cells that return tensors with ';' (or assign them); free it now with "
            "helpers.cleanup(); in a notebook, %config ZMQInteractiveShell.cache_size = 0",
            {"holders": [f"Out[{k}]" for k, _ in held], "bytes": nbytes},
        )
    else:
        return Check("output history", "pass", "no tensors in IPython's output history")


def _traceback_check(f: _Findings) -> Check:
    exceptions = f.exceptions
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
        return Check(
            "stored traceback",
            "warn",
            f"{_names([w for _, _, w in tb_rows])} keep{'s' if len(tb_rows) == 1 else ''} frames alive "
            f"with {format_bytes(total)} of tensors in their local variables",
            "keep the message, not the exception: errors.append(repr(e)) or "
            "traceback.format_exc(); after an OOM in a notebook run helpers.cleanup()",
            {"holders": [p for _, p, _ in tb_rows], "bytes": total},
        )
    else:
        return Check("stored traceback", "pass", "no stored exception or traceback holds tensors")


def _cache_check(f: _Findings, cache_entries: int) -> Check:
    caches = f.caches
    if caches:
        rows = [(_bytes_of(c)[0], p, len(c)) for p, c in caches]
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        return Check(
            "shape-keyed cache",
            "warn",
            "; ".join(f"{p} holds {n} tensors keyed by shape ({format_bytes(b)})" for b, p, n in rows[:3])
            + ": it grows with every new input shape",
            "bound it (functools.lru_cache(maxsize=...) or evict the oldest), or pad inputs to a "
            "few fixed lengths so few shapes ever occur",
            {"holders": [p for _, p, _ in rows], "bytes": total},
        )
    else:
        return Check("shape-keyed cache", "pass", f"no dict of {cache_entries}+ tensors keyed by shape")


def _eval_grad_check(f: _Findings) -> Check:
    eval_grads = f.eval_grads
    if eval_grads:
        rows = []
        for path, grads in eval_grads.items():
            nbytes = sum(storage_key(g)[1] for g in grads)
            rows.append((nbytes, path, len(grads)))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        return Check(
            "grads after eval",
            "warn",
            "; ".join(f"{p}: {n} parameters still hold .grad ({format_bytes(b)})" for b, p, n in rows[:3])
            + " while in eval mode",
            "model.zero_grad(set_to_none=True) after training, and evaluate under torch.inference_mode()",
            {"holders": [p for _, p, _ in rows], "bytes": total},
        )
    else:
        return Check("grads after eval", "pass", "no model in eval mode keeps gradients")


def leak_checks(namespace: dict | None = None, *, cache_entries: int = 16) -> LeakChecks:
    """Look for the usual leak patterns in the notebook's namespace (default: the caller's globals).

    Args:
        cache_entries: a dict of tensors keyed by shape with at least this many entries is reported.
    """
    whole_number("cache_entries", cache_entries)
    ns = caller_namespace(namespace)
    f = _scan(ns, cache_entries)
    return LeakChecks(
        [_graph_check(f), _hook_check(f), _history_check(ns), _traceback_check(f), _cache_check(f, cache_entries),
         _eval_grad_check(f)]
    )  # fmt: skip
