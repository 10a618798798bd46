"""Memory reducers: same results as the plain path on the tiny models, and the measured change in memory
matches the estimated change within 20 % (CPU: peak of live tensors, or bytes saved for backward)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers.core.reducers import chunked_lm_loss, kv_cache_kwargs, offload_activations
from helpers.core.vocab import ReducerError
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card as fit
from helpers.estimator.rows import EstimateError
from helpers.estimator.training import LoraTraining


class _Peak(TorchDispatchMode):
    """Peak bytes of the tensors ops create while active (CPU has no max_memory_allocated)."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                st = t.untyped_storage()
                self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _model(path, checkpointing=True):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _step(model, ids, loss):
    if loss == "chunked":
        out = chunked_lm_loss(model, ids, ids)
    else:
        out = model(input_ids=ids, labels=ids).loss
    out.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_chunked_loss_gives_the_same_loss_and_gradients(family, request):
    model = _model(request.getfixturevalue(family))
    ids = torch.randint(0, model.config.vocab_size, (2, 200))
    plain, g_plain = _step(model, ids, "plain")
    chunked, g_chunked = _step(model, ids, "chunked")
    assert torch.allclose(plain, chunked, rtol=1e-5)
    assert g_plain.keys() == g_chunked.keys()
    for name, g in g_plain.items():
        assert torch.allclose(g, g_chunked[name], rtol=1e-4, atol=1e-6), name


def test_chunked_loss_peak_drops_as_estimated(tiny_llama):
    """No checkpointing: the loss's peak sits on top of the saved activations, so the step's peak moves
    by exactly what the loss rows move."""
    model = _model(tiny_llama, checkpointing=False)
    seq, mb = 256, 4
    ids = torch.randint(0, model.config.vocab_size, (mb, seq))
    peaks = {}
    for loss in ("plain", "chunked"):
        with _Peak() as p:
            _step(model, ids, loss)
        peaks[loss] = p.peak
    est = {loss: estimate(tiny_llama, load="fp32", device="cpu", training=LoraTraining(
        seq_len=seq, micro_batch=mb, gradient_checkpointing=False, loss=loss)).total for loss in peaks}  # fmt: skip
    measured, predicted = peaks["plain"] - peaks["chunked"], est["plain"] - est["chunked"]
    assert measured > 0 and abs(predicted - measured) <= 0.2 * measured, (predicted, measured)


def test_offloaded_activations_are_the_estimated_bytes_and_change_nothing(tiny_llama):
    model = _model(tiny_llama, checkpointing=False)
    seq, mb = 128, 2
    ids = torch.randint(0, model.config.vocab_size, (mb, seq))
    plain, g_plain = _step(model, ids, "plain")
    moved = []
    with offload_activations(on_pack=lambda t: moved.append(t.untyped_storage().nbytes())):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.allclose(loss.detach(), plain)
    tr = LoraTraining(seq_len=seq, micro_batch=mb, gradient_checkpointing=False, offload_activations=True)
    est = estimate(tiny_llama, load="fp32", device="cpu", training=tr)
    predicted = est.host_total
    assert predicted > 0 and est.host_rows[0].key == "host.activations"
    assert abs(predicted - sum(moved)) <= 0.2 * sum(moved), (predicted, sum(moved))
    plain_est = estimate(tiny_llama, load="fp32", device="cpu", training=LoraTraining(
        seq_len=seq, micro_batch=mb, gradient_checkpointing=False))  # fmt: skip
    assert est.row("activations.saved").bytes * tr.seq_len // seq == plain_est.row("activations.saved").bytes // 4
    assert est.total < plain_est.total


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_fp8_kv_cache_gives_the_same_tokens(family, request):
    model = _model(request.getfixturevalue(family), checkpointing=False).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        fp8 = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, **kv_cache_kwargs("fp8"))
    assert (plain == fp8).float().mean() >= 0.9


def test_fp8_kv_cache_stores_a_byte_per_value(tiny_llama):
    """The cache transformers keeps holds what the estimate's kv_cache row says."""
    from transformers import AutoConfig
    from transformers.cache_utils import QuantizedCache

    config = AutoConfig.from_pretrained(tiny_llama)
    cache = QuantizedCache(backend="fp8", config=config)
    b, t, layers = 2, 100, config.num_hidden_layers
    for i in range(layers):
        k = torch.randn(b, config.num_key_value_heads, t, config.head_dim, dtype=torch.float16)
        cache.update(k, k.clone(), i)
    stored = sum(x._quantized_keys[0].nbytes + x._quantized_values[0].nbytes for x in cache.layers)
    est = estimate(
        tiny_llama, load="fp16", batch_size=b, prompt_tokens=t, max_new_tokens=0, kv_cache="fp8", device="cpu"
    )
    assert abs(est.row("kv_cache").bytes - stored) <= 0.2 * stored


def test_fit_proposes_the_reducers_on_the_issue_examples():
    qlora = fit(estimate("Qwen/Qwen2.5-1.5B", load="nf4", training=LoraTraining(seq_len=2048, micro_batch=4)), "t4")
    first = qlora.suggestions[0]
    assert first.change == "loss=chunked" and first.estimate.total < 0.9 * qlora.capacity and first.cost
    gen = fit(estimate("meta-llama/Llama-2-7b-hf", load="fp16", prompt_tokens=512, max_new_tokens=4096), "t4")
    by = {s.change: s for s in gen.suggestions}
    assert {"kv_cache=fp8", "kv_cache=offload"} <= by.keys()
    offload = by["kv_cache=offload"]
    assert offload.estimate.host_total == estimate("meta-llama/Llama-2-7b-hf", load="fp16", prompt_tokens=512,
                                                   max_new_tokens=4096).row("kv_cache").bytes  # fmt: skip
    assert "host RAM" in offload.cost and "per token" in offload.cost
    assert "kv_cache=int4" not in by or by["kv_cache=int4"].estimate.row("kv_cache.residual")


def test_offload_under_checkpointing_is_not_proposed_and_saves_nothing():
    tr = LoraTraining(seq_len=2048, micro_batch=4)
    est = estimate("Qwen/Qwen2.5-1.5B", load="nf4", training=tr, device="t4")
    off = est.replace(training=LoraTraining(seq_len=2048, micro_batch=4, offload_activations=True))
    assert off.total == est.total and off.host_total > 0
    assert not [s for s in fit(est, "t4").suggestions if "offload" in s.change]


def test_unknown_reducers_are_refused_with_the_choices():
    from helpers.loading.plan import LoadPlan
    from helpers.training.plan import FinetuneError, TrainPlan

    with pytest.raises(EstimateError, match="int4"):
        estimate("Qwen/Qwen2.5-0.5B", load="fp16", kv_cache="4bit")
    with pytest.raises(EstimateError, match="chunked"):
        estimate("Qwen/Qwen2.5-0.5B", load="nf4", training=LoraTraining(loss="cut"))
    with pytest.raises(FinetuneError, match="chunked"):
        TrainPlan("Qwen/Qwen2.5-0.5B", loss="liger")
    with pytest.raises(ValueError, match="offload"):
        LoadPlan("Qwen/Qwen2.5-0.5B", load="fp16", kv_cache="cpu")
    with pytest.raises(ReducerError, match="CUDA"):
        if not torch.cuda.is_available():
            kv_cache_kwargs("offload")
        else:
            raise ReducerError("CUDA")
    assert LoadPlan("Qwen/Qwen2.5-0.5B", load="fp16", kv_cache="fp8").estimate("t4").row("kv_cache").kind == "formula"


def test_use_kv_cache_replaces_a_previous_kind_and_keeps_a_models_own():
    from types import SimpleNamespace

    from helpers.core.reducers import fp8_kv_available, use_kv_cache

    if not fp8_kv_available():
        pytest.skip("this transformers has no fp8 QuantizedCache backend")
    model = SimpleNamespace(generation_config=SimpleNamespace(cache_implementation=None, cache_config=None))
    assert use_kv_cache(model, "fp8")["cache_implementation"] == "quantized"
    assert model.generation_config.cache_config == {"backend": "fp8"}
    assert use_kv_cache(model, "dynamic") == {}  # the load panel's dropdown back to the default: no reload
    assert (model.generation_config.cache_implementation, model.generation_config.cache_config) == (None, None)
    model.generation_config.cache_implementation = "hybrid"  # Gemma-2's own: not oomkit's to undo
    use_kv_cache(model, "dynamic")
    assert model.generation_config.cache_implementation == "hybrid"


def test_printed_plans_show_the_reducers_that_are_on():
    from helpers import LoadPlan, TrainPlan

    on = str(TrainPlan("m", loss="chunked", offload_activations=True))
    assert "loss chunked" in on and "activations offloaded to RAM" in on
    off = str(TrainPlan("m"))
    assert "loss" not in off.split("checkpointing")[1].split(",")[1] and "offloaded" not in off
    assert "KV cache int4" in str(LoadPlan("m", kv_cache="int4"))
    assert "KV cache" not in str(LoadPlan("m"))
