"""Lifting the GPU check's T4 cap for a moment (``scripts/gpu_check.py``'s ``act_as_t4`` sets it): building a
model, or a reference run that must not OOM, is no measurement."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def uncapped():
    """The whole card for a moment (building a model is no measurement: Qwen fp16 alone passes a T4)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    if not torch.cuda.is_available() or get is None:
        yield
        return
    fraction = get(0)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
