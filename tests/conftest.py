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
