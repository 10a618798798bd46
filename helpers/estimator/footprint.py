"""What a loaded model really holds: parameters, buffers and bitsandbytes' quantization state."""

from __future__ import annotations

import torch

from .rows import EstimateError

__all__ = ["footprint", "footprint_by_device", "footprint_by_name"]


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
    """(owner, tensor) for every tensor the model holds: parameters, buffers, int8 ``CB``/``SCB`` (on the
    weight, or on the layer's ``state`` where bitsandbytes moves ``SCB`` at the first forward) and 4-bit
    quant states. The owner is the parameter's or buffer's dotted name (quantization state: its weight's;
    a layer's ``state``: the layer's name)."""
    for name, p in model.named_parameters():
        yield name, p
        for attr in ("SCB", "CB"):
            yield name, getattr(p, attr, None)
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            for attr in ("absmax", "code", "offset"):
                yield name, getattr(qs, attr, None)
            qs = getattr(qs, "state2", None)
    for name, module in model.named_modules():
        state = getattr(module, "state", None)
        for attr in ("SCB", "CB"):
            yield f"{name}.state.{attr}" if name else f"state.{attr}", getattr(state, attr, None)
    yield from model.named_buffers()


def _unique_held(model: torch.nn.Module):
    """(owner, tensor) per held tensor, storage shared by several counted once (its first owner)."""
    seen: set = set()
    for name, t in _held_tensors(model):
        if not isinstance(t, torch.Tensor):
            continue
        key = id(t) if t.device.type == "meta" else (t.device, t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        yield name, t


def footprint_by_device(model: torch.nn.Module) -> dict[str, int]:
    """:func:`footprint` per device (``"cuda:0"``, ``"cpu"``, ``"meta"`` for weights an offload hook
    keeps elsewhere), quantization state included; shared storage counted once."""
    out: dict[str, int] = {}
    for _, t in _unique_held(model):
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return out


def footprint_by_name(model: torch.nn.Module) -> dict[str, int]:
    """:func:`footprint` per owner: bytes by parameter or buffer name (``model.layers.0.mlp.up_proj.weight``,
    its quantization state included; a layer's int8 ``state`` under ``<layer>.state.SCB``). Shared storage
    (tied embeddings) is counted once, under its first name; weights on the meta device (an offload hook
    keeps them elsewhere) are left out, so the values add up to :func:`footprint` exactly."""
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(
            f"footprint_by_name() measures a loaded model (torch.nn.Module), got {type(model).__name__}"
        )
    out: dict[str, int] = {}
    for name, t in _unique_held(model):
        if t.device.type != "meta":
            out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out
