"""helpers.oom.retry.attempt: the one OOM-retry step (catch precisely, release after the except block)."""

from __future__ import annotations

import weakref

import pytest
import torch

from helpers.oom.retry import Attempt, Watch, attempt


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


def test_memory_a_failed_step_left_on_the_second_card_is_collected(fake_gpus, monkeypatch):
    """A model split over 2×T4: the failed step's activations sit on GPU 1 while its inputs (on GPU 0,
    watched) are freed. Compared on GPU 0 alone the step looked gone and the full collector was skipped,
    leaving GPU 1's memory pinned; every card is compared now."""
    cuda = fake_gpus(2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # nothing real to synchronize or empty
    watch = Watch()

    def step():
        watch.add(torch.ones(4))  # the input: freed with the frame
        cuda.set(1, cuda.allocated[1] + 64 * 2**20)  # held on GPU 1 by something the frame left behind
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity")

    assert attempt(step, watch=watch, device="cuda:0").collected is True

    def clean_step():
        raise torch.OutOfMemoryError("CUDA out of memory")

    clean = attempt(clean_step, watch=Watch())
    assert clean.oom and clean.collected is False  # nothing left on any card: no full collection
