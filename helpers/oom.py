"""Out-of-memory errors: recognize them however they arrive.

The signatures are data (message fragments), not a chain of ``if``s. Diagnosis
(``explain_oom``) and the IPython handler build on ``is_oom``.
"""

from __future__ import annotations

import torch

__all__ = ["OOM_SIGNATURES", "is_oom"]

# Fragments (lower-case) that mark an allocation failure in an exception's message.
OOM_SIGNATURES: tuple[str, ...] = (
    "out of memory",  # CUDA/HIP allocator, "CUDA error: out of memory", MPS
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",  # older cuDNN
    "cudnn_status_not_supported. this error may appear if you passed in a non-contiguous input",  # cuDNN OOM in disguise
    "can't allocate memory",  # CPU: DefaultCPUAllocator
    "cannot allocate memory",
    "failed to allocate",
    "not enough memory",
)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it wraps) is an out-of-memory error.

    Recognizes ``torch.OutOfMemoryError``, ``MemoryError``, and ``RuntimeError``s whose message
    carries an allocation failure (cuBLAS, cuDNN, "CUDA error: out of memory", the CPU allocator),
    also when wrapped as the ``__cause__``/``__context__`` of another exception.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(exc, RuntimeError):
            text = " ".join(str(a) for a in exc.args).lower()
            if any(sig in text for sig in OOM_SIGNATURES):
                return True
        exc = exc.__cause__ or exc.__context__
    return False
