"""Grouped-query attention stays off SDPA's math kernel on pre-Ampere GPUs (helpers.core.attention)."""

import inspect
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import sdpa_attention

from helpers.core import attention


@pytest.fixture
def restore_transformers(monkeypatch):
    """Each test wraps transformers' function anew and leaves the original behind."""
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)
    attention.pre_ampere.cache_clear()
    yield
    attention.pre_ampere.cache_clear()


def _fake_cuda_key(index: int = 0):
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index), shape=(1, 2, 8, 16))


def test_the_wrapper_answers_false_only_for_a_pre_ampere_gpu(restore_transformers, monkeypatch):
    original = sdpa_attention.use_gqa_in_sdpa
    extra = (None,) * (len(inspect.signature(original).parameters) - 2)  # (mask, key) or (mask, key, value)
    assert attention.keep_gqa_off_math_kernel() and attention.keep_gqa_off_math_kernel()  # idempotent
    wrapped = sdpa_attention.use_gqa_in_sdpa
    assert wrapped is not original and wrapped.__wrapped__ is original and attention.gqa_kernel_fixed()
    key = torch.zeros(1, 2, 8, 16)
    cpu_extra = (key,) * len(extra)
    assert wrapped(None, key, *cpu_extra) == original(None, key, *cpu_extra)  # CPU tensors: transformers decides
    capability = {0: (7, 5), 1: (8, 0)}  # a T4 beside an A100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability[i])
    assert wrapped(None, _fake_cuda_key(0), *extra) is False
    asked = []
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", original)
    attention.pre_ampere.cache_clear()
    spy = lambda mask, key, *rest: asked.append(key.device) or True  # noqa: E731
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", spy)
    assert attention.keep_gqa_off_math_kernel()
    assert sdpa_attention.use_gqa_in_sdpa(None, _fake_cuda_key(1)) is True  # sm80: transformers' own answer
    assert sdpa_attention.use_gqa_in_sdpa(None, _fake_cuda_key(0)) is False
    assert asked == [torch.device("cuda", 1)]


def test_a_newer_gpu_with_flash_attention_switched_off_counts_as_one_without(restore_transformers, monkeypatch):
    """What `make gpu-check` does to act as a T4 on an H100 (flash off) makes the fix apply there too."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    assert not attention.no_fused_gqa_kernel(0)
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert attention.no_fused_gqa_kernel(0)
    finally:
        torch.backends.cuda.enable_flash_sdp(was)


def test_a_gqa_model_runs_sdpa_with_equal_heads_when_the_fix_applies(restore_transformers, monkeypatch, tiny_qwen2):
    """Through transformers' real attention code: with the fix in force the unpadded prompt reaches SDPA with
    as many key/value heads as query heads and no enable_gqa (what the memory-efficient kernel needs), and the
    generated tokens are the same."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = tok(["memory grows with every token of the prompt"], return_tensors="pt")
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], bool(kwargs.get("enable_gqa"))))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        before = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert any(gqa for _, _, gqa in seen), "transformers passes enable_gqa for an unpadded prompt"
    seen.clear()
    monkeypatch.setattr(attention, "_on_pre_ampere", lambda t: True)  # as on a T4
    assert attention.keep_gqa_off_math_kernel()
    with torch.no_grad():
        after = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert seen and not any(gqa for _, _, gqa in seen)
    assert all(q == k for q, k, _ in seen)
    assert torch.equal(before, after)


def test_the_note_names_a_gqa_model_on_a_pre_ampere_gpu_only(restore_transformers, monkeypatch, tiny_qwen2, tiny_llama):
    qwen = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert attention.keep_attention_fused(qwen) is None  # on the CPU: nothing changed
    assert not attention.gqa_kernel_fixed()
    cuda_param = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    for m in (qwen, llama):
        monkeypatch.setattr(m, "parameters", lambda: iter([cuda_param]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    if llama.config.num_key_value_heads == llama.config.num_attention_heads:
        assert attention.keep_attention_fused(llama) is None  # no grouped heads: nothing to fix
    note = attention.keep_attention_fused(qwen)
    assert note and "4 query heads, 2 key/value heads" in note and attention.gqa_kernel_fixed()
    attention.pre_ampere.cache_clear()
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa.__wrapped__)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    assert attention.keep_attention_fused(qwen) is None and not attention.gqa_kernel_fixed()


@pytest.mark.cuda
def test_on_a_gpu_the_fixed_path_runs_on_the_memory_efficient_kernel(restore_transformers, monkeypatch, tiny_qwen2):
    """With only the memory-efficient kernel allowed (all a T4 has for GQA), the fixed path generates;
    transformers' enable_gqa path finds no kernel there."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float16, attn_implementation="sdpa").cuda()
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    ids = tok(["memory grows with every token"], return_tensors="pt").to("cuda")
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), torch.no_grad():
        with pytest.raises(RuntimeError, match="No available kernel"):
            model(**ids)
        monkeypatch.setattr(attention, "_on_pre_ampere", lambda t: True)
        assert attention.keep_gqa_off_math_kernel()
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 8
