"""How Colab gets oomkit: the built wheel, the version ranges, the restart and no-GPU flows.

- ``pyproject.toml``'s lower bounds are the ones ``make test-compat`` runs, and Python is not capped;
- :mod:`helpers.core.compat` picks the right keyword for the installed transformers;
- :mod:`helpers.core.runtime` sets the allocator before CUDA starts, and says when a restart is needed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from helpers.core import compat, runtime

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = (REPO / "pyproject.toml").read_text()


from conftest import compat_script as _compat_script  # noqa: E402


def _bound(package: str) -> str | None:
    m = re.search(rf'"{re.escape(package)}>=([^",;]+)', PYPROJECT)
    return m.group(1) if m else None


# ----------------------------------------------------------------------------- ranges


def test_no_python_upper_cap():
    requires = re.search(r'requires-python\s*=\s*"([^"]+)"', PYPROJECT).group(1)
    assert "<" not in requires, f"requires-python {requires!r} caps Python: pip would refuse a newer runtime"


@pytest.mark.skipif(not (REPO / "scripts" / "compat.py").exists(), reason="runs from a source checkout")
def test_lower_bounds_are_the_tested_ones():
    low = _compat_script().LOW
    for package, version in low.items():
        assert _bound(package) == version, f"pyproject says {package}>={_bound(package)}, the matrix tests {version}"


@pytest.mark.skipif(not (REPO / "README.md").exists(), reason="runs from a source checkout")
def test_readme_tested_versions_are_the_matrix_pins():
    """The README's tested-versions table names what scripts/compat.py installs, column by column."""
    script = _compat_script()
    readme = (REPO / "README.md").read_text()
    header, *_ = [ln for ln in readme.splitlines() if ln.startswith("| column | Python |")]
    names = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == len(names) and cells[0] in ("low", "new", "colab"):
            rows[cells[0]] = dict(zip(names, cells))
    assert set(rows) == set(script.environments()), "one README row per matrix column"
    for package, version in script.LOW.items():
        assert rows["low"].get(package, version) == version, f"README's low {package}: the matrix tests {version}"
    for package, version in script.COLAB.items():
        if package in rows["colab"]:
            assert rows["colab"][package] == version, f"README's colab {package}: the matrix installs {version}"
    assert rows["colab"]["Python"] == script.COLAB_PYTHON
    assert "bitsandbytes" not in script.COLAB and rows["colab"]["bitsandbytes"].startswith("none preinstalled")


@pytest.mark.skipif(not (REPO / "requirements.txt").exists(), reason="runs from a source checkout")
def test_matrix_says_in_one_line_why_the_colab_column_cannot_run(monkeypatch, tmp_path):
    script = _compat_script()
    monkeypatch.setenv("OOMKIT_COLAB_PYTHON", str(tmp_path / "no-python"))
    colab = script.environments()["colab"]
    assert colab.missing == f"OOMKIT_COLAB_PYTHON={tmp_path / 'no-python'} is not a working Python 3.13"
    with pytest.raises(script.Unavailable, match="not a working Python"):
        script.prepare(colab, tmp_path / "oomkit.whl", None, tmp_path / "log")
    assert all(v.startswith(("torch==", "transformers==")) for v in colab.requirements[:2]), "exact pins, torch first"
    log = tmp_path / "pip.log"
    log.write_text(
        "ERROR: No matching distribution found for torch==2.11.0\nERROR: ResolutionImpossible: for help visit x\n"
    )
    assert script.last_error(log) == "ERROR: No matching distribution found for torch==2.11.0"
    out = "...\n= 201 passed, 2 skipped, 5 deselected, 725 warnings in 102.67s (0:01:42) =\n"
    assert script.pytest_counts(out) == "201 passed, 2 skipped, 5 deselected"


# ----------------------------------------------------------------------------- version shims


@pytest.mark.parametrize(
    ("transformers", "keyword", "tokenizer_keyword"),
    [("4.45.0", "torch_dtype", "tokenizer"), ("4.46.3", "torch_dtype", "processing_class"), ("4.56.0", "dtype", "processing_class"), ("5.23.0", "dtype", "processing_class")],
)  # fmt: skip
def test_keywords_follow_the_installed_transformers(monkeypatch, transformers, keyword, tokenizer_keyword):
    real = compat.importlib.metadata.version
    monkeypatch.setattr(
        compat.importlib.metadata, "version", lambda d: transformers if d == "transformers" else real(d)
    )
    assert compat.from_pretrained_dtype(torch.float16) == {keyword: torch.float16}
    assert compat.trainer_tokenizer_kwarg() == tokenizer_keyword


def test_load_plan_uses_the_keyword_this_transformers_reads():
    from helpers import LoadPlan

    kwargs = LoadPlan("some/model", load="fp16").from_pretrained_kwargs(device="t4")
    assert kwargs[compat.dtype_kwarg()] == torch.float16
    assert ("torch_dtype" in kwargs) != ("dtype" in kwargs)


def test_fp16_plan_really_loads_fp16(tiny_llama):
    """The failure the shim prevents: an unknown keyword silently loading fp32."""
    from helpers import LoadPlan, load

    model, _, _ = load(LoadPlan(str(tiny_llama), load="fp16", device_map=None))
    assert next(model.parameters()).dtype == torch.float16


def test_version_parsing():
    assert compat.version("torch")[:2] == tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert compat.version("surely-not-installed-oomkit-xyz") is None
    assert compat.OutOfMemoryError is torch.cuda.OutOfMemoryError or issubclass(compat.OutOfMemoryError, RuntimeError)


# ----------------------------------------------------------------------------- restart and no-GPU flows


@pytest.fixture
def clean_runtime(monkeypatch):
    monkeypatch.delenv(runtime.ALLOC_CONF, raising=False)
    monkeypatch.setattr(runtime, "_set_before_cuda", set())
    monkeypatch.setattr(runtime, "_start_environment", lambda: {})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def test_configure_allocator_before_cuda_sets_it(clean_runtime):
    clean_runtime.setenv(runtime.ALLOC_CONF, "max_split_size_mb:128")
    done = runtime.configure_allocator()
    assert (done.action, done.needs_restart) == ("set", False)
    assert os.environ[runtime.ALLOC_CONF] == "max_split_size_mb:128,expandable_segments:True"
    clean_runtime.setattr(torch.cuda, "is_initialized", lambda: True)  # CUDA starts afterwards
    assert not runtime.needs_restart_for("expandable_segments:True")
    assert runtime.configure_allocator().action == "already set"


def test_configure_allocator_replaces_a_contrary_value(clean_runtime):
    clean_runtime.setenv(runtime.ALLOC_CONF, "expandable_segments:False")
    assert runtime.configure_allocator().value == "expandable_segments:True"


def test_configure_allocator_after_cuda_changes_nothing_and_says_restart(clean_runtime):
    clean_runtime.setattr(torch.cuda, "is_initialized", lambda: True)
    assert runtime.cuda_initialized()
    done = runtime.configure_allocator()
    assert (done.action, done.needs_restart) == ("too late", True)
    assert runtime.ALLOC_CONF not in os.environ
    assert runtime.RESTART_MENU in done.message


def test_setting_made_after_cuda_started_needs_a_restart(clean_runtime):
    clean_runtime.setattr(torch.cuda, "is_initialized", lambda: True)
    clean_runtime.setenv(runtime.ALLOC_CONF, "expandable_segments:True")  # os.environ[...] = ... in a later cell
    check = runtime.needs_restart_for("expandable_segments:True")
    assert check.needed and "after CUDA initialized" in check.reason and runtime.RESTART_MENU in check.fix
    assert "restart needed" in str(check)
    assert runtime.configure_allocator().needs_restart


def test_setting_from_the_start_environment_is_in_effect(clean_runtime):
    clean_runtime.setattr(torch.cuda, "is_initialized", lambda: True)
    clean_runtime.setenv(runtime.ALLOC_CONF, "expandable_segments:True")
    clean_runtime.setattr(runtime, "_start_environment", lambda: {runtime.ALLOC_CONF: "expandable_segments:True"})
    assert not runtime.needs_restart_for("expandable_segments:True").needed


def test_missing_setting_before_cuda_is_not_yet_a_restart(clean_runtime):
    assert not runtime.needs_restart_for("expandable_segments:True").needed
    clean_runtime.setattr(torch.cuda, "is_initialized", lambda: True)
    assert runtime.needs_restart_for("expandable_segments:True").needed


def test_start_environment_reads_this_process():
    if not Path("/proc/self/environ").exists():
        pytest.skip("no /proc")
    assert runtime._start_environment().get("PATH") == os.environ.get("PATH") or "PATH" in runtime._start_environment()


def test_no_gpu_notice_names_the_menu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.GPU_MENU in runtime.gpu_notice()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.gpu_notice() is None
