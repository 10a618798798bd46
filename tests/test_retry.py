"""helpers.retry.attempt: the one OOM-retry step (catch precisely, release after the except block)."""

from __future__ import annotations

import weakref

import pytest
import torch

from helpers.retry import Attempt, Watch, attempt


def test_success_returns_the_value():
    result = attempt(lambda a, b: a + b, 2, 3)
    assert result == Attempt(True, 5, elapsed=result.elapsed) and result.ok and not result.oom


def test_oom_becomes_a_result_and_the_failed_call_is_freed_without_a_full_collection():
    watch = Watch()
    refs = []

    def step(n):
        x = watch.add(torch.ones(n))
        refs.append(weakref.ref(x))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")

    result = attempt(step, 1 << 16, watch=watch)
    assert result.oom and result.error == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert refs[0]() is None  # freed by refcounting once the except block is left
    assert result.collected is False  # so no 0.1-0.3 s gc.collect()


def test_a_failed_call_still_alive_is_collected():
    watch = Watch()
    kept = []

    def step():
        x = watch.add(torch.ones(4))
        cycle = [x]
        cycle.append(cycle)  # only the collector frees this
        raise MemoryError

    result = attempt(step, watch=watch)
    assert result.oom and result.error == "MemoryError" and result.collected and not kept


def test_wrapped_and_text_ooms_are_caught_other_errors_propagate():
    def wrapped():
        try:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
        except RuntimeError as e:
            raise ValueError("generation failed") from e

    assert attempt(wrapped).oom
    with pytest.raises(KeyError, match="labels"):
        attempt(lambda: {}["labels"])
    with pytest.raises(KeyboardInterrupt):

        def interrupted():
            raise KeyboardInterrupt

        attempt(interrupted)
