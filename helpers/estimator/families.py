"""Which family a model belongs to, and what follows from it: the Auto class that loads it and the
modules that stay unquantized in an 8-bit or 4-bit load.

Families: ``causal`` (decoder-only LMs), ``seq2seq`` (T5, BART: a text encoder and a decoder with
cross-attention), ``speech_seq2seq`` (Whisper: an audio encoder over mel frames) and ``image_text``
(LLaVA, Qwen2-VL, Idefics/SmolVLM: a vision tower and a projector in front of an LM). The one
home of the "which Auto class" decision: the estimator builds the meta model with it and
:func:`helpers.load` loads the checkpoint with it.
"""

from __future__ import annotations

__all__ = [
    "CAUSAL",
    "SEQ2SEQ",
    "SPEECH_SEQ2SEQ",
    "IMAGE_TEXT",
    "FAMILIES",
    "family",
    "auto_class",
    "vision_modules",
    "VISION_MODULE_NAMES",
    "frozen_modules",
    "lora_task_type",
]

CAUSAL, SEQ2SEQ, SPEECH_SEQ2SEQ, IMAGE_TEXT = "causal", "seq2seq", "speech_seq2seq", "image_text"
FAMILIES = {
    CAUSAL: "decoder-only language model",
    SEQ2SEQ: "encoder-decoder (text)",
    SPEECH_SEQ2SEQ: "encoder-decoder (speech)",
    IMAGE_TEXT: "vision-language model",
}
# The vision tower and the projector of the VLMs transformers ships, by their module names (LLaVA and
# most others: vision_tower + multi_modal_projector; Qwen2-VL: visual; Idefics3/SmolVLM: vision_model +
# connector). They stay in 16 bits in a quantized load: they are a small share of the weights, and
# quantizing the image path costs the model far more quality than quantizing the LM does.
VISION_MODULE_NAMES = ("vision_tower", "multi_modal_projector", "visual", "vision_model", "connector", "mm_projector")


def _mapping(name: str) -> dict:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, name, {})


def family(config) -> str:
    """The family of ``config``: ``causal``, ``seq2seq``, ``speech_seq2seq`` or ``image_text``."""
    model_type = getattr(config, "model_type", "") or ""
    if getattr(config, "is_encoder_decoder", False):
        speech = model_type in _mapping("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES")
        return SPEECH_SEQ2SEQ if speech else SEQ2SEQ
    image_text = model_type in _mapping("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")
    if image_text and getattr(config, "vision_config", None) is not None:
        return IMAGE_TEXT
    return CAUSAL


def auto_class(config):
    """The transformers Auto class that builds and loads a model of ``config``'s family (Whisper is in
    AutoModelForCausalLM's mapping too, as its decoder alone: the family decides first)."""
    import transformers

    name = {
        CAUSAL: "AutoModelForCausalLM",
        SEQ2SEQ: "AutoModelForSeq2SeqLM",
        SPEECH_SEQ2SEQ: "AutoModelForSpeechSeq2Seq",
        IMAGE_TEXT: "AutoModelForImageTextToText",
    }[family(config)]
    return getattr(transformers, name)


def vision_modules(model) -> list[str]:
    """Full names of the vision tower and projector modules of a VLM (the shallowest match of each),
    which a quantized load keeps in 16 bits; ``[]`` for other families."""
    if family(getattr(model, "config", None)) != IMAGE_TEXT:
        return []
    out: list[str] = []
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_MODULE_NAMES and not any(name.startswith(o + ".") for o in out):
            out.append(name)
    return out


def frozen_modules(model) -> list[str]:
    """Full names of the modules LoRA leaves alone (no adapters, frozen): a VLM's vision tower and projector,
    Whisper's audio encoder (the decoder learns the new words; the encoder's sound features carry over);
    ``[]`` for text models, whose every layer adapts."""
    fam = family(getattr(model, "config", None))
    if fam == IMAGE_TEXT:
        return vision_modules(model)
    if fam == SPEECH_SEQ2SEQ:
        encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
        return [name for name, m in model.named_modules() if m is encoder][:1]
    return []


def lora_task_type(config) -> str | None:
    """peft's ``task_type`` for ``config``'s family: ``SEQ_2_SEQ_LM`` for a text encoder-decoder (T5),
    ``None`` for Whisper (peft's seq2seq wrapper would hand it ``input_ids``; it reads ``input_features``),
    ``CAUSAL_LM`` for the rest."""
    fam = family(config)
    return "SEQ_2_SEQ_LM" if fam == SEQ2SEQ else None if fam == SPEECH_SEQ2SEQ else "CAUSAL_LM"
