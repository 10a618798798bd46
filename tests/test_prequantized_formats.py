"""mxfp4 (gpt-oss), fine-grained fp8 (Qwen3-FP8, DeepSeek-V3) and compressed-tensors checkpoints: the
weights as transformers lays them out, the kernel path per machine (kept or dequantized to bf16) and the
fixes named when a checkpoint is dequantized."""

from __future__ import annotations

import json

import pytest
import torch

import helpers.estimator.kernel_paths as KP
from helpers.core.sources import shipped_config
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card as fit
from helpers.estimator.rows import EstimateError

GPT_OSS = dict(model_type="gpt_oss", hidden_size=128, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=16, tie_word_embeddings=False,
               layer_types=["sliding_attention", "full_attention"],
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})  # fmt: skip
QWEN3_FP8 = dict(model_type="qwen3", hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000, tie_word_embeddings=False,
                 quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"})  # fmt: skip

# DeepSeek-V3's shape in small: MLA attention, a dense first layer, fused routed experts and a shared one
DEEPSEEK_V3_FP8 = dict(model_type="deepseek_v3", hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                       num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                       n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                       q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
                       vocab_size=1000, tie_word_embeddings=False,
                       quantization_config=QWEN3_FP8["quantization_config"])  # fmt: skip


def _meta_model(d: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "quantization_config"})
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _weights_without_buffers(est) -> int:
    return est.weights - est.row("weights.buffers").bytes


@pytest.fixture
def kernels(monkeypatch):
    """Set what this environment offers the mxfp4 kernels: ``kernels(triton, kernels_package)``."""
    return lambda triton, package: monkeypatch.setattr(KP, "mxfp4_software", lambda: (triton, package))


@pytest.mark.parametrize("config", [QWEN3_FP8, DEEPSEEK_V3_FP8], ids=["qwen3", "deepseek_v3"])
def test_fp8_weights_match_transformers_fp8_linear_layout(config):
    """FP8Linear and FP8Experts: a byte a value, an fp32 scale per 128x128 block (3-D for fused experts)."""
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
    from transformers.utils.quantization_config import FineGrainedFP8Config

    _, model = _meta_model(config)
    with torch.device("meta"):
        replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], pre_quantized=True,
                                quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128]))  # fmt: skip
    est = estimate(config, device="h100")
    assert est.load == "fp8" and est.quantized_by == "fp8"
    assert _weights_without_buffers(est) == _param_bytes(model)
    dequantized = estimate(config, load="bf16", device="h100")
    assert dequantized.load == "bf16" and dequantized.weights > est.weights


def test_mxfp4_weights_match_transformers_mxfp4_experts(kernels):
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    kernels(True, True)
    config, model = _meta_model(GPT_OSS)
    with torch.device("meta"):
        for layer in model.model.layers:
            layer.mlp.experts = Mxfp4GptOssExperts(config)
    est = estimate(GPT_OSS, device="t4")
    assert est.load == "mxfp4"
    experts = 2 * 4 * (2 * 128 * 128 + 128 * 128)  # layers x experts x (gate_up + down) values
    # the uint8 scales are no parameters: the load puts them in each projection's precision_config
    assert _weights_without_buffers(est) == _param_bytes(model) + experts // 32
    assert est.row("weights.quantized").bytes == experts // 2
    assert est.row("weights.quant_state").bytes == experts // 32


def test_mxfp4_path_follows_kernels_triton_and_compute_capability(kernels):
    kernels(True, True)
    kept = estimate(GPT_OSS, device="t4")
    kernels(True, False)
    dequantized = estimate(GPT_OSS, device="t4")
    assert (kept.load, dequantized.load) == ("mxfp4", "bf16")
    _, model = _meta_model(GPT_OSS)
    assert _weights_without_buffers(dequantized) == _param_bytes(model)  # every weight in bf16
    note = next(w for w in dequantized.warnings if "dequantizes mxfp4" in w)
    assert "`kernels` package" in note and "pip install -U kernels" in note and "bitsandbytes 4-bit" in note
    kernels(False, True)
    assert "Triton >= 3.4" in " ".join(estimate(GPT_OSS, device="t4").warnings)
    # load="mxfp4" states the target has the kernels; a V100 (7.0) dequantizes whatever is asked
    assert estimate(GPT_OSS, load="mxfp4", device="t4").load == "mxfp4"
    assert estimate(GPT_OSS, load="mxfp4", device="v100").load == "bf16"
    assert estimate(GPT_OSS, load="bf16", device="h100").load == "bf16"
    assert estimate(GPT_OSS, device="cpu").load == "bf16"


def test_fp8_dequantized_on_a_card_without_fp8():
    for device, load in (("t4", "bf16"), ("a100-40", "bf16"), ("l4", "fp8"), ("h100", "fp8")):
        assert estimate(QWEN3_FP8, device=device).load == load, device
    t4 = estimate(QWEN3_FP8, load="fp8", device="t4")
    assert t4.load == "bf16" and any("7.5 < 8.9" in w and "dequantizes fp8" in w for w in t4.warnings)
    with pytest.raises(EstimateError, match="already quantized"):
        estimate(QWEN3_FP8, load="nf4", device="t4")


def test_shipped_gpt_oss_fits_a_t4_only_with_its_kernels(kernels):
    assert shipped_config("openai/gpt-oss-20b") is not None and shipped_config("Qwen/Qwen3-8B-FP8") is not None
    kernels(True, True)
    kept = estimate("openai/gpt-oss-20b", device="t4")
    kernels(False, False)
    dequantized = estimate("openai/gpt-oss-20b", device="t4")
    assert 20.8e9 < kept.params < 21.0e9  # "21B parameters"
    assert kept.total < kept.capacity < dequantized.weights
    # the fix that keeps mxfp4 is proposed for the dequantized load, and it is what saves most
    verdict = fit(dequantized, "t4")
    kernels_fix = next(s for s in verdict.suggestions if s.change.startswith("pip install -U kernels"))
    assert kernels_fix.estimate.load == "mxfp4"


def test_a_stripped_gpt_oss_config_is_not_sent_to_a_pre_quantized_checkpoint():
    d = json.loads(shipped_config("openai/gpt-oss-20b").read_text())
    d.pop("quantization_config")
    est = estimate(d, device="t4")
    said = " ".join(est.warnings) + str(fit(est, "t4"))
    assert "GPTQ/AWQ" not in said and "pre-quantized checkpoint" not in said
    assert "ship in mxfp4" in said


def test_compressed_tensors_is_priced_dense_and_named():
    d = {**QWEN3_FP8, "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                          "strategy": "channel"}}},
         "ignore": ["lm_head"]}}  # fmt: skip
    est = estimate(d, device="t4")
    assert est.quantized_by == "compressed-tensors" and est.load == "bf16"
    assert est.weights == estimate({k: v for k, v in d.items() if k != "quantization_config"}, load="bf16").weights
    assert any("first forward pass" in w for w in est.warnings)


@pytest.mark.parametrize("qc", ["mxfp4", ["fp8"], 5])
def test_quantization_config_that_is_no_object_is_one_estimate_error(qc):
    with pytest.raises(EstimateError, match="quantization_config is .*not an object"):
        estimate({**QWEN3_FP8, "quantization_config": qc})


def test_fp8_block_size_that_is_not_two_numbers_is_refused():
    bad = {**QWEN3_FP8, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}
    with pytest.raises(EstimateError, match="weight_block_size"):
        estimate(bad, device="h100")


def test_preflight_checks_a_pre_quantized_checkpoint_as_it_loads(kernels):
    from helpers.environment import fit_checks

    kernels(False, False)
    check = fit_checks("openai/gpt-oss-20b")[0]
    assert "load=bf16" in str(check) and "39.61 GiB predicted" in str(check) and check.status == "fail"
    kernels(True, True)
    check = fit_checks("openai/gpt-oss-20b")[0]
    assert "load=mxfp4" in str(check) and "13.42 GiB predicted" in str(check)


def test_training_takes_the_dequantized_load_where_the_packed_one_cannot_train(kernels):
    from helpers.estimator.training import FullTraining, LoraTraining

    kernels(True, True)
    lora = LoraTraining(seq_len=64, micro_batch=1)
    # transformers' mxfp4 quantizer is not trainable (LoRA too): OpenAI fine-tunes gpt-oss dequantized
    trained = estimate(GPT_OSS, device="t4", training=lora)
    assert trained.load == "bf16" and any("cannot train mxfp4" in w for w in trained.warnings)
    with pytest.raises(EstimateError, match="cannot train mxfp4 weights.*pass load='bf16'"):
        estimate(GPT_OSS, load="mxfp4", device="t4", training=lora)
    # fp8 layers train adapters as they are; full fine-tuning trains 16-bit weights
    assert estimate(QWEN3_FP8, device="h100", training=lora).load == "fp8"
    assert estimate(QWEN3_FP8, device="h100", training=FullTraining(seq_len=64, micro_batch=1)).load == "bf16"
    with pytest.raises(EstimateError, match="full fine-tuning trains 16-bit weights"):
        estimate(QWEN3_FP8, load="fp8", device="h100", training=FullTraining(seq_len=64, micro_batch=1))


def test_skip_lists_in_quantization_config_are_module_names():
    one = {
        **QWEN3_FP8,
        "quantization_config": {**QWEN3_FP8["quantization_config"], "modules_to_not_convert": "lm_head"},
    }
    assert estimate(one, device="h100").weights == estimate(QWEN3_FP8, device="h100").weights  # not l, m, _, ...
    bad = {**QWEN3_FP8, "quantization_config": {**QWEN3_FP8["quantization_config"], "modules_to_not_convert": 5}}
    with pytest.raises(EstimateError, match="modules_to_not_convert in quantization_config is '5', not a list"):
        estimate(bad, device="h100")
    odd = {**QWEN3_FP8, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": ["x"]}}
    assert estimate(odd, device="t4").load == "bf16"


def test_the_current_gpu_s_compute_capability_decides_the_path(monkeypatch):
    import helpers.core.devices as D
    import helpers.estimator.core as C

    t4 = {"name": "Tesla T4", "capacity": 15 * 2**30, "bf16": False}  # as devices._current() describes a GPU
    monkeypatch.setattr(D, "_current", lambda: ("Tesla T4", t4))
    monkeypatch.setattr(C, "cuda_capability", lambda: (7, 5))
    assert estimate(QWEN3_FP8, device="current").load == "bf16"
    monkeypatch.setattr(C, "cuda_capability", lambda: (9, 0))
    assert estimate(QWEN3_FP8, device="current").load == "fp8"
