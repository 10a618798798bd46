"""What a loaded model really holds: parameters, buffers and bitsandbytes' quantization state."""

from __future__ import annotations

import torch

from .rows import EstimateError

__all__ = ["footprint", "footprint_by_device"]


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
    return sum(n for device, n in footprint_by_device(model).items() if device != "meta")


def _held_tensors(model: torch.nn.Module):
    """Every tensor the model holds: parameters, buffers, int8 ``CB``/``SCB`` (on the weight, or on the
    layer's ``state`` where bitsandbytes moves ``SCB`` at the first forward) and 4-bit quant states."""
    for p in model.parameters():
        yield p
        for attr in ("SCB", "CB"):
            yield getattr(p, attr, None)
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            for attr in ("absmax", "code", "offset"):
                yield getattr(qs, attr, None)
            qs = getattr(qs, "state2", None)
    for module in model.modules():
        state = getattr(module, "state", None)
        for attr in ("SCB", "CB"):
            yield getattr(state, attr, None)
    yield from model.buffers()


def footprint_by_device(model: torch.nn.Module) -> dict[str, int]:
    """:func:`footprint` per device (``"cuda:0"``, ``"cpu"``, ``"meta"`` for weights an offload hook
    keeps elsewhere), quantization state included; shared storage counted once."""
    seen: set = set()
    out: dict[str, int] = {}
    for t in _held_tensors(model):
        if not isinstance(t, torch.Tensor):
            continue
        key = id(t) if t.device.type == "meta" else (t.device, t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return out
