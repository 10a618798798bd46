"""The price of each memory reducer: its rows (GPU and host RAM) and what it costs in speed.

Each formula names its source. The reducers themselves run in :mod:`helpers.core.reducers`:

- **loss**: ``"plain"`` keeps three fp32 batch x seq x vocab buffers at the loss's backward
  (log-softmax's output, its incoming gradient and the one it returns); ``"chunked"``
  (``helpers.core.reducers.chunked_cross_entropy``) the same three for one chunk of tokens (Liger Kernel's
  chunk rule) plus the hidden states' fp32 gradient; ``"fused"`` (Liger Kernel's
  ``fused_linear_cross_entropy``) one chunk's scores in the compute dtype plus the hidden states'
  gradient, computed in forward.
- **activation offload** (``helpers.core.reducers.offload_activations``, saved-tensor hooks as
  ``torch.autograd.graph.save_on_cpu``): what the forward pass saves waits in pinned RAM; one
  layer's worth is on the GPU at a time. Under gradient checkpointing the checkpoints hold the
  layers' inputs themselves, so only the loss's saved scores move, and they come back for the
  loss's backward, the peak: nothing saved there.
- **KV cache** (transformers' ``QuantizedCache`` and ``DynamicCache(offloading=True)``): fp8 keeps 1
  byte per value; int4/int2 (KIVI, optimum-quanto or HQQ) the bits plus a 16-bit scale and zero
  point per group of 64, and the newest 128 tokens in 16 bits; each decoding step dequantizes one
  layer's keys and values. Offloaded: the layer being updated (old and new copy) and the next,
  prefetched, are on the GPU; the whole cache is in RAM and crosses PCIe twice per token.
"""

from __future__ import annotations

from ..core.devices import MACHINE_RAM, PCIE_BYTES_PER_S  # host <-> GPU copies, as a T4 in Colab sees them
from ..core.reducers import KV_GROUP, KV_RESIDUAL_TOKENS, loss_chunk_tokens
from ..core.units import format_bytes
from ..core.vocab import KV_CACHE_BITS
from .rows import HOST, EstimateRow

__all__ = ["HOST_RAM", "loss_bytes", "offload_rows", "kv_cache_rows", "host_cost"]

HOST_RAM = MACHINE_RAM["colab"]  # what an offload must fit in, with the process itself: a free Colab runtime's


def _seconds(nbytes: float) -> str:
    s = nbytes / PCIE_BYTES_PER_S
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def loss_bytes(d: dict, tokens: int, b: int, loss: str) -> tuple[int, str]:
    """Bytes of the loss's peak for ``tokens`` (batch x seq) and a note saying where they come from."""
    vocab, h = d["vocab"], d["h"]
    if loss == "plain":
        return tokens * vocab * 12, "batch x seq x vocab x 3 fp32 buffers"
    chunk = loss_chunk_tokens(tokens, vocab, h)
    if loss == "chunked":
        return chunk * vocab * 12 + tokens * h * 4, (
            f"chunked cross-entropy (helpers.core.reducers): {chunk} tokens x vocab x 3 fp32 buffers at a time, "
            "each chunk recomputed in backward, + the hidden states' fp32 gradient"
        )
    return chunk * vocab * (b + 4) + tokens * h * b, (
        f"Liger Kernel fused linear cross-entropy: {chunk} tokens x vocab scores ({b} B) and their fp32 "
        "loss terms at a time, + the hidden states' gradient, computed in forward"
    )


def offload_rows(saved: int, layer: int, loss_saved: int, checkpointing: bool) -> tuple[list[EstimateRow], int]:
    """Activation offload: the GPU rows that replace ``saved`` (what the forward pass keeps for
    backward), the host row, and the bytes that stay on the GPU."""
    moved = loss_saved + (0 if checkpointing else saved)
    step = _seconds(2 * moved)
    host = EstimateRow(
        f"{HOST}.activations", "activations offloaded to RAM (pinned)", moved, "formula",
        f"saved-tensor hooks (torch.autograd.graph.save_on_cpu): copied to RAM in forward and back in "
        f"backward, ~{step} per step over PCIe",
    )  # fmt: skip
    if checkpointing:
        return [host], saved
    window = EstimateRow(
        "activations.saved", "activations (offloaded: one layer on the GPU)", layer, "formula",
        "the layer computed in forward, or the one backward brought back from RAM",
    )  # fmt: skip
    return [window, host], layer


def kv_cache_rows(kv: int, layers: int, tokens: int, new: int, b: int, kind: str) -> list[EstimateRow]:
    """The KV cache's rows for ``kind`` (``kv``: the 16-bit dynamic cache's bytes for ``tokens``)."""
    per_layer = kv // max(1, layers)
    values = kv // b
    if kind == "offload":
        gpu = min(kv, 3 * per_layer)
        note = "transformers DynamicCache(offloading=True): the layer being updated (old and new copy) and the next"
        return [
            EstimateRow("kv_cache", "KV cache on the GPU (offloaded: 3 layers)", gpu, "formula", note),
            EstimateRow(f"{HOST}.kv_cache", "KV cache in RAM (offloaded)", kv, "formula",
                        f"the whole cache; each token moves it to the GPU and back: ~{_seconds(2 * kv)} per token "
                        "at the full length over PCIe"),
        ]  # fmt: skip
    bits = KV_CACHE_BITS[kind]
    if kind == "fp8":
        stored, note = values, "transformers QuantizedCache(backend='fp8'): 1 byte per value, one scale per tensor"
        transient = per_layer // b * (b + 4)
        how = "one layer's keys and values dequantized each step (fp32, then the compute dtype)"
        rows = []
    else:
        stored = values * bits // 8 + values // KV_GROUP * 4
        note = (f"transformers QuantizedCache (KIVI; optimum-quanto or HQQ): {bits}-bit values + a 16-bit scale "
                f"and zero point per {KV_GROUP}")  # fmt: skip
        residual = kv * min(KV_RESIDUAL_TOKENS, new, tokens) // max(1, tokens)
        rows = [EstimateRow("kv_cache.residual", f"KV cache: newest {KV_RESIDUAL_TOKENS} tokens in 16 bits",
                            residual, "formula", "QuantizedCache residual_length: quantized when it fills")]  # fmt: skip
        transient = 2 * per_layer
        how = "one layer's keys and values dequantized and concatenated with the new token each step"
    return [
        EstimateRow("kv_cache", f"KV cache ({kind})", stored, "formula", note),
        *rows,
        EstimateRow("kv_cache.dequantized", "KV cache: one layer dequantized", transient, "formula", how),
    ]


def host_cost(rows: list[EstimateRow]) -> str:
    """The host RAM (and the PCIe time noted on it) that ``rows``' host rows ask for; "" when none."""
    host = [r for r in rows if r.group == HOST]
    if not host:
        return ""
    total = sum(r.bytes for r in host)
    share = (
        f" (Colab has {format_bytes(HOST_RAM)})"
        if total < HOST_RAM
        else f", more than Colab's {format_bytes(HOST_RAM)} GB"
    )
    speed = "; ".join(r.note.split("~", 1)[1] for r in host if "~" in r.note)
    return f"+{format_bytes(total)} host RAM{share}" + (f", ~{speed}" if speed else "")
