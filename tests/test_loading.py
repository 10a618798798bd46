"""Load plans, pre-load refusals with their messages, and real int8/nf4 loads of the tiny model."""

import copy
import warnings

import httpx2
import pytest
import torch
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import helpers.core.sources as sources
import helpers.loading.checks as load_checks
import helpers.loading.loader as loading
import helpers.loading.plan as load_plan
import helpers.loading.report as load_report
import helpers.placement.decision as placement_decision
from helpers.core.errors import LoadRefused, ModelNotFoundError
from helpers.core.memory import GPUReadout, MemorySnapshot, RAMReadout
from helpers.core.units import GiB, MiB, format_bytes
from helpers.estimator.core import estimate
from helpers.loading.checks import check_plan
from helpers.loading.generation import generate_batched
from helpers.loading.loader import load
from helpers.loading.plan import LoadPlan
from helpers.placement import gpu_room as gpu_split
from helpers.placement.decision import max_memory_for  # fmt: skip
from helpers.placement.device_map import PlacementError
from helpers.placement.device_plan import reference_configs

T4_TOTAL = int(14.74 * GiB)
BNB_OK = (True, "bitsandbytes quantizes")


def machine(gpu=True, free=T4_TOTAL - 400 * MiB, ram_avail=11 * GiB):
    gpus = [GPUReadout(0, "Tesla T4", (7, 5), T4_TOTAL, free, 0, 0, 0, 0, [])] if gpu else []
    return MemorySnapshot("cuda" if gpu else "cpu", gpus, RAMReadout(int(12.7 * GiB), ram_avail, GiB, 500 * MiB))


def hub_error(cls, status):
    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/model")
    return cls(f"{status} error", response=httpx2.Response(status, request=request))


# -- the plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,quant_type", [("nf4", "nf4"), ("fp4", "fp4")])
def test_4bit_kwargs_use_quantization_config_not_deprecated_keywords(mode, quant_type):
    kw = LoadPlan("org/model", load=mode, double_quant=True, compute_dtype="fp16").from_pretrained_kwargs()
    qc = kw["quantization_config"]
    assert isinstance(qc, BitsAndBytesConfig) and qc.load_in_4bit and not qc.load_in_8bit
    assert qc.bnb_4bit_quant_type == quant_type and qc.bnb_4bit_use_double_quant
    assert qc.bnb_4bit_compute_dtype == torch.float16 and kw["dtype"] == torch.float16
    assert not {"load_in_8bit", "load_in_4bit", "torch_dtype"} & set(kw)
    assert kw["device_map"] == "auto" and kw["attn_implementation"] == "sdpa" and kw["trust_remote_code"] is False


@pytest.mark.parametrize("mode", ["int8", "nf4", "fp4"])
def test_device_map_auto_never_asks_bitsandbytes_to_offload(mode, monkeypatch):
    """Under device_map="auto" llm_int8_enable_fp32_cpu_offload would keep the layers transformers offloads
    quantized in RAM (it keeps them unquantized only along a dict map), where accelerate's offload hook
    cannot run 4-bit ones. An offload the checks accept loads their map instead, which sets the flag."""
    monkeypatch.setattr(load_plan, "device_kind", lambda: "cuda")
    config = LoadPlan("org/model", load=mode, compute_dtype="fp16", allow_offload=True).quantization_config()
    assert config.llm_int8_enable_fp32_cpu_offload is False
    # a device map of your own that names the CPU is transformers' documented offload: the flag goes with it
    own = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": 0, "lm_head": 0}
    mapped = LoadPlan("org/model", load=mode, compute_dtype="fp16", device_map=own).quantization_config()
    assert mapped.llm_int8_enable_fp32_cpu_offload is True
    one_card = LoadPlan("org/model", load=mode, compute_dtype="fp16", device_map={"": 0}).quantization_config()
    assert one_card.llm_int8_enable_fp32_cpu_offload is False


def test_int8_and_half_precision_kwargs():
    kw = LoadPlan("org/model", load="int8").from_pretrained_kwargs()
    assert kw["quantization_config"].load_in_8bit and "load_in_8bit" not in kw
    kw = LoadPlan("org/model", load="bf16", max_memory={0: GiB}, offload_folder="off").from_pretrained_kwargs()
    assert "quantization_config" not in kw and kw["dtype"] == torch.bfloat16
    assert kw["max_memory"] == {0: GiB} and kw["offload_folder"] == "off"


def test_auto_compute_dtype_follows_the_device(monkeypatch):
    assert LoadPlan("m", load="nf4").resolved_compute_dtype("cpu") == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert load_plan.auto_compute_dtype("cuda") == "fp16"  # T4: no bf16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert load_plan.auto_compute_dtype("cuda") == "bf16"
    assert LoadPlan("m", load="fp16").resolved_compute_dtype("cuda") == "fp16"


def test_bad_plan_values_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"use nf4 \(4-bit, QLoRA\), fp4, int8, or fp16/bf16/fp32, or .auto."):
        LoadPlan("m", load="int4")
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number >= 0"):
        LoadPlan("m", max_new_tokens=-1)
    with pytest.raises(ValueError, match="batch_size"):
        LoadPlan("m", batch_size=0)


def test_typical_plan_and_call_mistakes_say_what_to_pass(tiny_llama):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=r"'int4' \(4-bit is 'nf4' or 'fp4'\)"):
        LoadPlan("m", load="int4")
    with pytest.raises(ValueError, match="model must be a hub id.*got None"):
        LoadPlan(None)
    with pytest.raises(TypeError, match=r"unknown LoadPlan field\(s\) lod; did you mean load= for lod=\?"):
        load(str(tiny_llama), lod="fp32")
    with pytest.raises(TypeError, match="did you mean max_new_tokens="):
        LoadPlan("m").replace(max_new_token=64)
    with pytest.raises(TypeError, match=r"load\(\) takes a LoadPlan or a model id/path, got int"):
        load(123)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(TypeError, match=r"got one string \('hello'\): pass \[prompt\]"):
        generate_batched(object(), tok, "hello")
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1, got 0"):
        generate_batched(object(), tok, ["hello"], batch_size=0)
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number >= 1, got '8'"):
        generate_batched(object(), tok, ["hello"], max_new_tokens="8")
    with pytest.raises(TypeError, match="pass the model first"):
        generate_batched(tok, object(), ["hello"])


def test_token_is_never_shown():
    plan = LoadPlan("org/model", token="hf_SECRETsecret")
    assert "hf_SECRET" not in repr(plan) and "hf_SECRET" not in str(plan)


# -- real loads ------------------------------------------------------------------------------


@pytest.mark.bnb
@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_load_reports_measured_within_1_percent_of_estimated_weights(tiny_llama, mode):
    model, tok, report = load(LoadPlan(str(tiny_llama), load=mode, max_new_tokens=16, prompt_tokens=32))
    assert report.measured_weights > 0
    assert abs(report.weights_error) <= 1.0, str(report)
    assert report.estimated_weights == report.estimate.weights
    assert sum(report.placement.values()) > 0 and report.load_seconds > 0
    assert "weights" in str(report) and "estimated" in report._repr_html_()
    # table titles stay on one line where the column has room (a narrow table would otherwise wrap "where the
    # weights went"): the table is at least as wide as its title, at most as wide as the column
    html = report._repr_html_()
    assert html.count(">where the weights went</caption>") == 1 and "style='min-width:min(100%,23ch)'>" in html
    # quantized for real: bitsandbytes layers, not fp32 linears
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == ("Linear8bitLt" if mode == "int8" else "Linear4bit")
    # tokenizer ready for batched generation
    assert tok.pad_token is not None and tok.padding_side == "left"
    outs = generate_batched(
        model, tok, ["hello", "the memory of a small GPU is"], max_new_tokens=4, batch_size=2, progress=False
    )
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)


def test_load_accepts_a_path_and_field_changes(tiny_qwen2):
    model, tok, report = load(str(tiny_qwen2), load="fp32", max_new_tokens=8)
    assert report.plan.load == "fp32" and abs(report.weights_error) <= 1.0  # tied embeddings counted once
    assert next(model.parameters()).dtype == torch.float32


# -- bad input -------------------------------------------------------------------------------


def test_missing_model_path_names_it(tmp_path):
    missing = tmp_path / "models" / "codellama-gis"
    with pytest.raises(ModelNotFoundError, match="Model file not found") as e:
        load(LoadPlan(str(missing), load="fp32"))
    assert str(missing) in str(e.value) and isinstance(e.value, FileNotFoundError)
    assert e.value.fix


def test_missing_path_on_colab_says_drive_is_not_mounted(monkeypatch):
    monkeypatch.setattr(sources, "in_colab", lambda: True)
    path = "/content/drive/MyDrive/adapters/gis-lora"
    with pytest.raises(ModelNotFoundError, match="Google Drive is not mounted") as e:
        check_plan(LoadPlan("/content/drive/MyDrive/models/codellama", load="fp32"), snapshot=machine(False))
    assert "drive.mount('/content/drive')" in str(e.value)
    with pytest.raises(ModelNotFoundError, match="Adapter file not found: " + path):
        loading.check_adapter(path)


def test_missing_adapter_dir_is_refused_before_loading(tiny_llama, tmp_path):
    plan = LoadPlan(str(tiny_llama), load="fp32", adapter=str(tmp_path / "lora-out"))
    with pytest.raises(ModelNotFoundError, match="Adapter file not found") as e:
        load(plan)
    assert str(tmp_path / "lora-out") in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no adapter_config.json"):
        load(plan.replace(adapter=str(tmp_path / "empty")))


def test_folder_without_config_is_not_a_model(tmp_path):
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ModelNotFoundError, match="has no config.json.*weights.txt"):
        load(LoadPlan(str(tmp_path), load="fp32"))


def test_unknown_model_id_offline_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="offline") as e:
        load(LoadPlan("nobody-xyz/no-such-model-123", load="fp32"))
    assert "not in the Hugging Face cache" in str(e.value) and "local directory" in e.value.fix


def test_unknown_model_id_online(monkeypatch):
    monkeypatch.setattr(load_checks, "hub_offline_reason", lambda: None)

    def missing(model, token):
        raise hub_error(RepositoryNotFoundError, 404)

    monkeypatch.setattr(load_checks, "_hub_access", missing)
    with pytest.raises(ModelNotFoundError, match="Unknown model id 'nobody-xyz/no-such-model'") as e:
        load(LoadPlan("nobody-xyz/no-such-model", load="fp32"))
    assert "spelling" in e.value.fix


@pytest.mark.parametrize("token", [None, "hf_SECRETsecret"])
def test_gated_model_explains_hf_token_and_never_prints_it(monkeypatch, token):
    monkeypatch.setattr(load_checks, "hub_offline_reason", lambda: None)
    monkeypatch.setattr(load_checks, "find_token", lambda: None)

    def gated(model, tok):
        raise hub_error(GatedRepoError, 403)

    monkeypatch.setattr(load_checks, "_hub_access", gated)
    with pytest.raises(LoadRefused, match="meta-llama/Llama-2-7b-hf is a gated model") as e:
        load(LoadPlan("meta-llama/Llama-2-7b-hf", load="nf4", token=token))
    msg = str(e.value)
    assert "HF_TOKEN" in msg and "Colab" in msg
    assert ("no Hugging Face token" in msg) == (token is None)
    assert "hf_SECRET" not in msg


def test_bitsandbytes_missing_gives_the_install_line(tiny_llama, monkeypatch):
    real = load_checks.importlib.util.find_spec
    monkeypatch.setattr(load_checks.importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n))
    with pytest.raises(LoadRefused, match="needs bitsandbytes, which is not installed") as e:
        load(LoadPlan(str(tiny_llama), load="nf4"))
    assert "pip install -U bitsandbytes" in str(e.value)
    load(LoadPlan(str(tiny_llama), load="fp32", max_new_tokens=4))  # fp32 does not need it


def test_quantized_load_where_bitsandbytes_cannot_run(tiny_llama):
    why = "bitsandbytes cannot run on mps: no kernel image is available"
    with pytest.raises(LoadRefused, match="int8 \\(8-bit\\) loading needs bitsandbytes, but it cannot run here") as e:
        load(LoadPlan(str(tiny_llama), load="int8"), bnb=(False, why))
    assert why in str(e.value) and "fp16" in e.value.fix and "T4 GPU" in e.value.fix


def test_plan_that_does_not_fit_the_gpu_is_refused_with_the_top_fix(tiny_llama):
    big = estimate("mistralai/Mistral-7B-v0.1", load="fp32", device="t4", max_new_tokens=2048, batch_size=4)
    plan = LoadPlan(str(tiny_llama), load="fp16", device_map={"": 0})
    with pytest.raises(LoadRefused, match="does not fit the .* free on Tesla T4") as e:
        check_plan(plan, snapshot=machine(), bnb=BNB_OK, estimate=big)
    assert e.value.fix.startswith(("load=", "max_new_tokens=", "batch_size=", "prompt_tokens=", "a smaller"))
    assert "saves" in e.value.fix
    # device_map="auto" could offload, but not into 2 GiB of RAM
    with pytest.raises(LoadRefused, match="does not fit the .* of RAM available either"):
        check_plan(plan.replace(device_map="auto"), snapshot=machine(ram_avail=2 * GiB), bnb=BNB_OK, estimate=big)
    # offloading weights does not shrink the KV cache
    huge_cache = big.replace(max_new_tokens=4096, batch_size=64)
    with pytest.raises(LoadRefused, match="KV cache, activations and overheads alone .* offloading weights cannot"):
        check_plan(
            plan.replace(device_map="auto"), snapshot=machine(ram_avail=60 * GiB), bnb=BNB_OK, estimate=huge_cache
        )
    # with enough RAM it would offload: never silently; with allow_offload=True it loads, warned
    with pytest.raises(LoadRefused, match="would offload about .* to CPU RAM") as e:
        check_plan(plan.replace(device_map="auto"), snapshot=machine(ram_avail=60 * GiB), bnb=BNB_OK, estimate=big)
    assert "allow_offload=True" in e.value.fix
    checked = check_plan(
        plan.replace(device_map="auto", allow_offload=True), snapshot=machine(ram_avail=60 * GiB), bnb=BNB_OK,
        estimate=big,
    )  # fmt: skip
    assert any("offloaded" in w and "slower" in w for w in checked.warnings)


def test_memory_held_by_an_earlier_model_is_named_instead_of_a_silent_offload(tiny_llama):
    est = estimate("Llama-2-7b-hf", load="nf4", device="t4")
    held = machine(free=2 * GiB)
    held.gpus[0].allocated = 12 * GiB  # an earlier cell's model still on the card
    with pytest.raises(LoadRefused, match="already holds 12.00 GiB on the GPU.*unload\\(model\\) first"):
        check_plan(LoadPlan(str(tiny_llama), load="nf4"), snapshot=held, bnb=BNB_OK, estimate=est)


# -- what offloading puts into RAM, and checkpoints that cannot be offloaded -------------------


def test_one_card_offload_is_sized_as_bitsandbytes_leaves_it_unquantized(tiny_llama, monkeypatch):
    """Colab's T4 with 4 GiB free and 11 GiB of RAM. Llama-2-13B nf4 is 3.52 GiB over the card at nf4 width,
    but the layers that go to the CPU stay unquantized: 16.26 GiB, more than the 8.80 GiB offload may take
    (the kernel would die). The figure is the split's (placement per module), refused even with allow_offload."""
    snap = machine(free=4 * GiB)
    est = estimate(reference_configs()["Llama-2-13b"], load="nf4", device="t4")
    room = gpu_split.gpu_room(est, snap.gpu)
    placed = gpu_split.split_plan(est, [gpu_split.gpu_device(snap.gpu, room)], ram=gpu_split.offload_ram(snap),
                                  offload=True)  # fmt: skip
    assert format_bytes(est.total - room) == "3.52 GiB"  # what was compared with the RAM before
    assert format_bytes(placed.offloaded("cpu")) == "16.26 GiB"
    plan = LoadPlan(str(tiny_llama), load="nf4", allow_offload=True)
    with pytest.raises(LoadRefused, match=r"and the 16\.26 GiB of weights that would be offloaded \(offloaded "
                       r"bitsandbytes layers stay unquantized, in fp16\) do not fit the 11\.00 GiB of RAM available "
                       r"either \(offload may take 8\.80 GiB\)"):  # fmt: skip
        check_plan(plan, snapshot=snap, bnb=BNB_OK, estimate=est)
    # what fits the RAM is allowed, and the warning says what RAM will hold: Mistral-7B int8, 3.14 GiB over
    est = estimate("mistralai/Mistral-7B-v0.1", load="int8", device="t4")
    checked = check_plan(plan.replace(load="int8"), snapshot=snap, bnb=BNB_OK, estimate=est)
    (warning,) = checked.warnings
    assert warning.startswith("about 7.96 GiB of weights will be offloaded to CPU RAM"), warning
    # ...and it loads the map that was sized: along a dict map transformers keeps those layers unquantized
    monkeypatch.setattr(loading, "device_kind", lambda: "cuda")
    monkeypatch.setattr(load_plan, "device_kind", lambda: "cuda")
    kwargs, _ = loading._run_kwargs(plan.replace(load="int8", compute_dtype="fp16"), checked)
    assert kwargs["device_map"] == checked.split.device_map and "cpu" in set(kwargs["device_map"].values())
    assert kwargs["quantization_config"].llm_int8_enable_fp32_cpu_offload is True
    assert kwargs["max_memory"] == checked.split.max_memory


def test_without_a_placement_bitsandbytes_is_not_offloaded_and_fp16_is_counted(tiny_llama, monkeypatch):
    """An architecture the meta device cannot build: no checked map for bitsandbytes layers to be offloaded
    along (transformers' 'auto' would keep them quantized in RAM, where 4-bit ones cannot run): refused. An
    fp16 load offloads through transformers' own placement, its overflow compared with the RAM."""

    def unplaceable(*args, **kwargs):
        raise PlacementError("cannot build this architecture on the meta device")

    monkeypatch.setattr(placement_decision, "split_plan", unplaceable)
    snap = machine(free=4 * GiB)
    est = estimate(reference_configs()["Llama-2-13b"], load="nf4", device="t4")
    with pytest.raises(LoadRefused, match="placement cannot be built"):
        check_plan(LoadPlan(str(tiny_llama), load="nf4", allow_offload=True), snapshot=snap, bnb=BNB_OK, estimate=est)
    est = estimate("mistralai/Mistral-7B-v0.1", load="fp16", device="t4")
    overflow = est.total - gpu_split.gpu_room(est, machine(free=8 * GiB).gpu)
    plan = LoadPlan(str(tiny_llama), load="fp16", allow_offload=True)
    checked = check_plan(plan, snapshot=machine(free=8 * GiB), bnb=BNB_OK, estimate=est)
    assert checked.split is None and checked.warnings[0].startswith(f"about {format_bytes(overflow)} of weights")


BNB_NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
           "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "float16"}  # fmt: skip


def saved_bnb(name: str, quantization_config: dict):
    """A reference model's config as a "-bnb-4bit" repo ships it: its quantization_config decides the load."""
    config = copy.deepcopy(reference_configs()[name])
    config.quantization_config = dict(quantization_config)
    return config


def test_a_saved_bnb_checkpoint_that_would_offload_is_refused_even_with_allow_offload(tiny_llama):
    """transformers cannot offload part of a checkpoint that bitsandbytes saved (see the test below): oomkit
    refuses before loading whatever the plan allows, and never offers allow_offload as the fix."""
    est = estimate(saved_bnb("Llama-2-13b", BNB_NF4), device="t4")
    assert est.quantized_by == "bitsandbytes" and est.load == "nf4"
    plan = LoadPlan(str(tiny_llama), load="nf4")
    for allow in (False, True):
        with pytest.raises(LoadRefused, match="does not fit the 4.00 GiB free on Tesla T4, and a checkpoint saved "
                           "quantized by bitsandbytes cannot be offloaded") as e:  # fmt: skip
            check_plan(plan.replace(allow_offload=allow), snapshot=machine(free=4 * GiB), bnb=BNB_OK, estimate=est)
        assert "allow_offload" not in e.value.fix and "original (unquantized) checkpoint with load='nf4'" in e.value.fix
    # the estimate fits a whole T4, but transformers' placement leaves the last layers of a 13B int8 for the CPU
    int8 = estimate(saved_bnb("Llama-2-13b", {"quant_method": "bitsandbytes", "load_in_8bit": True}), device="t4")
    with pytest.raises(LoadRefused, match="leaves .* for CPU RAM, and a checkpoint saved quantized by bitsandbytes "
                       "cannot be offloaded") as e:  # fmt: skip
        check_plan(plan.replace(load="int8", allow_offload=True), snapshot=machine(), bnb=BNB_OK, estimate=int8)
    assert e.value.fix.startswith("a smaller batch or max_new_tokens; or load the original")
    # a hand-made map with a CPU or disk entry is refused before anything else is checked
    with pytest.raises(LoadRefused, match="the device_map puts part of .* on disk, and a checkpoint saved"):
        check_plan(plan.replace(device_map={"model": 0, "lm_head": "disk"}), snapshot=machine(), bnb=BNB_OK,
                   estimate=est)  # fmt: skip


@pytest.fixture(scope="module")
def saved_nf4(tiny_models, tmp_path_factory):
    """The tiny Llama saved after an nf4 load: a "-bnb-4bit" folder, as Unsloth and others publish them."""
    path = tmp_path_factory.mktemp("tiny-llama-bnb-4bit")
    model, tok, _ = load(LoadPlan(str(tiny_models["llama"]), load="nf4", double_quant=False))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def offloading_map(layers: int, first: str = "disk") -> dict:
    """A device map of the tiny Llama with layer 0 on ``first`` and the rest on the CPU (a CPU machine's offload)."""
    return {"model.embed_tokens": "cpu", **{f"model.layers.{i}": first if i == 0 else "cpu" for i in range(layers)},
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip


@pytest.mark.bnb
def test_what_from_pretrained_gets_for_a_saved_bnb_checkpoint(saved_nf4, tmp_path, monkeypatch):
    """Its own quantization_config loads it (none passed beside it); a map that offloads part of it is
    refused before from_pretrained is called (transformers would refuse it, or load what cannot run)."""
    plan = LoadPlan(str(saved_nf4), load="nf4", double_quant=False)
    kwargs, _ = loading._run_kwargs(plan, check_plan(plan, snapshot=machine(gpu=False), bnb=BNB_OK))
    assert "quantization_config" not in kwargs and "config" not in kwargs
    calls = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    offloading = plan.replace(device_map=offloading_map(4), offload_folder=str(tmp_path), allow_offload=True)
    for check in (True, False):  # not a risk to accept: a load that cannot work
        with pytest.raises(LoadRefused, match="the device_map puts part of .* on cpu and disk, and a checkpoint "
                           "saved quantized by bitsandbytes cannot be offloaded") as e:  # fmt: skip
            load(offloading, check=check)
        assert "load='nf4'" in e.value.fix
    assert calls == []
    model, _, report = load(plan)  # all on the CPU: no offload, loads
    assert len(calls) == 1 and "quantization_config" not in calls[0] and set(report.placement) == {"cpu"}


@pytest.mark.bnb
def test_transformers_own_offload_of_a_saved_bnb_checkpoint_is_an_oomkit_refusal(saved_nf4, tmp_path):
    """device_map="auto" with a CPU share in max_memory: when transformers' placement offloads after all
    (the checks predicted it would not), its ValueError comes back as LoadRefused with the fix."""
    est = estimate(str(saved_nf4), device="current")
    kwargs = {"device_map": "auto", "max_memory": {"cpu": 300 * 1024}, "offload_folder": str(tmp_path)}
    with pytest.raises(LoadRefused, match="transformers' placement put part of .* on the CPU or disk, and a "
                       "checkpoint saved quantized by bitsandbytes cannot be offloaded"):  # fmt: skip
        loading._from_pretrained(str(saved_nf4), kwargs, est)


@pytest.mark.bnb
def test_transformers_cannot_offload_a_saved_bnb_checkpoint_even_with_the_flag(saved_nf4, tmp_path):
    """Why load() refuses instead of passing llm_int8_enable_fp32_cpu_offload=True: a BitsAndBytesConfig passed
    beside the checkpoint's own is ignored (transformers warns, then refuses the offload), and the flag set in
    the checkpoint's own config builds the offloaded layers as plain nn.Linear, which the saved 4-bit weights
    do not fit (5.23: a size mismatch while loading; 5.1: the first forward fails). If this test fails,
    transformers has learnt to do it: pass the flag instead of refusing (placement.PREQUANTIZED_OFFLOAD)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(saved_nf4)
    dm = offloading_map(config.num_hidden_layers)
    flag = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", llm_int8_enable_fp32_cpu_offload=True)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="llm_int8_enable_fp32_cpu"):
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(saved_nf4, device_map=dm, offload_folder=str(tmp_path / "a"),
                                             quantization_config=flag)  # fmt: skip
    assert any("`quantization_config` from the model will be used" in str(w.message) for w in caught)
    config.quantization_config["llm_int8_enable_fp32_cpu_offload"] = True
    with pytest.raises((RuntimeError, ValueError), match="size|shape"):
        model = AutoModelForCausalLM.from_pretrained(saved_nf4, config=config, device_map=dm,
                                                     offload_folder=str(tmp_path / "b"))  # fmt: skip
        model(torch.tensor([[1, 2, 3]]))


def test_cpu_only_plan_larger_than_ram_is_refused(tiny_llama):
    big = estimate("mistralai/Mistral-7B-v0.1", load="fp32", device="cpu")
    with pytest.raises(LoadRefused, match="RAM available: the process would be killed"):
        check_plan(LoadPlan(str(tiny_llama), load="fp32"), snapshot=machine(gpu=False), bnb=BNB_OK, estimate=big)


def test_weight_file_larger_than_ram_is_refused_before_the_kernel_dies(tiny_llama):
    with pytest.raises(LoadRefused, match="the kernel would die while loading"):
        check_plan(LoadPlan(str(tiny_llama), load="fp32"), snapshot=machine(gpu=False, ram_avail=64 * 1024), bnb=BNB_OK)


def test_max_memory_keeps_room_for_the_kv_cache():
    est = estimate("mistralai/Mistral-7B-v0.1", load="nf4", compute_dtype="fp16", device="t4", max_new_tokens=1024)
    snap = machine()
    mm = max_memory_for(est, snap)
    context = est.row("overhead.cuda_context").bytes  # already paid when free memory was read
    runtime = est.total - est.weights
    assert mm[0] == snap.gpu.free + context - runtime - placement_decision.GPU_MARGIN
    assert mm[0] == snap.gpu.free - (runtime - context) - placement_decision.GPU_MARGIN  # KV cache etc. still get room
    assert mm["cpu"] == int(11 * GiB * 0.8)
    assert max_memory_for(est, machine(gpu=False)) is None


def test_offload_warnings_say_how_slow():
    (cpu,) = load_report.offload_warnings({"cuda:0": 10 * GiB, "cpu": 2 * GiB})
    assert "2.00 GiB" in cpu and "ms per token" in cpu and "Quantize" in cpu
    (disk,) = load_report.offload_warnings({"cuda:0": 10 * GiB, "disk": 3 * GiB})
    assert "s per generated token" in disk
    assert load_report.offload_warnings({"cuda:0": GiB}) == []


def test_placement_sums_modules_per_device():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    model.hf_device_map = {"0": 0, "1": "cpu"}
    assert loading.placement(model) == {"cuda:0": (16 + 4) * 4, "cpu": 16 * 4}
    del model.hf_device_map
    assert loading.placement(model) == {"cpu": 36 * 4}


def test_tokenizer_setup_for_batched_generation(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.padding_side = "right"
    tok.pad_token = None
    note = loading.setup_tokenizer(tok)
    assert tok.pad_token == tok.eos_token and tok.padding_side == "left"
    assert "pad token" in note and "left padding" in note


def test_importing_helpers_quiets_only_bitsandbytes_optional_cpu_kernel_line():
    """The 'pip install kernels' line bitsandbytes logs on some CPUs is dropped; its other warnings are not."""
    import logging
    import subprocess
    import sys

    import helpers  # noqa: F401 - installs the filter

    out = subprocess.run(
        [sys.executable, "-c", "import helpers, bitsandbytes"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kernels-community" not in out.stderr
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    keep = logging.LogRecord(log.name, logging.WARNING, __file__, 1, "something else went wrong", None, None)
    drop = logging.LogRecord(
        log.name,
        logging.WARNING,
        __file__,
        1,
        "Failed to load CPU gemm_4bit_forward from kernels-community: %s",
        ("x",),
        None,
    )
    assert log.filter(keep) and not log.filter(drop)


@pytest.mark.bnb
def test_a_4bit_model_keeps_the_measured_layout_after_generating(tiny_llama):
    """Generation on CPU must not repack the 4-bit weights (bf16 absmax, nested state expanded):
    the footprint after generating is still the one measured at load and estimated."""
    from helpers.estimator.footprint import footprint

    model, tok, report = load(LoadPlan(str(tiny_llama), load="nf4", double_quant=True), check=False)
    assert footprint(model) == report.measured_weights
    enc = tok(["where is the river"], return_tensors="pt")
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert footprint(model) == report.measured_weights == report.estimated_weights


@pytest.mark.bnb
@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_auto_compute_dtype_means_the_same_in_estimate_and_load(tiny_llama, mode):
    from helpers.estimator.footprint import footprint

    predicted = estimate(str(tiny_llama), load=mode, device="current").weights  # plain "auto", as the panel asks
    model, _, _ = load(LoadPlan(str(tiny_llama), load=mode))
    assert abs(footprint(model) - predicted) <= 0.01 * predicted, (footprint(model), predicted)


def test_loading_a_safetensors_shard_holds_less_process_memory_than_the_shard(tmp_path):
    """The measurement behind the RAM check: anonymous memory (what the kernel cannot drop) while a
    single-shard fp16 checkpoint loads, sampled in a fresh process."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import threading, time, torch
        from transformers import AutoModelForCausalLM, LlamaConfig
        cfg = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                          vocab_size=16000)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).save_pretrained({str(tmp_path)!r})
        def anon():
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))
        import gc; gc.collect()
        base, peak, stop = anon(), [0], []
        def watch():
            while not stop:
                peak[0] = max(peak[0], anon()); time.sleep(0.001)
        t = threading.Thread(target=watch); t.start()
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, dtype=torch.float16)
        stop.append(1); t.join()
        print(peak[0] - base)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    shard = max(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert int(out.stdout.split()[-1]) < shard, (int(out.stdout.split()[-1]), shard)


@pytest.mark.bnb
@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_placement_and_footprint_count_the_quantization_state_before_and_after_a_generation(tiny_llama, mode):
    """The report's per-device placement sums to the measured weights (the scales and absmax were left
    out), and footprint() still counts int8's SCB after the first forward moves it to the layer's state."""
    from helpers import footprint, generate_batched
    from helpers.loading.report import placement

    model, tok, report = load(LoadPlan(str(tiny_llama), load=mode))
    assert sum(placement(model).values()) == report.measured_weights == footprint(model)
    generate_batched(model, tok, ["memory"], max_new_tokens=2, progress=False)
    assert footprint(model) == report.measured_weights


def test_load_auto_means_what_estimate_auto_means(fake_gpus, tmp_path):
    """Issue 31: LoadPlan(load="auto") raised ValueError although estimate(load="auto") exists."""
    from helpers.estimator.core import estimate as estimate_memory

    fake_gpus(1, 12 * 2**30)  # a 12 GiB card: a 7B does not fit in fp16, so "auto" is nf4
    plan = LoadPlan("Llama-2-7b-hf", load="auto")
    assert plan.load == "nf4" == estimate_memory("Llama-2-7b-hf", load="auto", device="current").load
    fake_gpus(1, 40 * 2**30)  # room for fp16: "auto" is the GPU's 16-bit dtype, as the estimator says
    assert LoadPlan("Llama-2-7b-hf", load="auto").load == "fp16"
    with pytest.raises(ValueError, match=r"load='auto' .*needs the config of .*Or pass load= one of"):
        LoadPlan(str(tmp_path / "missing"), load="auto")
