"""The estimator's generation rows beyond the weights: what the attention kernel and bitsandbytes'
matmuls add to the prompt's forward pass, sliding-window caches after a long prompt, sampling, the
cuBLAS workspace per GPU, and the embeddings note. Figures are checked by hand (the phase model in
helpers/estimator/inference.py) and, where a CPU can show it, against transformers itself."""

from __future__ import annotations

import gc

import pytest
import torch

from helpers.core.devices import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_HOPPER, CUDA_CONTEXT
from helpers.core.units import MiB
from helpers.estimator.configs import resolve_config
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card as fit
from helpers.estimator.inference import SAMPLING_BYTES, dequantizes_4bit
from helpers.estimator.layout import kv_cache_bytes
from helpers.estimator.rows import EstimateError


def _phases(h: int, inter: int, heads: int, kv: int, hd: int, tokens: int, b: int = 2) -> tuple[int, int]:
    """(attention, MLP) bytes of one layer's prefill, as the estimator's formula counts them."""
    attn = tokens * (2 * h + 2 * heads * hd + 2 * kv * hd) * b
    mlp = tokens * (2 * h + 3 * inter) * b
    return attn, mlp


def _gqa_config(**over):
    from transformers import LlamaConfig

    # a narrow MLP, so the attention phase is the widest and K/V repeated per head show up in the total
    kw = dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
              num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)  # fmt: skip
    return LlamaConfig(**{**kw, **over})


def test_gqa_on_a_gpu_without_bf16_counts_k_and_v_repeated_per_head():
    attn, mlp = _phases(1024, 1024, 16, 2, 64, 512)
    repeat = 2 * 512 * 16 * 64 * 2  # K and V of one layer repeated to 16 heads, fp16
    t4 = estimate(_gqa_config(), load="fp16", prompt_tokens=512, device="t4")
    assert t4.row("activations.prefill").bytes == max(attn, mlp)
    assert t4.row("activations.gqa_repeat").bytes == max(attn + repeat, mlp) - max(attn, mlp) > 0
    assert "16 heads" in t4.row("activations.gqa_repeat").note
    # flash attention on bf16 GPUs takes GQA as it is; MHA has nothing to repeat
    assert "activations.gqa_repeat" not in {r.key for r in estimate(_gqa_config(), load="fp16", device="a100-40").rows}
    mha = estimate(_gqa_config(num_key_value_heads=16), load="fp16", device="t4")
    assert "activations.gqa_repeat" not in {r.key for r in mha.rows}


def test_gqa_copies_inside_the_wider_mlp_are_said_but_add_nothing():
    """Qwen2.5-7B on a T4: K/V repeated to 28 heads (224 MiB at 2 x 4096 tokens) stay below the MLP's
    peak (the same model measured on CPU: a wider phase hides them), so the prefill row names them."""
    est = estimate("Qwen/Qwen2.5-7B", load="fp16", batch_size=2, prompt_tokens=4096, device="t4")
    assert "activations.gqa_repeat" not in {r.key for r in est.rows}
    assert "K and V repeated to 28 heads" in est.row("activations.prefill").note


def test_an_architecture_without_sdpa_counts_eager_attention_scores():
    """Gemma-2 says _supports_sdpa = False: eager attention holds B x H x S x S scores in fp16 next to
    their fp32 softmax and its fp16 copy, and one float mask per attention kind (sliding and global)."""
    h, inter, heads, kv, hd, s = 2304, 9216, 8, 4, 256, 4096
    attn, mlp = _phases(h, inter, heads, kv, hd, s)
    scores = heads * s * s * (2 + 4 + 2)
    repeat = 2 * s * heads * hd * 2
    masks = 2 * s * s * 2
    est = estimate("google/gemma-2-2b", load="fp16", prompt_tokens=s, device="t4")
    assert est.row("activations.eager_attention").bytes == max(attn + repeat + scores, mlp) - max(attn, mlp) + masks
    assert est.row("activations.eager_attention").bytes > 900 * MiB
    assert "activations.eager_attention" not in {r.key for r in estimate("Llama-2-7b-hf", load="fp16").rows}


def test_a_loaded_model_is_counted_with_its_own_attention(tiny_llama):
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager")
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    assert estimate(eager, load="fp32", prompt_tokens=256).row("activations.eager_attention").bytes > 0
    assert "activations.eager_attention" not in {r.key for r in estimate(sdpa, load="fp32", prompt_tokens=256).rows}


def test_nf4_prefill_counts_the_dequantized_weight():
    """bitsandbytes' gemm_4bit dequantizes the whole weight for a long input: Llama-2-7B's 11008 x 4096
    MLP weights in fp16 plus the double-quantized absmax (fp32, and a copy with the offset added)."""
    h, inter, t = 4096, 11008, 512
    _, mlp = _phases(h, inter, 32, 32, 128, t)
    weight = inter * h * 2 + 8 * (inter * h // 64)
    call = t * (2 * h + 2 * inter) * 2 + weight  # one MLP intermediate alive, the next being written
    est = estimate("Llama-2-7b-hf", load="nf4", prompt_tokens=t, device="t4")
    assert est.row("activations.dequant").bytes == max(mlp, call) - mlp > 0
    short = estimate("Llama-2-7b-hf", load="nf4", prompt_tokens=32, device="t4")  # bitsandbytes' own kernel
    assert "activations.dequant" not in {r.key for r in short.rows}
    no_dq = estimate("Llama-2-7b-hf", load="nf4", prompt_tokens=t, device="t4", double_quant=False)
    assert no_dq.row("activations.dequant").bytes == max(mlp, call - 8 * (inter * h // 64)) - mlp
    assert "activations.dequant" not in {r.key for r in estimate("Llama-2-7b-hf", load="fp16", device="t4").rows}


@pytest.mark.parametrize(
    "rows, cdtype, capability, expected",
    [(4, "fp16", (7, 5), False), (64, "fp16", (7, 5), False), (65, "fp16", (7, 5), True), (8, "fp16", (7, 0), True),
     (8, "fp32", (8, 0), True), (7, "fp32", (8, 0), False), (1537, "bf16", (9, 0), True), (65, "bf16", None, True)],
)  # fmt: skip
def test_when_bitsandbytes_dequantizes_a_4bit_weight(rows, cdtype, capability, expected):
    assert dequantizes_4bit(rows, cdtype, capability) is expected


def test_int8_prefill_counts_the_int32_product():
    """LLM.int8's int8_linear_matmul writes an int32 tokens x out product, alive with the fp16 output,
    after an int8 copy of the input and its row scales."""
    h, inter, t = 4096, 11008, 2048
    _, mlp = _phases(h, inter, 32, 32, 128, t)
    call = t * (2 * h + 2 * inter) * 2 + t * (h + 4 * inter + 4)
    est = estimate("Llama-2-7b-hf", load="int8", prompt_tokens=t, device="t4")
    assert est.row("activations.int8_matmul").bytes == max(mlp, call) - mlp > 0
    assert "activations.int8_matmul" not in {r.key for r in estimate("Llama-2-7b-hf", load="nf4", device="t4").rows}


def test_sliding_window_layers_hold_the_whole_prompt_after_prefill():
    """transformers' DynamicSlidingWindowLayer keeps a view of the prompt's concatenated keys: each
    sliding layer holds storage for every prompt position until the first decoding step."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, vocab_size=256, sliding_window=16,
                       max_position_embeddings=1024)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    prompt = 100
    with torch.no_grad():
        cache = model(input_ids=torch.zeros(1, prompt, dtype=torch.long), use_cache=True).past_key_values
    held = sum(
        layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes() for layer in cache.layers
    )
    assert held == kv_cache_bytes(cfg, 1, prompt, 4, prompt_tokens=prompt)  # the estimate, fp32
    assert held > kv_cache_bytes(cfg, 1, prompt, 4)  # min(tokens, window) alone misses it
    mistral = estimate("Mistral-7B-v0.1", load="fp16", prompt_tokens=8192, max_new_tokens=256)
    assert mistral.row("kv_cache").bytes == 32 * 2 * 8192 * 8 * 128 * 2  # window 4096, but 8192 held
    assert "whole 8192-token prompt" in mistral.row("kv_cache").note


def test_sampling_counts_the_logits_processors():
    est = estimate("Llama-2-7b-hf", load="nf4", batch_size=4)
    assert "activations.sampling" not in {r.key for r in est.rows}
    sampled = est.replace(sampling=True)
    assert sampled.row("activations.sampling").bytes == 4 * 32000 * SAMPLING_BYTES
    assert sampled.total > est.total and sampled.inputs["sampling"] is True
    with pytest.raises(EstimateError, match="sampling must be True or False"):
        estimate("Llama-2-7b-hf", load="nf4", sampling="top_p")


def test_cublas_workspace_follows_the_gpu_and_sits_inside_the_allocator():
    assert CUBLAS_WORKSPACE == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680  # torch's :4096:2:16:8
    for device in ("t4", "v100", "l4", "a100-40"):
        est = estimate("Llama-2-7b-hf", load="nf4", device=device)
        assert est.row("overhead.cublas_workspace").bytes == 8_519_680, device
        assert est.row("overhead.cuda_context").bytes == CUDA_CONTEXT
    h100 = estimate("Llama-2-7b-hf", load="nf4", device="h100")
    assert h100.row("overhead.cublas_workspace").bytes == CUBLAS_WORKSPACE_HOPPER == 32 * MiB
    assert "inside memory_reserved()" in h100.row("overhead.cublas_workspace").note
    assert "outside PyTorch" in h100.row("overhead.cuda_context").note
    assert fit(estimate("Llama-2-7b-hf", load="nf4", device="a100-80"), "h100").estimate.total == h100.total
    assert not {"overhead.cuda_context", "overhead.cublas_workspace"} & {
        r.key for r in estimate("Llama-2-7b-hf", load="nf4", device="cpu").rows
    }


def test_the_embeddings_note_follows_tie_word_embeddings():
    from transformers import LlamaConfig

    assert estimate("Qwen/Qwen2.5-0.5B", load="fp16").row("weights.unquantized").note == "tied embeddings counted once"
    assert "untied" in estimate("Llama-2-7b-hf", load="nf4").row("weights.unquantized").note
    cfg, _, _ = resolve_config("Llama-2-7b-hf")
    assert "untied" in estimate(cfg, load="fp16").row("weights.unquantized").note
    gptq = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                       vocab_size=1000, tie_word_embeddings=True)  # fmt: skip
    gptq.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert estimate(gptq, device="t4").row("weights.unquantized").note == "tied embeddings counted once"


def test_qlora_rows_follow_what_the_upcast_model_keeps_under_fp16_autocast(tiny_llama, tmp_path):
    """prepare_qlora's fp32 upcast, run for real under fp16 autocast (what a T4 trains in): every decoder
    layer takes an fp32 input (so checkpointing keeps fp32 hidden states) and backward keeps an fp16 copy of
    the fp32 output layer. The estimate counts both, as 4-byte hidden states and a vocab x hidden x 2 row."""
    import warnings

    from helpers.loading.loader import load
    from helpers.training.adapters import prepare_qlora
    from helpers.training.plan import TrainPlan

    plan = TrainPlan(str(tiny_llama), precision="fp16", seq_len=32, batch_size=2, micro_batch=2,
                     output_dir=str(tmp_path / "o"))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = load(plan.load_plan())
        model, _ = prepare_qlora(model, plan)
    head = model.get_output_embeddings().weight
    inputs, saved = [], []
    for layer in model.base_model.model.model.layers:
        layer.register_forward_pre_hook(
            lambda m, a, kw: inputs.append((a[0] if a else kw["hidden_states"]).dtype), with_kwargs=True
        )
    model.train()
    ids = torch.randint(0, head.shape[0], (2, 32))
    pack = lambda t: saved.append((tuple(t.shape), t.dtype)) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # a forward kept without its backward pins the checkpointed layers (in C++, past gc)
    cfg = model.config
    del loss
    del model  # a QLoRA model holds reference cycles: collect it here, not in a later test's census
    gc.collect()
    assert head.dtype == torch.float32 and set(inputs) == {torch.float32}
    assert (tuple(head.T.shape), torch.float16) in saved  # autocast's copy of the output layer, kept for backward
    est = plan.estimate("t4", model=str(tiny_llama))
    assert est.row("activations.lm_head_copy").bytes == cfg.vocab_size * cfg.hidden_size * 2
    layers = cfg.num_hidden_layers
    assert est.row("activations.saved").bytes == layers * 2 * 32 * cfg.hidden_size * 4
