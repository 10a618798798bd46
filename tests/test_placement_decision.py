"""The one placement decision (helpers.placement.decision): where a model goes on simulated machines (one T4,
Kaggle's 2×T4, a CPU runtime), and that load(), the load panel and preflight each show that answer."""

import copy
import types

import pytest

import helpers.panels.widgets as widgets_mod
from helpers.core.devices import DEVICE_SETS, DEVICES, GPU_MARGIN
from helpers.core.errors import LoadRefused
from helpers.core.memory import GPUReadout, MemorySnapshot, RAMReadout
from helpers.core.units import GiB, MiB
from helpers.core.vocab import DOES_NOT_FIT, FITS, TIGHT
from helpers.environment import preflight
from helpers.estimator.core import estimate
from helpers.loading.checks import check_plan
from helpers.loading.plan import LoadPlan
from helpers.placement.decision import (
    ALONE,
    OFFLOAD,
    REFUSE,
    SPLIT,
    auto_placing,
    decide_placement,
    devices_snapshot,
    spill_fix,
    spill_why,
)
from helpers.placement.device_plan import PREQUANTIZED_OFFLOAD_FIX, reference_configs

T4 = {**DEVICES["t4"], "name": "Tesla T4"}
RAM = 20 * GiB
BNB_OK = (True, "bitsandbytes quantizes")


def decide(model, load, n=1, ram=RAM, est_kw=None, **placing):
    """The decision for ``model`` as ``load`` on ``n`` whole T4s and ``ram`` bytes of RAM to offload to."""
    est = estimate(model, load=load, device="t4", **(est_kw or {}))
    return decide_placement(auto_placing(**placing), est, devices_snapshot(est, [T4] * n, ram))


def llama13b():
    return reference_configs()["Llama-2-13b"]


def saved_bnb_70b():
    config = copy.deepcopy(reference_configs()["Llama-2-70b"])
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    return config


def test_a_readout_of_devices_gives_each_card_its_capacity_as_room():
    from helpers.placement.gpu_room import gpu_room

    est = estimate("mistralai/Mistral-7B-v0.1", load="nf4", device="t4")
    snap = devices_snapshot(est, [T4, {"name": "A100", "capacity": 40 * GiB, "bf16": True}], ram=3 * GiB)
    assert [gpu_room(est, g) for g in snap.gpus] == [T4["capacity"], 40 * GiB]
    assert [g.supports_bf16 for g in snap.gpus] == [False, True] and snap.ram.available == 3 * GiB


def test_a_model_that_fits_one_gpu_with_room_stays_on_it():
    d = decide("mistralai/Mistral-7B-v0.1", "nf4")
    assert (d.where, d.verdict, d.first_verdict, d.gpus) == (ALONE, FITS, FITS, 1)
    assert d.plan is None and d.spill == 0 and d.offloaded == 0 and not d.refused and d.reason == d.fix == ""
    assert set(d.max_memory) == {0, "cpu"} and d.max_memory["cpu"] == int(RAM * 0.8)  # room kept for the KV cache
    runtime = d.estimate.total - d.estimate.weights  # KV cache, activations, context: kept off the weights' cap
    assert d.max_memory[0] == T4["capacity"] - runtime - GPU_MARGIN
    two = decide("mistralai/Mistral-7B-v0.1", "nf4", n=2)
    assert two.where == ALONE and two.gpus == 1
    assert two.notes == ["fits on GPU 0 alone: the other GPU stays free (for a second model, or DDP); "
                         "LoadPlan(..., gpus=2) splits it across all 2"]  # fmt: skip
    assert str(two).startswith("fits on GPU 0 alone\nfits on GPU 0 alone: the other GPU stays free")


def test_a_tight_plan_stays_on_one_card_and_is_split_where_there_are_two():
    one = decide("mistralai/Mistral-7B-v0.1", "fp16")
    assert (one.where, one.verdict, one.plan) == (ALONE, TIGHT, None)
    two = decide("mistralai/Mistral-7B-v0.1", "fp16", n=2)
    assert (two.where, two.verdict, two.first_verdict, two.gpus) == (SPLIT, FITS, TIGHT, 2)
    assert [s.layers for s in two.plan.gpus] == [16, 16] and two.plan.offloaded("cpu") == 0
    assert two.max_memory == two.plan.max_memory and set(two.max_memory) == {0, 1}
    assert two.notes[0].startswith("split: GPU 0 (Tesla T4): layers 0-15, ")
    # gpus=1 keeps it on GPU 0 even so; gpus=2 splits what would fit one card with room
    assert decide("mistralai/Mistral-7B-v0.1", "fp16", n=2, gpus=1).where == ALONE
    assert decide("mistralai/Mistral-7B-v0.1", "nf4", n=2, gpus=2).where == SPLIT


def test_a_split_over_kaggles_two_t4s_from_the_device_set():
    """Llama-3.1-8B fp16 (16 GB of weights): more than one T4, less than two: split card by card."""
    est = estimate("meta-llama/Llama-3.1-8B", load="fp16", device="t4")
    devices = [{**DEVICES[name], "name": name} for name in DEVICE_SETS["kaggle-2xt4"]]
    d = decide_placement(None, est, devices_snapshot(est, devices))
    assert (d.where, d.first_verdict, d.gpus) == (SPLIT, DOES_NOT_FIT, 2)
    assert sum(s.weights for s in d.plan.shares) == est.weights and all(s.total <= s.capacity for s in d.plan.gpus)
    assert any("do not generate faster" in n for n in d.notes)
    refused = decide_placement(None, est, devices_snapshot(est, devices[:1], RAM))
    assert refused.where == REFUSE and refused.first_verdict == DOES_NOT_FIT
    assert refused.fix.endswith("; or accept the slowdown: LoadPlan(..., allow_offload=True)")
    assert refused.reason.startswith("the estimate (") and "would offload about" in refused.reason


def test_a_fit_that_transformers_placement_spills_to_the_cpu_is_refused_offloaded_or_split():
    """Llama-2-13B int8: the estimate fits a T4; transformers' placement for the card (bitsandbytes' 10 %
    margin, accelerate's largest-layer reserve) leaves 1.49 GiB of weights for the CPU."""
    d = decide(llama13b(), "int8")
    assert d.where == REFUSE and d.first_verdict == TIGHT and d.spill == d.plan.offloaded("cpu") > GiB
    assert d.why == spill_why(d.estimate) and "bitsandbytes 10 %" in d.why and d.why in d.reason
    assert d.fix == "load='nf4', or a smaller batch or max_new_tokens; or accept the slowdown: " \
                    "LoadPlan(..., allow_offload=True)"  # fmt: skip
    offloaded = decide(llama13b(), "int8", allow_offload=True)
    assert offloaded.where == OFFLOAD and offloaded.offloaded == d.spill and offloaded.plan.offloaded("cpu") == d.spill
    assert offloaded.warnings[0].endswith("generation will be much slower. Better: " + spill_fix(d.estimate))
    no_ram = decide(llama13b(), "int8", ram=0, allow_offload=True)
    assert no_ram.where == REFUSE and no_ram.fix == spill_fix(d.estimate)  # nowhere to offload to: not offered
    split = decide(llama13b(), "int8", n=2)
    assert split.where == SPLIT and split.plan.offloaded("cpu") == 0 and all(s.layers for s in split.plan.gpus)


def test_an_unquantized_spill_is_not_blamed_on_bitsandbytes():
    d = decide("codellama/CodeLlama-7b-hf", "fp16", est_kw={"batch_size": 4})
    assert d.where == REFUSE and d.spill > 0
    assert "bitsandbytes" not in d.reason and "accelerate for the largest layer" in d.reason
    assert "bitsandbytes 10 %" in spill_why(d.estimate.replace(load="nf4"))


def test_a_checkpoint_saved_quantized_is_never_offloaded_nor_told_to_change_its_load_mode():
    for allow in (False, True):
        d = decide(saved_bnb_70b(), "nf4", n=2, ram=100 * GiB, allow_offload=allow)
        assert d.where == REFUSE and "does not fit split across 2 GPUs" in d.reason and d.plan is not None
        assert "allow_offload" not in d.fix and PREQUANTIZED_OFFLOAD_FIX in d.fix
        one = decide(saved_bnb_70b(), "nf4", ram=100 * GiB, allow_offload=allow)
        assert one.where == REFUSE and "cannot be offloaded" in one.reason and PREQUANTIZED_OFFLOAD_FIX in one.fix
    fresh = types.SimpleNamespace(load="int8", quantized_by=None)
    saved = types.SimpleNamespace(load="nf4", quantized_by="bitsandbytes")
    assert spill_fix(fresh) == "load='nf4', or a smaller batch or max_new_tokens"
    assert spill_fix(saved) == f"a smaller batch or max_new_tokens; or {PREQUANTIZED_OFFLOAD_FIX}"


def test_a_refusal_has_the_reason_and_the_fix_and_raises_them():
    d = decide(reference_configs()["Llama-2-70b"], "nf4", n=2)
    assert d.where == REFUSE and d.verdict == DOES_NOT_FIT and d.gpus == 2
    assert d.reason.startswith("meta-llama/Llama-2-70b-hf as nf4 does not fit split across 2 GPUs")
    assert d.fix.startswith("a smaller model: ") and d.fix.endswith("LoadPlan(..., allow_offload=True)")
    assert not d.plan.fits and d.plan.reasons[0] in d.reason
    with pytest.raises(LoadRefused) as e:
        d.raise_refusal()
    assert (e.value.reason, e.value.fix) == (d.reason, d.fix)
    assert str(d) == f"refused: {d.reason}\nfix: {d.fix}"
    d.reason = "<script>x</script>"
    assert "<script>" not in d._repr_html_() and "&lt;script&gt;" in d._repr_html_()
    too_many = decide("mistralai/Mistral-7B-v0.1", "nf4", n=2, gpus=3)
    assert too_many.where == REFUSE and too_many.reason == "the plan asks for 3 GPUs and this machine has 2"
    bad_map = decide("mistralai/Mistral-7B-v0.1", "nf4", device_map="balance")
    assert bad_map.where == REFUSE and "neither a placement strategy nor a device" in bad_map.reason


def test_without_a_gpu_ram_decides():
    est = estimate("mistralai/Mistral-7B-v0.1", load="fp32", device="t4")
    snap = MemorySnapshot("cpu", [], RAMReadout(64 * GiB, 40 * GiB, 0, 0))
    d = decide_placement(None, est, snap)
    assert (d.where, d.gpus, d.plan, d.max_memory) == (ALONE, 0, None, None) and str(d).startswith("fits in RAM")
    snap.ram.available = 8 * GiB
    d = decide_placement(None, est, snap)
    assert d.where == REFUSE and "of RAM available: the process would be killed" in d.reason and d.fix


# ----------------------------------------------------------------------------- each renderer shows the answer


def _t4_machine(n=1):
    total = int(14.74 * GiB)
    gpus = [GPUReadout(i, "Tesla T4", (7, 5), total, total - 400 * MiB, 0, 0, 0, 0, []) for i in range(n)]
    return MemorySnapshot("cuda", gpus, RAMReadout(30 * GiB, 11 * GiB, GiB, 500 * MiB))


def test_load_raises_or_loads_the_decision(tiny_llama):
    est = estimate(llama13b(), load="int8", device="t4")
    plan = LoadPlan(str(tiny_llama), load="int8")
    d = decide_placement(plan, est, _t4_machine())
    with pytest.raises(LoadRefused) as e:
        check_plan(plan, snapshot=_t4_machine(), bnb=BNB_OK, estimate=est)
    assert (e.value.reason, e.value.fix) == (d.reason, d.fix)
    checked = check_plan(plan, snapshot=_t4_machine(2), bnb=BNB_OK, estimate=est)
    assert checked.decision.where == SPLIT and checked.split is checked.decision.plan
    assert checked.max_memory == checked.decision.max_memory and checked.notes == checked.decision.notes


def test_the_panel_shows_the_decision():
    panel = widgets_mod.LoadPanel("mistralai/Mistral-7B-v0.1", device="kaggle-2xt4", load="fp16")
    decided = panel.decision_for(panel.plan, panel.state.estimate)
    assert decided.where == SPLIT and panel.placement is decided.plan and panel.state.verdict == decided.verdict
    panel.set(load="nf4")
    assert panel.decision_for(panel.plan, panel.state.estimate).where == ALONE and panel.placement is None
    spill = widgets_mod.LoadPanel(str(_saved(llama13b())), device="t4", load="int8")
    d = spill.decision_for(spill.plan, spill.state.estimate, ["t4"])
    assert spill.state.verdict == DOES_NOT_FIT and d.spill > 0
    assert (spill.state.alternative.spill, spill.state.alternative.fix, spill.state.alternative.why) == (
        d.spill, d.fix, d.why)  # fmt: skip


def _saved(config):
    import tempfile

    folder = tempfile.mkdtemp(prefix="oomkit-13b-")
    config.save_pretrained(folder)
    return folder


def test_preflight_shows_the_decision():
    folder = _saved(llama13b())
    report = preflight(folder, snapshot=_t4_machine(), package_versions={}, bnb=(True, "ok"), colab=True,
                       checkpoint=(13 * GiB, 10 * GiB, "local"), load="int8")  # fmt: skip
    fit = report.check("fit")
    est = estimate(folder, load="int8", device=T4["capacity"], compute_dtype="fp16")
    caps = [int(14.74 * GiB) - 400 * MiB]
    d = decide_placement(None, est, devices_snapshot(est, [{**T4, "capacity": caps[0]}], int(11 * GiB * 0.8)))
    assert fit.status == "fail" and fit.data["placement_spill"] is True and d.spill > 0
    assert fit.fix.startswith(d.fix + "; or Kaggle's free 2×T4 holds it with load='int8'")
    assert f"but {d.why} would offload part of it to the CPU: load() refuses it" in fit.summary
