"""Test doubles: make a CPU run behave like a small GPU (tests, benchmarks, the CPU demo notebook).

``simulated_budget(model, tokens=...)``: within the block, a ``generate`` call whose batch x (prompt
+ new tokens) exceeds the budget runs out of memory for real (an allocation too large for any
machine), raised as ``torch.OutOfMemoryError`` with the message a T4 would print (so the OOM card reads
what a GPU user meets: the batch and the length to cut).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field

import torch

from .core.arguments import ArgumentError, number, whole_number
from .core.devices import CUDA_CONTEXT, DEVICES
from .core.units import format_bytes

__all__ = ["SimulatedBudget", "simulated_budget"]

# The simulated card: at the budget the run holds this share of a T4, with this share left free; a random
# spike asks for a small block while four times as much sits reserved in pieces.
BUDGET_SHARE = 0.85
FREE_SHARE = 0.02
SPIKE_BYTES = 64 * 2**20


@dataclass
class SimulatedBudget:
    """A ``generate`` that runs out of memory like a small GPU (see :func:`simulated_budget`)."""

    tokens: int
    oom_rate: float = 0.0
    seed: int = 0
    calls: int = 0
    ooms: int = 0
    _rng: random.Random = field(default=None, repr=False)
    _last_oom: bool = field(default=False, repr=False)

    def check(self, batch: int, seq: int) -> None:
        self.calls += 1
        over = batch * seq > self.tokens
        spike = not self._last_oom and self.oom_rate > 0 and self._rng.random() < self.oom_rate
        self._last_oom = over or spike
        if over or spike:
            self.ooms += 1
            try:
                torch.empty(1 << 50, dtype=torch.uint8)  # no machine has a PiB: a real allocator failure
            except RuntimeError as e:
                raise torch.OutOfMemoryError(self.message(batch, seq, over)) from e

    def message(self, batch: int, seq: int, over: bool) -> str:
        """The OOM a T4 would print here, in PyTorch's own words: the over-budget tokens' share of the card
        (a batch or a length too large), or a small request refused while memory sits reserved in pieces
        (a spike: fragmentation). The card an OOM report reads is the one a user meets on a GPU."""
        cap = DEVICES["t4"]["capacity"]
        per_token = int(cap * BUDGET_SHARE / self.tokens)
        need = min((batch * seq - self.tokens) * per_token, cap // 4) if over else SPIKE_BYTES
        free = int(cap * FREE_SHARE)
        unallocated = SPIKE_BYTES * 4 if not over else int(cap * 0.01)
        allocated = cap - free - unallocated - CUDA_CONTEXT
        why = f"batch {batch} x {seq} tokens > budget {self.tokens}" if over else "a random spike"
        return (
            f"CUDA out of memory. Tried to allocate {format_bytes(need)}. GPU 0 has a total capacity of "
            f"{format_bytes(cap)} of which {format_bytes(free)} is free. Including non-PyTorch memory, this process "
            f"has {format_bytes(cap - free)} memory in use. Of the allocated memory {format_bytes(allocated)} is "
            f"allocated by PyTorch, and {format_bytes(unallocated)} is reserved by PyTorch but unallocated. "
            f"(simulated on this machine for a T4: {why})"
        )


@contextlib.contextmanager
def simulated_budget(model, tokens: int, *, oom_rate: float = 0.0, seed: int = 0):
    """Within the block, ``model.generate`` runs out of memory when batch x (prompt + new tokens) > ``tokens``.

    With ``oom_rate`` > 0 it also fails at random moments (seeded; never twice in a row), like a
    fragmentation spike on a real GPU. The error is a ``torch.OutOfMemoryError`` raised from a real
    allocator failure, so ``is_oom`` and the cleanup path see exactly what a GPU OOM gives them.
    Yields the :class:`SimulatedBudget` (``.calls``, ``.ooms``).
    """
    whole_number("tokens", tokens)
    number("oom_rate", oom_rate, low=0, high=1, high_open=True)
    if not callable(getattr(model, "generate", None)):
        raise ArgumentError(f"simulated_budget() wraps a model's generate(); {model!r:.60} has none")
    budget = SimulatedBudget(tokens=tokens, oom_rate=oom_rate, seed=seed, _rng=random.Random(seed))
    original = model.generate

    def generate(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None and kwargs.get("input_features") is not None:
            ids = kwargs["input_features"][:, 0, :0]  # Whisper: a batch of audio, no prompt tokens
        batch, prompt = (ids.shape[0], ids.shape[1]) if ids is not None else (1, 0)
        budget.check(batch, prompt + int(kwargs.get("max_new_tokens", 0)))
        return original(*args, **kwargs)

    model.generate = generate
    try:
        yield budget
    finally:
        del model.generate  # the instance attribute goes, the class method is back
