"""``estimate()``: the rows of a model's GPU memory for a load mode and a use (generation or training)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from html import escape
from typing import Any

from ..core.arguments import flag, whole_number
from ..core.devices import (
    CUBLAS_WORKSPACE,
    CUBLAS_WORKSPACE_HOPPER,
    CUBLAS_WORKSPACE_HOPPER_MAJORS,
    CUDA_CONTEXT,
    compute_dtype_rule,
    cuda_capability,
    resolve_device,
)
from ..core.html import LEVEL_FILLS, Markup, level_color, mini_bar, share_percent, table
from ..core.units import format_bytes
from ..core.vocab import (
    BF16,
    DEFAULTS,
    DTYPE_BYTES,
    TIGHT_FRACTION,
    ReducerError,
    auto_load_order,
    dtype_name,
    kv_cache_name,
    load_mode_name,
    loss_name,
)
from .configs import hub_repo, resolve_config
from .families import CAUSAL, IMAGE_TEXT, family
from .family_rows import check_family_inputs, encoder_decoder_rows, image_tokens, vision_rows
from .family_training import vlm_sequence
from .hub_headers import header_rows, read_hub_headers
from .inference import Generation, generation_rows
from .kernel_paths import dequantized_rows, kernel_path, native_rows, path_note
from .layout import layout, weight_rows
from .prequantized import NATIVE_FORMATS, PACKED_METHODS, SHIPS_PREQUANTIZED, packed_rows, repo_quantization
from .rows import HOST, LOWER_BOUND, EstimateError, EstimateRow
from .training import FullTraining, LoraTraining, training_rows

__all__ = [
    "MemoryEstimate",
    "estimate",
    "FRAGMENTATION",
    "cublas_workspace",
    "SUMMARY_SEGMENTS",
    "summary_bar",
]

FRAGMENTATION = 0.05  # of the transient (KV cache, activations) memory: a rule of thumb until measured on a GPU


@dataclass
class MemoryEstimate:
    """The predicted memory of a model with given settings, as rows you can read and add up."""

    model: str
    load: str
    rows: list[EstimateRow]
    params: int
    device: str
    capacity: int | None
    approximate: bool = False
    warnings: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict, repr=False)
    source: Any = field(default=None, repr=False)
    quantized_by: str | None = None  # the checkpoint's own quantization ("bitsandbytes", "gptq", "awq")
    context: int | None = None  # the model's max_position_embeddings (None: the config does not say)
    host_rows: list[EstimateRow] = field(default_factory=list)  # host RAM an offload takes, not in total
    config: Any = field(default=None, repr=False, compare=False)  # what was estimated: time() reads its shape

    @property
    def host_total(self) -> int:
        """Bytes of host RAM the offloading reducers take (0 when nothing is offloaded)."""
        return sum(r.bytes for r in self.host_rows)

    @property
    def weights(self) -> int:
        """Bytes of the loaded weights (parameters, buffers, quantization state)."""
        return sum(r.bytes for r in self.rows if r.group == "weights")

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def lower_bounds(self) -> list[EstimateRow]:
        """The rows that are only lower bounds (their formula leaves out what it cannot size): with any, the
        estimate is at least :attr:`total`."""
        return [r for r in self.rows if r.kind == LOWER_BOUND]

    def row(self, key: str) -> EstimateRow:
        """The row with this key (``"kv_cache"``, ``"weights.quant_state"``, ...)."""
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(f"no row {key!r}; rows: {[r.key for r in self.rows]}")

    def group_bytes(self, group: str) -> int:
        """Bytes of every row in a group (``"weights"``, ``"kv_cache"``, ``"activations"``, ...)."""
        return sum(r.bytes for r in self.rows if r.group == group)

    def time(self, device: Any = None, **kwargs):
        """How long this plan takes on ``device`` (default: its own; ``calibration=calibrate()`` for this
        machine): load, prefill, decode, totals. See :func:`helpers.estimator.timing.estimate_time`."""
        from .timing import estimate_time

        return estimate_time(self, device, **kwargs)

    def replace(self, **changes) -> MemoryEstimate:
        """Re-estimate the same model with some settings changed (``load``, ``max_new_tokens``, ...)."""
        kwargs = {**self.inputs, **changes}
        return estimate(self.source, **kwargs)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "load": self.load, "params": self.params, "device": self.device,
            "capacity": self.capacity, "weights": self.weights, "total": self.total,
            "approximate": self.approximate, "warnings": self.warnings,
            "rows": [{"key": r.key, "name": r.name, "bytes": r.bytes, "kind": r.kind, "note": r.note} for r in self.rows],
            "host_rows": [{"key": r.key, "name": r.name, "bytes": r.bytes, "kind": r.kind, "note": r.note}
                          for r in self.host_rows],
            "inputs": {k: (dataclasses.asdict(v) | {"type": type(v).__name__}) if dataclasses.is_dataclass(v) else v
                       for k, v in self.inputs.items()},
        }  # fmt: skip

    def request(self) -> str:
        """The sizes this estimate assumed, in words: ``batch 1, 512 prompt + 256 new tokens``, or the
        training step's ``micro-batch 1 x 512 tokens`` (so a verdict never hides the budget it was made for)."""
        tr, inp = self.inputs.get("training"), self.inputs
        if tr is not None:
            return f"training: micro-batch {tr.micro_batch} x {tr.seq_len} tokens"
        if "batch_size" not in inp:
            return ""
        return f"batch {inp['batch_size']}, {inp['prompt_tokens']} prompt + {inp['max_new_tokens']} new tokens"

    def summary(self) -> list[tuple[str, int]]:
        """The one-glance split (the panel's segments): ``(label, bytes)`` per :data:`SUMMARY_SEGMENTS` entry this
        estimate has rows of, in bar order; they add up to ``total``."""
        return [(label, self.group_bytes_of(groups)) for label, groups in SUMMARY_SEGMENTS
                if any(r.group in groups for r in self.rows)]  # fmt: skip

    def group_bytes_of(self, groups: tuple[str, ...]) -> int:
        return sum(r.bytes for r in self.rows if r.group in groups)

    def _head(self) -> str:
        asked = self.request()
        return (
            f"{self.model}: {self.params:,} parameters, load={self.load}"
            + (" (approximate count)" if self.approximate else "")
            + (f"; {asked}" if asked else "")
        )

    def _total_line(self) -> str:
        """``5.80 GiB of 14.74 GiB on t4 (39 %): 8.94 GiB free``; over the card, the share over 100 % and by how much."""
        if not self.capacity:
            return format_bytes(self.total)
        room = self.capacity - self.total
        left = f"{format_bytes(room)} free" if room >= 0 else f"{format_bytes(-room)} over"
        return f"{format_bytes(self.total)} of {format_bytes(self.capacity)} on {self.device} ({share_percent(self.total, self.capacity)} %): {left}"

    def __str__(self) -> str:
        """The short form: the summary's few segments and the total; :meth:`details` has every row."""
        parts = self.summary()
        w = max([len(label) for label, _ in parts] + [len("total")])
        lines = [self._head()] + [f"  {label:<{w}}  {format_bytes(n):>11}" for label, n in parts]
        total, _, rest = self._total_line().partition(" of ")
        lines.append(f"  {'total':<{w}}  {total:>11}" + (f" of {rest}" if rest else ""))
        lines += self._tail()
        lines.append(f"  ({len(self.rows)} rows in .details(), each with how it is known)")
        return "\n".join(lines)

    def __repr__(self) -> str:  # the text a notebook shows without HTML (papermill, a terminal): not every row's repr
        return self.__str__()

    def _tail(self) -> list[str]:
        """Host RAM, notes and the time line: under both the short form and the details."""
        lines = [f"  host RAM: {r.name}  {format_bytes(r.bytes)}  {r.kind} ({r.note})" for r in self.host_rows]
        lines += [f"  note: {m}" for m in self.warnings]
        from .timing import time_line  # the card's datasheet only: no probe, no download

        return lines + ([f"  {line}"] if (line := time_line(self)) else [])

    def details(self) -> str:
        """Every row of the estimate, with how it is known (exact, formula, rule of thumb)."""
        w = max(len(r.name) for r in self.rows)
        lines = [self._head()] + [f"  {r.name:<{w}}  {format_bytes(r.bytes):>11}  {r.kind}" for r in self.rows]
        cap = f" of {format_bytes(self.capacity)} on {self.device}" if self.capacity else ""
        lines.append(f"  {'total':<{w}}  {format_bytes(self.total):>11}{cap}")
        return "\n".join(lines + self._tail())

    def _repr_html_(self) -> str:
        # first the one-glance summary (a stacked bar of the few segments, the total against the card), then
        # every row, folded: each row's share of the card (of the total without one)
        whole = self.capacity or self.total
        rows = [[r.name, format_bytes(r.bytes), mini_bar(r.bytes, whole), r.kind, r.note] for r in self.rows]
        rows.append([Markup("<b>total</b>"), Markup(f"<b>{format_bytes(self.total)}</b>"),
                     mini_bar(self.total, self.capacity), "", ""])  # fmt: skip
        rows += [[f"host RAM: {r.name}", format_bytes(r.bytes), "", r.kind, r.note] for r in self.host_rows]
        share = f"share of {self.device}" if self.capacity else "share"
        html = f"<div class='oomkit-estimate'><div><b>{escape(self._head())}</b></div>"
        html += summary_bar(self.summary(), self.total, self.capacity)
        html += f"<div style='font-family:monospace'>total {escape(self._total_line())}</div>"
        html += "".join(f"<div>note: {escape(m)}</div>" for m in self.warnings)
        html += (
            f"<details><summary>all {len(self.rows)} rows: where each figure comes from</summary>"
            + table(["", "bytes", share, "kind", "note"], rows)
            + "</details>"
        )
        from .timing import time_line  # the card's datasheet only: no probe, no download

        return html + (f"<div>{escape(line)}</div>" if (line := time_line(self)) else "") + "</div>"


# The summary's segments: (label, estimate row groups) in bar order, the panel's four (weights, what the use
# keeps: the KV cache or the training state, activations, overheads); a segment without rows is left out.
SUMMARY_SEGMENTS = (
    ("weights", ("weights",)),
    ("KV cache", ("kv_cache",)),
    ("training state", ("training",)),
    ("activations", ("activations",)),
    ("overheads", ("overhead",)),
)
_SEGMENT_OPACITY = (1.0, 0.75, 0.75, 0.5, 0.3)  # the panel's shades, so the same bar reads the same
TRACK = "rgba(128,128,128,0.25)"  # the empty part of a bar: translucent, so it reads on a light or dark theme


def summary_bar(parts: list[tuple[str, int]], total: int, capacity: int | None, width: int = 420) -> str:
    """A stacked bar of ``parts`` against ``capacity`` (the free part empty; past the card, scaled to the total
    with the card's edge marked), each part's label and bytes under it."""
    scale = max(capacity or 0, total) or 1
    color = level_color(total, capacity) if capacity else LEVEL_FILLS["ok"]
    opacity = dict(zip((label for label, _ in SUMMARY_SEGMENTS), _SEGMENT_OPACITY, strict=True))
    spans = "".join(
        f"<span title='{escape(label)} {format_bytes(n)}' style='display:block;float:left;height:100%;"
        f"width:{100 * n / scale:.2f}%;background:{color};opacity:{opacity.get(label, 0.5)}'></span>"
        for label, n in parts
    )
    edge = (f"<span style='position:absolute;left:{100 * capacity / scale:.2f}%;top:0;width:2px;height:100%;"
            "background:currentColor'></span>") if capacity and total > capacity else ""  # fmt: skip
    legend = [
        f"<span style='white-space:nowrap'><span style='color:{color};opacity:{max(opacity.get(label, 0.5), 0.5)}'>"
        f"&#9632;</span> {escape(label)} {format_bytes(n)}</span>"
        for label, n in parts
    ]
    if capacity:
        room = capacity - total
        legend.append(f"<span style='white-space:nowrap'>&#9633; free {format_bytes(room)}</span>" if room >= 0 else
                      f"<span style='white-space:nowrap'>over the card by {format_bytes(-room)}</span>")  # fmt: skip
    return (
        f"<div style='font-family:monospace;margin:4px 0'><div style='position:relative;width:100%;"
        f"max-width:{width}px;height:14px;background:{TRACK};border-radius:3px;overflow:hidden'>{spans}{edge}</div>"
        f"<div>{' &nbsp; '.join(legend)}</div></div>"
    )


def _compute_bytes(compute_dtype: Any, load: str, dev: dict | None) -> tuple[str, int]:
    try:
        compute_dtype = dtype_name(compute_dtype)
    except ValueError as e:
        raise EstimateError(f"compute_dtype: {e}") from None
    if load in DTYPE_BYTES:  # an unquantized model computes in the dtype it is loaded in
        return load, DTYPE_BYTES[load]
    if compute_dtype == "auto":
        compute_dtype = compute_dtype_rule(dev)  # the same rule load() uses on that device
    return compute_dtype, DTYPE_BYTES[compute_dtype]


def estimate(
    model: Any,
    *,
    load: str = "auto",
    double_quant: bool = True,
    compute_dtype: str = "auto",
    batch_size: int = DEFAULTS.batch_size,
    prompt_tokens: int = DEFAULTS.prompt_tokens,
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    training: LoraTraining | FullTraining | None = None,
    device: Any = None,
    skip_modules: list[str] | None = None,
    sampling: bool = False,
    kv_cache: str = "dynamic",
    encoder_tokens: int | None = None,
    audio_seconds: float | None = None,
    images: int | None = None,
    image_size: int | tuple[int, int] | None = None,
) -> MemoryEstimate:
    """Predict the GPU memory of ``model`` loaded with ``load`` and used as described.

    Args:
        model: hub id (its config.json is read, and for a config that does not ship, the headers of its
            safetensors files: exact weight bytes before download), short name or hub id of a shipped config
            (``helpers/data/configs``, offline), local folder, config.json path, config object or loaded model.
        load: fp32, fp16, bf16, int8 (LLM.int8), nf4 or fp4 (bitsandbytes 4-bit); "auto" (default) picks
            the widest that fits ``device``, or a pre-quantized checkpoint's own mode (bnb, GPTQ, AWQ).
        double_quant: 4-bit only: quantize the absmax values too (bnb_4bit_use_double_quant).
        compute_dtype: dtype of activations, KV cache and unquantized weights for quantized loads;
            "auto": the load dtype, or bf16 where the device supports it, else fp16.
        batch_size, prompt_tokens, max_new_tokens: generation shape (ignored when ``training``).
        training: :class:`LoraTraining` or :class:`FullTraining` for one training step instead.
        device: preset name (see ``DEVICES``), capacity in bytes, "current" or "cpu" (default T4).
        skip_modules: like ``llm_int8_skip_modules``: module names kept unquantized.
        sampling: generate() samples (``do_sample=True`` with top-k / top-p) instead of picking the
            likeliest token: its logits processors take about 34 bytes per batch x vocab entry more.
        encoder_tokens: encoder-decoder text models (T5, BART): the encoder's input length (default
            ``prompt_tokens``); the decoder starts from one token.
        audio_seconds: speech models (Whisper): the audio's length; each window is padded to the
            model's (30 s), so memory is that of one window.
        images, image_size: vision-language models: images per sample (default 1) and their size in
            pixels (an int or (height, width); it changes the token count where the processor keeps
            the resolution, as Qwen2-VL's does).
    """
    inputs = dict(load=load, double_quant=double_quant, compute_dtype=compute_dtype, batch_size=batch_size,
                  prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, training=training, device=device,
                  skip_modules=skip_modules, sampling=sampling, kv_cache=kv_cache)  # fmt: skip
    family_inputs = dict(encoder_tokens=encoder_tokens, audio_seconds=audio_seconds, images=images,
                         image_size=image_size)  # fmt: skip
    inputs.update({k: v for k, v in family_inputs.items() if v is not None})  # only a family's own
    _check_inputs(inputs)
    label, dev = resolve_device(device)
    config, name, loaded = resolve_config(model)
    check_family_inputs(config, family_inputs)
    repo, path = repo_quantization(config), None
    if repo is not None:
        requested = load
        load, double_quant, skip_modules = _repo_settings(repo, load, double_quant, skip_modules, name)
        if repo.method in (*NATIVE_FORMATS, "compressed-tensors"):
            # inputs keep the load as asked: on another device (a fix's bigger card) the path may differ
            kind = None if training is None else ("full" if isinstance(training, FullTraining) else "lora")
            path = kernel_path(repo, _with_capability(device, dev), requested, kind)
            load = path.load
            inputs.update(double_quant=double_quant)
        else:
            inputs.update(load=load, double_quant=double_quant)
    elif load == "auto":
        return _auto(model, inputs)
    else:
        load = load_mode_name(load, error=EstimateError)
        inputs.update(load=load)
    lay = layout(config, loaded)
    cdtype, b = _compute_bytes(compute_dtype, load, dev)
    if path is not None:
        rows, header_notes = _path_weights(model, lay, repo, path, b)
    else:
        rows, header_notes = _weights(model, lay, load, b, repo, double_quant, skip_modules)
    if training is None:
        shape = Generation(batch_size, prompt_tokens, max_new_tokens, b, cdtype, dev, load, double_quant,
                           skip_modules, sampling, inputs["kv_cache"])  # fmt: skip
        rows += _use_rows(config, lay, shape, family_inputs)
    else:
        unquantized = next((r.bytes for r in rows if r.key == "weights.unquantized"), 0)
        rows += training_rows(lay, config, load, b, training, unquantized, family_inputs, cpu=dev is None)[0]
    warnings = (_warnings(lay, config, load, cdtype, dev, inputs), header_notes)
    return _assembled(model, str(name), load, rows, lay, config, (label, dev, device), inputs, warnings, repo)


def _assembled(model, name: str, load: str, rows: list[EstimateRow], lay, config, where: tuple, inputs: dict,
               warnings: tuple[list, list], repo) -> MemoryEstimate:  # fmt: skip
    """The estimate from its rows: host rows set apart, the allocator and CUDA overheads added."""
    (label, dev, device), (first, notes) = where, warnings
    host = [r for r in rows if r.group == HOST]
    rows = [r for r in rows if r.group != HOST]
    rows += _overhead_rows(rows, len(lay.entries), workspace=cublas_workspace(device, dev))
    return MemoryEstimate(
        model=name,
        load=load,
        rows=rows,
        params=lay.params,
        device=label,
        capacity=(dev or {}).get("capacity"),
        approximate=lay.approximate,
        warnings=first + _moe_warning(rows, load, config) + _family_warnings(config, rows, inputs) + notes,
        inputs=inputs,
        source=model,
        quantized_by=repo.method if repo is not None else None,
        context=_context(config),
        host_rows=host,
        config=config,
    )


def _weights(model, lay, load: str, b: int, repo, double_quant: bool, skip_modules) -> tuple[list[EstimateRow], list]:
    """The weight rows and their notes: from the safetensors headers of a hub repo whose config is not
    shipped, where they can be read (every tensor's dtype and shape: exact before any download) and the
    load keeps the checkpoint's layout (a pre-quantized repo, or a 16/32-bit load); else from the config."""
    # an int8/4-bit load of an ordinary checkpoint is laid out by bitsandbytes from the shapes the config
    # gives as well: the headers would add requests, not precision
    keeps_layout = repo is not None or load in DTYPE_BYTES
    repo_id = hub_repo(model) if keeps_layout else None
    headers, why = read_hub_headers(repo_id) if repo_id is not None else (None, None)
    notes = [f"weights counted from the config, not the checkpoint: {why}"] if why else []
    if headers is not None:
        rows = header_rows(headers, lay, load, b, prequantized=repo is not None)
        return rows, notes + _count_note(headers, lay, repo)
    if load in PACKED_METHODS:
        return packed_rows(lay, repo, b), notes
    return weight_rows(lay, load, b, double_quant, skip_modules), notes


def _path_weights(model, lay, repo, path, b: int) -> tuple[list[EstimateRow], list]:
    """An mxfp4/fp8/compressed-tensors checkpoint's weights on the path transformers takes on this device,
    and a note naming it (and, when dequantized, what the packed format would hold and the fix). Kept packed,
    a hub repo's weights come from its safetensors headers where they can be read (as stored: exact)."""
    native = native_rows(lay, repo, b) if repo.method in NATIVE_FORMATS else []
    if path.dequantized:
        rows = dequantized_rows(lay, path, repo)
        return rows, [path_note(path, repo, rows, native)]
    repo_id = hub_repo(model)
    headers, why = read_hub_headers(repo_id) if repo_id is not None else (None, None)
    notes = [f"weights counted from the config, not the checkpoint: {why}"] if why else []
    # fp32 modules as native_rows keeps them: the checkpoint's own dtype (bf16) rules, not an fp16 load's
    rows = header_rows(headers, lay, BF16, b, prequantized=True, method=repo.method) if headers else native
    return rows, [path_note(path, repo, rows, native), *notes]


def _count_note(headers, lay, repo) -> list[str]:
    """An ordinary checkpoint whose headers hold another parameter count than the architecture builds
    (a tied lm_head stored twice, leftover tensors transformers skips): say so, the headers are what is read."""
    if repo is not None:
        return []
    stored = sum(t.numel for t in headers.entries.values())
    if stored == lay.params:
        return []
    return [f"the checkpoint's headers hold {stored:,} values, the architecture {lay.params:,} parameters: "
            "the weights row counts the checkpoint's tensors (transformers drops unused ones, ties shared ones)"]  # fmt: skip


def _use_rows(config, lay, g: Generation, extra: dict) -> list[EstimateRow]:
    """The generation rows of the model's family: decoder-only, encoder-decoder or vision-language."""
    fam = family(config)
    if fam == CAUSAL:
        return generation_rows(config, lay, g)
    if fam != IMAGE_TEXT:
        return encoder_decoder_rows(config, g.batch, g.prompt, g.new, g.b, extra)
    images = 1 if extra["images"] is None else extra["images"]
    per, note = image_tokens(config, extra["image_size"])
    seq = g.prompt + images * per
    rows = generation_rows(config, lay, dataclasses.replace(g, prompt=seq))
    rows[0].note += f"; {images} image(s) x {per} tokens in the prompt ({note})"
    return rows + vision_rows(config, g.batch, seq, images, per, g.b, sum(r.bytes for r in rows))


def _context(config) -> int | None:
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(c, "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def _warnings(lay, config, load: str, cdtype: str, dev: dict | None, inputs: dict) -> list[str]:
    """What the numbers alone do not say: an approximate count, bf16 on a card without it, a length
    past the model's context."""
    out = [f"parameter count is approximate (dimension-based): {lay.missing[0]}"] if lay.approximate else []
    if dev is not None and not dev.get("bf16") and BF16 in (load, cdtype):
        out.append(f"{dev.get('name', 'this GPU')} has no bf16 (compute capability < 8.0): use fp16 there")
    context = _context(config)
    tokens = inputs["prompt_tokens"] + inputs["max_new_tokens"] if inputs["training"] is None else None
    if tokens is None and inputs["training"] is not None:
        tokens = inputs["training"].seq_len
    if isinstance(context, int) and tokens is not None and tokens > context:
        out.append(f"{tokens} tokens is past this model's context of {context}: it would fail or degrade; "
                   f"keep prompt + new tokens <= {context}")  # fmt: skip
    return out


def _moe_warning(rows: list[EstimateRow], load: str, config=None) -> list[str]:
    experts = next((r.bytes for r in rows if r.key == "weights.moe_experts"), 0)
    if not experts:
        return []
    total = sum(r.bytes for r in rows if r.group == "weights")
    fix = "a pre-quantized checkpoint (GPTQ/AWQ) of this model, more GPUs, or a dense model of similar quality"
    shipped = SHIPS_PREQUANTIZED.get(getattr(config, "model_type", None))
    if shipped:  # its checkpoints already are pre-quantized: this config lost its quantization_config
        fix = (f"this architecture's checkpoints ship in {shipped}: estimate the checkpoint's own config.json, with "
               f"its quantization_config ({shipped} is read, and where transformers keeps it), or more GPUs")  # fmt: skip
    return [
        f"{format_bytes(experts)} of the {format_bytes(total)} of weights are MoE expert tensors that bitsandbytes "
        f"does not quantize: {load} saves far less here than on a dense model. Fix: {fix}"
    ]


def _family_warnings(config, rows: list[EstimateRow], inputs: dict) -> list[str]:
    """A VLM's 16-bit vision tower or Whisper's audio encoder in a quantized load; a family's full fine-tuning
    (counted as a decoder's); a VLM's seq_len too short for its image tokens."""
    fam, training = family(config), inputs["training"]
    out = []
    vision = next((r.bytes for r in rows if r.key == "weights.vision"), 0)
    audio = next((r.bytes for r in rows if r.key == "weights.audio_encoder"), 0)
    total = sum(r.bytes for r in rows if r.group == "weights")
    if vision:
        out.append(f"{format_bytes(vision)} of the {format_bytes(total)} of weights are the vision tower and "
                   "projector, kept in 16 bits (quantizing the image path costs quality)")  # fmt: skip
    if audio:
        out.append(f"{format_bytes(audio)} of the {format_bytes(total)} of weights are the audio encoder, kept in "
                   "16 bits (LoRA trains the decoder around it; quantizing it costs transcripts more)")  # fmt: skip
    if isinstance(training, LoraTraining) and fam == IMAGE_TEXT:
        seq, images, per, _ = vlm_sequence(config, training, inputs)
        if seq > training.seq_len:
            out.append(f"seq_len {training.seq_len} cannot hold {images} image(s) x {per} tokens: each sample's "
                       f"tokens, image tokens included, must fit seq_len (counted as {seq}); raise seq_len")  # fmt: skip
    return out


def _repo_settings(repo, load: str, double_quant: bool, skip: list[str] | None, name: str):
    """A pre-quantized checkpoint loads as it was saved: its mode is the only one, "auto" means it (mxfp4 and
    fp8 may also be asked dequantized, as transformers' ``dequantize=True`` loads them: bf16)."""
    if load not in ("auto", repo.load) and not (repo.method in NATIVE_FORMATS and load == BF16):
        raise EstimateError(
            f"{name} is already quantized ({repo.method}, {repo.load}): it loads as {repo.load} only; pass "
            f"load='auto' or load={repo.load!r}, or estimate the original (unquantized) model for {load}"
        )
    return repo.load, repo.double_quant, (skip if skip is not None else (repo.skip or None))


def _check_inputs(inputs: dict) -> None:
    for k in ("batch_size", "prompt_tokens", "max_new_tokens"):
        whole_number(k, inputs[k], minimum=0 if k == "max_new_tokens" else 1, error=EstimateError)
    flag("double_quant", inputs["double_quant"], error=EstimateError)
    if not isinstance(inputs["sampling"], bool):
        raise EstimateError(
            f"sampling must be True or False (do_sample with top-k / top-p), got {inputs['sampling']!r}"
        )
    try:
        inputs["kv_cache"] = kv_cache_name(inputs["kv_cache"])
    except ReducerError as e:
        raise EstimateError(str(e)) from None
    skip = inputs["skip_modules"]
    if skip is not None and (not isinstance(skip, list | tuple) or not all(isinstance(m, str) and m for m in skip)):
        raise EstimateError(f"skip_modules must be a list of module names such as ['lm_head'] (or None), got {skip!r}")
    training = inputs["training"]
    if training is None:
        return
    if not isinstance(training, LoraTraining | FullTraining):
        raise EstimateError(f"training must be LoraTraining(...), FullTraining(...) or None, got {training!r}")
    type(training).__post_init__(training)  # fields changed after construction are checked again
    _check_reducers(training)


def _check_reducers(training) -> None:
    try:
        loss_name(training.loss)
    except ReducerError as e:
        raise EstimateError(f"training.loss: {e}") from None
    if not isinstance(training.offload_activations, bool):
        raise EstimateError(f"training.offload_activations must be True or False, got {training.offload_activations!r}")


def _with_capability(device: Any, dev: dict | None) -> dict | None:
    """``dev`` with its compute capability: "current" reads this GPU's (its dict carries none), as
    :func:`cublas_workspace` does; transformers decides the mxfp4/fp8 kernel path on it."""
    if dev is not None and dev.get("capability") is None and isinstance(device, str):
        if device.strip().lower() == "current":
            return {**dev, "capability": cuda_capability()}
    return dev


_WORKSPACE_CONFIG = {CUBLAS_WORKSPACE: ":4096:2:16:8", CUBLAS_WORKSPACE_HOPPER: ":4096:8"}


def cublas_workspace(device: Any, dev: dict | None) -> int:
    """Bytes of torch's default cuBLAS workspace on ``dev`` (0 on CPU): 32 MiB on Hopper and Blackwell,
    8,519,680 bytes before (a device of unknown compute capability counts as the latter)."""
    if dev is None:
        return 0
    capability = dev.get("capability")
    if capability is None and isinstance(device, str) and device.strip().lower() == "current":
        capability = cuda_capability()
    return (
        CUBLAS_WORKSPACE_HOPPER if capability and capability[0] in CUBLAS_WORKSPACE_HOPPER_MAJORS else CUBLAS_WORKSPACE
    )


def _overhead_rows(rows: list[EstimateRow], n_tensors: int, *, workspace: int) -> list[EstimateRow]:
    """``workspace`` is the cuBLAS workspace's bytes, 0 on CPU (no CUDA context either)."""
    # the weights, and QLoRA's fp32 copy of the unquantized ones (allocated once, held for the whole run),
    # are not transient: the GPU check's QLoRA cells were measured against estimates that left it out
    transient = sum(r.bytes for r in rows if r.group != "weights" and r.key != "training.fp32_upcast")
    out = [
        EstimateRow("overhead.rounding", "allocator rounding", n_tensors * 256, "formula",
                    "512-byte blocks, ~256 B lost per tensor"),
        EstimateRow("overhead.fragmentation", "fragmentation margin", int(transient * FRAGMENTATION), "rule of thumb",
                    f"{FRAGMENTATION:.0%} of the transient memory"),
    ]  # fmt: skip
    if workspace:
        out += [
            EstimateRow("overhead.cuda_context", "CUDA context", CUDA_CONTEXT, "rule of thumb",
                        "outside PyTorch's allocator: driver context and kernels, 300-500 MiB"),
            EstimateRow("overhead.cublas_workspace", "cuBLAS workspace", workspace, "formula",
                        f"torch's default CUBLAS_WORKSPACE_CONFIG {_WORKSPACE_CONFIG.get(workspace, '')} on this "
                        "GPU, one per stream; allocated by PyTorch, so inside memory_reserved()"),
        ]  # fmt: skip
    return out


def _auto(model, inputs) -> MemoryEstimate:
    """load="auto": the widest load mode that fits the device (the smallest if none does)."""
    _, dev = resolve_device(inputs["device"])
    est = None
    for load in auto_load_order(bool((dev or {}).get("bf16"))):
        est = estimate(model, **{**inputs, "load": load})
        if est.capacity is None or est.total <= est.capacity * TIGHT_FRACTION:
            return est
    return est
