"""Fidelity round 4 (issue 47): the tie rule of a multimodal checkpoint, configs transformers rejects as one
EstimateError from every entry point, SGD momentum's state, the leak detector's run-out step, T5's fp32
``wo`` only where transformers keeps it, and the smaller-model fix kept within the family."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.core.sources import shipped_config
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card as fit
from helpers.estimator.rows import EstimateError
from helpers.estimator.training import FullTraining
from helpers.leaks.growth import GrowthDetector

TINY_VLM = "data/tiny/llava"


def _config(path: str) -> dict:
    return json.loads(open(f"{path}/config.json").read())


def _held(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters once, as named_parameters yields them


@pytest.mark.parametrize("model_type,text_type", [("mistral3", "mistral"), ("gemma3", "gemma3_text")])
def test_untied_multimodal_checkpoint_counts_its_own_lm_head(tmp_path, model_type, text_type):
    """Mistral3's config.json: no top-level tie_word_embeddings (the class says True), text_config says False;
    the checkpoint stores lm_head apart and from_pretrained keeps it apart."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    d = _config(TINY_VLM)
    d.update(model_type=model_type, tie_word_embeddings=False)
    d["text_config"]["model_type"] = text_type
    config = AutoConfig.for_model(**{k: v for k, v in d.items() if k not in ("architectures", "transformers_version")})
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("tie_word_embeddings")  # as the hub's Mistral-Small-3.1 config.json has it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.get_output_embeddings().weight is not loaded.get_input_embeddings().weight
    est = estimate(str(tmp_path), load="fp32", device="cpu")
    assert est.params == _held(loaded)
    assert "untied" in est.row("weights.unquantized").note


BAD = {
    "num_attention_heads": ({"num_attention_heads": 13}, "not a multiple of num_attention_heads 13"),
    "head_dim": ({"head_dim": 7}, "head_dim=7"),
    "rope_scaling as text": ({"rope_scaling": "linear"}, "rope_scaling='linear'"),
    "dynamic rope without factor": ({"rope_scaling": {"rope_type": "dynamic"}}, "rope_scaling=.*factor"),
    "tie_word_embeddings": ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
    "num_key_value_heads": ({"num_attention_heads": 32, "num_key_value_heads": 5, "hidden_size": 1024},
                            "num_key_value_heads 5 .* does not divide num_attention_heads 32"),
    "quantization_config as text": ({"quantization_config": "gptq"}, "quantization_config is 'gptq'"),
    "quantization_config as list": ({"quantization_config": ["gptq"]}, "quantization_config is .*list"),
    "no hidden_size": ({"hidden_size": None}, "has no hidden_size"),
}  # fmt: skip


def _bad(change: dict) -> dict:
    d = json.loads(shipped_config("Qwen/Qwen2.5-0.5B").read_text())
    d.update(change)
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("case", list(BAD))
def test_config_transformers_rejects_is_one_estimate_error_naming_the_field(case):
    change, said = BAD[case]
    with pytest.raises(EstimateError, match=said) as caught:
        estimate(_bad(change), device="t4")
    assert "\n" not in str(caught.value) and ("fix" in str(caught.value) or "pass" in str(caught.value))


def test_rejected_vlm_text_config_and_moe_routing():
    with pytest.raises(EstimateError, match="text_config=5 .* rejected by transformers' llava config"):
        estimate({**_config(TINY_VLM), "text_config": 5})
    moe = dict(model_type="mixtral", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, num_local_experts=4, num_experts_per_tok=8)  # fmt: skip
    with pytest.raises(EstimateError, match="num_experts_per_tok 8 .* more than num_local_experts 4"):
        estimate(moe)


def test_rejected_config_is_one_error_from_every_entry_point(tmp_path, capsys):
    from helpers.cli import estimate_main
    from helpers.environment import preflight
    from helpers.placement.device_plan import plan_devices
    from helpers.placement.fits import fits_table
    from helpers.training.distributed import training_memory
    from helpers.training.plan import TrainPlan

    (tmp_path / "config.json").write_text(json.dumps(_bad({"tie_word_embeddings": "no"})))
    folder = str(tmp_path)
    for call in (lambda: fits_table(folder), lambda: plan_devices(folder, load="fp16", devices="t4"),
                 lambda: training_memory(folder), lambda: TrainPlan(folder).estimate()):  # fmt: skip
        with pytest.raises(EstimateError, match="tie_word_embeddings='no'"):
            call()
    report = preflight(folder)
    assert any("tie_word_embeddings='no'" in str(c) for c in report.checks)
    assert estimate_main([folder]) == 2
    err = capsys.readouterr().err.strip()
    assert "tie_word_embeddings='no'" in err and err.count("error:") == 1 and "Traceback" not in err


def test_sgd_momentum_keeps_one_buffer_per_parameter():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained("data/tiny/llama", dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    real = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    rows = {o: estimate("data/tiny/llama", load="fp32", device="cpu", training=FullTraining(optimizer=o, seq_len=3,
            micro_batch=1)).row("training.optimizer").bytes for o in ("sgd", "sgd_momentum", "adamw_torch")}  # fmt: skip
    assert rows == {"sgd": 0, "sgd_momentum": real, "adamw_torch": 2 * real}


def test_leak_runs_out_at_the_step_that_runs_out():
    mib = 2**20
    det = GrowthDetector(capacity=100 * mib)
    for step in range(1, 21):
        det.record((9 + step) * mib)  # step k holds 9 + k MiB: step 91 fills 100 MiB exactly, step 92 needs 101
    assert det.report().predicted_oom_step == 92
    full = GrowthDetector(capacity=100 * mib, warmup=0, window=3)
    for level in (97, 98, 99, 100):
        full.record(level * mib)
    assert full.report().predicted_oom_step == 5  # nothing left: the next step


@pytest.mark.parametrize("dtype,load", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_t5_keeps_wo_in_fp32_only_where_transformers_does(dtype, load):
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained("data/tiny/t5", dtype=dtype)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(b.numel() * b.element_size() for b in model.buffers())
    assert estimate("data/tiny/t5", load=load, device="cpu").weights == held
    wo = {p.dtype for n, p in model.named_parameters() if n.endswith("wo.weight")}
    assert wo == ({torch.float32} if load == "fp16" else {torch.bfloat16})


def test_smaller_model_fix_stays_in_the_family():
    d = json.loads(shipped_config("openai/whisper-small").read_text())
    d.update(_name_or_path="openai/whisper-large-v2", d_model=1280, decoder_attention_heads=20,
             encoder_attention_heads=20, decoder_ffn_dim=5120, encoder_ffn_dim=5120, decoder_layers=32,
             encoder_layers=32, num_hidden_layers=32)  # fmt: skip
    est = estimate(d, load="fp32", device="t4", training=FullTraining(seq_len=128, micro_batch=4))
    smaller = [s for s in fit(est, "t4").suggestions if "model" in s.kwargs]
    assert [s.kwargs["model"] for s in smaller] == ["openai/whisper-small"]


def test_a_width_under_another_name_is_no_missing_hidden_size():
    # BLOOM's config.json says n_embed (its class takes it in __init__), GPT-2's n_embd, T5's d_model
    bloom = estimate(
        dict(model_type="bloom", n_embed=64, n_layer=2, num_attention_heads=4, vocab_size=100), load="fp16"
    )
    gpt2 = estimate(dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=100), load="fp16")
    assert bloom.params == 2 * (12 * 64 * 64 + 13 * 64) + 100 * 64 + 4 * 64  # blocks, embeddings, their two norms
    assert gpt2.params > 100 * 64 and not bloom.approximate and not gpt2.approximate


def test_a_hub_config_its_class_rejects_names_the_field_not_the_network(monkeypatch):
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoConfig, PretrainedConfig

    def strict(name, **kw):
        raise StrictDataclassFieldValidationError("tie_word_embeddings", TypeError("expected bool, got str"))

    monkeypatch.setattr(AutoConfig, "from_pretrained", strict)
    monkeypatch.setattr(PretrainedConfig, "get_config_dict",
                        lambda name, **kw: ({"model_type": "qwen2", "tie_word_embeddings": "no"}, {}))  # fmt: skip
    with pytest.raises(EstimateError, match="tie_word_embeddings='no' in the config of 'someone/Broken-1B'") as e:
        estimate("someone/Broken-1B")
    assert "Offline or private" not in str(e.value)


def test_a_validator_s_sentence_still_names_the_field(monkeypatch):
    """Llama's validate_architecture says "The hidden size (4096) is not a multiple of ...": hidden_size."""
    from huggingface_hub.errors import StrictDataclassClassValidationError
    from transformers import AutoConfig, PretrainedConfig

    def strict(name, **kw):
        cause = ValueError("The hidden size (4096) is not a multiple of the number of attention heads (13).")
        raise StrictDataclassClassValidationError("validate_architecture", cause) from cause

    monkeypatch.setattr(AutoConfig, "from_pretrained", strict)
    monkeypatch.setattr(PretrainedConfig, "get_config_dict",
                        lambda name, **kw: ({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 13}, {}))  # fmt: skip
    with pytest.raises(
        EstimateError, match=r"hidden_size=4096 in the config of 'someone/Odd-7B' is rejected .*fix hidden_size"
    ):
        estimate("someone/Odd-7B")
