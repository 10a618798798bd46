"""The estimator: exact weight layout per load mode (against real loaded tiny models), GQA, tied
embeddings, KV cache arithmetic, fit verdicts and fixes, preflight, CLI, bad input."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import helpers.estimator.layout as E
from helpers.cli import estimate_main
from helpers.core.devices import DEVICES, DeviceError, resolve_device
from helpers.core.sources import shipped_configs
from helpers.core.units import GiB, MiB
from helpers.environment import fit_checks
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card as fit
from helpers.estimator.fitting import max_batch_that_fits, max_new_tokens_that_fit
from helpers.estimator.footprint import footprint
from helpers.estimator.layout import kv_cache_bytes
from helpers.estimator.rows import EstimateError
from helpers.estimator.training import FullTraining, LoraTraining

QUANT = {"int8": dict(load_in_8bit=True)}
for _qt in ("nf4", "fp4"):
    for _dq in (False, True):
        QUANT[f"{_qt}{'+dq' if _dq else ''}"] = dict(load_in_4bit=True, bnb_4bit_quant_type=_qt,
                                                     bnb_4bit_use_double_quant=_dq,
                                                     bnb_4bit_compute_dtype=torch.float16)  # fmt: skip


def _load(path, mode):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    if mode in ("fp32", "fp16", "bf16"):
        return AutoModelForCausalLM.from_pretrained(
            path, dtype={"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[mode]
        )
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float16, quantization_config=BitsAndBytesConfig(**QUANT[mode])
    )


@pytest.mark.parametrize(
    "mode",
    [
        "fp32",
        "fp16",
        "bf16",
        *(pytest.param(m, marks=pytest.mark.bnb) for m in ["int8", "nf4", "nf4+dq", "fp4", "fp4+dq"]),
    ],
)
def test_predicted_weights_equal_real_loaded_bytes(tiny_llama, tiny_qwen2, mode):
    for path in (tiny_llama, tiny_qwen2):
        model = _load(path, mode)
        load = mode.split("+")[0]
        est = estimate(
            path,
            load=load,
            double_quant=mode.endswith("+dq"),
            compute_dtype="fp16" if load in ("int8", "nf4", "fp4") else "auto",
        )
        assert est.weights == footprint(model), (path.name, mode)
        assert est.params == sum(p.numel() for p in _load(path, "fp32").parameters())
        # the same layout read from the loaded (quantized) model itself
        assert (
            estimate(model, load=load, double_quant=mode.endswith("+dq"), compute_dtype="fp16").weights == est.weights
            if load in ("int8", "nf4", "fp4")
            else True
        )


def test_layout_arithmetic_by_hand(tiny_llama):
    # Llama tiny: hidden 128, inter 256, 4 layers, 4 heads, 2 kv heads (head_dim 32), vocab 1024, untied.
    h, i, n, kv, v = 128, 256, 4, 2 * 32, 1024
    linears = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # (out, in) per layer
    q_numel = n * sum(o * k for o, k in linears)
    plain = v * h * 2 + n * 2 * h + h  # embeddings + lm_head (unquantized), 2 norms per layer, final norm
    assert estimate(tiny_llama, load="fp16").params == q_numel + plain
    int8 = estimate(tiny_llama, load="int8", compute_dtype="fp16")
    assert int8.row("weights.quantized").bytes == q_numel
    assert int8.row("weights.quant_state").bytes == 4 * n * sum(o for o, _ in linears)
    nf4 = estimate(tiny_llama, load="nf4", double_quant=False, compute_dtype="fp16")
    assert nf4.row("weights.quantized").bytes == q_numel // 2
    blocks = [o * k // 64 for o, k in linears]
    assert nf4.row("weights.quant_state").bytes == n * sum(4 * b + 64 for b in blocks)
    dq = estimate(tiny_llama, load="nf4", double_quant=True, compute_dtype="fp16")
    assert dq.row("weights.quant_state").bytes == n * sum(b + 4 * math.ceil(b / 256) + 4 + 1024 + 64 for b in blocks)
    assert dq.row("weights.unquantized").bytes == plain * 2


def test_tied_embeddings_counted_once(tiny_qwen2):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_qwen2)
    tied = estimate(cfg, load="fp16").params
    cfg_untied = AutoConfig.from_pretrained(tiny_qwen2, tie_word_embeddings=False)
    assert estimate(cfg_untied, load="fp16").params == tied + cfg.vocab_size * cfg.hidden_size
    assert estimate("Qwen2.5-0.5B", load="fp16").params == 494_032_768  # tied, published count


def test_gqa_kv_cache_uses_kv_heads():
    est = estimate("Mistral-7B-v0.1", load="fp16", batch_size=2, prompt_tokens=1000, max_new_tokens=24)
    # 32 layers x 2 (k, v) x batch 2 x 1024 tokens x 8 kv heads x 128 x 2 bytes
    assert est.row("kv_cache").bytes == 32 * 2 * 2 * 1024 * 8 * 128 * 2
    llama2 = estimate("Llama-2-7b-hf", load="fp16", batch_size=2, prompt_tokens=1000, max_new_tokens=24)
    assert llama2.row("kv_cache").bytes == 4 * est.row("kv_cache").bytes  # MHA: 32 kv heads


def test_kv_cache_sliding_window_and_explicit_head_dim():
    from helpers.estimator.configs import resolve_config

    gemma, _, _ = resolve_config("gemma-2-2b")
    # alternating sliding (4096) and global layers; head_dim 256 is explicit (2304 / 8 = 288 is wrong)
    short = kv_cache_bytes(gemma, 1, 4096)
    assert short == 26 * 2 * 4096 * 4 * 256 * 2
    long = kv_cache_bytes(gemma, 1, 8192)
    assert long == 13 * 2 * 8192 * 4 * 256 * 2 + 13 * 2 * 4096 * 4 * 256 * 2


def test_shipped_configs_give_published_counts():
    expected = {"meta-llama/Llama-2-7b-hf": 6_738_415_616, "mistralai/Mistral-7B-v0.1": 7_241_732_096,
                "Qwen/Qwen2.5-0.5B": 494_032_768, "openai-community/gpt2": 124_439_808,
                "TinyLlama/TinyLlama-1.1B-Chat-v1.0": 1_100_048_384, "meta-llama/Llama-3.1-8B": 8_030_261_248,
                "Qwen/Qwen2.5-7B": 7_615_616_512, "microsoft/phi-2": 2_779_683_840,
                "google/gemma-2-2b": 2_614_341_888, "facebook/opt-1.3b": 1_315_758_080}  # fmt: skip
    assert set(expected) <= set(shipped_configs())
    for hub_id, n in expected.items():
        assert estimate(hub_id, load="fp16").params == n, hub_id


def test_rows_are_labelled_and_add_up():
    est = estimate("Llama-2-7b-hf", load="nf4")
    assert {r.kind for r in est.rows} <= {"exact", "formula", "rule of thumb"}
    assert est.total == sum(r.bytes for r in est.rows)
    assert all(r.kind == "exact" for r in est.rows if r.name.startswith("weights"))
    assert "total" in str(est) and "<table" in est._repr_html_()


def test_reestimating_is_cached():
    """Re-estimates parse the config once (counted; the speed is bench/panel_latency.py's and hot_spots.py's)."""
    from helpers.estimator.configs import _parsed

    first = estimate("TinyLlama-1.1B-Chat-v1.0", load="nf4")
    before = _parsed.cache_info()
    for n in range(20):
        est = estimate("TinyLlama-1.1B-Chat-v1.0", load="nf4", max_new_tokens=n)
        assert est.weights == first.weights
    after = _parsed.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 20


def test_fit_verdicts_and_ranked_fixes():
    est = estimate("Llama-2-7b-hf", load="fp16", batch_size=2, max_new_tokens=1024, prompt_tokens=1024)
    v = fit(est, "t4")
    assert v.verdict == "does not fit" and v.headroom < 0 and v.capacity == DEVICES["t4"]["capacity"]
    assert v.suggestions and v.suggestions[0].estimate.total <= v.capacity
    changes = [s.change for s in v.suggestions]
    assert "load=int8" in changes and "load=nf4" in changes
    for s in v.suggestions:  # savings are re-estimates (or, for an offload, its placement), not percentages
        assert s.saving == est.total - s.total
    assert fit(estimate("Llama-2-7b-hf", load="nf4"), "t4").verdict == "fits"
    assert fit(est, 80 * GiB).verdict == "fits"
    assert "DOES NOT FIT" in str(v) and "<table" in v._repr_html_()


def test_training_estimates_and_fixes():
    qlora = estimate("Llama-2-7b-hf", load="nf4", training=LoraTraining(r=16))
    # all-linear LoRA on Llama-2-7B: 32 layers x r=16 x (in+out) summed over the 7 linears
    n = 32 * 16 * (3 * (4096 + 4096) + (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    assert qlora.row("training.adapters").bytes == 4 * n
    assert qlora.row("training.optimizer").bytes == 2 * n
    no_ckpt = qlora.replace(training=LoraTraining(r=16, gradient_checkpointing=False))
    assert no_ckpt.total > qlora.total
    full = estimate("Llama-2-7b-hf", load="bf16", training=FullTraining())
    v = fit(full, "t4")
    assert v.verdict == "does not fit"
    assert any("LoRA" in s.change for s in v.suggestions)


def test_inverse_questions():
    n = max_new_tokens_that_fit("Llama-2-7b-hf", load="fp16", device="t4")
    assert fit(estimate("Llama-2-7b-hf", load="fp16", max_new_tokens=n), "t4").verdict != "does not fit"
    assert fit(estimate("Llama-2-7b-hf", load="fp16", max_new_tokens=n + 1), "t4").verdict == "does not fit"
    b = max_batch_that_fits("Llama-2-7b-hf", load="nf4", device="t4")
    assert b > 1 and estimate("Llama-2-7b-hf", load="nf4", batch_size=b + 1).total > DEVICES["t4"]["capacity"]
    assert max_batch_that_fits("Llama-3.1-8B", load="fp32", device="t4") == 0


@pytest.mark.bnb
def test_footprint_counts_quant_state_that_transformers_misses(tiny_llama):
    model = _load(tiny_llama, "nf4+dq")
    assert footprint(model) > model.get_memory_footprint()


def test_preflight_check_without_gpu_says_t4(tiny_llama):
    from helpers.environment import preflight

    report = preflight(
        str(tiny_llama),
        snapshot=_cpu_snapshot(),
        package_versions={},
        bnb=(True, "ok"),
        colab=False,
        checkpoint=(1, 1, "test"),
    )
    check = report.check("fit")
    assert check.status == "pass" and "T4" in check.summary and check.data["load"] == "fp16"


def test_when_no_single_change_fits_the_top_fix_combines_them():
    """CodeLlama-7B fp16, 16 x (2048 + 4096) tokens on a T4: no one change fits (batch 1 alone leaves 16 GiB,
    nf4 alone 57 GiB), so the first fix joins them and fits with the margin; the others say they fall short."""
    est = estimate("codellama/CodeLlama-7b-hf", load="fp16", batch_size=16, prompt_tokens=2048, max_new_tokens=4096)
    verdict = fit(est, "t4")
    top = verdict.suggestions[0]
    assert top.change == "batch_size=1 + load=nf4" and top.kwargs == {"batch_size": 1, "load": "nf4"}
    again = est.replace(**top.kwargs)
    assert again.total == top.estimate.total and fit(again, "t4").verdict == "fits"
    lines = str(verdict).splitlines()
    assert "not enough alone" not in lines[1]
    assert any("batch_size=1:" in ln and "not enough alone" in ln for ln in lines[2:])


def test_a_combined_fix_names_each_setting_once():
    """A prompt halved twice reads as one change to its last value, not as two (a combination read
    'prompt_tokens=16384 (truncate inputs) + load=nf4 + prompt_tokens=8192 (truncate inputs)')."""
    est = estimate("codellama/CodeLlama-7b-hf", load="fp16", prompt_tokens=32768, max_new_tokens=1024, device="t4")
    top = fit(est, "t4").suggestions[0]
    assert top.kwargs == {"prompt_tokens": 8192, "load": "nf4"}  # the prompt was halved first, then again
    assert top.change == "load=nf4 + prompt_tokens=8192 (truncate inputs)"


def test_a_top_fix_that_falls_short_says_so():
    from helpers.panels.widgets import LoadPanel

    # a made-up card with room for little more than the CUDA context the estimate counts: nothing fits
    panel = LoadPanel("openai-community/gpt2", device=440 * MiB, load="fp16", batch_size=2, widgets=False)
    state = panel.state
    assert state.verdict == "does not fit" and state.suggestion is not None
    assert "not enough alone" in state.verdict_text() and "not enough alone" in state.verdict_html()


def test_preflight_auto_picks_a_mode_that_fits():
    checks = fit_checks("Llama-2-7b-hf", load="auto", max_new_tokens=256, snapshot=_cpu_snapshot())
    assert checks[0].data["load"] == "nf4" and checks[0].status == "pass"  # what notebook 01 loads, too
    fp16 = fit_checks("Llama-2-7b-hf", load="fp16", max_new_tokens=4096, snapshot=_cpu_snapshot())[0]
    assert fp16.status == "fail" and fp16.fix


def _cpu_snapshot():
    from helpers.core.memory import MemorySnapshot, RAMReadout

    return MemorySnapshot("cpu", [], RAMReadout(12 * GiB, 11 * GiB, GiB, 500 * MiB), [])


@pytest.mark.parametrize("hub_id", sorted(shipped_configs()))
def test_cli_offline_on_every_shipped_config(hub_id, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_type = json.loads(shipped_configs()[hub_id].read_text()).get("model_type", "")
    prequantized = "quantization_config" in shipped_configs()[hub_id].read_text()  # loads only as saved
    code = estimate_main([hub_id, "--load", "auto" if prequantized else "nf4", "--json"])
    printed = capsys.readouterr()
    if code == 2:  # a transformers that cannot build this model type (Llama 4 under 5.1): one clear error
        error = " ".join(printed.err.split())
        assert not printed.out.strip() and f"cannot build model_type '{model_type}'" in error, error
        assert "pip install -U transformers" in error
        return
    out = json.loads(printed.out)
    assert out["params"] > 0 and out["total"] == sum(r["bytes"] for r in out["rows"])
    assert out["fit"]["verdict"] in ("fits", "tight", "does not fit")
    assert code == (1 if out["fit"]["verdict"] == "does not fit" else 0)  # the exit status says fit or not


def _cli_help(capsys) -> str:
    with pytest.raises(SystemExit):
        estimate_main(["--help"])
    return capsys.readouterr().out


def test_cli_text_lora_and_bad_input(capsys):
    # 8B in fp16 with a LoRA step does not fit a T4: exit 1, so `python -m helpers estimate ... && train` stops
    assert estimate_main(["Llama-3.1-8B", "--load", "fp16", "--max-new-tokens", "4096", "--lora", "r=8"]) == 1
    assert "LoRA adapters" in capsys.readouterr().out
    assert estimate_main(["Llama-2-7b-hf", "--load", "nf4", "--max-new-tokens", "64"]) == 0
    assert "FITS" in capsys.readouterr().out.upper()
    assert "1 it does not fit" in " ".join(_cli_help(capsys).split())
    assert estimate_main(["Llama-2-7b-hf", "--load", "int3"]) == 2
    assert "use nf4 (4-bit, QLoRA), fp4, int8, or fp16/bf16/fp32" in capsys.readouterr().err
    assert estimate_main(["Llama-2-7b-hf", "--max-new-tokens", "-5"]) == 2
    assert estimate_main(["Llama-2-7b-hf", "--lora", "rank"]) == 2


def test_bad_inputs_have_clear_messages(tmp_path, monkeypatch):
    with pytest.raises(EstimateError, match=r"use nf4 \(4-bit, QLoRA\), fp4, int8, or fp16/bf16/fp32"):
        estimate("Llama-2-7b-hf", load="int3")
    with pytest.raises(EstimateError, match="max_new_tokens must be a whole number"):
        estimate("Llama-2-7b-hf", load="fp16", max_new_tokens=-1)
    with pytest.raises(DeviceError, match="unknown device"):
        estimate("Llama-2-7b-hf", load="fp16", device="tpu")
    with pytest.raises(EstimateError, match="data/configs"):  # no network here, and none needed
        estimate("someone/not-a-real-model-xyz", load="fp16")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(EstimateError, match="no 'model_type'.*lacks num_hidden_layers, vocab_size"):
        estimate(bad, load="fp16")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(
        json.dumps(
            {
                "model_type": "brand-new-arch",
                "hidden_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 512,
                "vocab_size": 1000,
            }
        )
    )
    est = estimate(unknown, load="fp16")
    assert est.approximate and "brand-new-arch" in str(est)
    assert est.params == 2 * (4 * 256 * 256 + 3 * 256 * 512 + 2 * 256) + 256 + 1000 * 256  # tied by default


def test_unknown_architecture_falls_back_to_approximate_count(monkeypatch):
    from transformers import LlamaConfig

    def boom(config):
        raise NotImplementedError("no modeling code for this architecture")

    monkeypatch.setattr(E, "_meta_model", boom)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=1000,
        tie_word_embeddings=False,
        name_or_path="fallback-test",
    )
    est = estimate(cfg, load="nf4")
    assert est.approximate and "approximate" in str(est)
    # q, k, v, o, gate, up, down + norms; embeddings and lm_head: the dimension count of a Llama
    assert est.params == 3 * (4 * 256 * 256 + 3 * 256 * 512 + 2 * 256) + 256 + 2 * 1000 * 256
    cfg_missing = LlamaConfig(hidden_size=256, num_hidden_layers=3, vocab_size=0)
    with pytest.raises(EstimateError, match="vocab_size"):
        estimate(cfg_missing, load="fp16")


def test_current_device_honours_a_per_process_memory_cap(monkeypatch):
    """set_per_process_memory_fraction (acting as a T4 on a bigger card) is the allocator's real limit."""
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, major=9),
    )
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.1875)
    name, dev = resolve_device("current")
    assert dev["capacity"] == 15 * 2**30 and "capped at 19%" in name
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 1.0)
    assert resolve_device("current")[1]["capacity"] == 80 * 2**30


def test_typical_mistakes_get_a_message_that_says_what_to_pass(tmp_path, capsys):
    # a local path that does not exist: not the hub's "Repo id must be in the form ..." message
    with pytest.raises(EstimateError, match=r"/no/such/model does not exist.*existing model folder") as e:
        estimate("/no/such/model", load="fp16")
    assert "Repo id" not in str(e.value)
    with pytest.raises(EstimateError, match=f"{tmp_path} exists and holds"):
        estimate(str(tmp_path / "typo" / "model"), load="fp16")
    est = estimate("Llama-2-7b-hf", load="fp16")
    with pytest.raises(EstimateError, match=r"call fit\(estimate\(model, load=...\), device\)"):
        fit("Llama-2-7b-hf", "t4")
    with pytest.raises(DeviceError, match=r"less than 1 MiB; for 15 GiB pass 15 \* GiB"):
        fit(est, 15)
    assert fit(est, "24GiB").capacity == fit(est, "24 GiB").capacity == 24 * GiB  # as the CLI's --device
    with pytest.raises(EstimateError, match="footprint.*loaded model.*use estimate"):
        footprint("Llama-2-7b-hf")
    with pytest.raises(EstimateError, match="LoraTraining.r must be a whole number >= 1, got 0"):
        estimate("Llama-2-7b-hf", load="nf4", training=LoraTraining(r=0))
    assert estimate_main(["Llama-2-7b-hf", "--lora", "r=x"]) == 2
    assert "--lora r='x': r takes a whole number, e.g. r=16" in capsys.readouterr().err


def test_fixes_on_a_t4_never_propose_bf16_and_leave_the_margin():
    from helpers.core.vocab import TIGHT_FRACTION

    cap = DEVICES["t4"]["capacity"]
    for est in (estimate("Llama-2-7b-hf", load="fp32"), estimate("Llama-2-7b-hf", load="fp16", max_new_tokens=8192)):
        verdict = fit(est, "t4")
        assert verdict.suggestions and not any("bf16" in s.change for s in verdict.suggestions)
        first = verdict.suggestions[0]
        assert first.estimate.total <= cap * TIGHT_FRACTION, first  # the top fix really fits, with the margin
        assert "model" not in first.kwargs  # the user's own model is kept when a setting can make it fit


def test_estimate_warns_about_bf16_on_a_t4_and_a_length_past_the_context():
    assert any("has no bf16" in w for w in estimate("Llama-2-7b-hf", load="bf16", device="t4").warnings)
    assert not any("bf16" in w for w in estimate("Llama-2-7b-hf", load="bf16", device="a100-40").warnings)
    long = estimate("openai-community/gpt2", load="fp16", prompt_tokens=512, max_new_tokens=4096)
    assert any("past this model's context of 1024" in w for w in long.warnings)
    assert not any("context" in w for w in estimate("openai-community/gpt2", load="fp16").warnings)


def test_every_dtype_spelling_is_accepted():
    from helpers.loading.plan import LoadPlan

    base = estimate("Llama-2-7b-hf", load="nf4", compute_dtype="fp16").total
    for spelling in (torch.float16, "float16", "torch.float16", "half", "FP16"):
        assert estimate("Llama-2-7b-hf", load="nf4", compute_dtype=spelling).total == base, spelling
        assert LoadPlan("x/y", load="nf4", compute_dtype=spelling).compute_dtype == "fp16"
    assert LoadPlan("x/y", compute_dtype=torch.bfloat16).compute_dtype == "bf16"
    with pytest.raises(EstimateError, match="unknown dtype 'int4'.*float16"):
        estimate("Llama-2-7b-hf", load="nf4", compute_dtype="int4")


@pytest.mark.bnb
def test_moe_experts_are_a_row_with_words_and_match_a_real_nf4_load(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig

    from helpers.loading.loader import load
    from helpers.loading.plan import LoadPlan

    cfg = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, num_local_experts=4)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp_path)
    est = estimate(str(tmp_path), load="nf4", device="current")
    experts = est.row("weights.moe_experts").bytes
    assert experts > est.row("weights.quantized").bytes  # most of this model stays unquantized
    assert any("MoE expert tensors that bitsandbytes does not quantize" in w for w in est.warnings)
    model, _, _ = load(LoadPlan(str(tmp_path), load="nf4"))
    assert abs(footprint(model) - est.weights) <= 0.01 * est.weights
    assert "weights.moe_experts" not in {r.key for r in estimate(str(tmp_path), load="fp16").rows}


@pytest.mark.bnb
def test_a_saved_bnb_4bit_checkpoint_is_estimated_from_its_own_quantization_config(tmp_path, tiny_llama):
    from helpers.loading.loader import load
    from helpers.loading.plan import LoadPlan

    model, tokenizer, _ = load(LoadPlan(str(tiny_llama), load="nf4", double_quant=False))
    model.save_pretrained(tmp_path)  # a "-bnb-4bit" repo, as Unsloth and others publish them
    tokenizer.save_pretrained(tmp_path)
    est = estimate(str(tmp_path), device="current")  # load="auto": the repo's own mode
    assert est.load == "nf4" and est.inputs["double_quant"] is False and est.quantized_by == "bitsandbytes"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded, _, _ = load(LoadPlan(str(tmp_path), load="nf4", double_quant=False))
    # the checkpoint's own quantization_config loads it; none is passed beside it (transformers warned)
    assert not [w for w in caught if "quantization_config" in str(w.message)]
    assert abs(footprint(reloaded) - est.weights) <= 0.01 * est.weights
    with pytest.raises(EstimateError, match="already quantized.*loads as nf4 only"):
        estimate(str(tmp_path), load="int8")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_layouts_follow_their_formulas(method):
    from transformers import LlamaConfig

    qc = {"quant_method": method, "bits": 4, "group_size": 128}
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=1000, tie_word_embeddings=False)  # fmt: skip
    cfg.quantization_config = qc
    est = estimate(cfg, device="t4")
    assert est.load == method
    linears = [(512, 512)] * 4 + [(1024, 512), (1024, 512), (512, 1024)]  # (out, in) per layer
    packed = 2 * sum(o * k * 4 // 8 for o, k in linears)
    groups = [(o, k, -(-k // 128)) for o, k in linears]
    state = 2 * sum(g * o * 4 // 8 + g * o * 2 + (4 * k if method == "gptq" else 0) for o, k, g in groups)
    assert est.row("weights.quantized").bytes == packed
    assert est.row("weights.quant_state").bytes == state
    assert est.row("weights.unquantized").bytes == (2 * 1000 * 512 + 2 * 2 * 512 + 512) * 2  # embed, lm_head, norms


def test_sizes_past_any_machine_get_a_clear_error(capsys):
    for device in (float("nan"), float("inf"), 10**400, "9" * 400 + "GiB", "1e400GiB"):
        with pytest.raises(DeviceError, match="not a real size|too large|not a memory size"):
            estimate("Llama-2-7b-hf", load="nf4", device=device)
    assert estimate_main(["Llama-2-7b-hf", "--device", "9" * 400 + "GiB"]) == 2
    assert "too large to be real" in capsys.readouterr().err


def test_an_unquantized_load_is_counted_in_its_own_dtype_whatever_the_compute_dtype():
    fp16 = estimate("Llama-2-7b-hf", load="fp16").weights
    assert estimate("Llama-2-7b-hf", load="fp16", compute_dtype="fp32").weights == fp16  # was counted at 4 bytes


def test_fixes_that_keep_the_inputs_and_a_margin_rank_before_truncating_the_prompt():
    """Llama-2-7B fp16 on a T4 is tight; halving the prompt leaves 35 MiB below the tight line, int8
    leaves 6 GiB: the load mode ranks first, the truncation last and says how little it leaves."""
    from helpers.core.vocab import TIGHT_FRACTION
    from helpers.estimator.fitting import fix_margin

    cap = DEVICES["t4"]["capacity"]
    verdict = fit(estimate("Llama-2-7b-hf", load="fp16"), "t4")
    changes = [s.change for s in verdict.suggestions]
    assert changes[:2] == ["load=int8", "load=nf4"] and changes[-1] == "prompt_tokens=256 (truncate inputs)"
    truncated = verdict.suggestions[-1]
    assert cap * TIGHT_FRACTION - fix_margin(cap) < truncated.estimate.total <= cap * TIGHT_FRACTION
    assert str(verdict).splitlines()[-1].endswith("to spare") and "fits with only" in str(verdict)
    assert fix_margin(cap) == 256 * MiB and fix_margin(4 * GiB) == int(4 * GiB * 0.02)


def test_fewer_new_tokens_and_a_smaller_batch_rank_before_a_truncated_prompt():
    """Llama-3.1-8B nf4, 2 x (8192 + 16384) tokens on a T4: a prompt cut in half saves less than batch 1,
    but drops half of each input; fewer new tokens (most of them kept) and batch 1 come first."""
    est = estimate("Llama-3.1-8B", load="nf4", batch_size=2, prompt_tokens=8192, max_new_tokens=16384)
    verdict = fit(est, "t4")
    keys = [next(iter(s.kwargs)) for s in verdict.suggestions if "kv_cache" not in s.kwargs]  # reducers rank first
    assert keys[:3] == ["max_new_tokens", "batch_size", "prompt_tokens"], [s.change for s in verdict.suggestions]
    shaped = [s for s in verdict.suggestions if "kv_cache" not in s.kwargs]
    assert shaped[2].saving < shaped[1].saving  # not by saving alone
    assert 8192 <= shaped[0].kwargs["max_new_tokens"] < 16384  # keeps at least half of them


def test_new_tokens_and_smaller_models_stay_within_the_context():
    # GPT-2's context is 1024 tokens: with a 512-token prompt, 512 new ones at most whatever the memory
    assert max_new_tokens_that_fit("openai-community/gpt2", load="fp16", device="t4") == 512
    assert max_new_tokens_that_fit("openai-community/gpt2", load="fp16", prompt_tokens=2000, device="t4") == -1
    # 16 x (512 + 8192) tokens on 2 GiB: memory alone would allow 1160 new tokens, the context 512
    est = estimate("openai-community/gpt2", load="fp16", batch_size=16, prompt_tokens=512, max_new_tokens=8192)
    fixes = fit(est, 2 * GiB).suggestions
    assert [s.kwargs for s in fixes if "max_new_tokens" in s.kwargs] == [{"max_new_tokens": 512}]
    # 3000 + 1000 tokens: Phi-2, TinyLlama and OPT (2048) would be smaller, but cannot hold them
    verdict = fit(estimate("Llama-2-7b-hf", load="fp16", prompt_tokens=3000, max_new_tokens=1000), "t4")
    (smaller,) = [s for s in verdict.suggestions if "model" in s.kwargs]
    assert smaller.estimate.context >= 4000 and smaller.kwargs["model"] == "google/gemma-2-2b"


@pytest.mark.parametrize(
    ("model", "kwargs"),
    [
        ("meta-llama/Llama-3.1-8B", {"load": "fp16", "max_new_tokens": 1024}),
        ("meta-llama/Llama-3.1-8B", {"load": "fp16", "batch_size": 8, "max_new_tokens": 3000}),
        ("Qwen/Qwen2.5-7B", {"load": "int8", "batch_size": 16, "max_new_tokens": 4096}),
        ("Llama-2-7b-hf", {"load": "fp16", "prompt_tokens": 3000, "max_new_tokens": 1000}),
    ],
)
def test_the_smaller_model_is_the_largest_shipped_one_that_fits(model, kwargs):
    """The fix's search goes largest first and stops early (a slider move asks it each time); its answer
    is what estimating every shipped config with the same settings picks."""
    from helpers.core.sources import shipped_configs
    from helpers.core.vocab import TIGHT_FRACTION
    from helpers.estimator.configs import resolve_config
    from helpers.estimator.families import family

    est, cap = estimate(model, **kwargs), DEVICES["t4"]["capacity"]
    tokens = est.inputs["prompt_tokens"] + est.inputs["max_new_tokens"]
    own = family(resolve_config(model)[0])  # a smaller model of the same family: no speech model for an LM
    same = [h for h in shipped_configs() if family(resolve_config(h)[0]) == own]
    every = [estimate(h, **est.inputs) for h in same if "quantization_config" not in shipped_configs()[h].read_text()]
    fitting = [
        e for e in every
        if e.params < est.params and e.total <= cap * TIGHT_FRACTION and (e.context is None or e.context >= tokens)
    ]  # fmt: skip
    found = [s.kwargs["model"] for s in fit(est, "t4").suggestions if "model" in s.kwargs]
    assert found == ([max(fitting, key=lambda e: e.params).model] if fitting else [])
