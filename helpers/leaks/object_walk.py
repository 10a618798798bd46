"""Who holds what: walk a namespace breadth first, naming the path to each object.

Shared by the leak census, the leak checks and ``cleanup()``.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from ..core.session import ipython

__all__ = ["walk", "ATOMS", "MAX_OBJECTS", "MAX_DEPTH"]

_SKIP_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}
ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice)
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.GeneratorType, property, classmethod, staticmethod)  # fmt: skip
_MODULE_INTERNALS = {"training"}
_PROXIES = weakref.ProxyTypes


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
        # raise ... from e, or raised while handling e: the earlier exception's frames live on too
        # (also under "from None", which hides the context from the printout, not from memory)
        if obj.__cause__ is not None:
            yield f"{path}.__cause__", obj.__cause__
        if obj.__context__ is not None and obj.__context__ is not obj.__cause__:
            yield f"{path}.__context__", obj.__context__
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
    if isinstance(obj, _OPAQUE) or isinstance(obj, ATOMS):
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for name, v in list(d.items()):
            if not name.startswith("__"):
                yield f"{path}.{name}", v


def _roots(namespace: dict, system_roots: bool = True) -> list[tuple[str, object]]:
    roots = [
        (k, v)
        for k, v in namespace.items()
        if not k.startswith("_") and k not in _SKIP_NAMES and not isinstance(v, _OPAQUE)
    ]
    if not system_roots:
        return roots
    out = namespace.get("Out")
    ip = ipython()
    if not isinstance(out, dict) and ip is not None and namespace is ip.user_ns:
        out = ip.user_ns.get("Out")
    if isinstance(out, dict):
        roots.append(("Out", out))
    for name in ("last_value", "last_exc", "last_traceback"):
        v = getattr(sys, name, None)
        if v is not None:
            roots.append((f"sys.{name}", v))
    return roots


MAX_OBJECTS = 200_000  # a namespace walk stops here: holder names past it are not found
# ... and goes no deeper than this: a holder name is a few attributes and indexes long, while a list nested
# 200,000 deep would cost a path string per level, each as long as the depth (quadratic: minutes)
MAX_DEPTH = 100


def walk(
    namespace: dict,
    max_objects: int = MAX_OBJECTS,
    stats: dict | None = None,
    *,
    system_roots: bool = True,
    max_depth: int = MAX_DEPTH,
) -> Iterator[tuple[str, object]]:
    """Breadth first from the namespace's names, so each object gets its shortest path first.
    ``stats`` (a dict) gets ``truncated=True`` when ``max_objects`` stopped the walk early, and
    ``too_deep=True`` when objects nested past ``max_depth`` levels were not walked.
    ``system_roots``: also start from IPython's ``Out`` and ``sys.last_*`` (False: the namespace only)."""
    seen: set[int] = set()
    queue = deque((path, obj, 0) for path, obj in _roots(namespace, system_roots))
    visited = 0
    if stats is not None:
        stats["truncated"] = stats["too_deep"] = False
    while queue:
        if visited >= max_objects:
            if stats is not None:
                stats["truncated"] = True
            return
        path, obj, depth = queue.popleft()
        if type(obj) in _PROXIES or isinstance(obj, ATOMS):  # a dead weakref proxy raises on isinstance
            continue
        if not isinstance(obj, torch.Tensor):  # tensors: every path is a holder name; others: once
            if id(obj) in seen:
                continue
            seen.add(id(obj))
        yield path, obj
        visited += 1
        if depth >= max_depth:
            if stats is not None:
                stats["too_deep"] = True
            continue
        try:
            queue.extend((child_path, child, depth + 1) for child_path, child in _children(obj, path))
        except Exception:  # an object whose attributes cannot be read: skip it, keep walking
            continue
