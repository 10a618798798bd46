"""The tiny offline models are real architectures that bitsandbytes can quantize."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig


def test_llama_has_gqa_and_untied_embeddings(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors")) < 8 * 2**20


def test_qwen2_ties_embeddings(tiny_qwen2):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert model.config.model_type == "qwen2"
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tokenizer_is_a_trained_bpe_with_chat_template(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok("Quantization stores weights in fewer bits.")["input_ids"]
    assert len(ids) < 20  # merges learned from the corpus, not one token per byte
    assert tok.decode(ids, skip_special_tokens=True) == "Quantization stores weights in fewer bits."
    assert "<|assistant|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_bitsandbytes_quantizes_real_linear_layers_on_cpu(tiny_llama, mode):
    import bitsandbytes as bnb

    q = (
        BitsAndBytesConfig(load_in_8bit=True)
        if mode == "int8"
        else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=q, device_map="cpu")
    cls = bnb.nn.Linear8bitLt if mode == "int8" else bnb.nn.Linear4bit
    quantized = [m for m in model.modules() if isinstance(m, cls)]
    assert len(quantized) == 4 * 7  # q, k, v, o, gate, up, down in each of 4 layers
    out = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_build_is_deterministic(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("b", Path(__file__).parents[1] / "data" / "build_tiny_models.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    p1 = b.build(tmp_path / "a")["qwen2"]
    p2 = b.build(tmp_path / "b")["qwen2"]
    assert (p1 / "model.safetensors").read_bytes() == (p2 / "model.safetensors").read_bytes()
    assert (p1 / "tokenizer.json").read_bytes() == (p2 / "tokenizer.json").read_bytes()


def test_t5_is_an_encoder_decoder_with_its_tokenizer(tiny_t5):
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5)
    assert model.config.is_encoder_decoder and model.config.model_type == "t5"
    ids = AutoTokenizer.from_pretrained(tiny_t5)(["translate this"], return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape == (1, 4)


def test_whisper_transcribes_its_feature_extractors_window(tiny_whisper):
    import numpy as np
    from transformers import AutoFeatureExtractor, AutoModelForSpeechSeq2Seq

    model = AutoModelForSpeechSeq2Seq.from_pretrained(tiny_whisper)
    features = AutoFeatureExtractor.from_pretrained(tiny_whisper)(
        np.zeros(16000, dtype="float32"), sampling_rate=16000, return_tensors="pt"
    ).input_features
    assert features.shape == (1, 80, 2 * model.config.max_source_positions)  # padded to the whole window
    assert model.generate(features, max_new_tokens=3, min_new_tokens=3).shape[0] == 1


def test_the_vlm_has_a_vision_tower_and_a_processor(tiny_vlm):
    import numpy as np
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    image = Image.fromarray(np.zeros((48, 40, 3), dtype="uint8"))
    batch = processor(images=[image], text=["<image> describe"], return_tensors="pt")
    assert batch["pixel_values"].shape == (1, 3, 32, 32)
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 16  # a 4 x 4 grid of patches
    assert (
        model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1]
        == batch["input_ids"].shape[1] + 3
    )
