"""plan_devices: the device map transformers/accelerate compute, per-device bytes, bitsandbytes' rules."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import GiB, estimate
from helpers.core.devices import DeviceError, resolve_devices
from helpers.core.sources import shipped_configs
from helpers.core.vocab import torch_dtype
from helpers.estimator.configs import resolve_config
from helpers.placement.device_map import PlacementError, placement_model
from helpers.placement.device_plan import plan_devices, reference_configs
from helpers.placement.fits import fits_table

# a pre-quantized config (gpt-oss mxfp4, Qwen3 fp8) loads only as saved: no fp16 or nf4 plan
SHIPPED = sorted(m for m, path in shipped_configs().items() if "quantization_config" not in path.read_text())


HEADROOM = GiB  # bytes every fake GPU keeps for the runtime


def _split_capacity(model: str, load: str) -> int:
    """A fake GPU that holds about 3/4 of the model's weights (at least 1.5x its largest tensor) plus the headroom."""
    w = estimate(model, load=load, compute_dtype="fp16").weights
    config, _, _ = resolve_config(model)
    largest = max(p.numel() * 2 for p in placement_model(config, load, torch.float16)[0].parameters())
    return int(max(w * 0.75, largest * 1.5)) + HEADROOM


def _accelerate_map(plan, model: str):
    """accelerate.utils.infer_auto_device_map on the same meta model, quantized sizes and max_memory."""
    from accelerate.utils import CustomDtype, infer_auto_device_map

    config, _, _ = resolve_config(model)
    meta, quantized = placement_model(config, plan.load, torch_dtype(plan.compute_dtype))
    target = torch.int8 if plan.load == "int8" else CustomDtype.INT4
    special = {n: target for n, p in meta.named_parameters() if id(p) in quantized} or None
    no_split = list(meta._no_split_modules)
    return dict(infer_auto_device_map(meta, max_memory=dict(plan.placed_max_memory),
                                      no_split_module_classes=no_split, special_dtypes=special))  # fmt: skip


@pytest.mark.parametrize("model", SHIPPED)
@pytest.mark.parametrize("load", ["fp16", "nf4"])
def test_plan_matches_accelerate_and_sums_to_the_estimate(model, load):
    cap = _split_capacity(model, load)
    plan = plan_devices(model, load=load, devices={0: cap, 1: cap}, compute_dtype="fp16",
                        headroom=HEADROOM)  # fmt: skip
    assert plan.device_map == _accelerate_map(plan, model)
    assert sum(s.weights for s in plan.shares) == estimate(model, load=load, compute_dtype="fp16").weights
    assert plan.fits, plan.reasons
    assert {0, 1} <= set(plan.device_map.values()), "fake capacities this small must split the model"


def _transformers_map(model: str, load: str, strategy: str, max_memory: dict) -> dict:
    """transformers' own path: its quantizer swaps the linears on the meta model, then _get_device_map."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.integrations.accelerate import _get_device_map
    from transformers.quantizers.auto import get_hf_quantizer

    qc = {"int8": BitsAndBytesConfig(load_in_8bit=True), "nf4": BitsAndBytesConfig(load_in_4bit=True)}.get(load)
    config, _, _ = resolve_config(model)
    hq, config, _ = get_hf_quantizer(copy.deepcopy(config), qc, "auto", True, {})
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    if hq is not None:
        hq.preprocess_model(
            model=meta, dtype=torch.float16, device_map="auto", checkpoint_files=None, use_kernels=False
        )
        hq.validate_environment = lambda **kw: None  # the map is compared even where bitsandbytes would refuse it
    return dict(_get_device_map(meta, strategy, dict(max_memory), hq))


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
@pytest.mark.parametrize("load", ["fp16", "int8", "nf4"])
@pytest.mark.parametrize("model", ["meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-0.5B"])
def test_plan_is_the_map_from_pretrained_computes(model, load, strategy):
    pytest.importorskip("transformers.integrations.accelerate")
    cap = _split_capacity(model, load)
    plan = plan_devices(model, load=load, devices=[cap, cap], compute_dtype="fp16", headroom=HEADROOM,
                        strategy=strategy)  # fmt: skip
    assert plan.device_map == _transformers_map(model, load, strategy, plan.max_memory)


@pytest.mark.parametrize("load, margin", [("fp16", 1.0), ("int8", 0.9), ("nf4", 0.9)])
def test_bitsandbytes_margin_comes_with_a_quantizer_also_on_explicit_max_memory(load, margin, monkeypatch):
    """What infer_auto_device_map gets inside transformers' _get_device_map, given the explicit one-card
    max_memory load() passes: bitsandbytes' quantizer (adjust_max_memory) takes 10 % of every cap for int8 and
    4-bit, explicit or not; fp16 has no quantizer and no margin (get_balanced_memory's own 90 % is only for a
    max_memory left unset). The plan places with the very caps transformers ends up with."""
    pytest.importorskip("transformers.integrations.accelerate")
    import transformers.integrations.accelerate as tia

    seen: dict = {}
    real = tia.infer_auto_device_map

    def spy(model, max_memory=None, **kwargs):
        seen.update(max_memory)
        return real(model, max_memory=max_memory, **kwargs)

    monkeypatch.setattr(tia, "infer_auto_device_map", spy)
    model = "Qwen/Qwen2.5-0.5B"
    plan = plan_devices(model, load=load, devices=[GiB], compute_dtype="fp16", headroom=0, cpu_offload=True,
                        cpu_memory=4 * GiB)  # fmt: skip
    assert plan.max_memory == {0: GiB, "cpu": 4 * GiB}
    _transformers_map(model, load, "auto", plan.max_memory)
    assert seen == {0: GiB * margin, "cpu": 4 * GiB * margin}
    assert plan.placed_max_memory == seen


def test_sequential_lowers_the_card_it_fills_until_its_kv_cache_fits():
    """The automatic caps keep each card half the KV cache free; "sequential" stacks 3/4 of the layers on
    GPU 0, whose cache then overflows it: its cap is lowered until it fits, and the map is still
    transformers' own for the caps from_pretrained gets."""
    pytest.importorskip("transformers.integrations.accelerate")
    model = "meta-llama/Llama-2-7b-hf"
    kw = dict(load="fp16", devices="kaggle-2xt4", batch_size=4, prompt_tokens=2048, max_new_tokens=512)
    plan = plan_devices(model, strategy="sequential", **kw)
    assert plan.fits, plan.reasons
    assert plan.max_memory[0] < plan.max_memory[1] == plan_devices(model, **kw).max_memory[1]
    assert plan.gpus[0].layers > plan.gpus[1].layers  # still GPU 0 first
    assert plan.device_map == _transformers_map(model, "fp16", "sequential", plan.max_memory)
    # caps of your own are left as they are: the card is refused, not re-capped
    mm = {0: plan_devices(model, **kw).max_memory[0], 1: plan.max_memory[1]}
    mine = plan_devices(model, strategy="sequential", max_memory=mm, **kw)
    assert not mine.fits and mine.reasons[0].startswith("GPU 0 needs")
    with pytest.raises(PlacementError, match="unknown strategy 'balance'; use one of auto, balanced"):
        plan_devices(model, strategy="balance", **kw)


def test_kv_cache_follows_the_layers_and_sums_to_the_estimate():
    model = "meta-llama/Llama-2-7b-hf"
    plan = plan_devices(model, load="fp16", devices="kaggle-2xt4")
    est = estimate(model, load="fp16")
    assert sum(s.layers for s in plan.gpus) == 32
    assert sum(s.kv_cache for s in plan.gpus) == est.group_bytes("kv_cache")
    assert plan.fits and len(plan.crossings) == 1
    assert set(plan.max_memory) == {0, 1} and plan.from_pretrained_kwargs()["device_map"] == plan.device_map


def test_a_smaller_kv_cache_leaves_the_cards_more_room_as_the_estimate_prices_it():
    model = "meta-llama/Llama-2-7b-hf"
    plain = plan_devices(model, load="fp16", devices="kaggle-2xt4", max_new_tokens=4096)
    fp8 = plan_devices(model, load="fp16", devices="kaggle-2xt4", max_new_tokens=4096, kv_cache="fp8")
    est = estimate(model, load="fp16", max_new_tokens=4096, kv_cache="fp8")
    assert sum(s.kv_cache for s in fp8.gpus) == est.group_bytes("kv_cache")
    assert sum(s.kv_cache for s in fp8.gpus) < sum(s.kv_cache for s in plain.gpus)
    assert max(s.total for s in fp8.gpus) < max(s.total for s in plain.gpus)


def test_overflow_without_offload_is_refused_with_a_fix():
    plan = plan_devices("meta-llama/Llama-2-7b-hf", load="fp16", devices=["t4"], max_new_tokens=4096)
    assert not plan.fits and "do not fit" in plan.reasons[0]
    assert "int8" in plan.fixes[0] and "cpu_offload=True" in plan.fixes[0]


def test_int8_cpu_offload_sets_the_bitsandbytes_flag():
    plan = plan_devices("meta-llama/Llama-2-7b-hf", load="int8", devices=["t4"], cpu_offload=True,
                        cpu_memory=20 * GiB, headroom=9 * GiB)  # fmt: skip
    assert plan.fits, plan.reasons
    assert plan.offloaded("cpu") > 0 and "ms/token" in plan.slowdown
    assert plan.quantization_changes == {"llm_int8_enable_fp32_cpu_offload": True}


def test_4bit_disk_offload_is_refused():
    plan = plan_devices(reference_configs()["Llama-2-70b"], load="nf4", devices="kaggle-2xt4", cpu_offload=True,
                        disk_offload=True, cpu_memory=4 * GiB)  # fmt: skip
    assert plan.offloaded("disk") > 0
    assert any("cannot be offloaded to disk" in r for r in plan.reasons)
    assert "<b>refused</b>" in plan._repr_html_()


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans this machine's GPUs")
def test_no_gpu_plans_everything_on_the_cpu(tiny_llama):
    plan = plan_devices(str(tiny_llama), load="fp32", devices="current", cpu_memory=GiB)
    assert plan.device_map == {"": "cpu"} and plan.fits and plan.offloaded("cpu") == plan.weights


def test_resolve_devices():
    assert [d["capacity"] for _, d in resolve_devices("kaggle-2xt4")] == [15_828_320_256] * 2
    assert len(resolve_devices(["t4", "l4"])) == 2
    assert resolve_devices({0: 2 * GiB, 1: 3 * GiB})[1][1]["capacity"] == 3 * GiB
    with pytest.raises(DeviceError, match="keyed 0, 1"):
        resolve_devices({1: 2 * GiB})
    with pytest.raises(DeviceError, match="list GPUs only"):
        resolve_devices(["t4", "cpu"])
    with pytest.raises(PlacementError):
        plan_devices("meta-llama/Llama-2-7b-hf", load="int4", devices="t4")


def test_fits_table_knows_the_classics():
    table = fits_table(loads=("nf4", "fp16"), machines={"T4": ["t4"], "2×T4": "kaggle-2xt4"})
    assert table.cell("Llama-2-13b", "nf4", "T4").startswith("fits")
    assert table.cell("Llama-2-13b", "fp16", "T4") == "does not fit"
    assert table.cell("Llama-2-13b", "fp16", "2×T4").startswith("fits")
    assert table.cell("Llama-2-70b", "nf4", "2×T4") == "does not fit"
    assert "| 13b | nf4 |" in table.markdown() and "<table" in table._repr_html_()


def test_supported_kwargs_drops_what_an_older_signature_lacks():
    """transformers 5.1's copy of infer_auto_device_map has no no_placement_params; newer ones do."""
    from helpers.core.compat import supported_kwargs

    def old(model, max_memory=None):
        return None

    def new(model, max_memory=None, no_placement_params=None):
        return None

    def open_ended(model, **kwargs):
        return None

    assert supported_kwargs(old, no_placement_params=["x"]) == {}
    assert supported_kwargs(new, no_placement_params=["x"]) == {"no_placement_params": ["x"]}
    assert supported_kwargs(open_ended, no_placement_params=None) == {"no_placement_params": None}


def test_an_offloaded_groups_quantization_is_decided_once_not_per_layer(monkeypatch):
    """Each offloaded device-map key used to be a skip pattern: transformers' rule then ran one regex per module
    per key (a 1,024-layer nf4 fit() took 120 s). Counted in patterns tried, the work now grows with the modules."""
    import transformers.quantizers.quantizers_utils as qu

    from helpers.estimator import layout as layout_module
    from helpers.placement.device_plan import plan_devices

    real, tried = qu.should_convert_module, [0]

    def counting(name, patterns=None):
        tried[0] += len(patterns or ())
        return real(name, patterns)

    monkeypatch.setattr(qu, "should_convert_module", counting)
    layout_module._should_convert.cache_clear()
    from transformers import LlamaConfig

    from helpers.core.sources import shipped_config

    wide = json.loads(shipped_config("meta-llama/Llama-3.1-8B").read_text())
    wide.update(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64)
    config = LlamaConfig(**{k: v for k, v in wide.items() if k != "architectures"})  # a 70B's shape
    plan = plan_devices(config, load="int8", devices="t4", cpu_offload=True, cpu_memory=60 * 2**30)
    layout_module._should_convert.cache_clear()
    offloaded = [k for k, v in plan.device_map.items() if v == "cpu"]
    assert len(offloaded) > 40  # the case this is about: most layers on the CPU
    modules = 80 * 7 + 1  # the linears and lm_head, each asked about with a pattern or two
    assert tried[0] <= 4 * modules, (tried[0], len(offloaded))
