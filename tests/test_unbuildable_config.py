"""A config this transformers knows but cannot build (Llama 4 under transformers 5.1, issue 47 item 4): one
EstimateError naming the model type, the error and the fix, on every stack (the build failure is forced here)."""

from __future__ import annotations

import pytest
import transformers

from helpers.cli import estimate_main
from helpers.estimator import layout as layout_mod
from helpers.estimator.configs import config_from_dict
from helpers.estimator.core import estimate
from helpers.estimator.rows import EstimateError

SCOUT = "meta-llama/Llama-4-Scout-17B-16E-Instruct"  # a shipped config


@pytest.fixture
def unbuildable(monkeypatch):
    def fail(config):
        raise AttributeError(f"'{type(config).__name__}' object has no attribute 'pad_token_id'")

    layout_mod.clear_layout_cache()
    monkeypatch.setattr(layout_mod, "_meta_model", fail)
    yield
    layout_mod.clear_layout_cache()


def test_a_known_type_transformers_cannot_build_names_the_version_and_the_fix(unbuildable, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EstimateError) as e:
        estimate(SCOUT, load="nf4", device="t4")
    text = str(e.value)
    assert f"transformers {transformers.__version__} cannot build model_type 'llama4'" in text
    assert "pad_token_id" in text and "pip install -U transformers" in text


def test_the_cli_prints_that_error_alone(unbuildable, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert estimate_main([SCOUT, "--load", "nf4", "--json"]) == 2
    printed = capsys.readouterr()
    assert not printed.out.strip() and "cannot build model_type 'llama4'" in " ".join(printed.err.split())


def test_an_unknown_type_names_the_transformers_that_wrote_it():
    config = config_from_dict({"model_type": "llama99", "transformers_version": "9.1.0"}, "config.json")
    assert "pip install -U 'transformers>=9.1.0'" in config.oomkit_unknown
    with pytest.raises(EstimateError, match=r"transformers>=9.1.0.*lacks hidden_size"):
        layout_mod.layout(config)
