"""Build the tiny random-weight models that tests and CPU demos load instead of hub models.

Deterministic: the same corpus and seed give the same tokenizer and weights. Each model is a
real architecture (Llama with GQA and untied embeddings; Qwen2 with tied embeddings and q/k/v
biases) at a size where every ``nn.Linear`` is quantizable by bitsandbytes (dimensions are
multiples of 64) yet the whole checkpoint stays a few MB.

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


def build_one(name: str, out: Path, tok) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    cls_name, kwargs, has_pad = MODELS[name]
    vocab = -(-tok.get_vocab_size() // 64) * 64  # round up: quantizable embedding/lm_head shapes
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>" if has_pad else None,
        model_max_length=kwargs["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
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


def build(out: Path = DEFAULT_OUT, force: bool = False) -> dict[str, Path]:
    """Build every tiny model into ``out`` unless an up-to-date build is already there."""
    out = Path(out)
    stamp = out / "BUILD.json"
    fp = fingerprint()
    paths = {name: out / name for name in MODELS}
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
    stamp.write_text(json.dumps({"fingerprint": fp, "models": sorted(MODELS)}, indent=2))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args()
    for name, path in build(args.out, args.force).items():
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"{name:6s} {path}  ({size / 2**20:.1f} MiB of safetensors)")


if __name__ == "__main__":
    main()
