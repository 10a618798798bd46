"""Find the largest batch that fits, and adapt a loop's batch size when it runs out of memory.

``find_max_batch_size(step)`` grows the batch geometrically, then bisects between the largest size
that ran and the smallest that ran out of memory, down to the exact boundary (``tolerance=1.0``, the
default). The bisection splits at the geometric mean while the range is wide (batch limits are
spread over orders of magnitude), clamped so that a plain bisection could still finish within
``ceil(log2(limit)) + 2`` tries. A known ``limit`` is an upper bound that never has to be tried, so
most searches need only a few failing tries. The safety margin is a separate step afterwards:
``batch_size = floor(max_ok * margin)``, and both figures are reported. Between tries it drops the exception (its traceback pins every tensor of the
failed step: the usual reason a retry runs out of memory again) and empties the cache.

``@adaptive_batch(start=...)`` is the decorator form, in the style of accelerate's
``find_executable_batch_size``; unlike it, it remembers what worked across calls, falls back to a
known-good size instead of shrinking by 10 % per failure, and grows back towards the largest size
that fits.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.arguments import MAX_COUNT, flag
from ..core.errors import OomkitError
from ..core.html import progress_bar
from ..core.vocab import TIGHT_FRACTION
from .retry import attempt

__all__ = [
    "Trial",
    "BatchSearch",
    "find_max_batch_size",
    "adaptive_batch",
    "clear_cache",
    "remembered_batch",
    "remember_batch",
    "BatchSizeError",
    "DEFAULT_LIMIT",
]


class BatchSizeError(OomkitError, torch.OutOfMemoryError):
    """Even the smallest batch runs out of memory (a ``torch.OutOfMemoryError``, so OOM handlers see it)."""


@dataclass(frozen=True)
class Trial:
    """One try: the batch size, whether ``step`` ran, how long it took, and the error in one line."""

    size: int
    ok: bool
    seconds: float = 0.0
    error: str | None = None

    # a Trial unpacks and compares like the tuple (size, ok)
    def __iter__(self):
        return iter((self.size, self.ok))

    def __eq__(self, other):
        if isinstance(other, tuple):
            return (self.size, self.ok) == other
        return NotImplemented if not isinstance(other, Trial) else (self.size, self.ok) == (other.size, other.ok)

    def __hash__(self):
        return hash((self.size, self.ok))


@dataclass
class BatchSearch:
    """The outcome of a search.

    Attributes:
        max_ok: the largest size that ran (0 when none did).
        batch_size: ``max_ok`` after the safety margin (at least 1): the size to use.
        trials: every size tried, in order, and whether it ran.
        first_failed: the smallest size that ran out of memory (None when none did, or ``limit + 1``
            when only the limit bounded the search).
        limit_bound: True when ``first_failed`` is that ``limit + 1``, not a size that ran out of
            memory: a later search with a larger limit must not stop there.
        limit, margin, key, cached: the search's settings; ``cached`` is True when it started from
            a previous result for ``key``.
    """

    max_ok: int
    batch_size: int
    trials: list[Trial] = field(default_factory=list)
    first_failed: int | None = None
    limit: int | None = None
    margin: float = TIGHT_FRACTION
    key: Hashable | None = None
    cached: bool = False
    seconds: float = 0.0
    note: str | None = None
    limit_bound: bool = False

    @property
    def oom_trials(self) -> int:
        return sum(not t.ok for t in self.trials)

    def tries_text(self) -> str:
        """The search without its answer: the largest size that ran, what bounded it, the tries (for a caller
        such as ``find_micro_batch`` that answers with a number of its own: one number on the screen)."""
        tried = ", ".join(f"{t.size}{'' if t.ok else '✗'}" for t in self.trials)
        bound = f"; {self.first_failed} ran out of memory" if self.first_failed else ""
        if self.limit and self.max_ok >= self.limit:
            bound = f"; the limit {self.limit} fits"
        return (
            f"largest that ran: {self.max_ok}{bound}; {len(self.trials)} tries, {self.oom_trials} out of memory "
            f"[{tried}]{' (started from cache)' if self.cached else ''}"
        )

    def __str__(self) -> str:
        return f"batch size {self.batch_size} (margin {self.margin:.0%}); {self.tries_text()}" + (
            f"\n{self.note}" if self.note else ""
        )

    def _repr_html_(self, title: str | None = None) -> str:
        from ..core.html import badge, table

        rows = [[t.size, badge("pass" if t.ok else "fail"), f"{t.seconds:.2f} s", t.error or ""] for t in self.trials]
        return table(["batch size", "ran", "time", "error"], rows, title=str(self) if title is None else title)


_CACHE: dict[Hashable, BatchSearch] = {}

# Without a limit the search grows until a size runs out of memory; a step that never does (on the
# CPU, or one that ignores its argument) would grow forever. 4096 is past any batch a 16 GB T4 fits
# for a language model, and reached in 7 tries from 1 at the default growth of 4.
DEFAULT_LIMIT = 4096


def remembered_batch(key: Hashable) -> BatchSearch | None:
    """The search remembered for ``key`` (by :func:`find_max_batch_size` or :func:`remember_batch`), or None."""
    return _CACHE.get(key)


def remember_batch(key: Hashable, search: BatchSearch) -> None:
    """Remember what worked for ``key``: a later search (or ``safe_generate``) with that key starts there."""
    _CACHE[key] = search


def clear_cache(key: Hashable | None = None) -> None:
    """Forget cached searches (all of them, or the one for ``key``)."""
    if key is None:
        _CACHE.clear()
    else:
        _CACHE.pop(key, None)


def _try(step: Callable[[int], Any], size: int) -> Trial:
    """Run ``step(size)``; an OOM becomes a failed Trial (and its memory is given back), anything else propagates."""
    result = attempt(step, size)
    return Trial(size, result.ok, result.elapsed, result.error)


def _next_size(lo: int, hi: int, left: int | None = None) -> int:
    """The next size to try strictly between ``lo`` (ran) and ``hi`` (failed): log-midpoint on wide ranges.

    ``left``: tries that may follow this one; the split is clamped so that a plain bisection of either
    side still closes within them (the log-midpoint wins on average, this bounds the worst case)."""
    base = max(lo, 1)
    if hi > 4 * base:
        mid = round(math.sqrt(base * hi))
    else:
        mid = (lo + hi) // 2
    if left is not None and left >= 0:
        mid = min(max(mid, hi - 2**left), lo + 2**left)
    return min(max(mid, lo + 1), hi - 1)


def _bisections(width: int) -> int:
    """Tries a plain bisection needs to close a (ran, failed) bracket ``width`` apart."""
    return max(0, math.ceil(math.log2(width))) if width > 1 else 0


def _done(lo: int, hi: int, tolerance: float) -> bool:
    # the true maximum is at most hi - 1, so lo >= tolerance * (hi - 1) bounds what is left on the table
    return hi - lo <= 1 or (lo > 0 and lo >= tolerance * (hi - 1))


def _check_sizes(start: Any, limit: Any) -> None:
    if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 1:
        raise ValueError(f"start must be a positive whole batch size, got {start!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1):
        raise ValueError(f"limit must be a positive whole batch size or None, got {limit!r}")
    for name, value in (("start", start), ("limit", limit)):
        if value is not None and value > MAX_COUNT:
            raise ValueError(f"{name} must be a batch size <= {MAX_COUNT:,} (larger is a typo), got {value!r}")


def _check_fraction(name: str, value: Any, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1] ({example}), got {value!r}")


def find_max_batch_size(
    step: Callable[[int], Any],
    *,
    start: int = 1,
    limit: int | None = None,
    margin: float = TIGHT_FRACTION,
    key: Hashable | None = None,
    growth: int = 4,
    tolerance: float = 1.0,
    progress: bool = False,
) -> BatchSearch:
    """Find the largest batch size for which ``step(batch_size)`` runs without running out of memory.

    Args:
        step: runs one representative step (forward, or forward + backward + optimizer step) at a
            batch size. An OOM (``torch.OutOfMemoryError``, a ``RuntimeError`` with OOM text such as
            cuBLAS/cuDNN allocation failures, the CPU allocator's) marks the size as too big;
            any other exception propagates.
        start: the first size to try.
        limit: the largest size worth having (e.g. the dataset size); never exceeded, never tried
            unless the search reaches it. None: grow until a size runs out of memory, at most to
            ``DEFAULT_LIMIT`` (4096; the result's ``note`` says when it stopped there).
        margin: ``batch_size = floor(max_ok * margin)``: headroom for longer sequences and
            fragmentation later.
        key: caches the result (e.g. ``(model_name, seq_len, device)``); a later search with the
            same key starts from the cached size and usually needs one try.
        growth: whole factor (>= 2) by which the size grows while nothing has failed yet (no ``limit``).
        tolerance: stop once the largest size that ran is within this fraction of the smallest
            that failed; 1.0 (default): the exact largest size that runs (on the benchmark's 200
            workloads fewer tries than a textbook doubling + bisection: mean 8.3 against 9.2, at
            most 14 against 23). Lower it to trade precision for tries (0.92: mean 6.7 tries there,
            but short of the maximum in 92 of 200 cases, by up to 8 %).
        progress: show a bar of the tries while it searches (each try can take seconds: a real step).

    Returns:
        A :class:`BatchSearch`.

    Raises:
        BatchSizeError: even batch size 1 (or ``start`` and below) runs out of memory.

    >>> search = find_max_batch_size(lambda b: model(batch[:b]).loss.backward(), limit=256)  # doctest: +SKIP
    >>> search.batch_size  # doctest: +SKIP
    """
    _check_search(step, start, limit, margin, key, growth, tolerance)
    started = time.perf_counter()
    cached = _CACHE.get(key) if key is not None else None
    ceiling = limit if limit is not None else DEFAULT_LIMIT
    with _SearchBar(step, limit, progress) as counted:
        lo, hi, trials, ran_out = _search(
            counted, _first_size(start, ceiling, cached), limit, cached, growth, tolerance
        )
    note = None
    if limit is None and lo >= DEFAULT_LIMIT:
        note = (
            f"stopped at the default limit {DEFAULT_LIMIT} without running out of memory (on the CPU, or "
            "a step that ignores its batch size, nothing ever does): pass limit= the largest batch worth "
            "having, e.g. the dataset size"
        )
        warnings.warn(f"find_max_batch_size {note}", stacklevel=2)
    result = BatchSearch(
        max_ok=lo,
        batch_size=max(1, math.floor(lo * margin)),
        trials=trials,
        first_failed=hi,
        limit=limit,
        margin=margin,
        key=key,
        cached=cached is not None,
        seconds=time.perf_counter() - started,
        note=note,
        limit_bound=hi is not None and not ran_out,
    )
    if key is not None:
        _CACHE[key] = result
    return result


class _SearchBar:
    """A progress bar of a search's tries (``progress``): ``with _SearchBar(step, limit, on) as counted:`` runs
    ``counted(size)`` as ``step(size)``, counting the try and saying its size and whether it ran."""

    def __init__(self, step: Callable[[int], Any], limit: int | None, on: bool):
        self.step, self.on = step, on
        self.total = _bisections(limit) + 2 if limit is not None else None  # the search's most tries with a limit
        self.bar = None

    def __enter__(self) -> Callable[[int], Any]:
        if not self.on:
            return self.step
        self.bar = progress_bar(self.total, "batch-size search", "try", leave=False)
        return self.counted

    def counted(self, size: int) -> Any:
        self.bar.set_postfix_str(f"trying {size}", refresh=True)
        try:
            out = self.step(size)
        except BaseException:
            self.bar.set_postfix_str(f"{size} out of memory", refresh=False)
            raise
        finally:
            self.bar.update(1)
        self.bar.set_postfix_str(f"{size} ran", refresh=False)
        return out

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.total = self.bar.n  # done: the bar ends full, however many tries the bound allowed
            self.bar.close()


def _check_search(step: Any, start: Any, limit: Any, margin: Any, key: Any, growth: Any, tolerance: Any) -> None:
    if not callable(step):
        raise TypeError(
            f"step must be a function of the batch size, got {type(step).__name__}: "
            "e.g. find_max_batch_size(lambda b: model(batch[:b]).loss.backward())"
        )
    _check_sizes(start, limit)
    _check_fraction("margin", margin, "the share of the largest working size to use, e.g. 0.9")
    if isinstance(growth, bool) or not isinstance(growth, numbers.Integral) or growth < 2:
        raise ValueError(
            f"growth must be a whole number >= 2 (the factor the size grows by while nothing failed), got {growth!r}"
        )
    _check_fraction("tolerance", tolerance, "e.g. 0.92: stop within 8 % of the limit")
    if key is not None:
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"key must be hashable, got {type(key).__name__} {key!r:.60}: use a tuple, "
                "e.g. key=(model_name, seq_len)"
            ) from None


def _first_size(start: int, limit: int | None, cached: BatchSearch | None) -> int:
    size = min(start, limit) if limit is not None else start
    if cached is not None and cached.max_ok > 0:
        size = min(cached.max_ok, limit) if limit is not None else cached.max_ok
    return size


def _tried(trials: list[Trial]) -> str:
    return ", ".join(f"{t.size}{'' if t.ok else '✗'}" for t in trials)


def _try_in_search(step: Callable[[int], Any], size: int, trials: list[Trial]) -> Trial:
    """``_try``, with a note on a non-OOM error saying where the search was."""
    try:
        return _try(step, size)
    except BaseException as e:  # not an OOM: the step itself is broken; say where the search was
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(
                f"helpers.oom.batch_size: step({size}) raised {type(e).__name__}, which is not an "
                "out-of-memory error, so the batch-size search stopped (fix the step: it must run "
                "at any batch size). Tries before it: " + (_tried(trials) or "none")
            )
        raise


def _search(
    step: Callable[[int], Any],
    size: int,
    limit: int | None,
    cached: BatchSearch | None,
    growth: int,
    tolerance: float,
) -> tuple[int, int | None, list[Trial], bool]:
    """Grow, then bisect: (largest size that ran, smallest that failed or limit + 1 or None, trials,
    whether that bound ran out of memory: False when it is only the limit + 1)."""
    lo, hi = 0, (limit + 1 if limit is not None else None)
    ran_out = False  # hi is a size that ran out of memory, here or in the cached search
    trials: list[Trial] = []
    # the worst case allowed: what a plain bisection of the first bracket needs, plus one try
    budget = _bisections(limit) + 2 if limit is not None else None
    while True:
        trial = _try_in_search(step, size, trials)
        trials.append(trial)
        if trial.ok:
            lo = size
            if cached is not None and size == cached.max_ok and cached.first_failed and not cached.limit_bound:
                # the cached bound still holds unless memory got tighter: trust it. Only a real OOM: an
                # earlier search's limit + 1 would cap this one, whose limit may be larger
                if hi is None or cached.first_failed <= hi:
                    hi, ran_out = cached.first_failed, True
            if hi is None:
                if size >= DEFAULT_LIMIT:  # never ran out of memory: stop at the default limit
                    return lo, None, trials, False
                size = min(size * growth, DEFAULT_LIMIT)
                continue
        else:
            hi, ran_out = size, True
            if size == 1:
                raise BatchSizeError(
                    "even batch size 1 runs out of memory: free memory (helpers.cleanup()), shorten the "
                    "sequence, quantize the model or enable gradient checkpointing. Tries: " + _tried(trials)
                )
            if lo == 0:
                # nothing has run yet: shrink as fast as we grew
                size = max(1, size // growth)
                continue
        if hi is None or _done(lo, hi, tolerance):
            return lo, hi, trials, ran_out
        if budget is None:  # no limit: the first failure set the bracket
            budget = len(trials) + _bisections(hi - lo) + 1
        size = _next_size(lo, hi, budget - len(trials) - 1)


class _AdaptiveState:
    """What an ``@adaptive_batch`` function has learned: the largest size that ran, the smallest that failed."""

    def __init__(self, start: int, limit: int | None, tolerance: float, grow: bool):
        self.start, self.limit, self.tolerance, self.grow = start, limit, tolerance, grow
        self.reset()

    def reset(self) -> None:
        self.lo, self.hi = 0, (self.limit + 1 if self.limit is not None else None)
        self.batch_size = min(self.start, self.limit) if self.limit is not None else self.start
        self.trials: list[Trial] = []

    def after_success(self, size: int) -> None:
        self.lo = max(self.lo, size)
        if not self.grow:
            self.batch_size = size
        elif self.hi is None:
            # nothing failed yet and no limit: keep the size (growing blindly would invite an OOM)
            self.batch_size = size
        elif _done(self.lo, self.hi, self.tolerance):
            self.batch_size = self.lo
        else:
            self.batch_size = _next_size(self.lo, self.hi)  # probe upwards on the next call

    def after_oom(self, size: int) -> int:
        self.hi = size if self.hi is None else min(self.hi, size)
        if self.lo >= self.hi:  # memory got tighter than before: what ran is no longer known to run
            self.lo = 0
        if self.lo > 0:
            self.batch_size = self.lo  # known to run: no second failure
        elif size == 1:
            raise BatchSizeError(
                "even batch size 1 runs out of memory: free memory (helpers.cleanup()), "
                "shorten the sequence, quantize the model or enable gradient checkpointing"
            )
        else:
            self.batch_size = max(1, size // 2)
        return self.batch_size


def adaptive_batch(start: int = 128, *, limit: int | None = None, tolerance: float = 0.92, grow: bool = True):
    """Decorator: call ``fn(batch_size, *args, **kwargs)``, retrying with a smaller batch on OOM.

    Like accelerate's ``find_executable_batch_size``, the function takes the batch size as its first
    argument and the decorator supplies it. On OOM it drops the exception's references, frees
    memory and retries with the largest size known to run (or half the failed size when none is
    known yet). It remembers across calls: when called repeatedly (per chunk, per epoch) it
    probes between the largest size that ran and the smallest that failed, so it converges on
    the largest batch that fits instead of only ever shrinking. Non-OOM errors propagate.

    Args:
        start: the first batch size.
        limit: never go above this.
        tolerance: stop probing once the working size is within this fraction of the failing one.
        grow: probe upwards after a failure (False: only ever shrink, like accelerate).

    The wrapper exposes ``.batch_size`` (the size the next call uses), ``.trials`` and ``.reset()``.

    >>> @adaptive_batch(start=64)
    ... def evaluate(batch_size, rows):
    ...     return [len(rows[i:i + batch_size]) for i in range(0, len(rows), batch_size)]
    >>> evaluate(list(range(100)))[:2]
    [64, 36]
    """
    if callable(start):  # @adaptive_batch without parentheses: decorate with the defaults
        return adaptive_batch()(start)
    _check_sizes(start, limit)
    _check_fraction("tolerance", tolerance, "e.g. 0.92: stop probing within 8 % of the failing size")
    flag("grow", grow)

    def decorate(fn):
        state = _AdaptiveState(start, limit, tolerance, grow)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            while True:
                size = state.batch_size
                result = attempt(functools.partial(fn, size, *args, **kwargs))
                state.trials.append(Trial(size, result.ok, result.elapsed, result.error))
                if result.ok:
                    state.after_success(size)
                    return result.value
                state.after_oom(size)

        return _Adaptive(wrapper, state)

    return decorate


class _Adaptive:
    """The decorated function: callable, with ``batch_size``, ``trials`` and ``reset()``."""

    def __init__(self, fn, state: _AdaptiveState):
        self._fn, self._state = fn, state
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    @property
    def batch_size(self) -> int:
        return self._state.batch_size

    @property
    def max_ok(self) -> int:
        return self._state.lo

    @property
    def trials(self) -> list[Trial]:
        return self._state.trials

    def reset(self) -> None:
        self._state.reset()

    def __repr__(self) -> str:
        return f"<adaptive_batch {getattr(self._fn, '__name__', 'fn')}: next batch size {self.batch_size}>"
