"""module_memory(): a loaded model's bytes per part, adding up to footprint() exactly."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import footprint, module_memory
from helpers.loading.model_parts import ModuleMemory


def _load(path, quant: dict | None = None):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    if quant is None:
        return AutoModelForCausalLM.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float16, quantization_config=BitsAndBytesConfig(**quant)
    )


def _check_sums(model) -> ModuleMemory:
    mm = module_memory(model)
    assert mm.total == footprint(model)
    assert sum(s.bytes for s in mm.segments) == footprint(model)
    assert mm.num_layers == model.config.num_hidden_layers
    assert [s.name for s in mm.layers] == [f"layer {i}" for i in range(mm.num_layers)]
    assert all(s.bytes > 0 for s in mm.layers)
    return mm


def test_tiny_llama_parts(tiny_llama):
    model = _load(tiny_llama)
    mm = _check_sums(model)
    emb = model.get_input_embeddings().weight
    assert mm.bytes_of("embeddings") == emb.numel() * emb.element_size()
    assert mm.bytes_of("lm_head") == model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    layer0 = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    assert mm.layers[0].bytes == layer0
    assert not mm.tied and mm.layers_path == "model.layers"
    text = str(mm)
    assert "decoder layers × 4" in text and "model.embed_tokens" in text and "lm_head" in text


def test_tied_head_counts_once(tiny_qwen2):
    model = _load(tiny_qwen2)
    mm = _check_sums(model)
    assert mm.tied and mm.bytes_of("lm_head") == 0 and "tied" in str(mm)


@pytest.mark.bnb
@pytest.mark.parametrize(
    "quant",
    [
        dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
             bnb_4bit_compute_dtype=torch.float16),
        dict(load_in_8bit=True),
    ],
    ids=["nf4+dq", "int8"],
)  # fmt: skip
def test_quantized_loads_include_quant_state(tiny_llama, quant):
    model = _load(tiny_llama, quant)
    mm = _check_sums(model)
    weights_only = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    assert mm.layers[0].bytes > weights_only  # absmax / row scales counted with their layer


def test_html_bar_escapes_module_names(tiny_llama):
    model = _load(tiny_llama)
    evil = "<img src=x onerror=alert(1)>"
    model.add_module(evil, torch.nn.Linear(4, 4))
    mm = _check_sums(model)
    html = mm._repr_html_()
    assert evil not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert html.count("title=") == len([s for s in mm.segments if s.bytes])  # one bar segment per part
    assert evil in str(mm)  # the text table shows it as is


def test_plain_module_without_layers():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    mm = module_memory(model)
    assert mm.num_layers == 0 and mm.total == footprint(model) == mm.bytes_of("other")
    assert "other" in str(mm) and "<table" in mm._repr_html_()


def test_rejects_a_non_module():
    from helpers.estimator.rows import EstimateError

    with pytest.raises(EstimateError, match="loaded model"):
        module_memory("TinyLlama")
