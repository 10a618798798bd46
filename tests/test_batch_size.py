"""find_max_batch_size and @adaptive_batch against steps whose memory limit is known."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from helpers.oom.batch_size import BatchSizeError, Trial, adaptive_batch, clear_cache, find_max_batch_size


@pytest.fixture(autouse=True)
def no_full_collection(request, monkeypatch):
    """These steps allocate nothing, so the full ``gc.collect()`` after each simulated OOM (0.1-1.5 s
    once transformers is imported, on a loaded machine) only costs time: stubbed, except in the tests
    marked ``real_gc`` that check the memory of a failed step comes back."""
    if "real_gc" not in request.keywords:
        monkeypatch.setattr(gc, "collect", lambda *args: 0)


def budget_step(max_ok: int, calls: list | None = None, error=torch.OutOfMemoryError):
    def step(batch_size: int):
        if calls is not None:
            calls.append(batch_size)
        if batch_size > max_ok:
            raise error(f"CUDA out of memory. Tried to allocate {batch_size} MiB")

    return step


@pytest.mark.parametrize("limit", [16, 100, 1024])
def test_finds_the_exact_maximum_within_trial_budget(limit):
    budget = math.ceil(math.log2(limit)) + 2
    for true_max in sorted({1, 2, 3, limit // 3, limit - 1, limit, limit + 50, 7}):
        s = find_max_batch_size(budget_step(true_max), limit=limit)
        assert s.max_ok == min(true_max, limit)  # the default tolerance bisects to the boundary
        assert len(s.trials) <= budget
        assert s.batch_size == max(1, math.floor(s.max_ok * 0.9))  # the margin: a separate step
    s = find_max_batch_size(budget_step(limit // 3), limit=limit, tolerance=0.9)
    assert 0.9 * (limit // 3) <= s.max_ok <= limit // 3


@pytest.mark.parametrize("limit", [64, 100, 4096])
def test_every_maximum_is_found_exactly_and_within_budget(limit, monkeypatch):
    """Exhaustive over the true maximum: never more than ceil(log2(limit)) + 2 tries (plain bisection's
    bound plus one), whatever the log-midpoint splits did."""
    import gc

    monkeypatch.setattr(gc, "collect", lambda *a: 0)  # nothing is allocated; the release is tested elsewhere
    budget = math.ceil(math.log2(limit)) + 2
    maxima = range(1, limit + 2) if limit <= 100 else sorted({*range(1, 80), *range(limit - 80, limit + 2), 1000, 2047})
    tries = []
    for true_max in maxima:
        s = find_max_batch_size(budget_step(true_max), limit=limit, margin=1.0)
        assert s.max_ok == min(true_max, limit), true_max
        assert len(s.trials) <= budget, (true_max, s.trials)
        tries.append(len(s.trials))
    assert max(tries) <= budget


def test_grows_without_limit_and_records_trials():
    s = find_max_batch_size(budget_step(300), margin=1.0)
    assert s.max_ok == 300 and s.batch_size == s.max_ok
    assert s.trials[0] == (1, True) and isinstance(s.trials[0], Trial)
    assert any(not ok for _, ok in s.trials)
    assert "out of memory" in str(s) and "<table" in s._repr_html_()


def test_start_above_maximum_shrinks():
    s = find_max_batch_size(budget_step(10), start=512)
    assert s.max_ok == 10 and s.trials[0] == (512, False)


def test_cache_per_key_starts_there():
    clear_cache()
    calls: list[int] = []
    first = find_max_batch_size(budget_step(77), limit=256, key=("tiny", 128, "cpu"))
    second = find_max_batch_size(budget_step(77, calls), limit=256, key=("tiny", 128, "cpu"))
    assert second.cached and calls == [first.max_ok] and second.max_ok == first.max_ok
    other = find_max_batch_size(budget_step(77), limit=256, key=("tiny", 512, "cpu"))
    assert not other.cached
    clear_cache()


def test_a_cached_limit_does_not_cap_a_later_search_with_a_larger_limit():
    """A search stopped by its limit (8) records 9 as its bound; only a size that ran out of memory may
    cap a later search with the same key (it did: limit 64 gave 8 after trying only [8])."""
    clear_cache()
    small = find_max_batch_size(budget_step(1000), limit=8, key="limit-then-larger")
    assert small.max_ok == 8 and small.first_failed == 9
    large = find_max_batch_size(budget_step(1000), limit=64, key="limit-then-larger")
    assert large.cached and large.max_ok == 64 and large.first_failed == 65 and "the limit 64 fits" in str(large)
    assert small.limit_bound and large.limit_bound  # both bounds are limits, neither ran out of memory
    # a real out-of-memory bound is still trusted: one try
    real = find_max_batch_size(budget_step(20), limit=64, key="real-bound")
    assert real.first_failed == 21 and not real.limit_bound
    calls: list[int] = []
    again = find_max_batch_size(budget_step(20, calls), limit=64, key="real-bound")
    assert again.max_ok == 20 and calls == [20] and not again.limit_bound
    clear_cache()


@pytest.mark.real_gc
def test_runtime_error_ooms_and_real_cpu_oom_are_caught():
    for error in (
        lambda m: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
        lambda m: RuntimeError("CUDA error: out of memory"),
    ):
        assert find_max_batch_size(budget_step(20, error=error), limit=64).max_ok >= 18

    def real(batch_size):
        torch.empty(batch_size << 42 if batch_size > 5 else batch_size)  # a real allocator failure past 5

    assert find_max_batch_size(real, limit=64, tolerance=1.0).max_ok == 5


def test_other_errors_propagate():
    def step(batch_size):
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape") as e:
        find_max_batch_size(step)
    if hasattr(e.value, "add_note"):  # the note says where the search was and that it is not an OOM
        assert "step(1) raised ValueError, which is not an out-of-memory error" in e.value.__notes__[0]


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="start must be a positive whole batch size, got '4'"):
        find_max_batch_size(lambda b: None, start="4")
    with pytest.raises(ValueError, match="limit must be a positive whole batch size or None, got 8.0"):
        find_max_batch_size(lambda b: None, limit=8.0)
    with pytest.raises(TypeError, match="key must be hashable.*use a tuple"):
        find_max_batch_size(lambda b: None, limit=8, key=["model", 512])
    with pytest.raises(TypeError, match="step must be a function of the batch size"):
        find_max_batch_size(8)

    @adaptive_batch  # without parentheses: the defaults, not a TypeError
    def run(batch_size):
        return batch_size

    assert run() == 128


def test_batch_of_one_does_not_fit():
    with pytest.raises(BatchSizeError, match="even batch size 1"):
        find_max_batch_size(budget_step(0), start=8)


@pytest.mark.real_gc
def test_failed_step_memory_is_released_before_retry():
    refs = []

    def step(batch_size):
        held = torch.ones(1 << 20)
        refs.append(weakref.ref(held))
        if batch_size > 3:
            raise torch.OutOfMemoryError("CUDA out of memory")

    find_max_batch_size(step, limit=8)
    assert all(r() is None for r in refs)


def test_adaptive_batch_falls_back_then_grows_back():
    calls: list[int] = []
    step = budget_step(37, calls)

    @adaptive_batch(start=128)
    def run(batch_size, tag):
        step(batch_size)
        return batch_size, tag

    assert run("a") == (32, "a")  # 128 and 64 fail, 32 runs
    sizes = [run("b")[0] for _ in range(6)]
    assert sizes[-1] == run.batch_size and 34 <= sizes[-1] <= 37  # grew back toward 37
    assert sum(not ok for _, ok in run.trials) <= 5
    assert all(s <= 37 for s in sizes)


def test_adaptive_batch_non_oom_propagates():
    @adaptive_batch(start=4)
    def run(batch_size):
        raise KeyError("labels")

    with pytest.raises(KeyError):
        run()


def test_step_that_never_runs_out_of_memory_stops_at_the_default_limit():
    """Issue 16 item 9: without limit= a step that never OOMs (CPU, or ignoring its argument) grew forever."""
    from helpers.oom.batch_size import DEFAULT_LIMIT

    calls: list[int] = []

    def step(batch_size):
        calls.append(batch_size)
        if len(calls) > 40:  # the old search never returned: fail instead of hanging the suite
            raise AssertionError("the search does not stop")

    with pytest.warns(UserWarning, match="default limit"):
        s = find_max_batch_size(step)
    assert s.max_ok == DEFAULT_LIMIT and max(calls) == DEFAULT_LIMIT and len(calls) <= 8
    assert "pass limit=" in s.note and s.note in str(s)


@pytest.mark.parametrize("growth", [1, 0, -2, 2.5, True])
def test_growth_that_would_loop_forever_or_go_negative_is_refused(growth):
    calls: list[int] = []

    def step(batch_size):
        calls.append(batch_size)
        if len(calls) > 40 or batch_size < 1:
            raise AssertionError(f"tried {batch_size} after {len(calls)} tries")
        if batch_size > 5:
            raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(ValueError, match=f"growth must be a whole number >= 2.*got {growth!r}"):
        find_max_batch_size(step, start=64, growth=growth)
    assert calls == []
    with pytest.raises(ValueError, match="tolerance must be in"):
        find_max_batch_size(step, tolerance=float("nan"))
