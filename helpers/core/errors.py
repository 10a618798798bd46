"""The one base of every error oomkit raises on purpose.

Each module's errors also derive from the builtin a caller would expect (``ValueError`` for bad
input, ``FileNotFoundError`` for a missing model, ``torch.OutOfMemoryError`` for a batch that never
fits), so ``except OomkitError`` catches oomkit's refusals and ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "OomkitError",
    "LoadError",
    "ModelNotFoundError",
    "LoadRefused",
    "EvalError",
    "FingerprintError",
    "ScoreError",
    "ContextLengthError",
    "ModelUnloadedError",
]


class OomkitError(Exception):
    """Raised by oomkit with a message that names the bad value and what to do instead."""


class LoadError(OomkitError, RuntimeError):
    """A load refused before it started: ``reason`` says why, ``fix`` what to do."""

    def __init__(self, reason: str, fix: str | None = None):
        self.reason, self.fix = reason, fix
        super().__init__(reason + (f"\nfix: {fix}" if fix else ""))


class ModelNotFoundError(LoadError, FileNotFoundError):
    """The model (or adapter) path does not exist, or the hub id is unknown."""


class LoadRefused(LoadError):
    """The model exists but loading it as planned would crash (OOM, dead kernel, no bitsandbytes)."""

    placement = None  # the DevicePlan that did not fit, where a split was built (set by gpu_split.check_split)


class EvalError(OomkitError, ValueError):
    """Bad input to ``safe_generate`` (raised before any generation).

    Here, not in ``evaluate``, because the prompt loader, the results file and the scorers raise it too.
    """


class FingerprintError(EvalError):
    """A generation setting whose behaviour cannot be fingerprinted, so a resume could not check it."""


class ScoreError(OomkitError, RuntimeError):
    """``safe_generate``'s ``score=`` function raised: raised after the run, whose outputs are all saved.

    ``report`` is the run's :class:`helpers.EvalReport` (each failed record has ``score_error``).
    """

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return type(self), (self.args[0], self.report)


class ContextLengthError(OomkitError, ValueError):
    """A prompt plus its new tokens would run past the model's context (its ``max_position_embeddings``)."""


class ModelUnloadedError(OomkitError, RuntimeError):
    """A model that ``unload()`` emptied was called: its weights are gone, so it must be loaded again."""
