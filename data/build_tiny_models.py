"""Build the tiny random-weight models that tests and CPU demos load instead of hub models.

Deterministic: the same corpus and seed give the same tokenizer and weights. Each model is a
real architecture (Llama with GQA and untied embeddings; Qwen2 with tied embeddings and q/k/v
biases) at a size where every ``nn.Linear`` is quantizable by bitsandbytes (dimensions are
multiples of 64) yet the whole checkpoint stays a few MB. Beside the decoder-only LMs, one model of
each other family oomkit knows (``FAMILY_MODELS``): T5 (encoder-decoder), Whisper (speech
encoder-decoder, with its feature extractor: 2-second windows of 80 mel bins) and LLaVA (a CLIP
vision tower of 32 x 32 images in 8 x 8 patches, a projector and a Llama, with its processor).

Usage: ``python data/build_tiny_models.py [--out data/tiny] [--force]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS_DIR = HERE / "corpus"
DEFAULT_OUT = HERE / "tiny"
SEED = 1234
VOCAB_TARGET = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# name -> (transformers config class, config kwargs, has pad token)
MODELS: dict[str, tuple[str, dict, bool]] = {
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,  # GQA: 2 query heads per key/value head
            max_position_embeddings=512,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        ),
        False,  # like real Llama checkpoints: no pad token, loading must set one
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
        ),
        True,
    ),
}


# name -> builder function (below); each writes its model and its tokenizer or processor
FAMILY_MODELS = ("t5", "whisper", "llava")
WHISPER_SECONDS = 2  # the feature extractor's window (Whisper's own is 30 s): 200 mel frames, 100 positions
VLM_IMAGE, VLM_PATCH = 32, 8  # a 4 x 4 grid of patches: 16 image tokens per image


def corpus_files() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*.txt"))


def fingerprint() -> str:
    """Hash of everything that determines the output, so a rebuild happens only when it changes."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    for f in corpus_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def train_tokenizer(vocab_size: int = VOCAB_TARGET):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in corpus_files()], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def fast_tokenizer(tok, has_pad: bool, max_length: int):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>" if has_pad else None,
        model_max_length=max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def padded_vocab(n: int) -> int:
    return -(-n // 64) * 64  # round up: quantizable embedding/lm_head shapes


def build_one(name: str, out: Path, tok) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, kwargs, has_pad = MODELS[name]
    vocab = padded_vocab(tok.get_vocab_size())
    fast = fast_tokenizer(tok, has_pad, kwargs["max_position_embeddings"])
    config = getattr(transformers, cls_name)(
        vocab_size=vocab,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        **kwargs,
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = fast.pad_token_id or fast.eos_token_id
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    fast.save_pretrained(target)
    return target


def _save(model, processor, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    processor.save_pretrained(target)
    return target


def build_t5(out: Path, tok) -> Path:
    """T5 (relative attention, no position embeddings): 2 encoder + 2 decoder layers, tied embeddings."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    fast = fast_tokenizer(tok, True, 512)
    config = T5Config(vocab_size=padded_vocab(tok.get_vocab_size()), d_model=128, d_ff=256, d_kv=32, num_layers=2,
                      num_heads=4, pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
                      decoder_start_token_id=fast.pad_token_id)  # fmt: skip
    torch.manual_seed(SEED)
    return _save(T5ForConditionalGeneration(config), fast, out / "t5")


def build_whisper(out: Path, tok) -> Path:
    """Whisper: two conv layers over 80 mel bins, 2 encoder + 2 decoder layers, a 2-second window."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    fast = fast_tokenizer(tok, True, 128)
    extractor = WhisperFeatureExtractor(feature_size=80, chunk_length=WHISPER_SECONDS)
    config = WhisperConfig(vocab_size=padded_vocab(tok.get_vocab_size()), num_mel_bins=80, encoder_layers=2,
                           decoder_layers=2, d_model=128, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=256, decoder_ffn_dim=256, max_source_positions=extractor.nb_max_frames // 2,
                           max_target_positions=128, pad_token_id=fast.pad_token_id, bos_token_id=fast.bos_token_id,
                           eos_token_id=fast.eos_token_id, decoder_start_token_id=fast.bos_token_id,
                           begin_suppress_tokens=None, suppress_tokens=None)  # fmt: skip
    torch.manual_seed(SEED)
    model = WhisperForConditionalGeneration(config)
    target = _save(model, fast, out / "whisper")
    extractor.save_pretrained(target)
    return target


def build_llava(out: Path, tok) -> Path:
    """LLaVA: a CLIP vision tower (32 x 32 images, 8 x 8 patches), a 2-layer projector and a 2-layer Llama."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )  # fmt: skip

    fast = fast_tokenizer(tok, True, 512)
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(vocab_size=padded_vocab(len(fast)), hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, pad_token_id=fast.pad_token_id, bos_token_id=fast.bos_token_id,
                       eos_token_id=fast.eos_token_id)  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=VLM_IMAGE, patch_size=VLM_PATCH)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=fast.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, pad_token_id=fast.pad_token_id)  # fmt: skip
    images = CLIPImageProcessor(size={"shortest_edge": VLM_IMAGE}, crop_size={"height": VLM_IMAGE, "width": VLM_IMAGE})
    processor = LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=VLM_PATCH,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1)  # fmt: skip
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = fast.pad_token_id
    return _save(model, processor, out / "llava")


def build(out: Path = DEFAULT_OUT, force: bool = False) -> dict[str, Path]:
    """Build every tiny model into ``out`` unless an up-to-date build is already there."""
    out = Path(out)
    stamp = out / "BUILD.json"
    fp = fingerprint()
    paths = {name: out / name for name in (*MODELS, *FAMILY_MODELS)}
    if not force and stamp.exists():
        try:
            if json.loads(stamp.read_text()).get("fingerprint") == fp:
                stamp.touch()  # keeps make's timestamp check happy
                return paths
        except json.JSONDecodeError:
            pass
    tok = train_tokenizer()
    for name in MODELS:
        build_one(name, out, tok)
    for name in FAMILY_MODELS:
        globals()[f"build_{name}"](out, tok)
    stamp.write_text(json.dumps({"fingerprint": fp, "models": sorted(paths)}, indent=2))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args()
    for name, path in build(args.out, args.force).items():
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"{name:8s} {path}  ({size / 2**20:.1f} MiB of safetensors)")


if __name__ == "__main__":
    main()
