"""load_checks: what load() refuses before any weight is read. Pre-quantized GPTQ/AWQ checkpoints here."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from helpers import LoadPlan, estimate, load
from helpers.core.errors import LoadRefused
from helpers.loading.checks import PREQUANTIZED_BACKENDS, check_prequantized_backend


def _gptq_repo(tiny_llama, tmp_path, method: str = "gptq"):
    """The tiny Llama's config as a GPTQ/AWQ checkpoint's config says it (no weights: nothing gets that far)."""
    repo = tmp_path / f"tiny-{method}"
    shutil.copytree(tiny_llama, repo)
    config = json.loads((repo / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32, "desc_act": False}
    (repo / "config.json").write_text(json.dumps(config))
    return repo


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_prequantized_repo_plans_as_saved(tiny_llama, tmp_path, method):
    repo = _gptq_repo(tiny_llama, tmp_path, method)
    plan = LoadPlan(str(repo), load="auto")  # the checkpoint's own quantization (it was a dead end)
    assert plan.load == method and plan.quantization_config() is None  # transformers reads the repo's own
    assert LoadPlan(str(repo), load=method.upper()).load == method
    est = plan.estimate("t4")
    assert est.load == method and est.total == estimate(str(repo), load=method, device="t4").total


@pytest.mark.skipif(all(importlib.util.find_spec(n) for n in PREQUANTIZED_BACKENDS["gptq"]), reason="backend installed")
def test_a_missing_backend_is_refused_before_loading_with_the_install_line(tiny_llama, tmp_path):
    repo = _gptq_repo(tiny_llama, tmp_path)
    with pytest.raises(LoadRefused) as refused:
        load(LoadPlan(str(repo), load="auto"))
    text = str(refused.value)
    assert "saved quantized with GPTQ" in text and "pip install" in text and "load='nf4'" in text
    with pytest.raises(LoadRefused, match="pip install"):  # check=False skips fit and RAM, not this
        load(LoadPlan(str(repo), load="gptq"), check=False)
    with pytest.raises(ValueError, match="already quantized .gptq.*load='gptq'"):  # nf4, the plan's default
        LoadPlan(str(repo)).estimate("t4")
    check_prequantized_backend(LoadPlan(str(tiny_llama), load="fp32"))  # an ordinary checkpoint: nothing to say
