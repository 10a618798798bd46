"""Every difference between the library versions oomkit accepts, in one place.

oomkit runs on whatever torch / transformers / accelerate / peft / bitsandbytes a Colab runtime
already has (``pyproject.toml`` holds the ranges; ``make test-compat`` runs the lowest and the
newest). Code elsewhere asks this module instead of comparing versions itself:

- :func:`from_pretrained_dtype`: transformers < 4.56 takes ``torch_dtype=``, newer ones ``dtype=``
  (an unknown keyword is silently ignored by old releases, so an fp16 plan would load fp32).
- :func:`trainer_tokenizer_kwarg`: ``Trainer(processing_class=)`` since transformers 4.46, ``tokenizer=`` before.
- :data:`OutOfMemoryError`: ``torch.OutOfMemoryError`` since torch 2.5, ``torch.cuda.OutOfMemoryError`` before.
- :func:`bitsandbytes_runs_on_cpu`: bitsandbytes 0.48 (the oldest tested) runs int8 and 4-bit on the CPU; 0.45 does not.
- :func:`library_notes_silenced`: the notes a library release logs or warns about a call oomkit made itself
  (its wording changes between releases, so each caller names the notes by their words).

Bottom layer: imports nothing from ``helpers``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import re
import warnings
from collections.abc import Iterator

import torch

__all__ = [
    "version", "at_least", "DTYPE_KWARG_SINCE", "PROCESSING_CLASS_SINCE", "BNB_CPU_SINCE",
    "dtype_kwarg", "from_pretrained_dtype", "trainer_tokenizer_kwarg", "OutOfMemoryError", "bitsandbytes_runs_on_cpu",
    "library_notes_silenced",
]  # fmt: skip

DTYPE_KWARG_SINCE = (4, 56)  # transformers: from_pretrained(dtype=) replaced torch_dtype=
PROCESSING_CLASS_SINCE = (4, 46)  # transformers: Trainer(processing_class=) replaced tokenizer=
BNB_CPU_SINCE = (0, 48)  # bitsandbytes: int8 / 4-bit kernels on the CPU

OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def version(dist: str) -> tuple[int, ...] | None:
    """The installed release of ``dist`` as numbers (``"4.45.0.dev0"`` -> ``(4, 45, 0)``); ``None`` if missing."""
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0].split("dev")[0])[:3])


def at_least(dist: str, minimum: tuple[int, ...]) -> bool:
    """True when ``dist`` is installed at ``minimum`` or newer."""
    found = version(dist)
    return found is not None and found >= minimum


def dtype_kwarg() -> str:
    """The ``from_pretrained`` keyword for the weights' dtype in the installed transformers."""
    return "dtype" if at_least("transformers", DTYPE_KWARG_SINCE) else "torch_dtype"


def from_pretrained_dtype(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``{"dtype": dtype}`` or, for transformers < 4.56, ``{"torch_dtype": dtype}``."""
    return {dtype_kwarg(): dtype}


def trainer_tokenizer_kwarg() -> str:
    """The ``Trainer`` keyword that takes the tokenizer: ``processing_class`` or (before 4.46) ``tokenizer``."""
    return "processing_class" if at_least("transformers", PROCESSING_CLASS_SINCE) else "tokenizer"


def supported_kwargs(fn, **kwargs) -> dict:
    """``kwargs`` less those ``fn`` does not take: transformers' copy of ``infer_auto_device_map`` gained
    ``no_placement_params`` after 5.1, and the oldest supported release rejects it."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def bitsandbytes_runs_on_cpu() -> bool:
    """Whether the installed bitsandbytes has CPU kernels (int8 / nf4 without a GPU)."""
    return at_least("bitsandbytes", BNB_CPU_SINCE)


class _DropNotes(logging.Filter):
    """Drops log records whose message matches ``pattern``."""

    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(str(record.msg))


@contextlib.contextmanager
def library_notes_silenced(*notes: str, libraries: tuple[str, ...] = ("transformers",)) -> Iterator[None]:
    """Within the block, drop the log records and Python warnings whose text matches one of ``notes`` (regular
    expressions) from ``libraries``' loggers: the notes a library prints about a call oomkit made itself (a
    user who called it would want them; under oomkit's call they name arguments the user never passed).
    Everything else still prints."""
    pattern = re.compile("|".join(f"(?:{n})" for n in notes))
    drop = _DropNotes(pattern)
    # a filter applies at the logger that makes the record, so every logger of the library gets it
    # (transformers names one per module: transformers.generation.utils, transformers.models.llama...)
    names = [n for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] in libraries]
    targets = [logging.getLogger(n) for n in {*names, *libraries}]
    # and the handlers the library's records reach (transformers' own on its root logger): a module imported
    # inside the block (transformers.integrations.bitsandbytes, on a quantized load) makes its logger then
    targets += [h for lib in libraries for h in logging.getLogger(lib).handlers]
    for target in targets:
        target.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for note in notes:
                warnings.filterwarnings("ignore", message=f".*{note}")
            yield
    finally:
        for target in targets:
            target.removeFilter(drop)
