"""QLoRA through TrainPlan on the tiny T5, Whisper and LLaVA (bitsandbytes nf4 on CPU): the family's examples
and collator, LoRA only where it belongs (not in the vision tower or the audio encoder, which stay 16-bit),
a real training step, and a resume after an interruption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.estimator.core import estimate
from helpers.loading.loader import load
from helpers.training.adapters import prepare_qlora
from helpers.training.data import IGNORE, collate
from helpers.training.family_data import build_family_dataset, load_processor
from helpers.training.finetune import last_checkpoint, train
from helpers.training.plan import FinetuneError, TrainPlan

pytestmark = pytest.mark.bnb


def _rows(name: str) -> list[dict]:
    from PIL import Image

    rng = np.random.default_rng(0)
    if name == "t5":
        return [{"instruction": "translate: hello there", "response": "bonjour"},
                {"instruction": "translate: cat", "response": "le chat noir"}] * 2  # fmt: skip
    if name == "whisper":
        return [{"audio": rng.standard_normal(n).astype("float32"), "text": t}
                for n, t in [(8000, "hello world"), (16000, "a cat"), (4000, "yes"), (12000, "no way")]]  # fmt: skip
    pic = [Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")) for _ in range(2)]
    return [{"image": pic[i % 2], "instruction": "what is it?", "response": ["a cat", "a red dog"][i % 2]}
            for i in range(4)]  # fmt: skip


@pytest.fixture(scope="module")
def family_paths(tiny_t5, tiny_whisper, tiny_vlm):
    return {"t5": str(tiny_t5), "whisper": str(tiny_whisper), "llava": str(tiny_vlm)}


def _setup(path: str, name: str, out, **kw):
    plan = TrainPlan(path, load="nf4", seq_len=64, batch_size=2, micro_batch=2, max_steps=2, save_steps=1,
                     warmup_steps=0, learning_rate=1e-2, output_dir=str(out), **kw)  # fmt: skip
    model, _, _ = load(plan.load_plan(), device_map=None)
    processor = load_processor(path)
    return plan, model, processor, build_family_dataset(model, processor, _rows(name), plan.seq_len)


FROZEN = {"t5": (), "whisper": ("model.encoder.",), "llava": ("model.vision_tower.", "model.multi_modal_projector.")}


@pytest.mark.parametrize("name", ["t5", "whisper", "llava"])
def test_a_qlora_step_trains_only_the_adapters_outside_the_frozen_parts(family_paths, name, tmp_path):
    import bitsandbytes as bnb

    plan, model, processor, data = _setup(family_paths[name], name, tmp_path)
    peft_model, params = prepare_qlora(model, plan)
    base = peft_model.get_base_model()
    adapted = [n for n, _ in base.named_modules() if n.endswith(".lora_A")]
    assert adapted and not [n for n in adapted if n.startswith(FROZEN[name])]
    if name == "t5":  # a text encoder-decoder adapts both halves
        assert any(n.startswith("encoder.") for n in adapted) and any(n.startswith("decoder.") for n in adapted)
    quantized = [n for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and not [n for n in quantized if n.startswith(FROZEN[name])]
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    result = train(peft_model, processor, plan, data, view=False)
    assert result.global_step == 2 and all(np.isfinite(loss) for _, loss in result.losses)
    changed = [n for n, p in peft_model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed and all("lora_" in n for n in changed)


def test_the_collator_pads_each_key_to_its_own_length_and_stacks_arrays():
    t5 = collate([{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [8]},
                  {"input_ids": [5], "attention_mask": [1], "labels": [8, 9]}], pad_token_id=0)  # fmt: skip
    assert t5["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert t5["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert t5["labels"].tolist() == [[8, IGNORE], [8, 9]]
    audio = collate([{"input_features": torch.ones(2, 3), "labels": [1]}, {"input_features": torch.zeros(2, 3),
                     "labels": [1, 2, 3]}])  # fmt: skip
    assert audio["input_features"].shape == (2, 2, 3) and audio["labels"].tolist() == [[1, IGNORE, IGNORE], [1, 2, 3]]


def test_family_examples_hold_what_each_model_reads(family_paths, tmp_path):
    _, whisper, processor, data = _setup(family_paths["whisper"], "whisper", tmp_path / "w")
    fe = processor.feature_extractor
    assert data[0]["input_features"].shape == (fe.feature_size, fe.nb_max_frames)
    assert data[0]["labels"][0] != whisper.config.decoder_start_token_id  # the model prepends it itself
    assert data[0]["labels"][-1] == processor.tokenizer.eos_token_id
    _, vlm, vproc, vdata = _setup(family_paths["llava"], "llava", tmp_path / "v")
    ex = vdata[0]
    image_positions = [i for i, t in enumerate(ex["input_ids"]) if t == vlm.config.image_token_id]
    assert len(image_positions) == 16  # (32 / 8)^2 patches, CLS dropped by the "default" strategy
    answer_at = next(i for i, label in enumerate(ex["labels"]) if label != IGNORE)
    assert answer_at > image_positions[-1]  # the image and the instruction are masked out of the loss
    assert vproc.tokenizer.decode(ex["input_ids"][answer_at:], skip_special_tokens=True).strip() == "a cat"
    with pytest.raises(FinetuneError, match="seq_len"):
        build_family_dataset(vlm, vproc, _rows("llava")[:1], seq_len=10)
    with pytest.raises(FinetuneError, match="audio, text"):
        build_family_dataset(whisper, processor, [{"instruction": "x"}], seq_len=10)


def test_whispers_encoder_stays_16_bit_as_the_estimate_counts_it(family_paths):
    est = estimate(family_paths["whisper"], load="nf4", device="cpu")
    model, _, report = load(family_paths["whisper"], load="nf4", device_map=None)
    encoder = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("model.encoder."))
    assert est.row("weights.audio_encoder").bytes == encoder > 0
    assert any("audio encoder, kept in 16 bits" in w for w in est.warnings)
    assert report.measured_weights == report.estimated_weights == est.weights


def test_an_interrupted_whisper_run_resumes_at_its_checkpoint(family_paths, tmp_path):
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise KeyboardInterrupt  # the runtime disconnects after the first checkpoint

    plan, model, processor, data = _setup(family_paths["whisper"], "whisper", tmp_path)
    peft_model, _ = prepare_qlora(model, plan)
    with pytest.raises(KeyboardInterrupt):
        train(peft_model, processor, plan, data, view=False, callbacks=[Stop()])
    assert last_checkpoint(tmp_path).name == "checkpoint-1"
    plan2, model2, _, _ = _setup(family_paths["whisper"], "whisper", tmp_path)
    again, _ = prepare_qlora(model2, plan2)
    result = train(again, processor, plan2, data, view=False)
    assert (result.resumed_from, result.global_step) == (1, 2) and not result.changed


@pytest.mark.parametrize("name", ["t5", "whisper", "llava"])
def test_find_micro_batch_runs_real_steps_with_the_familys_inputs(family_paths, name, tmp_path):
    from helpers.training.family_data import probe_batch
    from helpers.training.finetune import find_micro_batch

    plan, model, _, _ = _setup(family_paths[name], name, tmp_path)
    inputs = probe_batch(model, 2, plan.seq_len)
    key = {"t5": "input_ids", "whisper": "input_features", "llava": "pixel_values"}[name]
    assert inputs[key].shape[0] == 2 and inputs["labels"].shape == (2, plan.seq_len)
    peft_model, _ = prepare_qlora(model, plan.replace(micro_batch=None))
    micro = find_micro_batch(peft_model, plan.replace(micro_batch=None))
    assert (micro.micro_batch, micro.gradient_accumulation) == (2, 1)  # the CPU never runs out: the whole batch


def test_a_vlm_probe_needs_room_for_its_image_tokens(family_paths, tmp_path):
    from helpers.training.family_data import probe_batch

    _, model, _, _ = _setup(family_paths["llava"], "llava", tmp_path)
    with pytest.raises(FinetuneError, match="an image takes 16 tokens"):
        probe_batch(model, 1, 16)


def _tiny_native_resolution_vlm(kind: str):
    """A random-weight Qwen2-VL (native resolution, grids of patches) or Idefics3/SmolVLM (pixel-shuffled
    tiles), small enough for a CPU step: the probe's inputs must be what these models take."""
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)  # fmt: skip
    if kind == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        config = Qwen2VLConfig(
            text_config=text | {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}, "bos_token_id": 1,
                                "eos_token_id": 2},
            vision_config=dict(depth=1, embed_dim=32, num_heads=2, hidden_size=32, mlp_ratio=2),
            image_token_id=100, vision_start_token_id=101, vision_end_token_id=102, video_token_id=103,
        )  # fmt: skip
        return Qwen2VLForConditionalGeneration(config)
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        text_config=text | {"model_type": "llama"}, scale_factor=2, image_token_id=100,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=64, patch_size=16),
    )  # fmt: skip
    return Idefics3ForConditionalGeneration(config)


@pytest.mark.parametrize("kind", ["qwen2_vl", "idefics3"])
def test_find_micro_batch_makes_up_native_resolution_images(kind):
    """Qwen2-VL's and SmolVLM's images (as many tokens as the estimator counts) go through a real training
    step, so find_micro_batch measures these models instead of asking for micro_batch by hand."""
    from helpers.estimator.family_rows import image_tokens
    from helpers.training.family_data import probe_batch
    from helpers.training.finetune import find_micro_batch

    torch.manual_seed(0)
    model = _tiny_native_resolution_vlm(kind)
    n = image_tokens(model.config)[0]
    seq = n + 24
    inputs = probe_batch(model, 2, seq)
    assert (inputs["input_ids"] == model.config.image_token_id).sum(dim=1).tolist() == [n, n]
    start = int(kind == "qwen2_vl")  # Qwen2-VL's vision-start token before the image
    assert inputs["labels"].shape == (2, seq) and (inputs["labels"] != IGNORE).sum(dim=1).tolist() == [24 - start] * 2
    loss = model(**inputs).loss
    loss.backward()
    tower = getattr(model.model, "visual", None) or model.model.vision_model
    assert torch.isfinite(loss) and all(p.grad is not None for p in tower.parameters())  # the image went through
    model.zero_grad(set_to_none=True)
    plan = TrainPlan(model=f"tiny-{kind}", seq_len=seq, batch_size=2, gradient_checkpointing=False)
    micro = find_micro_batch(model, plan)
    assert (micro.micro_batch, micro.gradient_accumulation) == (2, 1)
    with pytest.raises(FinetuneError, match=f"an image takes {n + start} tokens"):
        probe_batch(model, 1, n)
