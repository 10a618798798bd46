"""Shared fixtures: the tiny offline models, an in-process IPython shell, CUDA skipping."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# One intra-op thread per process (the notebook kernels and launched ranks inherit it): the tiny models'
# operations are too small to split, and two threads per process on a 2-core machine spin more than they
# compute (measured: the checkpoint and leak tests took 0.40x the CPU seconds with one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

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


@pytest.fixture(scope="session")
def tiny_t5(tiny_models) -> Path:
    """T5ForConditionalGeneration: the encoder-decoder text family."""
    return tiny_models["t5"]


@pytest.fixture(scope="session")
def tiny_whisper(tiny_models) -> Path:
    """WhisperForConditionalGeneration with its feature extractor (2-second windows)."""
    return tiny_models["whisper"]


@pytest.fixture(scope="session")
def tiny_vlm(tiny_models) -> Path:
    """LlavaForConditionalGeneration (CLIP vision tower, projector, Llama) with its processor."""
    return tiny_models["llava"]


@functools.cache
def compat_script():
    """scripts/compat.py as a module (it builds the wheel and runs the notebooks from it)."""
    spec = importlib.util.spec_from_file_location("oomkit_compat_script", REPO / "scripts" / "compat.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The package as Colab installs it: the built wheel."""
    if not (REPO / "helpers").is_dir():
        pytest.skip("builds the wheel from a source checkout (make test-compat runs the tests without helpers/)")
    return compat_script().build_wheel(tmp_path_factory.mktemp("wheel"))


@dataclass
class WheelNotebooks:
    """Every notebook run once per test session from the installed wheel, in an empty directory."""

    work: Path  # the empty directory the notebooks were copied into and ran in
    target: Path  # where the wheel was installed
    lines: dict[str, str]  # "stem[name]" -> its "ok ..." or "FAIL ..." line
    output: str


@pytest.fixture(scope="session")
def wheel_notebooks(wheel, tmp_path_factory, tiny_models) -> WheelNotebooks:
    """The way Colab runs them: the wheel installed in a fresh venv, only the .ipynb files beside them.
    One execution of every notebook serves every test in tests/test_wheel.py."""
    root = tmp_path_factory.mktemp("wheel-notebooks")
    venv_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv_dir], check=True)
    python = venv_dir / "bin" / "python"
    target = compat_script().site_packages(python)
    # the wheel's files go into the new venv; its dependencies come from this environment, as a
    # plain path entry (not a site dir, so this environment's editable oomkit is never seen)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", target, wheel],
        check=True,
    )
    (target / "zz_oomkit_dependencies.pth").write_text(str(compat_script().site_packages(sys.executable)) + "\n")
    work = root / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OOMKIT_TINY"] = str(next(iter(tiny_models.values())).parent)
    done = subprocess.run(
        [python, REPO / "scripts" / "compat.py", "notebooks", "--keep-going", work],
        cwd=work, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    lines = {ln.split()[1]: ln for ln in done.stdout.splitlines() if ln.startswith(("ok ", "FAIL "))}
    return WheelNotebooks(work, target, lines, done.stdout[-3000:] + done.stderr[-3000:])


GLOO_CONNECT = "Connection closed by peer"  # gloo's rendezvous on localhost: about one run in 15 here


def retry_gloo_connect(call, tries: int = 3):
    """``call()``, again (at most ``tries`` times) only when gloo's known localhost connect error ends it."""
    for attempt in range(tries):
        try:
            return call()
        except Exception as e:
            if GLOO_CONNECT not in str(e) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def ipython_shell():
    """A real IPython InteractiveShell in this process (what a notebook kernel runs)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    yield shell
    shell.reset(new_session=False)


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["cuda"] = pytest.mark.skip(reason="needs a CUDA GPU")
    if importlib.util.find_spec("bitsandbytes") is None:  # Colab does not preinstall it (the matrix's colab column)
        skips["bnb"] = pytest.mark.skip(reason="needs bitsandbytes, which is not installed")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
    if hasattr(config, "workerinput"):
        # a pytest-xdist worker (make test: -n 2 --dist loadscope --no-loadscope-reorder, so modules go
        # to workers in this order, each whole to one): the longest modules start first (the built
        # wheel's, whose notebooks run about two minutes, on one worker while the other takes the next),
        # and the many short ones come last, to fill whichever worker is free: a long module started
        # last would leave the other worker idle at the end. (xdist_group cannot do it: pytest 9
        # ignores the node id xdist 3.8 rewrites for it.)
        first = {name: i for i, name in enumerate(LONGEST_MODULES)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))


# Modules by their share of make test (--durations=0, summed per module, 2026-11-28), longest first.
LONGEST_MODULES = (
    "test_wheel.py",
    "test_checkpoint_kills.py",
    "test_notebooks.py",
    "test_gpu_check.py",
    "test_first_screen.py",
    "test_checkpoints.py",
    "test_loading.py",
    "test_finetune.py",
    "test_evaluate.py",
    "test_leaks.py",
    "test_docs.py",
)


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
