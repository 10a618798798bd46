"""Memory reducers switched on by one setting: chunked cross-entropy, activation offload, KV cache kinds.

The estimator prices them (``estimator/reducers.py``); this module runs them, with the libraries
that implement them: transformers' cache implementations (``cache_implementation="quantized"`` or
``"offloaded"``), Liger Kernel's fused linear cross-entropy (through ``TrainingArguments(
use_liger_kernel=True)``, where it is installed) and PyTorch's saved-tensor hooks. The chunked
cross-entropy here is plain PyTorch: it runs on any device, and computes the output layer and the
loss a chunk of tokens at a time, each chunk recomputed in backward, so the scores of
batch x seq x vocab never exist at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .vocab import KV_CACHE_BITS, KV_CACHES, LOSSES, ReducerError, kv_cache_name, loss_name

__all__ = [
    "installed", "liger_available", "kv_quant_backend", "fp8_kv_available", "kv_cache_available",
    "kv_cache_kwargs", "use_kv_cache", "loss_available", "loss_choices", "kv_cache_choices", "loss_chunk_tokens", "chunked_cross_entropy", "chunked_lm_loss", "offload_activations",
    "KV_RESIDUAL_TOKENS", "KV_GROUP",
]  # fmt: skip

KV_RESIDUAL_TOKENS = 128  # transformers' QuantizedCache default residual_length: newest tokens kept in 16 bits
KV_GROUP = 64  # its q_group_size: one scale and one zero point per 64 values


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def liger_available() -> bool:
    """Liger Kernel's fused linear cross-entropy: liger-kernel installed (it runs on CUDA GPUs)."""
    return installed("liger_kernel")


def kv_quant_backend() -> str | None:
    """The integer KV-cache backend transformers can use here: "quanto", "hqq", or None."""
    if installed("optimum.quanto"):
        return "quanto"
    return "hqq" if installed("hqq") else None


def fp8_kv_available() -> bool:
    """Whether this transformers has the fp8 ``QuantizedCache`` backend (no extra package)."""
    try:
        from transformers import cache_utils
    except ImportError:
        return False
    return hasattr(cache_utils, "Fp8QuantizedLayer")


def kv_cache_available(kind: str, *, cuda: bool = True) -> tuple[bool, str]:
    """Whether KV cache ``kind`` runs here (on a CUDA GPU when ``cuda``), and if not, why."""
    kind = kv_cache_name(kind)
    if kind in ("int4", "int2") and kv_quant_backend() is None:
        return False, f"kv_cache={kind!r} needs optimum-quanto or hqq (pip install optimum-quanto)"
    if kind == "fp8" and not fp8_kv_available():
        return False, "kv_cache='fp8' needs transformers with the fp8 QuantizedCache backend (5.x); use 'int4'"
    if kind == "offload" and not cuda:
        return False, "kv_cache='offload' moves the cache between a CUDA GPU and RAM: there is no CUDA GPU here"
    return True, ""


def loss_available(loss: str) -> tuple[bool, str]:
    """Whether training loss ``loss`` runs here (its library is installed), and if not, why."""
    if loss_name(loss) == "fused" and not liger_available():
        return False, (
            "loss='fused' needs liger-kernel (pip install liger-kernel) and a CUDA GPU; "
            "'chunked' saves about as much in plain PyTorch"
        )
    return True, ""


UNAVAILABLE = " (not here)"  # appended to a panel option that cannot run on this machine; a note says why


def loss_choices() -> tuple[tuple[str, str], ...]:
    """A dropdown's (label, value) per training loss; one that cannot run here says so in its label."""
    return tuple((v if loss_available(v)[0] else v + UNAVAILABLE, v) for v in LOSSES)


def kv_cache_choices(*, cuda: bool = True) -> tuple[tuple[str, str], ...]:
    """A dropdown's (label, value) per KV cache kind; one that cannot run here says so in its label."""
    return tuple((k if kv_cache_available(k, cuda=cuda)[0] else k + UNAVAILABLE, k) for k in KV_CACHES)


def kv_cache_kwargs(kind: Any) -> dict:
    """``generate()`` keyword arguments for KV cache ``kind`` ({} for the default dynamic cache).

    Raises :class:`ReducerError` for an unknown kind or one this machine cannot run."""
    kind = kv_cache_name(kind)
    if kind == "dynamic":
        return {}
    ok, why = kv_cache_available(kind, cuda=torch.cuda.is_available())
    if not ok:
        raise ReducerError(why)
    if kind == "offload":
        return {"cache_implementation": "offloaded"}
    if kind == "fp8":
        return {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}
    config = {"backend": kv_quant_backend(), "nbits": KV_CACHE_BITS[kind], "q_group_size": KV_GROUP,
              "residual_length": KV_RESIDUAL_TOKENS}  # fmt: skip
    return {"cache_implementation": "quantized", "cache_config": config}


def use_kv_cache(model, kind: Any) -> dict:
    """Make ``kind`` the KV cache of every ``model.generate()`` call (its generation config), replacing
    one a previous call set; returns the settings applied ({} for the default dynamic cache)."""
    kwargs = kv_cache_kwargs(kind)
    config = getattr(model, "generation_config", None)
    if config is not None and getattr(config, "cache_implementation", None) in ("quantized", "offloaded"):
        config.cache_implementation = None  # a previous call's kind (a model's own, e.g. Gemma-2's, stays)
        config.cache_config = None
    if config is not None:
        for key, value in kwargs.items():
            setattr(config, key, value)
    return kwargs


def loss_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of the chunked loss: Liger Kernel's rule (fused_linear_cross_entropy.py), a
    power of two near tokens / ceil(vocab / hidden), so one chunk's scores are about the size of
    the hidden states."""
    per = math.ceil(tokens / max(1, math.ceil(vocab / max(1, hidden))))
    return min(tokens, 1 << max(0, (per - 1).bit_length()))


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None):
    logits = torch.nn.functional.linear(hidden, weight).float()
    if softcap:  # Gemma-2's final_logit_softcapping, as its forward applies it
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None = None, num_items=None
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ weight.T`` against ``labels`` (shifted inside, -100
    ignored, as transformers' causal LM loss), one chunk of tokens at a time, each recomputed in backward.
    ``num_items``: divide by this count instead (Trainer's tokens over the accumulated micro-batches)."""
    h = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1).to(hidden.device)
    count = (y != -100).sum()
    chunk = loss_chunk_tokens(h.shape[0], weight.shape[0], weight.shape[1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss, h[part], weight, y[part], softcap, use_reentrant=False)
    return total / (count.clamp(min=1) if num_items is None else num_items)


def chunked_lm_loss(
    model, input_ids: torch.Tensor, labels: torch.Tensor, num_items=None, **inputs: Any
) -> torch.Tensor:
    """A causal LM's training loss through :func:`chunked_cross_entropy`: the decoder's hidden states,
    then the output layer and the loss a chunk at a time (peft-wrapped models too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    for name in ("logit_scale", "output_multiplier_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ReducerError(f"loss='chunked' does not apply {name} of {type(base).__name__}: use loss='plain'")
    head = base.get_output_embeddings()
    hidden = base.get_decoder()(input_ids=input_ids, **inputs).last_hidden_state
    softcap = getattr(config, "final_logit_softcapping", None)
    return chunked_cross_entropy(hidden, head.weight, labels, softcap, num_items)


class _OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """``torch.autograd.graph.save_on_cpu`` for activations only: weights (parameters, already on the
    GPU for good) and tensors already in RAM stay where they are instead of being copied each step."""

    def __init__(self, pin_memory: bool):
        def pack(tensor: torch.Tensor):
            if isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "cpu" or not tensor.numel():
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
            host.copy_(tensor, non_blocking=pin_memory)
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


@contextlib.contextmanager
def offload_activations(enabled: bool = True, *, on_pack=None):
    """Inside it, what the forward pass saves for backward waits in (pinned) RAM instead of GPU memory,
    and comes back as backward needs it. ``on_pack(tensor)`` sees each tensor moved (for tests)."""
    if not enabled:
        yield
        return
    hooks = _OffloadHooks(pin_memory=torch.cuda.is_available())
    if on_pack is not None:
        inner = hooks.pack_hook

        def counted(tensor):
            if not (isinstance(tensor, torch.nn.Parameter) or not tensor.numel()):
                on_pack(tensor)
            return inner(tensor)

        hooks.pack_hook = counted
    with hooks:
        yield
