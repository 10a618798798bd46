"""Out-of-memory errors: the one import for recognizing, explaining and handling them.

Recognizing an OOM and reading its message lives in :mod:`helpers.oom.messages`, the diagnosis
(``explain_oom``, ``OOMReport``) in :mod:`helpers.oom.diagnosis`; both are re-exported here, so
``from helpers.oom.hook import X`` works for every name in ``__all__``. This module holds what a user
runs: the IPython handler (``install``, ``%load_ext helpers.oom.hook``); ``python -m helpers explain`` is
parsed in :mod:`helpers.cli` and calls ``explain_oom``.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from html import escape

from ..core.units import format_bytes
from .causes import CAUSES as CAUSES
from .messages import EXCEPTION_GROUPS, oom_in

__all__ = [
    "BROKEN_SIGNATURES",
    "BrokenContext",
    "broken_context",
    "install",
    "uninstall",
]


# ---------------------------------------------------------------------------------------------
# Notebook integration: show the diagnosis under a short traceback and give the memory back
# ---------------------------------------------------------------------------------------------

_INSTALLED: dict = {}  # id(shell) -> (the custom exceptions and handler there before install)


def _handler(shell, etype, value, tb, tb_offset=None):
    """IPython custom exception handler: a broken CUDA context gets "restart", an OOM (also one inside an
    ExceptionGroup) a diagnosis and its memory back, a user's own handler what it registered for,
    anything else the usual traceback.

    It never raises: IPython unregisters a custom handler that raises once, for the rest of the session,
    so a failure here (an exception whose ``__str__`` raises, say) falls back to a plain traceback."""
    try:
        if broken_context(value) is not None:
            return _show_broken(shell, etype, value, tb, tb_offset)
        oom = oom_in(value)
        if oom is None:
            return _not_an_oom(shell, etype, value, tb, tb_offset)
        return _show_oom(shell, etype, value, tb, oom)
    except Exception as failure:  # noqa: BLE001 - see the docstring
        try:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        except Exception:  # noqa: BLE001 - even the traceback cannot be shown: say what little is known
            print(f"{etype.__name__} (its message could not be shown: {type(failure).__name__})", file=sys.stderr)
        return None


def _not_an_oom(shell, etype, value, tb, tb_offset):
    previous_types, previous = _INSTALLED.get(id(shell), ((), None))
    if previous is not None and previous_types and issubclass(etype, previous_types):
        return previous(etype, value, tb, tb_offset)  # the user's own handler keeps its types
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    return None


def _show_card(shell, card) -> None:
    """The card as HTML in a notebook front end (its text where there is none)."""
    if getattr(shell, "kernel", None) is None:
        return
    from IPython.display import display

    display({"text/html": card._repr_html_(), "text/plain": str(card)}, raw=True)


def _show_broken(shell, etype, value, tb, tb_offset):
    """A CUDA error that breaks the context: say restart, and touch no GPU memory (any CUDA call fails now)."""
    from ..core.session import in_colab

    card = BrokenContext(broken_context(value), str(value), colab=in_colab())
    _show_card(shell, card)
    short = traceback.format_exception(etype, value, tb, limit=-3)
    in_text = getattr(shell, "kernel", None) is None
    shell._showtraceback(etype, value, ["".join(short).rstrip(), *(["", str(card)] if in_text else [card.lines()[1]])])


def _show_oom(shell, etype, value, tb, oom: BaseException):
    # imported here: `%load_ext helpers` must not import torch (the diagnosis's tensor census does)
    from .diagnosis import explain_oom
    from .reclaim import cleanup, clear_exception_frames, freed_text, held

    before = held()
    short = traceback.format_exception(etype, value, tb, limit=-3)  # the last frames: where it ran out
    report = explain_oom(oom, namespace=shell.user_ns)
    # the traceback's frames keep every tensor the failed code created, and so do the frames of an
    # earlier OOM this one was raised while handling (a retry): clear them all, then collect
    traceback.clear_frames(tb)
    clear_exception_frames(value)
    del tb
    freed = cleanup(drop_history=False, drop_traceback=False)  # the kernel still reports the error
    after = held()
    readout = (
        f"Released what the traceback pinned: {freed_text(before - after)}; now {format_bytes(after.rss)} RSS"
        + (f", {format_bytes(after.gpu_allocated)} GPU allocated" if after.gpu_allocated is not None else "")
        + f" ({freed.objects_collected} objects collected)"
    )
    _show_card(shell, report)
    in_text = getattr(shell, "kernel", None) is None
    first_fix = f"First fix: {report.fixes[0]}" if report.fixes else ""
    stb = ["".join(short).rstrip(), "", str(report) if in_text else first_fix, "", readout]
    shell._showtraceback(etype, value, stb)  # shown as the cell's error, so "run all" still stops here
    return None


def install(shell=None) -> bool:
    """Show a diagnosis for every OOM in this notebook and free what its traceback pins; answer a CUDA
    error that breaks the context with "restart" and what survives it.

    A custom exception handler already there (the user's own) keeps working: its exceptions still go
    to it, and only OOMs and broken CUDA contexts are answered here first. Returns False outside
    IPython. ``uninstall()`` restores the previous handler.
    """
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None:
        return False
    if id(shell) not in _INSTALLED:
        theirs = shell.CustomTB if shell.custom_exceptions else None
        _INSTALLED[id(shell)] = (tuple(shell.custom_exceptions), theirs)
    previous_types = _INSTALLED[id(shell)][0]
    # torch.OutOfMemoryError is a RuntimeError: caught without naming it, so installing does not import torch
    ours = (MemoryError, RuntimeError, *EXCEPTION_GROUPS)
    shell.set_custom_exc(tuple(dict.fromkeys(ours + previous_types)), _handler)
    return True


def uninstall(shell=None) -> bool:
    """Restore the handler that was there before :func:`install`."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    if shell is None or id(shell) not in _INSTALLED:
        return False
    types_, theirs = _INSTALLED.pop(id(shell))
    if theirs is None:
        shell.set_custom_exc((), None)
    else:
        shell.custom_exceptions, shell.CustomTB = types_, theirs
    return True


def load_ipython_extension(ip) -> None:
    install(ip)


def unload_ipython_extension(ip) -> None:
    uninstall(ip)


# ----------------------------------------------------------------------------- CUDA errors that break the context: restart, not clean up


# lower-case message fragments, each with what it means
BROKEN_SIGNATURES: dict[str, str] = {
    "device-side assert triggered": "a kernel's assert failed (often an index out of range: a token id past "
    "the vocabulary, a label outside the classes)",
    "illegal memory access": "a kernel read or wrote memory it does not own",
    "unspecified launch failure": "a kernel crashed while running",
    "misaligned address": "a kernel accessed memory at a misaligned address",
    "illegal instruction": "a kernel ran an illegal instruction",
    "cudaerrorlaunchfailure": "a kernel crashed while running",
}

SURVIVES = (
    "files: Google Drive, and /content or the working folder (a restart keeps the disk; only "
    "'Disconnect and delete runtime' wipes it), so saved checkpoints, adapters and eval results written "
    "with safe_generate stay"
)
LOST = "every variable, the loaded model and anything not yet written to a file"


def broken_context(error: BaseException | str) -> str | None:
    """The signature ``error`` (or its text, or an exception in its chain) matches, or None."""
    seen, current = set(), error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = (current if isinstance(current, str) else str(current)).lower()
        hit = next((s for s in BROKEN_SIGNATURES if s in text), None)
        if hit is not None:
            return hit
        if isinstance(current, str):
            return None
        current = current.__cause__ or current.__context__
    return None


@dataclass
class BrokenContext:
    """What a CUDA error that breaks the context means, and the restart that is the only way out."""

    signature: str
    message: str
    colab: bool = False

    @property
    def menu(self) -> str:
        return (
            "Runtime > Restart session" if self.colab else "Kernel > Restart Kernel (Colab: Runtime > Restart session)"
        )

    def lines(self) -> list[str]:
        return [
            f"CUDA error: {BROKEN_SIGNATURES[self.signature]}. This process's CUDA context is now unusable: "
            "every later GPU call fails the same way, so a cleanup or retry cannot help.",
            f"Restart: {self.menu}, then rerun the notebook from the top.",
            f"Survives the restart: {SURVIVES}.",
            f"Lost: {LOST}.",
            "To find the line at fault, rerun with CUDA_LAUNCH_BLOCKING=1 set in the first cell (errors are "
            "reported asynchronously, so this traceback may point past it).",
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        first, *rest = self.lines()
        items = "".join(f"<li>{escape(line)}</li>" for line in rest)
        return (
            "<div class='oomkit-broken-cuda' style='font-family:monospace'>"
            f"<b>{escape(first)}</b><ul>{items}</ul>"
            f"<details><summary>message</summary><pre>{escape(self.message[:2000])}</pre></details></div>"
        )
