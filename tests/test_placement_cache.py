"""The placement's caches (issue 47 item 2): transformers' module sizes kept per model and load, each placement
question answered once per panel move or fit(); counted in calls of the expensive functions, never in time."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig

from helpers import GiB, MiB, estimate
from helpers.estimator.fitting import fit_one_card
from helpers.placement import device_map, gpu_room, split_checks
from helpers.placement.decision import REFUSE, decide_placement, devices_snapshot
from helpers.placement.device_map import ModuleSizes, device_map_for, module_sizes, placement_model
from helpers.placement.device_plan import one_move
from helpers.placement.gpu_room import split_plan
from helpers.placement.split_checks import FIXES_NOT_ASKED


def _config(**changes) -> LlamaConfig:
    sizes = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=16000, max_position_embeddings=4096)  # fmt: skip
    return LlamaConfig(**{**sizes, **changes})


@pytest.fixture
def walks(monkeypatch):
    """Counts transformers' compute_module_sizes walks (its signature kept, so the placement still caches)."""
    import transformers.integrations.accelerate as hf

    original, count = hf.compute_module_sizes, [0]

    def counting(model, hf_quantizer=None, buffers_only=False, only_modules=True):
        count[0] += 1
        return original(model, hf_quantizer, buffers_only=buffers_only, only_modules=only_modules)

    monkeypatch.setattr(hf, "compute_module_sizes", counting)
    return count


def _total(config, load="fp16", dtype=torch.float16) -> int:
    return module_sizes(config, load, dtype).of()[0][""]


def test_a_changed_key_is_another_answer():
    base = _total(_config())
    assert _total(_config()) == base  # an equal config (another object): the same answer
    assert _total(_config(num_hidden_layers=17)) > base  # the config's sizes
    assert _total(_config(intermediate_size=1024)) < base
    assert 1.99 * base < _total(_config(), dtype=torch.float32) < 2 * base  # the dtype (fp32 buffers stay fp32)
    assert _total(_config(), load="nf4") < base / 2  # the load mode: 4-bit linears
    assert _total(_config(), load="int8") not in (base, _total(_config(), load="nf4"))
    assert _total(_config(tie_word_embeddings=True)) < base  # tied: the embedding counted once
    config = _config()
    before = _total(config)
    config.num_hidden_layers = 8  # the same object changed in place: its key changed with it
    assert _total(config) < before


def test_changed_skip_modules_are_another_answer(walks):
    """The quantized set (bitsandbytes' skip modules) is part of the answer: another set is sized afresh."""
    meta, quantized = placement_model(_config(), "nf4", torch.float16)
    cached = module_sizes(_config(), "nf4", torch.float16)
    keep = {id(p) for n, p in meta.named_parameters() if n.endswith("mlp.down_proj.weight")}
    other = ModuleSizes(meta, "nf4", quantized - keep)  # the down projections skipped: they stay 16-bit
    assert other.of()[0][""] > cached.of()[0][""]
    caps = {0: 60 * MiB, 1: 60 * MiB}
    device_map_for(meta, "nf4", quantized, caps)  # the first placement walks each module it places, once
    walks[0] = 0
    dm_cached, _ = device_map_for(meta, "nf4", quantized, caps)
    assert walks[0] == 0  # the placement model's own sizes, kept
    dm_other, _ = device_map_for(meta, "nf4", quantized - keep, caps)
    assert walks[0] > 0 and dm_other != dm_cached  # not the cached sizes of the other quantized set


def test_the_cached_sizes_are_transformers_own():
    import transformers.integrations.accelerate as hf

    meta, quantized = placement_model(_config(), "nf4", torch.float16)
    sizes = module_sizes(_config(), "nf4", torch.float16)
    for kwargs in ({}, {"only_modules": False}, {"buffers_only": True}):
        assert sizes.of(**kwargs) == hf.compute_module_sizes(meta, sizes, **kwargs)
    layer = meta.model.layers[3]
    assert sizes.of(layer, buffers_only=True) == hf.compute_module_sizes(layer, sizes, buffers_only=True)


def _panel(tmp_path, devices):
    from helpers.panels.widgets import LoadPanel

    _config().save_pretrained(tmp_path)
    return LoadPanel(str(tmp_path), device=devices, widgets=True, load="fp16", max_new_tokens=16)


def test_a_warm_move_walks_the_modules_at_most_twice(tmp_path, walks):
    """A slider move over two cards re-plans the split and tries fixes (each one transformers' placement); with
    the sizes cached per model and load a warm move walks the modules at most twice (~one walk per placed
    module and plan without the cache: 170 a move on a 405B)."""
    panel = _panel(tmp_path, ["700MiB", "700MiB"])
    assert panel.state.verdict == "does not fit"
    walks[0] = 0
    panel.controls["max_new_tokens"].value = 32
    panel.controls["max_new_tokens"].value = 48
    assert walks[0] <= 2
    walks[0] = 0
    with _uncached():
        panel.controls["max_new_tokens"].value = 64
    assert walks[0] > _config().num_hidden_layers  # the same move with transformers' own walks: the cache matters


@contextlib.contextmanager
def _uncached():
    saved = device_map._sizes_from
    device_map._sizes_from = lambda sizes: contextlib.nullcontext()
    try:
        yield
    finally:
        device_map._sizes_from = saved


def _estimate():
    return estimate(_config(), load="fp16", compute_dtype="fp16", max_new_tokens=64)


def test_one_move_plans_each_question_once_and_never_outlives_it(monkeypatch):
    calls = []
    real = gpu_room.plan_devices
    monkeypatch.setattr(gpu_room, "plan_devices", lambda *a, **k: calls.append(1) or real(*a, **k))
    est, cards = _estimate(), [{"name": "small", "capacity": 800 * MiB, "bf16": False}] * 2
    split_plan(est, cards)
    split_plan(est, cards)
    assert len(calls) == 2  # no scope: asked twice, planned twice
    with one_move():
        a = split_plan(est, cards)
        b = split_plan(est, [dict(c, extra="ignored") for c in cards])  # what the placement reads is the key
        a.notes.append("a caller's note")
        a.shares[0].weights = 0
        assert len(calls) == 3 and b.notes == split_plan(est, cards).notes and b.shares[0].weights > 0
        split_plan(est, cards, ram=GiB, offload=True)  # other arguments: another question
        split_plan(_estimate(), cards)  # another estimate: another question
    assert len(calls) == 5
    split_plan(est, cards)
    assert len(calls) == 6  # the scope closed: its answers went with it


def test_a_decision_without_fixes_says_the_same_where_it_goes(monkeypatch):
    est = _estimate()
    snap = devices_snapshot(est, [{"name": "small", "capacity": 700 * MiB, "bf16": False}] * 2)
    fitted = []
    real = split_checks.fit_one_card
    monkeypatch.setattr(split_checks, "fit_one_card", lambda *a, **k: fitted.append(k) or real(*a, **k))
    full = decide_placement(None, est, snap)
    asked = len(fitted)
    bare = decide_placement(None, est, snap, fixes=False)
    assert full.where == bare.where == REFUSE and (full.verdict, full.reason) == (bare.verdict, bare.reason)
    assert full.fix and full.fix != FIXES_NOT_ASKED and bare.fix == FIXES_NOT_ASKED
    assert len(fitted) - asked < asked  # no re-estimate for the fix


def test_an_offload_of_the_whole_model_names_no_empty_module():
    """Every module on the CPU is the map {"": "cpu"}: the fix names the layers, not an empty "(with )"."""
    from helpers.placement.machine_fit import device_fixes

    (fix,) = device_fixes(_estimate(), ["450MiB"], host_ram=8 * GiB)
    assert "16 of 16 decoder layers to CPU RAM" in fix.change and "(with" not in fix.change


def test_a_hopeless_split_skips_the_fixes_and_says_the_same(tmp_path, monkeypatch):
    """Cards whose memory added up is less than the model's 4-bit weights: no fix of the panel's knobs can fit a
    split, so the estimator's fixes are not asked; the answer is the one trying them all gives."""
    from helpers.panels import widgets

    panel = _panel(tmp_path, ["24MiB", "24MiB"])  # 4-bit: 61 MiB of weights
    fitted = []
    monkeypatch.setattr(widgets, "fit_one_card", lambda *a, **k: fitted.append(1) or fit_one_card(*a, **k))
    panel.controls["max_new_tokens"].value = 32
    skipped = panel.state.fix
    assert not fitted and skipped is not None
    monkeypatch.setattr(type(panel), "_least_weights", lambda self, est: 0)  # every candidate tried
    panel.controls["max_new_tokens"].value = 48
    assert fitted and panel.state.fix == skipped
