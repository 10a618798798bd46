"""The one base of every error oomkit raises on purpose.

Each module's errors also derive from the builtin a caller would expect (``ValueError`` for bad
input, ``FileNotFoundError`` for a missing model, ``torch.OutOfMemoryError`` for a batch that never
fits), so ``except OomkitError`` catches oomkit's refusals and ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = ["OomkitError"]


class OomkitError(Exception):
    """Raised by oomkit with a message that names the bad value and what to do instead."""
