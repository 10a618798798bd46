"""What a loaded model really holds: parameters, buffers and bitsandbytes' quantization state."""

from __future__ import annotations

import torch

from .rows import EstimateError

__all__ = ["footprint"]


def footprint(model: torch.nn.Module) -> int:
    """Exact bytes held by a loaded model: parameters, buffers and bitsandbytes quantization state.

    Storage shared by several tensors (tied embeddings, int8 CB/weight, the nested code of 4-bit
    layers) is counted once. transformers' ``get_memory_footprint()`` misses the quantization state.
    """
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(
            f"footprint() measures a loaded model (torch.nn.Module), got {type(model).__name__}; "
            "for a hub id or path before loading, use estimate(model, load=...)"
        )
    seen: set[tuple] = set()
    total = 0

    def add(t):
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = (t.device, t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            return
        seen.add(key)
        total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        for attr in ("SCB", "CB"):
            add(getattr(p, attr, None))
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            for attr in ("absmax", "code", "offset"):
                add(getattr(qs, attr, None))
            qs = getattr(qs, "state2", None)
    for b in model.buffers():
        add(b)
    return total
