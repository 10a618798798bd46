"""Give memory back: drop what silently pins tensors in notebooks, collect, empty the CUDA cache.

Why memory "never comes back" after an OOM in a notebook: the stored traceback
(``sys.last_traceback`` and IPython's last execution result) keeps every frame alive, and each
frame keeps its tensors; the output history (``Out``, ``_``, ``_5``) keeps every displayed value;
an exception kept in a variable (``err = e``) keeps its traceback's frames too.
``gc.collect(); torch.cuda.empty_cache()`` alone frees none of them.
"""

from __future__ import annotations

import gc
import inspect
import sys
import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from ..core.arguments import ArgumentError, flag, namespace_dict
from ..core.errors import ModelUnloadedError, OomkitError
from ..core.memory import allocated, reserved
from ..core.session import caller_namespace, ipython
from ..core.units import format_bytes
from ..leaks.object_walk import walk

__all__ = [
    "Held",
    "held",
    "CleanupReport",
    "FreeError",
    "cleanup",
    "free",
    "unload",
    "drop_exception_state",
    "drop_output_history",
    "clear_kept_exception_frames",
    "clear_exception_frames",
    "release_after_oom",
]


@dataclass(frozen=True)
class Held:
    """What this process holds, measured one way for every "how much came back" (``cleanup``, ``free``,
    ``unload``, the OOM hook's readout and the per-cell line all read it, so they agree).

    ``gpu_allocated`` / ``gpu_reserved``: every card (None without CUDA). ``tensors``: without CUDA, the
    live tensors' bytes, the exact answer there (RSS keeps what malloc frees for reuse: it read "RAM 0 B
    freed" for 8 MiB of tensors gone). ``rss``: this process's resident memory. A difference of two
    ``Held`` (``after - before``) is a ``Held`` of signed changes.
    """

    gpu_allocated: int | None
    gpu_reserved: int | None
    tensors: int | None
    rss: int

    def __sub__(self, other: Held) -> Held:
        def minus(a, b):
            return None if a is None or b is None else a - b

        return Held(*(minus(getattr(self, n), getattr(other, n)) for n in ("gpu_allocated", "gpu_reserved",
                                                                           "tensors", "rss")))  # fmt: skip

    @property
    def memory(self) -> int:
        """The one figure for what the tensors hold: GPU allocated with CUDA, live tensor bytes without."""
        return self.gpu_allocated if self.gpu_allocated is not None else self.tensors or 0


def held() -> Held:
    """What this process holds now (see :class:`Held`); without CUDA it walks the live tensors once."""
    rss = psutil.Process().memory_info().rss
    if torch.cuda.is_available():
        return Held(allocated("all"), reserved("all"), None, rss)
    from ..leaks.tensors import tensor_bytes

    return Held(None, None, tensor_bytes(), rss)


def freed_text(freed: Held) -> str:
    """``freed`` (``before - after``) in words, as every report of memory given back says it."""
    ram = f"RAM {format_bytes(max(freed.rss, 0))} back to the OS"
    if freed.gpu_allocated is not None:
        return (
            f"GPU {format_bytes(freed.gpu_allocated)} allocated / {format_bytes(freed.gpu_reserved)} reserved "
            f"freed, {ram}"
        )
    return f"tensors {format_bytes(freed.tensors or 0)} freed ({ram})"


@dataclass
class CleanupReport:
    """What a cleanup gave back. Positive numbers are bytes freed (``freed``: all of them, as
    :class:`Held`; the per-cell line of the same cell shows the same change, negative)."""

    gpu_allocated_freed: int
    gpu_reserved_freed: int
    rss_freed: int
    objects_collected: int
    dropped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tensors_freed: int | None = None  # without CUDA: live tensor bytes freed (the exact figure there)

    @property
    def freed(self) -> Held:
        gpu = torch.cuda.is_available() or self.tensors_freed is None
        return Held(
            self.gpu_allocated_freed if gpu else None, self.gpu_reserved_freed if gpu else None,
            self.tensors_freed, self.rss_freed,
        )  # fmt: skip

    def __str__(self) -> str:
        what = f" (dropped {', '.join(self.dropped)})" if self.dropped else ""
        return (
            f"cleanup: {freed_text(self.freed)}, {self.objects_collected} objects collected in "
            f"{self.seconds:.2f} s{what}"
        )

    def _repr_html_(self) -> str:
        from html import escape

        return f"<div style='font-family:monospace'>{escape(str(self))}</div>"


def drop_exception_state() -> list[str]:
    """Forget the last exception everywhere Python and IPython keep it, so its frames can die."""
    dropped = []
    for name in ("last_traceback", "last_value", "last_type", "last_exc"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
            dropped.append(f"sys.{name}")
    ip = ipython()
    if ip is not None:
        # IPython's traceback formatter keeps the last traceback it printed
        for name in ("InteractiveTB", "SyntaxTB"):
            formatter = getattr(ip, name, None)
            if getattr(formatter, "tb", None) is not None:
                formatter.tb = None
                dropped.append(f"IPython {name}.tb")
    result = getattr(ip, "last_execution_result", None) if ip is not None else None
    if result is not None:
        if getattr(result, "error_in_exec", None) is not None:
            result.error_in_exec = None
            dropped.append("IPython last error")
        if getattr(result, "result", None) is not None:
            result.result = None
    return dropped


# a suspended generator or coroutine lives on in its frame: clearing that frame would close it
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _clearable_frames(tb):
    """The frames of a traceback that hold a call's own locals: not a module's (its locals are its
    globals, the notebook's variables) and not a generator's or coroutine's (it may be resumed)."""
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name != "<module>" and not frame.f_code.co_flags & _RESUMABLE:
            yield frame
        tb = tb.tb_next


def _holds_tensors(value: Any, budget: int = 2000) -> bool:
    """True when ``value`` is, or reaches (through containers, attributes, model outputs, caches), a
    tensor or a module; the leak census's walk, bounded to ``budget`` objects."""
    return any(isinstance(o, torch.Tensor | torch.nn.Module) for _, o in walk({"x": value}, budget, system_roots=False))


def _frames_hold_tensors(tb) -> bool:
    """True when a clearable frame of the traceback ``tb`` holds a tensor or a module, directly or
    inside what its locals hold."""
    return any(_holds_tensors(value) for frame in _clearable_frames(tb) for value in frame.f_locals.values())


def _clear_frames(tb) -> None:
    for frame in _clearable_frames(tb):
        try:
            frame.clear()
        except RuntimeError:  # still executing (the caller's own frame, for one): nothing to free there
            continue
        # Reading f_locals (as _frames_hold_tensors did) caches a dict of the locals on the frame before
        # Python 3.13, and frame.clear() leaves that dict alone; reading it again after the clear drops
        # the names that are gone, and with them the last references to the tensors.
        frame.f_locals  # noqa: B018 - the read is the point


def clear_exception_frames(exc: BaseException | None, *, only_holding: bool = False) -> int:
    """Clear the call frames of ``exc`` and of every exception in its chain (``raise ... from``, or
    raised while handling another: a retry that ran out of memory again). The exception, its message
    and the traceback's files and lines stay. ``only_holding``: only tracebacks whose frames hold
    tensors or modules. Returns how many tracebacks were cleared."""
    cleared, seen, todo = 0, set(), [exc]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        if tb is not None and (not only_holding or _frames_hold_tensors(tb)):
            _clear_frames(tb)
            cleared += 1
        todo += [exc.__cause__, exc.__context__]  # both: "from None" hides the context, memory keeps it
    return cleared


def _kept_exceptions(namespace: dict) -> list[tuple[str, list[BaseException]]]:
    """``(name, exceptions)`` for each name holding an exception, or a list, tuple, set or dict of
    them (``errors.append(e)``)."""
    kept = []
    for name, value in list(namespace.items()):
        if name.startswith("_"):
            continue
        if isinstance(value, BaseException):
            kept.append((name, [value]))
        elif isinstance(value, list | tuple | set | frozenset | dict):
            items = value.values() if isinstance(value, dict) else value
            found = [v for v in list(items)[:1000] if isinstance(v, BaseException)]
            if found:
                kept.append((name, found))
    return kept


def clear_kept_exception_frames(namespace: dict) -> list[str]:
    """Clear the local variables of the traceback frames that exceptions kept in ``namespace`` still hold.

    ``except torch.OutOfMemoryError as e: err = e`` keeps ``err``, its traceback, every frame of the
    failed call and each frame's tensors; so does ``errors.append(e)``. Only exceptions (or the ones
    they were raised from) whose frames hold tensors or modules, directly or inside a model output,
    a dict or a cache, are touched; the exception, its message and the traceback's file and line
    numbers stay, so it still prints. Module-level frames (the notebook's variables) and the frames
    of generators and coroutines (clearing would close them) are left alone. Returns what was cleared.
    """
    cleared = []
    for name, excs in _kept_exceptions(namespace):
        n = sum(clear_exception_frames(e, only_holding=True) > 0 for e in excs)
        if n:
            what = type(excs[0]).__name__ if len(excs) == 1 else f"{n} of its {len(excs)} exceptions"
            cleared.append(f"frames kept by {name} ({what})")
    return cleared


def drop_output_history() -> list[str]:
    """Clear IPython's ``Out``/``_oh``, ``_``, ``__``, ``___`` and the numbered ``_N`` outputs."""
    ip = ipython()
    if ip is None:
        return []
    out = ip.user_ns.get("_oh") or {}
    n = len(out)
    hook = getattr(ip, "displayhook", None)
    if hook is not None and getattr(hook, "do_full_cache", False):
        hook.flush()  # clears _oh (== Out), _N, and the displayhook's own _ / __ / ___
    else:
        out.clear()
    for ns in (ip.user_ns, getattr(ip, "user_ns_hidden", {})):
        for name in ("_", "__", "___"):
            if name in ns and not isinstance(ns[name], str):
                ns[name] = ""
    return [f"Out ({n} outputs)"] if n else []


def counters() -> tuple[int, int, int]:
    """(allocated, reserved) on every GPU, and this process's RSS: what a cleanup can give back."""
    return allocated("all"), reserved("all"), psutil.Process().memory_info().rss


def _collect_and_empty(collect: bool = True) -> int:
    collected = gc.collect() if collect else 0
    # synchronize() and ipc_collect() would create a CUDA context (hundreds of MiB) in a session that
    # never used the GPU; without one there is no cache to empty
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        mps.empty_cache()
    return collected


# Tensors a failed call left in GPU memory above this much mean something still holds its frames.
_PINNED_SLACK = 16 << 20


def release_after_oom(
    probe: weakref.ref | None = None, *, baseline: int | None = None, device: torch.device | int | str | None = None
) -> bool:
    """Give back what a failed (out-of-memory) call held; call it after ``del`` of the exception.

    Drops the stored exception state, then runs the full garbage collector only when something of the
    failed call is still alive: ``probe`` (a weak reference to one of the call's inputs, which its
    frames hold) did not die, or CUDA memory allocated on ``device`` (the current one; ``"all"``: every
    card) is still above ``baseline`` (the figure before the call). With neither to go by it always collects. A full collection costs 0.1-0.3 s once
    transformers is imported, more than a small batch takes, and refcounting alone frees a failed
    ``generate``'s frames, so an adaptive loop that collects after every OOM pays for nothing.
    Then it empties the allocator cache. Returns whether the full collection ran.
    """
    drop_exception_state()
    pinned = probe is None and baseline is None
    if probe is not None and probe() is not None:
        pinned = True
    if baseline is not None and torch.cuda.is_available():
        pinned = pinned or allocated(device) > baseline + _PINNED_SLACK
    _collect_and_empty(collect=pinned)
    return pinned


def _report(before: Held, started: float, collected: int, dropped: list[str]) -> CleanupReport:
    freed = before - held()
    return CleanupReport(
        gpu_allocated_freed=freed.gpu_allocated or 0,
        gpu_reserved_freed=freed.gpu_reserved or 0,
        rss_freed=freed.rss,
        objects_collected=collected,
        dropped=dropped,
        seconds=time.perf_counter() - started,
        tensors_freed=freed.tensors,
    )


class FreeError(OomkitError, NameError):
    """``free()`` was given a name the namespace does not hold."""


def cleanup(*, drop_history: bool = True, drop_traceback: bool = True, namespace: dict | None = None) -> CleanupReport:
    """Free what can be freed without deleting your variables, and report how much came back.

    Drops the stored exception and (inside IPython) the output history, clears the frames that an
    exception kept in a variable of ``namespace`` (default: the notebook's, or the caller's globals)
    still holds with tensors in them (the exception itself stays), runs the garbage collector, then
    returns cached CUDA blocks to the driver.
    """
    flag("drop_history", drop_history)
    flag("drop_traceback", drop_traceback)
    namespace_dict("namespace", namespace)
    started = time.perf_counter()
    before = held()
    return _report(before, started, *_reclaim(caller_namespace(namespace), drop_history, drop_traceback))


def _reclaim(namespace: dict, drop_history: bool = True, drop_traceback: bool = True) -> tuple[int, list[str]]:
    """cleanup's work, unmeasured (``free`` and ``unload`` measure around their own): (objects collected,
    what was dropped)."""
    dropped: list[str] = []
    if drop_traceback:
        dropped += drop_exception_state()
        dropped += clear_kept_exception_frames(namespace)
    if drop_history:
        dropped += drop_output_history()
    return _collect_and_empty(), dropped


def free(*names: str, namespace: dict | None = None) -> CleanupReport:
    """Delete ``names`` from the notebook's namespace (or ``namespace``), then :func:`cleanup`.

    >>> free("model", "trainer")   # doctest: +SKIP
    """
    ns = caller_namespace(namespace)
    wrong = [n for n in names if not isinstance(n, str) or not n.isidentifier()]
    if wrong:
        raise ArgumentError(
            f"free() takes variable names as strings, got {', '.join(map(repr, wrong))}; e.g. free('model', 'trainer')"
        )
    missing = [n for n in names if n not in ns]
    if missing:
        raise FreeError(
            f"free(): no variable named {', '.join(map(repr, missing))} here; "
            f"pass the names as strings, e.g. free('model')"
        )
    started = time.perf_counter()
    before = held()
    for n in names:
        del ns[n]
    collected, dropped = _reclaim(ns)
    return _report(before, started, collected, [f"del {n}" for n in names] + dropped)


def _refuse_unloaded(module: torch.nn.Module, args: Any) -> None:
    raise ModelUnloadedError(
        f"this {type(module).__name__} was unloaded (helpers.unload emptied its weights to give the memory "
        "back), so it cannot run: load it again, e.g. model, tokenizer, report = load(plan) or panel.load(), "
        "and use the new model"
    )


def _optimizers(ns: dict) -> list[tuple[str, torch.optim.Optimizer]]:
    """Optimizers in the namespace or one attribute deep (``trainer.optimizer``; accelerate's
    ``AcceleratedOptimizer`` is one, its ``state`` the wrapped optimizer's)."""
    found: list[tuple[str, torch.optim.Optimizer]] = []
    for name, value in list(ns.items()):
        if name.startswith("_") or isinstance(value, type | types.ModuleType):
            continue
        for label, opt in ((name, value), (f"{name}.optimizer", getattr(value, "optimizer", None))):
            if isinstance(opt, torch.optim.Optimizer) and all(opt is not o for _, o in found):
                found.append((label, opt))
    return found


def _drop_optimizer_state(model: torch.nn.Module, ns: dict) -> list[str]:
    """Forget the optimizer state (AdamW's two moments: twice the trained parameters in fp32) that
    optimizers in the namespace keep for ``model``'s parameters; the optimizers stay usable."""
    params = {id(p) for p in model.parameters()}
    dropped = []
    for label, opt in _optimizers(ns):
        mine = [p for p in list(opt.state) if id(p) in params]
        for p in mine:
            del opt.state[p]
        if mine:
            dropped.append(f"{label} state of {len(mine)} parameters")
    return dropped


def unload(model: torch.nn.Module, *, namespace: dict | None = None, release_weights: bool = True) -> CleanupReport:
    """Take a model out of memory for good and report what came back.

    Removes accelerate's dispatch hooks (they hold references to offloaded weights), deletes
    every name in the caller's namespace bound to ``model``, and with ``release_weights``
    swaps each parameter and buffer for an empty tensor on the same device, so memory comes
    back even when something else (a Trainer, a pipeline, ``Out``) still holds the module. The
    state that optimizers in the namespace (or a ``trainer.optimizer``) keep for its parameters is
    dropped too. Nothing is copied back to the CPU first. The model object is unusable afterwards.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"unload() takes a torch.nn.Module, got {type(model).__name__}; to drop other objects use free('name')"
        )
    started = time.perf_counter()
    before = held()
    dropped: list[str] = []
    try:
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(model, recurse=True)
    except ImportError:  # pragma: no cover - accelerate is a dependency
        pass
    if release_weights:
        with torch.no_grad():
            for module in model.modules():
                for store in (module._parameters, module._buffers):
                    for t in store.values():
                        if t is not None and t.numel():
                            # new empty storage on the same device: nothing moves to the CPU
                            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                            t.grad = None
                # bitsandbytes keeps quantization state (absmax, scales) beside the weight
                w = module._parameters.get("weight")
                if w is not None and hasattr(w, "quant_state"):
                    w.quant_state = None
                if w is not None and hasattr(w, "SCB"):  # Int8Params: CB is the int8 weight itself
                    w.CB = w.SCB = None
                if getattr(module, "quant_state", None) is not None:  # Linear4bit keeps its own reference
                    module.quant_state = None
                if hasattr(module, "state") and hasattr(module.state, "reset_grads"):
                    module.state.CB = module.state.SCB = None
        dropped.append("weights")
        # a name still bound to it gets a clear error, whichever module is called (PeftModel.generate
        # calls its inner model directly)
        for module in model.modules():
            if module is model or hasattr(module, "generate") or module is getattr(model, "model", None):
                module.register_forward_pre_hook(_refuse_unloaded)
    ns = caller_namespace(namespace)
    if release_weights:  # kept weights may still be trained: their optimizer state stays too
        dropped += _drop_optimizer_state(model, ns)
    for name in [k for k, v in ns.items() if v is model and not k.startswith("__")]:
        del ns[name]
        dropped.append(f"del {name}")
    del model
    collected, also = _reclaim(ns)
    return _report(before, started, collected, dropped + also)
