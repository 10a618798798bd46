"""Loading on a machine with more than one GPU (Kaggle's 2×T4), simulated with memory readouts: when a
plan stays on GPU 0, when and how it is split, what is refused, and what the load report shows."""

import pytest
import torch

import helpers.loading.loader as loading
import helpers.loading.plan as load_plan
from helpers.core.errors import LoadRefused
from helpers.core.memory import GPUReadout, MemorySnapshot, RAMReadout
from helpers.core.units import GiB, MiB
from helpers.estimator.core import estimate
from helpers.loading.checks import check_plan
from helpers.loading.loader import load
from helpers.loading.plan import LoadPlan
from helpers.placement import gpu_room
from helpers.placement.device_map import PlacementError
from helpers.placement.device_plan import plan_devices, reference_configs

T4_TOTAL = int(14.74 * GiB)
BNB_OK = (True, "bitsandbytes quantizes")


def kaggle(n=2, free=T4_TOTAL - 400 * MiB, ram_avail=11 * GiB, held=0):
    """A Kaggle-like machine: ``n`` T4s with ``free`` bytes each (GPU 0 holding ``held``), and its RAM."""
    gpus = [GPUReadout(i, "Tesla T4", (7, 5), T4_TOTAL, free, held if i == 0 else 0, 0, 0, 0, []) for i in range(n)]
    return MemorySnapshot("cuda", gpus, RAMReadout(int(30 * GiB), ram_avail, GiB, 500 * MiB))


def llama8b(load):
    return estimate("meta-llama/Llama-3.1-8B", load=load, device="t4")


def test_a_model_that_fits_gpu_0_stays_there_and_the_other_gpu_stays_free(tiny_llama):
    checked = check_plan(
        LoadPlan(str(tiny_llama), load="int8"), snapshot=kaggle(), bnb=BNB_OK, estimate=llama8b("int8")
    )
    assert checked.split is None
    assert set(checked.max_memory) == {0, "cpu"}  # transformers alone would spread it over GPU 1 too
    assert checked.notes == [
        "fits on GPU 0 alone: the other GPU stays free (for a second model, or DDP); "
        "LoadPlan(..., gpus=2) splits it across all 2"
    ]
    # one GPU: nothing to say
    assert check_plan(LoadPlan(str(tiny_llama), load="int8"), snapshot=kaggle(n=1), bnb=BNB_OK,
                      estimate=llama8b("int8")).notes == []  # fmt: skip


def test_a_model_too_big_for_one_t4_is_split_card_by_card(tiny_llama):
    est = llama8b("fp16")  # 16 GB of weights: more than a T4, less than two
    with pytest.raises(LoadRefused, match="does not fit the .* free on Tesla T4"):
        check_plan(LoadPlan(str(tiny_llama), load="fp16"), snapshot=kaggle(n=1), bnb=BNB_OK, estimate=est)
    checked = check_plan(LoadPlan(str(tiny_llama), load="fp16"), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    split = checked.split
    assert split is not None and split.fits
    assert [s.device for s in split.gpus] == [0, 1]
    assert [s.layers for s in split.gpus] == [16, 16]
    assert sum(s.weights for s in split.shares) == est.weights  # the same bytes, divided
    assert all(s.total <= s.capacity for s in split.gpus)
    assert checked.max_memory == split.max_memory and set(split.max_memory) == {0, 1}
    assert checked.notes[0].startswith("split: GPU 0 (Tesla T4): layers 0-15, ")
    assert "GPU 1 (Tesla T4): layers 16-31" in checked.notes[0]
    assert any("do not generate faster" in n for n in checked.notes)
    # the map is the one plan_devices computes for these cards (transformers' own placement)
    same = plan_devices(est.source, load="fp16", devices=[{"name": "T4", "capacity": s.capacity, "bf16": False}
                                                         for s in split.gpus])  # fmt: skip
    assert same.device_map == split.device_map


def test_gpus_asks_for_a_split_or_refuses_what_the_machine_lacks(tiny_llama):
    est = estimate("meta-llama/Llama-2-7b-hf", load="nf4", device="t4")
    plan = LoadPlan(str(tiny_llama), load="nf4", gpus=2)
    checked = check_plan(plan, snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    assert checked.split is not None and [s.layers > 0 for s in checked.split.gpus] == [True, True]
    with pytest.raises(LoadRefused, match="asks for 3 GPUs and this machine has 2") as e:
        check_plan(plan.replace(gpus=3), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    assert "gpus=None" in e.value.fix
    one = check_plan(plan.replace(gpus=1), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    assert one.split is None and set(one.max_memory) == {0, "cpu"} and one.notes == []
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="gpus must be a whole number >= 1"):
            LoadPlan("m", gpus=bad)


def test_too_big_for_both_is_refused_with_a_fix_a_t4_can_take(tiny_llama):
    est = llama8b("fp32")  # 32 GB
    with pytest.raises(LoadRefused, match="Llama-3.1-8B as fp32 does not fit split across 2 GPUs") as e:
        check_plan(LoadPlan(str(tiny_llama), load="fp32"), snapshot=kaggle(ram_avail=60 * GiB), bnb=BNB_OK,
                   estimate=est)  # fmt: skip
    assert e.value.fix.startswith("load=fp16") and "bf16" not in e.value.fix  # a T4 has no bf16
    assert "allow_offload=True" in e.value.fix
    checked = check_plan(LoadPlan(str(tiny_llama), load="fp32", allow_offload=True), snapshot=kaggle(ram_avail=60 * GiB),
                         bnb=BNB_OK, estimate=est)  # fmt: skip
    assert checked.split.offloaded("cpu") > 0
    assert any("ms/token" in w for w in checked.warnings)


def test_the_single_gpu_fix_never_suggests_bf16_on_a_t4(tiny_llama):
    with pytest.raises(LoadRefused) as e:
        check_plan(LoadPlan(str(tiny_llama), load="fp32", device_map={"": 0}), snapshot=kaggle(n=1), bnb=BNB_OK,
                   estimate=llama8b("fp32"))  # fmt: skip
    assert "bf16" not in e.value.fix


def test_a_hand_made_device_map_is_checked_on_each_card(tiny_llama):
    est = llama8b("fp16")
    split = check_plan(LoadPlan(str(tiny_llama), load="fp16"), snapshot=kaggle(), bnb=BNB_OK, estimate=est).split
    given = check_plan(LoadPlan(str(tiny_llama), load="fp16", device_map=split.device_map), snapshot=kaggle(),
                       bnb=BNB_OK, estimate=est)  # fmt: skip
    assert [s.total for s in given.split.shares] == [s.total for s in split.shares]
    with pytest.raises(LoadRefused, match="leaves model.embed_tokens.weight out") as e:
        check_plan(LoadPlan(str(tiny_llama), load="fp16", device_map={"model.layers": 0, "lm_head": 1}),
                   snapshot=kaggle(), bnb=BNB_OK, estimate=est)  # fmt: skip
    assert "device_map='auto'" in e.value.fix
    lopsided = {"model": 0, "lm_head": 1}  # everything but the head on GPU 0
    with pytest.raises(LoadRefused, match="device_map does not fit this machine: GPU 0 needs"):
        check_plan(LoadPlan(str(tiny_llama), load="fp16", device_map=lopsided), snapshot=kaggle(free=12 * GiB),
                   bnb=BNB_OK, estimate=est)  # fmt: skip
    with pytest.raises(LoadRefused, match="uses GPU 2 and this machine has 2"):
        check_plan(LoadPlan(str(tiny_llama), load="fp16", device_map={"model": 0, "lm_head": 2}),
                   snapshot=kaggle(), bnb=BNB_OK, estimate=est)  # fmt: skip


def test_a_max_memory_over_several_gpus_is_placed_within_it_and_checked_per_card(tiny_llama):
    est = llama8b("fp16")  # does not fit GPU 0 alone: that alone is no reason to refuse
    plan = LoadPlan(str(tiny_llama), load="fp16", max_memory={0: "13GiB", 1: "13GiB"})
    checked = check_plan(plan, snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    assert checked.split.fits and [s.layers for s in checked.split.gpus] == [16, 16]
    assert checked.max_memory == {0: 13 * GiB, 1: 13 * GiB}  # the caps, as from_pretrained takes them
    # GPU 0 has 5 GiB free: transformers would still put 8 GiB there within these caps
    uneven = kaggle()
    uneven.gpus[0].free = 5 * GiB
    with pytest.raises(LoadRefused, match="within this max_memory, GPU 0 needs") as e:
        check_plan(plan, snapshot=uneven, bnb=BNB_OK, estimate=est)
    assert "max_memory=None" in e.value.fix
    assert check_plan(plan.replace(max_memory=None), snapshot=uneven, bnb=BNB_OK, estimate=est).split.fits
    with pytest.raises(LoadRefused, match="max_memory caps GPU 2 and this machine has 2"):
        check_plan(plan.replace(max_memory={0: "13GiB", 2: "13GiB"}), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    # a CPU machine rehearsing a Kaggle notebook: nothing to place on, nothing refused
    cpu = MemorySnapshot("cpu", [], RAMReadout(int(30 * GiB), 25 * GiB, GiB, 500 * MiB))
    assert check_plan(plan, snapshot=cpu, bnb=BNB_OK, estimate=llama8b("nf4")).split is None


def test_an_offload_larger_than_the_ram_is_refused(tiny_llama):
    est = estimate(reference_configs()["Llama-2-70b"], load="nf4", device="t4")
    plan = LoadPlan(str(tiny_llama), load="nf4", allow_offload=True)
    with pytest.raises(LoadRefused, match="offloaded to CPU RAM exceed the .* offered"):
        check_plan(plan, snapshot=kaggle(ram_avail=28 * GiB), bnb=BNB_OK, estimate=est)


def test_without_a_placement_an_offload_larger_than_the_ram_is_refused(monkeypatch, tiny_llama):
    """The caps transformers splits within (an architecture the meta device cannot build): the weights over
    the cards are counted unquantized in RAM, as the placement counts them. Llama-2-70B nf4 on 2×T4 was let
    through with 28 GiB of RAM (its nf4 overflow fits the 22.4 GiB offload may take; unquantized it does not)."""

    def unplaceable(*args, **kwargs):
        raise PlacementError("cannot build this architecture on the meta device (ValueError: model_type 'x')")

    monkeypatch.setattr(
        gpu_room, "plan_devices", unplaceable
    )  # every split_plan call: the architecture has no placement
    est = estimate(reference_configs()["Llama-2-70b"], load="nf4", device="t4")
    plan = LoadPlan(str(tiny_llama), load="nf4", allow_offload=True)
    with pytest.raises(LoadRefused, match=r"would offload .* of weights to CPU RAM \(offloaded bitsandbytes layers "
                       r"stay unquantized, in fp16\), more than the 22.40 GiB offered"):  # fmt: skip
        check_plan(plan, snapshot=kaggle(ram_avail=28 * GiB), bnb=BNB_OK, estimate=est)
    checked = check_plan(plan, snapshot=kaggle(ram_avail=60 * GiB), bnb=BNB_OK, estimate=est)
    assert checked.max_memory["cpu"] == int(60 * GiB * 0.8)


def test_a_saved_bnb_checkpoint_is_split_over_the_gpus_or_refused_never_offloaded(tiny_llama):
    """A "-bnb-4bit" repo of Llama-2-70B does not fit 2×T4: offload is refused even with allow_offload
    (transformers cannot load it so), and the fix is not allow_offload."""
    import copy

    config = copy.deepcopy(reference_configs()["Llama-2-70b"])
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    est = estimate(config, device="t4")
    for allow in (False, True):
        with pytest.raises(LoadRefused, match="does not fit split across 2 GPUs") as e:
            check_plan(LoadPlan(str(tiny_llama), load="nf4", allow_offload=allow), snapshot=kaggle(ram_avail=100 * GiB),
                       bnb=BNB_OK, estimate=est)  # fmt: skip
        assert "allow_offload" not in e.value.fix and "original (unquantized) checkpoint" in e.value.fix
    assert "cannot be offloaded" in str(e.value)


def test_a_one_card_map_is_checked_on_the_card_it_names(tiny_llama):
    est = estimate("meta-llama/Llama-2-7b-hf", load="nf4", device="t4")
    tight = kaggle()
    tight.gpus[1].free = 2 * GiB
    for device_map in ({"": 1}, "cuda:1", {"": "cuda:1"}, torch.device("cuda", 1)):
        with pytest.raises(LoadRefused, match="does not fit the 2.00 GiB free"):
            check_plan(LoadPlan(str(tiny_llama), load="nf4", device_map=device_map), snapshot=tight, bnb=BNB_OK,
                       estimate=est)  # fmt: skip
    busy = kaggle()
    busy.gpus[0].free = 2 * GiB
    assert check_plan(LoadPlan(str(tiny_llama), load="nf4", device_map={"": 1}), snapshot=busy, bnb=BNB_OK,
                      estimate=est).split is None  # fmt: skip
    with pytest.raises(LoadRefused, match="on GPU 3 and this machine has 2"):
        check_plan(LoadPlan(str(tiny_llama), load="nf4", device_map={"": 3}), snapshot=busy, bnb=BNB_OK, estimate=est)


def test_an_fp32_split_is_laid_out_in_fp32_on_uneven_cards(tiny_llama):
    est = estimate("microsoft/phi-2", load="fp32", device="t4")
    uneven = kaggle()
    uneven.gpus[0].free, uneven.gpus[1].free = int(4.5 * GiB), 9 * GiB
    split = check_plan(LoadPlan(str(tiny_llama), load="fp32"), snapshot=uneven, bnb=BNB_OK, estimate=est).split
    assert split.fits and split.compute_dtype == "fp32"
    assert sum(s.weights for s in split.shares) == est.weights


def test_an_architecture_without_a_placement_is_capped_per_card_not_offloaded(monkeypatch, tiny_llama):
    def unplaceable(*args, **kwargs):
        raise PlacementError("cannot build this architecture on the meta device (ValueError: model_type 'x')")

    monkeypatch.setattr(
        gpu_room, "plan_devices", unplaceable
    )  # every split_plan call: the architecture has no placement
    est = llama8b("fp16")
    checked = check_plan(LoadPlan(str(tiny_llama), load="fp16"), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    assert checked.split is None and set(checked.max_memory) == {0, 1}  # no "cpu": never a silent offload
    assert checked.notes == ["split by transformers within max_memory (cannot build this architecture on the meta "
                             "device: not checked card by card)"]  # fmt: skip
    with pytest.raises(LoadRefused, match="the 2 GPUs have room for"):
        check_plan(LoadPlan(str(tiny_llama), load="fp32"), snapshot=kaggle(), bnb=BNB_OK, estimate=llama8b("fp32"))


def test_the_offload_folder_asked_for_is_the_one_used(tiny_llama):
    est = llama8b("fp32")
    plan = LoadPlan(str(tiny_llama), load="fp32", allow_offload=True, offload_folder="/kaggle/working/offload")
    checked = check_plan(plan, snapshot=kaggle(ram_avail=60 * GiB), bnb=BNB_OK, estimate=est)
    assert checked.split.from_pretrained_kwargs(plan)["offload_folder"] == "/kaggle/working/offload"


def test_the_split_is_what_from_pretrained_gets(tiny_llama, monkeypatch):
    est = llama8b("int8")
    plan = LoadPlan(str(tiny_llama), load="int8", gpus=2, compute_dtype="fp16")  # no GPU here to ask
    checked = check_plan(plan, snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    monkeypatch.setattr(loading, "device_kind", lambda: "cuda")
    monkeypatch.setattr(load_plan, "device_kind", lambda: "cuda")
    kwargs, _ = loading._run_kwargs(plan, checked)
    assert kwargs["device_map"] == checked.split.device_map
    assert kwargs["max_memory"] == checked.split.max_memory
    assert kwargs["quantization_config"].llm_int8_enable_fp32_cpu_offload is False  # nothing spills
    monkeypatch.setattr(loading, "device_kind", lambda: "cpu")
    monkeypatch.setattr(load_plan, "device_kind", lambda: "cpu")
    kwargs, _ = loading._run_kwargs(plan, checked)  # a split planned for a simulated machine loads on the CPU
    assert kwargs["device_map"] is None and "max_memory" not in kwargs


def test_a_split_load_reports_each_device(tiny_llama):
    """The real load path on CPU, planned for a simulated 2×T4: the report shows the planned share of
    each GPU beside what was measured (all on the CPU here)."""
    model, _, report = load(LoadPlan(str(tiny_llama), load="fp32", gpus=2), snapshot=kaggle(), bnb=BNB_OK)
    planned = {s.device: s.weights for s in report.split.shares}
    assert sum(planned.values()) == report.estimated_weights
    rows = {r[0]: r for r in report.placement_rows()}
    assert set(rows) == {"cuda:0", "cuda:1", "cpu"} and rows["cpu"][1] == ""
    text = str(report)
    assert "on cuda:0" in text and "on cuda:1" in text and "note: split: GPU 0 (Tesla T4): layers 0-" in text
    report.notes.append("<img src=x onerror=alert(1)>")
    html = report._repr_html_()
    assert "<img" not in html and "&lt;img" in html and "estimated" in html
    del model


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (Kaggle's 2×T4)")
def test_on_two_real_gpus_the_split_lands_as_planned(tiny_llama):
    model, tok, report = load(LoadPlan(str(tiny_llama), load="fp16", gpus=2))
    rows = {r[0]: r for r in report.placement_rows()}
    assert {"cuda:0", "cuda:1"} <= set(rows)
    planned = {f"cuda:{s.device}": s.weights for s in report.split.gpus}
    for dev, planned_bytes in planned.items():  # within 1 % (a tied embedding split across cards counts twice)
        assert abs(report.placement[dev] - planned_bytes) <= 0.01 * planned_bytes
    ids = tok(["hello"], return_tensors="pt").to("cuda:0")
    assert model.generate(**ids, max_new_tokens=4).shape[1] == ids["input_ids"].shape[1] + 4


def test_one_t4_refuses_what_transformers_placement_would_offload(tiny_llama):
    """Colab's one T4: the estimate of a 13B int8 fits, but the placement from_pretrained computes for the
    card leaves its last layers for the CPU. Refused before loading (never a silent offload); with
    allow_offload the load goes on, warned."""
    est = estimate(reference_configs()["Llama-2-13b"], load="int8", device="t4")
    plan = LoadPlan(str(tiny_llama), load="int8")
    with pytest.raises(LoadRefused, match="placement for it .* leaves .* of weights for CPU RAM") as e:
        check_plan(plan, snapshot=kaggle(n=1), bnb=BNB_OK, estimate=est)
    assert "bitsandbytes 10 % of the card for its buffers" in str(e.value)
    assert e.value.fix.startswith("load='nf4'") and "allow_offload=True" in e.value.fix
    checked = check_plan(plan.replace(allow_offload=True), snapshot=kaggle(n=1), bnb=BNB_OK, estimate=est)
    assert any("much slower" in w for w in checked.warnings)
    # it loads the placement that was checked (the offloaded layers unquantized, as sized), flag included
    assert "cpu" in set(checked.split.device_map.values())
    assert checked.split.quantization_changes == {"llm_int8_enable_fp32_cpu_offload": True}
    # what the placement keeps on the card is not touched
    nf4 = estimate(reference_configs()["Llama-2-13b"], load="nf4", device="t4")
    assert check_plan(plan.replace(load="nf4"), snapshot=kaggle(n=1), bnb=BNB_OK, estimate=nf4).warnings == []


def test_an_allowed_offload_into_too_little_ram_is_refused(tiny_llama):
    est = estimate(reference_configs()["Llama-2-13b"], load="int8", device="t4")
    plan = LoadPlan(str(tiny_llama), load="int8", allow_offload=True)
    with pytest.raises(LoadRefused, match="leaves .* for CPU RAM, and .* do not fit the GPUs and the CPU RAM offered"):
        check_plan(plan, snapshot=kaggle(n=1, ram_avail=int(1.2 * GiB)), bnb=BNB_OK, estimate=est)


def test_an_architecture_without_a_causal_lm_class_is_an_oomkit_answer_not_a_traceback(tiny_llama):
    from transformers import T5Config

    est = estimate(T5Config(), load="fp16", device="t4")
    for n in (1, 2):  # the placement cannot build it: the estimate decides, as before
        assert check_plan(LoadPlan(str(tiny_llama), load="fp16"), snapshot=kaggle(n=n), bnb=BNB_OK, estimate=est)


def test_each_device_map_strategy_is_split_as_transformers_places_it(tiny_llama, monkeypatch):
    """device_map="sequential" / "balanced" / "balanced_low_0" on a 2×T4: placed with that strategy over both
    cards (not checked against GPU 0 alone and refused), and the checked map is what from_pretrained gets."""
    est = llama8b("fp16")  # 16 GB: more than one T4
    plan = LoadPlan(str(tiny_llama), load="fp16")
    auto = check_plan(plan, snapshot=kaggle(), bnb=BNB_OK, estimate=est).split
    balanced = check_plan(plan.replace(device_map="balanced"), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    assert balanced.split.device_map == auto.device_map  # transformers places "auto" as "balanced"
    seq = check_plan(plan.replace(device_map="sequential"), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    layers = [s.layers for s in seq.split.gpus]
    assert seq.split.fits and layers[0] > layers[1] > 0 and sum(layers) == 32  # GPU 0 filled first
    monkeypatch.setattr(loading, "device_kind", lambda: "cuda")
    monkeypatch.setattr(load_plan, "device_kind", lambda: "cuda")
    kwargs, _ = loading._run_kwargs(seq.plan, seq)
    assert kwargs["device_map"] == seq.split.device_map and kwargs["max_memory"] == seq.split.max_memory
    # within caps of the user's, as the repro of the review had it
    capped = check_plan(plan.replace(device_map="sequential", max_memory={0: "13GiB", 1: "13GiB"}),
                        snapshot=kaggle(), bnb=BNB_OK, estimate=est)  # fmt: skip
    assert capped.split.fits and capped.max_memory == {0: 13 * GiB, 1: 13 * GiB}
    # balanced_low_0 leaves GPU 0 only what GPU 1 cannot hold, less the largest layer's reserve: it spills
    with pytest.raises(LoadRefused, match="with device_map='balanced_low_0'") as e:
        check_plan(plan.replace(device_map="balanced_low_0"), snapshot=kaggle(), bnb=BNB_OK, estimate=est)
    assert e.value.fix.startswith("device_map='auto' fits these cards: GPU 0 (Tesla T4): layers 0-15")
    # a model that fits GPU 1 alone: balanced_low_0 keeps GPU 0 (nearly) free, as asked
    low = check_plan(plan.replace(load="nf4", device_map="balanced_low_0"), snapshot=kaggle(), bnb=BNB_OK,
                     estimate=llama8b("nf4")).split  # fmt: skip
    assert low.fits and [s.layers for s in low.gpus] == [0, 32]


def test_a_strategy_on_one_card_is_checked_as_auto(tiny_llama):
    """On one GPU every strategy places alike: the same caps, spill check and offload rules as "auto"."""
    for strategy in ("sequential", "balanced", "balanced_low_0"):
        plan = LoadPlan(str(tiny_llama), load="int8", device_map=strategy)
        checked = check_plan(plan, snapshot=kaggle(n=1), bnb=BNB_OK, estimate=llama8b("int8"))
        assert set(checked.max_memory) == {0, "cpu"}  # room kept for the KV cache, as for "auto"
        offload = plan.replace(load="fp16", allow_offload=True)
        checked = check_plan(offload, snapshot=kaggle(n=1), bnb=BNB_OK, estimate=llama8b("fp16"))
        assert checked.split.offloaded("cpu") > 0 and any("offloaded to CPU RAM" in w for w in checked.warnings)
    # gpus=1 on two cards: GPU 0 alone, whatever the strategy
    one = check_plan(LoadPlan(str(tiny_llama), load="int8", device_map="sequential", gpus=1), snapshot=kaggle(),
                     bnb=BNB_OK, estimate=llama8b("int8"))  # fmt: skip
    assert one.split is None and set(one.max_memory) == {0, "cpu"}


def test_a_device_map_string_that_is_no_strategy_nor_device_is_refused(tiny_llama):
    with pytest.raises(LoadRefused, match="device_map='balance' is neither a placement strategy nor a device") as e:
        check_plan(LoadPlan(str(tiny_llama), load="nf4", device_map="balance"), snapshot=kaggle(), bnb=BNB_OK,
                   estimate=llama8b("nf4"))  # fmt: skip
    assert "'sequential'" in e.value.fix and "'balanced_low_0'" in e.value.fix
    assert check_plan(LoadPlan(str(tiny_llama), load="nf4", device_map="cuda:1"), snapshot=kaggle(), bnb=BNB_OK,
                      estimate=llama8b("nf4")).split is None  # a device is a one-card map  # fmt: skip
