import pytest
import torch

from helpers.oom.messages import is_oom


def test_real_cpu_allocation_failure_is_oom():
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 45)
    assert is_oom(info.value)


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    MemoryError(),
])  # fmt: skip
def test_oom_forms(exc):
    assert is_oom(exc)


def test_wrapped_oom_is_found():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as inner:
            raise ValueError("generation failed") from inner
    except ValueError as outer:
        assert is_oom(outer)


@pytest.mark.parametrize("exc", [RuntimeError("shape mismatch"), ValueError("out of memory"), KeyError("x")])
def test_other_errors_are_not_oom(exc):
    assert not is_oom(exc)
