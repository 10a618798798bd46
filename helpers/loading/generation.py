"""Batched generation, written once: left-padded prompts, one ``generate`` call, only the new text back.

``generate_batch(model, tokenizer, prompts, max_new_tokens=...)`` runs one padded call and returns a
:class:`Generated` (texts, new-token ids, new-token counts up to the stop token). Prompts may be
strings or token ids already computed (``encode``), so a caller that needed the lengths first does
not tokenize twice. Padding is done here, on the left (every prompt ends where generation starts),
whatever the tokenizer's ``padding_side``; the pad id is the tokenizer's, else its end-of-sequence
token. ``generate_batched`` loops over fixed-size chunks with a progress bar (the notebook API's, and
``training_data.answer``'s); ``safe_generate`` calls ``generate_batch`` through ``helpers.oom.retry.attempt``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core import phases
from ..core.arguments import number, whole_number
from ..core.compat import library_notes_silenced
from ..core.errors import ContextLengthError
from ..core.html import progress_bar
from ..core.vocab import DEFAULTS

__all__ = [
    "check_generate_kwargs",
    "GENERATE_NOTES",
    "Generated",
    "encode",
    "embedding_rows",
    "token_ids_problem",
    "pad_token_id",
    "pad_left",
    "stop_token_ids",
    "count_new_tokens",
    "model_device",
    "context_length",
    "new_tokens_room",
    "new_tokens_in_context",
    "generate_batch",
    "generate_batched",
    "first_prompt_streamer",
    "can_stream",
    "PhaseSteps",
]


@dataclass
class Generated:
    """One batch's output: ``texts`` (special tokens skipped), ``token_ids`` (new tokens only, on the
    CPU, one row per returned sequence) and ``new_tokens`` (per row, up to and including the first
    stop token; the rest is padding)."""

    texts: list[str]
    token_ids: torch.Tensor
    new_tokens: list[int]


# What transformers says about the generate() call oomkit makes, not about anything the user passed: the model's
# generation_config.json max_length beside the max_new_tokens oomkit always passes, its sampling flags beside
# greedy decoding, a model just trained with gradient checkpointing (use_cache is turned back off by itself)
GENERATE_NOTES = (
    r"Both `max_new_tokens` .* and `max_length`",
    r"Using the model-agnostic default `max_length`",
    r"The following generation flags are not valid",
    r"note that some of these attributes may be set through the model's `generation_config",
    r"Passing `generation_config` together with generation-related arguments",
    r"`use_cache=True` is incompatible with gradient checkpointing",
    r"Caching is incompatible with gradient checkpointing",
    r"Setting `pad_token_id` to `eos_token_id`",
)


def encode(tokenizer, prompts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids per prompt (unpadded): compute them once, pass them to :func:`generate_batch`."""
    return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]]


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its end-of-sequence id (what ``generate`` pads finished rows with)."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, list | tuple) and value:
            value = value[0]
        if isinstance(value, int):
            return value
    raise ValueError(
        "the tokenizer has neither a pad nor an end-of-sequence token: call "
        "helpers.loading.loader.setup_tokenizer(tokenizer, model) first"
    )


def pad_left(ids: Sequence[Sequence[int]], pad_id: int, device: Any = None) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` with every row padded on the left to the longest."""
    width = max((len(row) for row in ids), default=0)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        if row:
            input_ids[i, width - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def stop_token_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence ids of the model's generation config and of the tokenizer."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def count_new_tokens(ids: torch.Tensor, stop: set[int]) -> int:
    """New tokens up to and including the first end-of-sequence token (the rest is padding)."""
    for i, t in enumerate(ids.tolist()):
        if t in stop:
            return i + 1
    return len(ids)


def model_device(model) -> torch.device:
    """Where the model's (first) parameters are: where its inputs must go."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def context_length(model, tokenizer) -> int | None:
    """The most tokens (prompt + new) the model takes: its config's ``max_position_embeddings`` (or the
    same under another name), else the tokenizer's ``model_max_length``; None when neither says."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 1 << 30 else None


def new_tokens_room(context: int | None, prompt_tokens: int, max_new_tokens: int) -> int:
    """New tokens a prompt of ``prompt_tokens`` may get: ``max_new_tokens``, fewer where the context ends
    (below 1: the prompt fills the context and is refused, by ``safe_generate`` and ``generate_batched``)."""
    return max_new_tokens if context is None else min(max_new_tokens, context - prompt_tokens)


OVER_CONTEXT = ("refuse", "cap")


def new_tokens_in_context(
    ids: Sequence[Sequence[int]], max_new_tokens: int, context: int | None, over_context: str = "refuse"
) -> list[int]:
    """New tokens each prompt gets within ``context``: ``max_new_tokens``, or with ``over_context="cap"``
    what is left after the prompt. A prompt that leaves no room for one new token is always refused.

    Raises:
        ContextLengthError: prompts over the context (each named with its length), and the fixes.
    """
    if over_context not in OVER_CONTEXT:
        raise ContextLengthError(
            f"over_context must be 'refuse' (an error when prompt + max_new_tokens exceed the context) or 'cap' "
            f"(fewer new tokens for those prompts), got {over_context!r}"
        )
    room = [new_tokens_room(context, len(row), max_new_tokens) for row in ids]
    full = [k for k, n in enumerate(room) if n < 1]
    over = [k for k, n in enumerate(room) if n < max_new_tokens]
    bad = full if over_context == "cap" else over
    if bad:
        shown = ", ".join(f"#{k} ({len(ids[k])} tokens)" for k in bad[:5]) + (" ..." if len(bad) > 5 else "")
        if full:
            fix = "Shorten or drop them: they leave no room for one new token"
        else:
            fits = min(room[k] for k in bad)
            fix = (
                f"Pass max_new_tokens={fits} or less, or over_context='cap' for fewer new tokens where the context ends"
            )
        raise ContextLengthError(
            f"{len(bad)} prompt(s) plus max_new_tokens={max_new_tokens} do not fit the model's {context}-token "
            f"context: {shown}. {fix}"
        )
    return room


def generate_batch(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    add_special_tokens: bool = True,
    stop: set[int] | None = None,
    watch=None,
    monitor: phases.PhaseRecorder | None = None,
    media: dict[str, torch.Tensor] | None = None,
    **generate_kwargs: Any,
) -> Generated:
    """Generate for ``prompts`` in one left-padded ``model.generate`` call.

    Args:
        prompts: strings, or token ids per prompt (from :func:`encode`; not tokenized again).
        add_special_tokens: for string prompts (False when the text already has its BOS, e.g. a
            chat template).
        stop: end-of-sequence ids for the counts (default: :func:`stop_token_ids`).
        watch: a :class:`helpers.oom.retry.Watch`; the input tensor is added to it, so an OOM retry can
            tell whether the failed call is gone.
        monitor: a :class:`helpers.MemoryMonitor` (any :class:`helpers.core.phases.PhaseRecorder`) to record the
            ``"prefill"`` and ``"decode"`` phases in; default every running monitor (none: nothing added).
        media: batched model inputs beside the ids: Whisper's ``input_features`` (its prompts have no
            ids), a VLM's ``pixel_values`` (see :mod:`helpers.evaluation.inputs`); cast to the model's dtype.
        generate_kwargs: passed to ``model.generate`` (e.g. ``do_sample=False``).
    """
    if isinstance(prompts, str):
        raise TypeError(f"prompts must be a list of strings, got one string ({prompts[:40]!r}): pass [prompt]")
    ids = list(prompts)
    if ids and isinstance(ids[0], str):
        ids = encode(tokenizer, ids, add_special_tokens=add_special_tokens)
    pad = pad_token_id(tokenizer)
    device = model_device(model)
    enc = pad_left(ids, pad, device) if any(ids) else {}  # Whisper: the audio is the whole prompt
    dtype = getattr(model, "dtype", torch.float32)  # its first floating-point weights': the encoder's dtype
    enc.update({k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in (media or {}).items()})
    if watch is not None:
        watch.add(next(iter(enc.values())))
    steps = PhaseSteps(monitor) if phases.recorders(monitor) else None
    if steps is not None:
        generate_kwargs = steps.added_to(generate_kwargs)
    if generate_kwargs.get("stop_strings") and "tokenizer" not in generate_kwargs:
        generate_kwargs = {**generate_kwargs, "tokenizer": tokenizer}  # generate reads stop strings with it
    try:
        with torch.inference_mode(), library_notes_silenced(*GENERATE_NOTES):
            out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad, **generate_kwargs)
    finally:
        if steps is not None:
            steps.close()
    # an encoder-decoder returns the decoder's tokens alone, after its start token
    start = 1 if getattr(model.config, "is_encoder_decoder", False) else enc["input_ids"].shape[1]
    new = out[:, start:].cpu()
    del out, enc
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    stop = stop_token_ids(model, tokenizer) if stop is None else stop
    return Generated(texts, new, [count_new_tokens(row, stop) for row in new])


class PhaseSteps:
    """A logits processor that splits one ``generate`` call into phases: ``"prefill"`` from its start
    to the first step's logits (the prompt's forward pass), ``"decode"`` from there to :meth:`close`.
    It returns the scores unchanged."""

    def __init__(self, recorder: phases.PhaseRecorder | None = None) -> None:
        self.recorder = recorder
        self.current = "prefill"
        self._opened = phases.begin("prefill", recorder)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.current == "prefill":
            phases.end(self._opened)
            self.current, self._opened = "decode", phases.begin("decode", self.recorder)
        return scores

    def added_to(self, generate_kwargs: dict) -> dict:
        """``generate_kwargs`` with this processor after the caller's own ``logits_processor``s."""
        from transformers import LogitsProcessorList

        return {
            **generate_kwargs,
            "logits_processor": LogitsProcessorList([*(generate_kwargs.get("logits_processor") or []), self]),
        }

    def close(self) -> None:
        """End the open phase (an exception in ``generate`` included)."""
        phases.end(self._opened)
        self._opened, self.current = [], None


def first_prompt_streamer(tokenizer, header: str | None = "streaming the first prompt's answer:"):
    """A transformers ``TextStreamer`` that prints the first prompt's new text as it is generated.

    ``TextStreamer`` takes one sequence; this one follows row 0 of a batch (the other rows come back
    when the batch ends), so a long generation shows at once that it is working and what it writes.
    Pass it as ``streamer=`` to ``generate``; greedy or sampling only (``generate`` refuses a streamer
    with beam search).
    """
    from transformers import TextStreamer

    class FirstRowStreamer(TextStreamer):
        def put(self, value):
            if header is not None and self.next_tokens_are_prompt:
                print(header, flush=True)
            super().put(value[:1])  # the prompt as (batch, length), then (batch,) per step: row 0 only

    return FirstRowStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def can_stream(model, generate_kwargs: dict) -> bool:
    """False when ``generate`` would refuse a streamer (beam search) or the caller passes its own."""
    if "streamer" in generate_kwargs:
        return False
    config = getattr(model, "generation_config", None)
    beams = generate_kwargs.get("num_beams", getattr(config, "num_beams", 1))
    return beams in (None, 1)


@contextlib.contextmanager
def _eval_mode(model):
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()  # dropout off: generation is deterministic under greedy decoding
    try:
        yield
    finally:
        if was_training:
            model.train(True)


# generate() settings with a range, checked before a batch runs (transformers fails deep in a kernel, or
# hangs): name -> (lowest, whether the value must be a whole number)
GENERATE_RANGES = {
    "num_beams": (1, True), "num_beam_groups": (1, True), "top_k": (0, True), "min_new_tokens": (0, True),
    "no_repeat_ngram_size": (0, True), "num_return_sequences": (1, True), "temperature": (0, False),
    "top_p": (0, False), "repetition_penalty": (0, False), "length_penalty": (None, False),
}  # fmt: skip


# Beam search keeps num_beams sequences (and their KV cache) per prompt: past this many it is a typo or a
# hostile value (2**20 beams expand one prompt into a million sequences before anything runs)
MAX_BEAMS = 128


def check_generate_kwargs(kwargs: dict, error: type[Exception] = ValueError) -> None:
    """Refuse a ``generate()`` setting of the wrong type or out of range, naming it and its value."""
    for name, (low, whole) in GENERATE_RANGES.items():
        if name not in kwargs or kwargs[name] is None:
            continue
        if whole:
            whole_number(f"generate setting {name}", kwargs[name], minimum=low, error=error)
        else:
            number(f"generate setting {name}", kwargs[name], low=-math.inf if low is None else low, error=error)
    if "top_p" in kwargs and kwargs["top_p"] is not None and not 0 < kwargs["top_p"] <= 1:
        raise error(f"generate setting top_p is a probability in (0, 1], got {kwargs['top_p']!r}")
    for name in ("num_beams", "num_beam_groups"):
        if (kwargs.get(name) or 1) > MAX_BEAMS:
            raise error(
                f"generate setting {name}={kwargs[name]!r}: beam search keeps that many sequences (and their KV "
                f"cache) per prompt; use at most {MAX_BEAMS} (4-8 is usual)"
            )


@torch.inference_mode()
def generate_batched(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    batch_size: int = DEFAULTS.batch_size,
    progress: bool = True,
    add_special_tokens: bool = True,
    desc: str = "generating",
    stream: bool = False,
    over_context: str = "refuse",
    monitor: phases.PhaseRecorder | None = None,
    **generate_kwargs: Any,
) -> list[str]:
    """Generate for ``prompts`` in chunks of ``batch_size`` (a tqdm bar when ``progress``): the new text only.

    The model is in eval mode for the call (its training mode is restored after); with
    ``num_return_sequences=n`` in ``generate_kwargs`` the list holds n texts per prompt, in order.
    ``stream``: print the first prompt's answer token by token while its batch runs
    (:func:`first_prompt_streamer`); ignored with beam search or a ``streamer`` of your own.
    ``over_context``: a prompt whose tokens plus ``max_new_tokens`` exceed the model's context
    (:func:`context_length`) raises :class:`ContextLengthError` (``"refuse"``); ``"cap"`` gives each
    batch the new tokens its longest prompt leaves room for (a prompt that fills the context is refused).
    ``monitor``: a :class:`helpers.MemoryMonitor` to record each chunk in (an ``"eval batch"`` phase
    holding its ``"prefill"`` and ``"decode"``); default every running monitor.
    bitsandbytes' int8 note (fp32 compute on a CPU casts to fp16 inside every layer) is not logged on every call.
    """
    bnb_log = logging.getLogger("bitsandbytes.autograd._functions")
    quiet = _DropMessage("MatMul8bitLt: inputs will be cast")
    bnb_log.addFilter(quiet)
    try:
        return _generate_batched(model, tokenizer, prompts, max_new_tokens, batch_size, progress, add_special_tokens,
                                 desc, stream, over_context, generate_kwargs, monitor)  # fmt: skip
    finally:
        bnb_log.removeFilter(quiet)


def _generate_batched(model, tokenizer, prompts, max_new_tokens, batch_size, progress, add_special_tokens, desc,
                      stream, over_context, generate_kwargs, monitor=None) -> list[str]:  # fmt: skip
    if isinstance(prompts, str):
        raise TypeError(f"prompts must be a list of strings, got one string ({prompts[:40]!r}): pass [prompt]")
    if not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts must be a list of strings, got {prompts!r:.60}")
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        whole_number(name, value)
    check_generate_kwargs(generate_kwargs)
    if not callable(getattr(model, "generate", None)) or not callable(tokenizer):
        raise TypeError(
            f"generate_batched(model, tokenizer, prompts) got {type(model).__name__} and "
            f"{type(tokenizer).__name__}: pass the model first, as load() returns them"
        )
    ids = encode(tokenizer, prompts, add_special_tokens=add_special_tokens) if prompts else []
    new = new_tokens_in_context(ids, max_new_tokens, context_length(model, tokenizer), over_context)
    stop = stop_token_ids(model, tokenizer)
    stream = stream and can_stream(model, generate_kwargs)  # beam search, or the caller's own streamer: no
    out: list[str] = []
    starts = range(0, len(ids), batch_size)
    with _eval_mode(model):
        for n, i in enumerate(progress_bar(len(starts), desc, "batch", disable=not progress, iterable=starts)):
            streamer = {"streamer": first_prompt_streamer(tokenizer)} if stream and n == 0 else {}
            with phases.phase("eval batch", monitor):
                out += generate_batch(
                    model,
                    tokenizer,
                    ids[i : i + batch_size],
                    max_new_tokens=min(new[i : i + batch_size]),
                    stop=stop,
                    monitor=monitor,
                    **streamer,
                    **generate_kwargs,
                ).texts
    return out


class _DropMessage(logging.Filter):
    """A logging filter that drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# token ids the model has no embedding row for: a pad token added without resize_token_embeddings
# (advice many guides give) fails at the first padded batch with a raw IndexError from inside the model


def embedding_rows(model) -> int | None:
    """The rows of the model's input embedding (the ids it can look up); None when it has none to read."""
    try:
        emb = model.get_input_embeddings()
        rows = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    except (AttributeError, NotImplementedError, TypeError, IndexError):
        return None
    return int(rows) if isinstance(rows, int) and rows > 0 else None


def token_ids_problem(model, tokenizer) -> str | None:
    """Why the tokenizer's special tokens (pad, eos, bos) cannot be looked up in ``model``; None when they can."""
    rows = embedding_rows(model)
    if rows is None:
        return None
    for kind in ("pad", "eos", "bos"):
        tid = getattr(tokenizer, f"{kind}_token_id", None)
        if isinstance(tid, int) and not isinstance(tid, bool) and tid >= rows:
            token = getattr(tokenizer, f"{kind}_token", None)
            return (
                f"the tokenizer's {kind} token {token!r} is id {tid}, but the model's embedding has {rows} rows "
                f"(ids 0-{rows - 1}): the token was added to the tokenizer without resizing the model, and "
                "looking it up would fail inside the model. Call model.resize_token_embeddings(len(tokenizer)) "
                "after adding it (before preparing LoRA), or pad with a token the model has: "
                "tokenizer.pad_token = tokenizer.eos_token"
            )
    return None
