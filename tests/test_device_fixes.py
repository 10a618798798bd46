"""fit()'s fixes past one card (issue 33): split over a machine's GPUs, or offload decoder layers to CPU RAM.

Llama-3.1-8B in fp16 (15.5 GiB) does not fit a T4 (14.74 GiB). On one T4 it gets "offload N layers to CPU
RAM"; on Kaggle's 2×T4 (or a T4 with ``gpus=2``) it gets "use both GPUs"; each is what plan_devices places.
"""

import re

import pytest

from helpers import fit
from helpers.core.devices import DEVICES, OFFLOAD_RAM_SHARE
from helpers.core.units import GiB
from helpers.estimator import fitting
from helpers.estimator.core import estimate
from helpers.estimator.fitting import DeviceSuggestion
from helpers.estimator.reducers import HOST_RAM
from helpers.estimator.rows import EstimateError
from helpers.estimator.training import LoraTraining
from helpers.placement import machine_fit as device_fixes_module
from helpers.placement.device_plan import plan_devices

LLAMA3 = "meta-llama/Llama-3.1-8B"


@pytest.fixture(scope="module")
def fp16():
    return estimate(LLAMA3, load="fp16", device="t4")


@pytest.fixture(scope="module")
def one_t4(fp16):
    return fit(fp16, "t4")


@pytest.fixture(scope="module")
def kaggle(fp16):
    return fit(fp16, "kaggle-2xt4")


def device_fixes(verdict, kind=None):
    return [s for s in verdict.suggestions if isinstance(s, DeviceSuggestion) and kind in (None, s.kind)]


def position(verdict, change):
    return next(i for i, s in enumerate(verdict.suggestions) if s.change == change)


def test_on_one_t4_llama3_8b_fp16_gets_an_offload_fix_with_a_plausible_layer_count(one_t4):
    assert one_t4.verdict == "does not fit"
    (off,) = device_fixes(one_t4)
    assert off.kind == "offload"
    n = int(re.search(r"offload (\d+) of 32 decoder layers", off.change).group(1))
    # 15.5 GiB of weights on a 14.74 GiB card that keeps room for its KV cache and context: a few layers go
    assert 1 <= n <= 8
    assert off.kwargs == {"device_map": "auto", "allow_offload": True}
    assert "LoadPlan(..., allow_offload=True)" in off.change
    # the per-token cost: the offloaded bytes cross PCIe every token, at the package's stated bandwidth
    assert "cross PCIe every token" in off.cost and "ms/token at 8.00 GiB/s" in off.cost
    assert off.plan.fits and off.total <= DEVICES["t4"]["capacity"]
    cpu = next(s for s in off.plan.shares if s.device == "cpu")
    assert cpu.layers == n and off.saving == one_t4.estimate.total - off.total
    assert not device_fixes(one_t4, "split")  # one card: nothing to split over


def test_the_offload_is_plan_devices_answer_for_colabs_ram(one_t4):
    """One home: the fix renders plan_devices' placement (Colab's RAM for a preset), it computes none itself."""
    (off,) = device_fixes(one_t4)
    plan = plan_devices(LLAMA3, load="fp16", devices="t4", cpu_offload=True,
                        cpu_memory=int(HOST_RAM * OFFLOAD_RAM_SHARE))  # fmt: skip
    assert off.plan.device_map == plan.device_map
    assert [s.total for s in off.plan.shares] == [s.total for s in plan.shares]


def test_kaggle_2xt4_fits_split_with_layers_and_gib_per_card(kaggle, fp16):
    """On a machine the verdict is where load() puts the model: split over both cards, each about half full."""
    assert kaggle.device == "kaggle-2xt4" and kaggle.verdict == "fits" and not kaggle.suggestions
    assert "layers 0-15" in kaggle.where and "layers 16-31" in kaggle.where
    assert kaggle.used < 0.6 * kaggle.capacity < kaggle.estimate.total  # about 8 GiB on each 14.74 GiB card
    (split,) = device_fixes_module.device_fixes(fp16, ["t4", "t4"])  # the split, as a fix, for the panel's alternative
    assert split.kind == "split" and split.kwargs == {"device_map": "auto", "gpus": 2}
    assert split.change.startswith("use both GPUs: LoadPlan(..., gpus=2)")
    assert "no speedup" in split.cost and "one after the other" in split.cost
    plan = plan_devices(LLAMA3, load="fp16", devices="kaggle-2xt4")
    assert plan.fits and split.plan.device_map == plan.device_map


def test_a_t4_with_gpus_2_is_planned_as_two_t4s(fp16, kaggle):
    two = fit(fp16, "t4", gpus=2)
    assert two.device == "2x t4" and two.verdict == kaggle.verdict and two.where == kaggle.where
    one = fit(fp16, "kaggle-2xt4", gpus=1)  # one card of the two: its own verdict, no split
    assert one.verdict == "does not fit" and not device_fixes(one, "split")


def test_same_card_fixes_rank_every_fit_before_the_offload(one_t4):
    # the offload: after every fix that fits at full speed, before those that do not fit
    off = position(one_t4, device_fixes(one_t4)[0].change)
    assert all(s.verdict_on(one_t4.capacity) == "fits" for s in one_t4.suggestions[:off])
    assert all(s.verdict_on(one_t4.capacity) != "fits" for s in one_t4.suggestions[off + 1 :])
    assert off > position(one_t4, "load=nf4")


@pytest.mark.parametrize("device", ["t4", "kaggle-2xt4"])
def test_a_model_that_fits_one_t4_gets_neither(device):
    v = fit(estimate(LLAMA3, load="nf4", device="t4"), device)
    assert v.verdict == "fits" and not v.suggestions


def test_str_and_html_show_each_device_fix(one_t4, kaggle):
    (fix,) = device_fixes(one_t4)
    assert fix.change in str(one_t4) and fix.where in str(one_t4) and fix.cost in str(one_t4)
    html = one_t4._repr_html_()
    assert "device_map=&#x27;auto&#x27;" in html and "decoder layers" in html
    row = next(s for s in one_t4.to_dict()["suggestions"] if s.get("kind") == fix.kind)
    assert row["where"] == fix.where and row["total"] == fix.total
    assert kaggle.where in str(kaggle) and "layers 16-31" in kaggle._repr_html_()
    assert kaggle.to_dict()["where"] == kaggle.where and kaggle.to_dict()["used"] == kaggle.used


def test_html_escapes_a_described_gpus_name(fp16):
    card = {"name": "<b>T4</b>", "capacity": DEVICES["t4"]["capacity"], "bf16": False}
    v = fit(fp16, [card, card])
    assert v.verdict == "fits" and "<b>T4</b>" in v.where
    html = v._repr_html_()
    assert "<b>T4</b>" not in html and "&lt;b&gt;T4&lt;/b&gt;" in html


def test_a_budget_in_bytes_gets_no_device_fix(fp16):
    """A byte count is a budget some caller computed (free memory, cards added up), not a machine."""
    assert not device_fixes(fit(fp16, 15 * GiB))


def test_training_gets_no_device_fix():
    est = estimate(LLAMA3, load="fp16", device="t4", training=LoraTraining())
    v = fit(est, "kaggle-2xt4")
    assert v.verdict == "does not fit" and v.suggestions and not device_fixes(v)


def test_no_offload_when_the_ram_cannot_hold_the_layers(fp16):
    assert device_fixes_module.device_fixes(fp16, ["t4"], host_ram=GiB) == []
    (off,) = device_fixes_module.device_fixes(fp16, ["t4"], host_ram=HOST_RAM)
    assert off.kind == "offload"


def test_gpus_is_checked(fp16):
    for bad in (0, -1, True, 1.5):
        with pytest.raises(EstimateError, match="gpus"):
            fit(fp16, "t4", gpus=bad)
    with pytest.raises(EstimateError, match="gpus=3"):
        fit(fp16, "kaggle-2xt4", gpus=3)


def test_this_machine_with_two_gpus_gets_the_split(fp16, monkeypatch):
    """ "current" on a machine with two T4s (faked: this machine has none): the split over both."""
    t4 = {"name": "Tesla T4", "capacity": DEVICES["t4"]["capacity"], "bf16": False}
    real = fitting.resolve_device
    monkeypatch.setattr(fitting, "resolve_devices", lambda d: [("0: Tesla T4", t4), ("1: Tesla T4", t4)])
    monkeypatch.setattr(fitting, "resolve_device", lambda d: ("Tesla T4", t4) if d == "current" else real(d))
    v = fit(fp16, "current")
    assert v.device == "this machine (2 GPUs)" and v.verdict == "fits" and "layers 16-31" in v.where


def test_the_cli_takes_a_machine_and_prints_the_split(capsys):
    from helpers.cli import estimate_main

    assert estimate_main([LLAMA3, "--load", "fp16", "--device", "kaggle-2xt4"]) == 0  # split over both: it fits
    out = capsys.readouterr().out
    assert "on the fullest GPU of kaggle-2xt4" in out and "split over 2 GPUs" in out and "layers 16-31" in out
