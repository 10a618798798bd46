"""oomkit: load, fine-tune and evaluate Hugging Face models on small GPUs without OOM crashes.

The notebook-facing API is re-exported here; each concern lives in its own module.
"""

from __future__ import annotations

import importlib
import logging

from .cleanup import CleanupReport, cleanup, free, unload
from .memory import MemorySnapshot, allocated, reserved, snapshot
from .preflight import PreflightReport, preflight
from .units import GiB, MiB, format_bytes, parse_bytes

__version__ = "0.1.0"


def _quiet_optional_cpu_kernel(record: logging.LogRecord) -> bool:
    # bitsandbytes logs a warning on every import on AVX512-bf16 CPUs when the optional `kernels`
    # package (which fetches a faster 4-bit CPU kernel from the Hub) is absent; its built-in CPU
    # path works, and CPU is only where oomkit's demos and tests run, so the line is noise there.
    return "gemm_4bit_forward from kernels-community" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_quiet_optional_cpu_kernel)

__all__ = [
    "CleanupReport", "cleanup", "free", "unload",
    "MemorySnapshot", "allocated", "reserved", "snapshot",
    "PreflightReport", "preflight",
    "GiB", "MiB", "format_bytes", "parse_bytes",
]  # fmt: skip

# Modules that hook into IPython when a notebook runs `%load_ext helpers`. Each exposes
# `_load_ipython_extension(ip)` / `_unload_ipython_extension(ip)`; a module not yet present is skipped.
IPYTHON_EXTENSIONS = ["helpers.oom", "helpers.cellstats"]


def _extension_modules():
    for name in IPYTHON_EXTENSIONS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "_load_ipython_extension"):
            yield mod


def load_ipython_extension(ip) -> None:
    """``%load_ext helpers``: OOM diagnosis on error and per-cell memory accounting."""
    for mod in _extension_modules():
        mod._load_ipython_extension(ip)


def unload_ipython_extension(ip) -> None:
    for mod in _extension_modules():
        if hasattr(mod, "_unload_ipython_extension"):
            mod._unload_ipython_extension(ip)
