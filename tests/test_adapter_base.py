"""An adapter trained on another base model is refused with both names (issue 31 item 4)."""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import helpers
from helpers.core.errors import LoadError


def _adapter(base, out):
    model = AutoModelForCausalLM.from_pretrained(base)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft.save_pretrained(out)
    return out


def test_an_adapter_of_another_base_is_refused_before_it_loads(tiny_llama, tiny_qwen2, tmp_path):
    adapter = _adapter(tiny_qwen2, tmp_path / "qwen2-adapter")
    with pytest.raises(LoadError, match=r"trained on .*qwen2.*another base model: model_type 'qwen2'") as e:
        helpers.load(helpers.LoadPlan(str(tiny_llama), load="fp32", adapter=str(adapter)))
    assert "fix: load" in str(e.value)


def test_an_adapter_of_this_base_loads(tiny_llama, tmp_path):
    adapter = _adapter(tiny_llama, tmp_path / "llama-adapter")
    model, _, report = helpers.load(helpers.LoadPlan(str(tiny_llama), load="fp32", adapter=str(adapter)))
    assert report.adapter_bytes > 0
    helpers.unload(model)
