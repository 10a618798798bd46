"""safe_generate's batch sizes: where the first size comes from and what it is remembered under."""

from __future__ import annotations

import types

import torch

import helpers.estimator.fitting as estimator
from helpers.evaluation import batching as eval_batching
from helpers.evaluation.batching import batch_cache_key, start_size


def _model(name: str = "org/m"):
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(_name_or_path=name)
    return model


def test_a_smaller_kv_cache_is_remembered_apart_from_the_default_one():
    model = _model()
    plain = batch_cache_key(model, 256)
    assert plain == batch_cache_key(model, 256, "dynamic") == batch_cache_key(model, 256, None)
    assert plain == ("safe_generate", "org/m", 256, "cpu")  # what find_max_batch_size(key=...) users pass
    int4 = batch_cache_key(model, 256, "int4")
    assert int4 != plain and int4[-1] == "kv_cache=int4" and int4 != batch_cache_key(model, 256, "offload")


def test_the_estimated_start_prices_the_kv_cache_asked_for(monkeypatch):
    seen = {}

    def fake_fit(model, **kw):
        seen.update(kw)
        return {"dynamic": 3, "int4": 9}[kw["kv_cache"] or "dynamic"]

    monkeypatch.setattr(eval_batching, "model_device", lambda m: torch.device("cuda"))  # the estimate runs on CUDA only
    monkeypatch.setattr(estimator, "max_batch_that_fits", fake_fit)
    monkeypatch.setattr(eval_batching, "model_load_mode", lambda m: "nf4")
    args = dict(key=("k",), prompt_tokens=100, max_new_tokens=50, limit=64)
    assert start_size(_model(), "auto", **args) == (3, "estimate")
    assert start_size(_model(), "auto", **args, kv_cache="int4") == (9, "estimate")
    assert seen["kv_cache"] == "int4" and seen["prompt_tokens"] == 100 and seen["max_new_tokens"] == 50
