"""How big each batch of ``safe_generate`` is: the size it starts from, and how it adapts to memory.

``start_size`` picks the first size (given, ``find_max_batch_size``'s cache under ``batch_cache_key``,
the estimator's prediction on CUDA, or a first guess). ``TokenBudget`` then sizes every batch in
batch x sequence-length tokens, between the largest that ran and the smallest that ran out of
memory, and ``remember`` stores what a run learned where the next run (and ``find_max_batch_size``)
looks.
"""

from __future__ import annotations

import math

import torch

from ..core.errors import EvalError
from ..loading.generation import model_device
from ..oom.batch_size import BatchSearch, remember_batch, remembered_batch

__all__ = ["TokenBudget", "batch_cache_key", "model_load_mode", "remember", "start_size"]

# ---------------------------------------------------------------------------------------------
# the batch controller


class TokenBudget:
    """Batch sizes from what is known about memory, in batch x sequence-length tokens.

    Memory of a generate call grows with batch x (prompt + new tokens), so a failure at 8 x 300
    tokens says little about 8 x 100. Until the first OOM the batch doubles after each success (from
    a known-good or predicted start). Then ``ok`` is the largest product that ran, ``fail`` the
    smallest that ran out of memory; the next batch probes between them (geometric midpoint while
    far apart), and after ``regrow`` successes in a row a converged bound is probed upwards again.
    """

    def __init__(self, start: int, limit: int, tolerance: float = 0.8, regrow: int = 16, growth: int = 2):
        self.start, self.limit, self.tolerance, self.regrow, self.growth = start, limit, tolerance, regrow, growth
        self.ok = 0
        self.fail: int | None = None
        self.streak = 0
        self.size = start  # used until the first OOM; doubles after each success until then

    def size_for(self, seq: int) -> int:
        if self.fail is None:
            return max(1, min(self.size, self.limit))
        if self.ok == 0:
            target = self.fail // 2
        elif self.ok >= self.tolerance * self.fail:
            target = self.ok
        else:
            target = int(math.sqrt(self.ok * self.fail))
        size = min(target // seq, (self.fail - 1) // seq)
        return max(1, min(size, self.limit))

    def after_success(self, size: int, seq: int) -> None:
        self.ok = max(self.ok, size * seq)
        self.streak += 1
        if self.fail is None and size >= self.size:
            self.size = min(self.limit, size * self.growth)  # no limit seen yet: look for it
        if self.fail is not None and self.ok >= self.fail:  # the failure was a transient spike
            self.fail = int(self.ok * 1.5)
        if self.fail is not None and self.streak >= self.regrow and self.ok >= self.tolerance * self.fail:
            # memory may have come back (another tensor freed, a random spike gone): look again
            self.fail = int(self.fail * 1.5)
            self.streak = 0

    def after_oom(self, size: int, seq: int) -> None:
        tokens = size * seq
        self.fail = tokens if self.fail is None else min(self.fail, tokens)
        if self.ok >= self.fail:  # memory got tighter than before: what ran is no longer known to run
            self.ok = 0
        self.streak = 0


# ---------------------------------------------------------------------------------------------
# the starting batch size


_FIRST_GUESS = 8  # without a cached or predicted size: start here and double while it fits


def model_load_mode(model) -> str:
    """The load mode ``model`` is in, as the estimator names it (``nf4``, ``int8``, ``bf16``, ``fp32``, ``fp16``)."""
    if getattr(model, "is_loaded_in_4bit", False):
        return "nf4"
    if getattr(model, "is_loaded_in_8bit", False):
        return "int8"
    dtype = getattr(model, "dtype", torch.float16)
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, "fp16")


def batch_cache_key(model, max_new_tokens: int, kv_cache: str | None = None) -> tuple:
    """The ``find_max_batch_size`` cache key ``safe_generate(batch_size="auto")`` starts from.

    Search once with ``find_max_batch_size(step, key=batch_cache_key(model, 256))`` and every later
    ``safe_generate`` of that model and length starts at the size found (and learns from each run).
    """
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    key = ("safe_generate", str(name), max_new_tokens, str(model_device(model)))
    # a smaller KV cache fits a larger batch: its sizes are remembered apart from the default cache's
    return key if kv_cache in (None, "dynamic") else (*key, f"kv_cache={kv_cache}")


def start_size(
    model, batch_size, *, key: tuple, prompt_tokens: int, max_new_tokens: int, limit: int, kv_cache: str | None = None
) -> tuple[int, str]:
    """(start, where it came from): an int given, find_max_batch_size's cache, the estimator, or a first guess."""
    if isinstance(batch_size, BatchSearch):
        return max(1, min(batch_size.batch_size, limit)), "given BatchSearch"
    if isinstance(batch_size, int) and not isinstance(batch_size, bool):
        if batch_size < 1:
            raise EvalError(f"batch_size must be 'auto' or a positive int, got {batch_size}")
        return min(batch_size, limit), "given"
    if batch_size != "auto":
        raise EvalError(f"batch_size must be 'auto', a positive int or a BatchSearch, got {batch_size!r}")
    cached = remembered_batch(key)
    if cached is not None and cached.max_ok > 0:
        return max(1, min(cached.max_ok, limit)), "find_max_batch_size cache"
    if model_device(model).type == "cuda":
        from ..estimator.fitting import max_batch_that_fits
        from ..estimator.rows import EstimateError

        try:
            predicted = max_batch_that_fits(
                model,
                device="current",
                load=model_load_mode(model),
                limit=limit,
                prompt_tokens=prompt_tokens,
                max_new_tokens=max_new_tokens,
                kv_cache=kv_cache,  # the estimate prices the cache kind asked for
            )
            if predicted > 0:
                return min(predicted, limit), "estimate"
        except (EstimateError, ValueError, TypeError, AttributeError):
            pass  # unknown architecture: start from the limit and let OOMs find the size
    return min(limit, _FIRST_GUESS), "first guess, doubles while it fits"


def remember(key: tuple, budget: TokenBudget, seq: int) -> None:
    """Store what this run learned where find_max_batch_size looks, so the next run starts there."""
    if budget.ok > 0 and seq > 0:
        size = budget.ok // seq
        fail = (budget.fail // seq) if budget.fail else None
        remember_batch(key, BatchSearch(max_ok=max(1, size), batch_size=max(1, size), first_failed=fail, key=key))
