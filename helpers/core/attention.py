"""Keep grouped-query attention on a fused kernel on GPUs older than Ampere (a T4, a V100).

transformers passes ``enable_gqa=True`` to ``scaled_dot_product_attention`` when a prompt has no
padding mask (``use_gqa_in_sdpa``). Before compute capability 8.0 neither flash nor cuDNN attention
exists, and PyTorch's memory-efficient kernel refuses key/value heads fewer than query heads, so
SDPA silently falls back to the math kernel: it builds the whole fp32 ``seq x seq`` score matrix
for every head (TinyLlama at a 2048-token prompt: 32 x 2048² x 4 bytes = 512 MiB per sequence,
before the softmax's copies), and a T4 generates 1.6-1.8x slower (figures from transformers issue
48633 and PR 45776; the check still ignores the GPU in 5.23). Expanding the
key/value heads first, transformers' own ``repeat_kv`` path (``pack_gqa`` for one-token decode
steps where the installed transformers has it), lets the memory-efficient kernel run: the same
result, with one layer's expanded K/V as the transient cost. The estimator counts that cost.

:func:`keep_gqa_off_math_kernel` wraps ``use_gqa_in_sdpa`` to answer False for tensors on such a
GPU and defers to transformers everywhere else; :func:`helpers.load` applies it when the first GPU is
older than sm80. Bottom layer: imports nothing from ``helpers``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["keep_gqa_off_math_kernel", "keep_attention_fused", "gqa_kernel_fixed", "pre_ampere", "no_fused_gqa_kernel"]

_MARK = "_oomkit_pre_ampere_wrapper"


@functools.lru_cache(maxsize=16)
def pre_ampere(index: int) -> bool:
    """True for a CUDA device older than compute capability 8.0 (no flash attention, no bf16)."""
    return torch.cuda.get_device_capability(index)[0] < 8


def no_fused_gqa_kernel(index: int) -> bool:
    """True where no fused SDPA kernel takes ``enable_gqa`` on CUDA device ``index``: before sm80, or
    with flash attention switched off (``torch.backends.cuda.enable_flash_sdp(False)``, as
    ``make gpu-check`` does to act as a T4 on a bigger card)."""
    return pre_ampere(index) or not torch.backends.cuda.flash_sdp_enabled()


def _on_pre_ampere(t: torch.Tensor) -> bool:
    if not t.is_cuda or torch.compiler.is_compiling():  # a compiled graph keeps transformers' own choice
        return False
    return no_fused_gqa_kernel(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _sdpa_module():
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:  # a transformers without SDPA integration: nothing to fix
        return None
    return sdpa_attention if callable(getattr(sdpa_attention, "use_gqa_in_sdpa", None)) else None


def gqa_kernel_fixed() -> bool:
    """Whether transformers' ``use_gqa_in_sdpa`` is wrapped (by :func:`keep_gqa_off_math_kernel`)."""
    module = _sdpa_module()
    return module is not None and getattr(module.use_gqa_in_sdpa, _MARK, False)


def keep_gqa_off_math_kernel() -> bool:
    """Make transformers expand key/value heads instead of passing ``enable_gqa`` on pre-Ampere GPUs.

    Idempotent; changes nothing for tensors on CPUs or on sm80+ GPUs, nor under ``torch.compile``.
    Returns True when the wrapper is in place (False where the installed transformers has no
    ``use_gqa_in_sdpa`` to wrap).
    """
    module = _sdpa_module()
    if module is None:
        return False
    original = module.use_gqa_in_sdpa
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def use_gqa_in_sdpa(attention_mask: Any, key: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        if _on_pre_ampere(key):
            return False  # repeat_kv / pack_gqa: equal head counts, so the memory-efficient kernel runs
        return original(attention_mask, key, *args, **kwargs)

    setattr(use_gqa_in_sdpa, _MARK, True)
    module.use_gqa_in_sdpa = use_gqa_in_sdpa
    return True


def keep_attention_fused(model: torch.nn.Module) -> str | None:
    """For a grouped-query model on a pre-Ampere GPU, apply :func:`keep_gqa_off_math_kernel` and
    return a note saying so; None (and nothing changed) for any other model or device."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    param = next(model.parameters(), None)
    if not heads or kv_heads >= heads or param is None or not param.is_cuda:
        return None
    if not no_fused_gqa_kernel(param.device.index or 0):
        return None
    if not keep_gqa_off_math_kernel():
        return None
    return (
        f"grouped-query attention ({heads} query heads, {kv_heads} key/value heads) kept on the memory-efficient "
        "kernel: on a GPU older than sm80 transformers' enable_gqa falls back to the math kernel and its "
        "seq x seq fp32 scores (helpers.core.attention)"
    )
