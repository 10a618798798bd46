"""Shared fixtures: the tiny offline models, an in-process IPython shell, CUDA skipping."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def _builder():
    spec = importlib.util.spec_from_file_location("build_tiny_models", REPO / "data" / "build_tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """Paths of the tiny models (built once, cached in data/tiny)."""
    return _builder().build()


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture
def ipython_shell():
    """A real IPython InteractiveShell in this process (what a notebook kernel runs)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    yield shell
    shell.reset(new_session=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class FakeCuda:
    """torch.cuda as a machine with ``n`` cards of ``capacity`` bytes shows it; tests set each card's
    ``allocated``/``reserved`` (this process) and ``others`` (held outside it) and read what
    ``reset_peak_memory_stats`` did. Only the readouts are faked: nothing is allocated."""

    def __init__(self, n: int, capacity: int, name: str = "Tesla T4", capability: tuple[int, int] = (7, 5)):
        import types

        self.n, self.capacity = n, capacity
        self.props = types.SimpleNamespace(
            name=name, total_memory=capacity, major=capability[0], minor=capability[1], uuid="fake"
        )
        self.allocated = dict.fromkeys(range(n), 0)
        self.reserved = dict.fromkeys(range(n), 0)
        self.peak = dict.fromkeys(range(n), 0)
        self.others = dict.fromkeys(range(n), 0)
        self.resets: list[int] = []

    def index(self, device) -> int:
        if device is None:
            return 0
        if isinstance(device, str | torch.device):
            return torch.device(device).index or 0
        return int(device)

    def set(self, device: int, allocated: int, reserved: int | None = None) -> None:
        self.allocated[device] = allocated
        self.reserved[device] = max(allocated, reserved or 0)
        self.peak[device] = max(self.peak[device], allocated)

    def install(self, monkeypatch) -> FakeCuda:
        fake = {
            "is_available": lambda: True,
            "device_count": lambda: self.n,
            "current_device": lambda: 0,
            "get_device_properties": lambda d=None: self.props,
            "get_device_capability": lambda d=None: (self.props.major, self.props.minor),
            "get_per_process_memory_fraction": lambda d=None: 1.0,
            "memory_allocated": lambda d=None: self.allocated[self.index(d)],
            "memory_reserved": lambda d=None: self.reserved[self.index(d)],
            "max_memory_allocated": lambda d=None: self.peak[self.index(d)],
            "max_memory_reserved": lambda d=None: self.reserved[self.index(d)],
            "reset_peak_memory_stats": self._reset,
            "mem_get_info": lambda d=None: (self.free(self.index(d)), self.capacity),
            "memory_stats": lambda d=None: {
                "allocated_bytes.all.current": self.allocated[self.index(d)],
                "reserved_bytes.all.current": self.reserved[self.index(d)],
            },
        }
        for attr, value in fake.items():
            monkeypatch.setattr(torch.cuda, attr, value, raising=False)
        return self

    def free(self, device: int) -> int:
        return max(0, self.capacity - self.reserved[device] - self.others[device])

    def _reset(self, device=None) -> None:
        d = self.index(device)
        self.resets.append(d)
        self.peak[d] = self.allocated[d]


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(n, capacity)``: install a :class:`FakeCuda` for this test and return it."""

    def install(n: int = 2, capacity: int = 15 * 2**30, **kwargs) -> FakeCuda:
        return FakeCuda(n, capacity, **kwargs).install(monkeypatch)

    return install
