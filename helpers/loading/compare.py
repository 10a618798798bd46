"""What a load mode costs in quality, beside what it saves in memory: ``compare_loads(model, texts)``.

Each mode is loaded on its own with :func:`helpers.loading.load` and unloaded before the next
(:func:`helpers.reclaim.unload`), so a model that fits a T4 only in 4-bit is compared there too. On the
user's texts each mode reports perplexity (teacher forced, every token after the first), the share of
positions where its most likely next token is the reference's (greedy agreement), the KL divergence of its
next-token distributions from the reference's (what the quantization changed), its measured weight
bytes, and greedy decode tokens/s. The first mode is the reference (16-bit on a GPU, fp32 on CPU).

    >>> compare_loads("Qwen/Qwen2.5-0.5B", my_texts)          # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.devices import compute_dtype_rule, device_kind
from ..core.errors import LoadError, OomkitError
from ..core.html import escape, table
from ..core.units import format_bytes
from ..core.vocab import load_mode_name

__all__ = ["LoadCompareError", "LoadQuality", "LoadComparison", "compare_loads"]

MAX_TOKENS = 512  # each text is cut to this many tokens: quality shows in far fewer, time grows with more
DECODE_TOKENS = 16  # greedy tokens generated to time decoding
# The reference's next-token distributions are kept (fp16, CPU) for the KL divergence of each other mode
# over this many positions: 2,048 x a 128k vocabulary is 512 MiB of host RAM.
KL_TOKENS = 2048


class LoadCompareError(OomkitError, ValueError):
    """Bad input to ``compare_loads``: no texts, a text that is not a string, an unknown load mode."""


@dataclass
class LoadQuality:
    """One load mode's figures on the texts (``error``: why it could not be measured; the others stand)."""

    load: str
    perplexity: float | None = None
    agreement: float | None = None  # share of positions whose argmax next token equals the reference's
    # mean KL(reference || this mode) of the next-token distributions, nats per token: llama.cpp's measure of
    # what a quantization changes; unlike a perplexity gap it is never negative and has no first-order noise
    kl: float | None = None
    weight_bytes: int | None = None  # measured after the load (footprint)
    peak_bytes: int | None = None  # CUDA only: max_memory_allocated while scoring and decoding
    tokens_per_s: float | None = None  # greedy decode, batch 1
    load_seconds: float | None = None
    error: str | None = None
    loaded_as: str | None = None  # a bitsandbytes mode that quantized no layer: the dtype it loaded as

    @property
    def label(self) -> str:
        """The mode as the table shows it: ``nf4 (stayed fp32)`` when the weights were not quantized."""
        return f"{self.load} (stayed {self.loaded_as})" if self.loaded_as else self.load


@dataclass
class LoadComparison:
    """Quality, memory and speed per load mode, against the first (the reference)."""

    model: str
    texts: int
    tokens: int  # tokens scored per mode (every text's tokens after its first)
    rows: list[LoadQuality] = field(default_factory=list)

    @property
    def reference(self) -> LoadQuality:
        return self.rows[0]

    def gap(self, load: str) -> float | None:
        """Perplexity of ``load`` over the reference's, less 1 (0.05: 5 % higher); None if either failed."""
        row, ref = self.row(load), self.reference
        if row.perplexity is None or ref.perplexity is None:
            return None
        return row.perplexity / ref.perplexity - 1

    def row(self, load: str) -> LoadQuality:
        for r in self.rows:
            if r.load == load:
                return r
        raise KeyError(f"no load {load!r} compared; compared: {[r.load for r in self.rows]}")

    def _cells(self) -> list[list[str]]:
        cells = []
        for r in self.rows:
            if r.error:
                cells.append([r.load, "failed", "", "", "", "", "", r.error])
                continue
            gap = self.gap(r.load)
            unquantized = "bitsandbytes quantized no layer" if r.loaded_as else ""
            cells.append([
                r.label, f"{r.perplexity:.3f}", "reference" if r is self.reference else
                ("" if gap is None else f"{gap:+.2%}"),
                "" if r.kl is None else f"{r.kl:.5f}",
                "" if r.agreement is None else f"{r.agreement:.1%}",
                format_bytes(r.weight_bytes) if r.weight_bytes is not None else "",
                "" if r.tokens_per_s is None else f"{r.tokens_per_s:,.1f}",
                "; ".join(n for n in ("" if r.peak_bytes is None else f"peak {format_bytes(r.peak_bytes)}",
                                      unquantized) if n),
            ])  # fmt: skip
        return cells

    HEADER = ("load", "perplexity", "vs reference", "KL nats/token", "greedy agreement", "weights", "decode tokens/s",
              "note")  # fmt: skip

    def __str__(self) -> str:
        rows = [list(self.HEADER), *self._cells()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEADER))]
        lines = [f"{self.model}: {self.texts} texts, {self.tokens:,} tokens scored per load mode"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        title = f"{self.model}: {self.texts} texts, {self.tokens:,} tokens scored per load mode"
        return table(list(self.HEADER), self._cells(), title=title)  # table() escapes every cell

    def __repr__(self) -> str:
        return f"LoadComparison({escape(self.model)!r}, loads={[r.load for r in self.rows]})"


def _check(texts: Any, loads: Any) -> tuple[list[str], tuple[str, ...]]:
    if isinstance(texts, str) or not isinstance(texts, list | tuple) or not texts:
        raise LoadCompareError(
            f"texts must be a non-empty list of strings (your own prompts or documents), got {type(texts).__name__}"
        )
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if bad:
        raise LoadCompareError(f"texts[{bad[0]}] is not a non-empty string; pass only text to score")
    if loads is None:
        loads = (compute_dtype_rule(device_kind()), "int8", "nf4")
    if isinstance(loads, str) or not loads:
        raise LoadCompareError("loads must be a sequence of load modes, the reference first: e.g. ('bf16', 'nf4')")
    return list(texts), tuple(load_mode_name(m, error=LoadCompareError) for m in loads)


def _score(model, encoded: list[torch.Tensor]) -> tuple[float, int, list[torch.Tensor], torch.Tensor]:
    """(summed negative log-likelihood, tokens scored, argmax next tokens per text, the log-probabilities of the
    first :data:`KL_TOKENS` positions in fp16 on the CPU)."""
    nll, count, argmax, kept = 0.0, 0, [], []
    with torch.no_grad():
        for ids in encoded:
            logits = model(input_ids=ids.to(model.device)).logits[0, :-1].float()
            target = ids[0, 1:].to(logits.device)
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            room = KL_TOKENS - sum(k.shape[0] for k in kept)
            if room > 0:
                kept.append(torch.log_softmax(logits[:room], -1).to("cpu", torch.float16))
            count += target.numel()
            argmax.append(logits.argmax(-1).cpu())
    return nll, count, argmax, torch.cat(kept)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref, oth = reference.float(), other.float()
    return float((ref.exp() * (ref - oth)).sum(-1).mean())


def _decode_rate(model, ids: torch.Tensor) -> float:
    prompt = ids[:, :32].to(model.device)
    kwargs = dict(max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, do_sample=False, eos_token_id=None,
                  pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)  # warm
        started = time.perf_counter()
        model.generate(prompt, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return DECODE_TOKENS / (time.perf_counter() - started)


def _measure(model_path: str, mode: str, texts: list[str], load_kwargs: dict) -> tuple[LoadQuality, list, Any, int]:
    from ..oom.reclaim import unload
    from .loader import load

    model, tokenizer, report = load(model_path, load=mode, **load_kwargs)
    try:
        encoded = [tokenizer(t, return_tensors="pt").input_ids[:, :MAX_TOKENS] for t in texts]
        encoded = [e for e in encoded if e.shape[1] > 1]
        if not encoded:
            raise LoadCompareError("every text is one token or less: nothing to score; pass sentences")
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        nll, count, argmax, logprobs = _score(model, encoded)
        rate = _decode_rate(model, encoded[0])
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    finally:
        unload(model, namespace={})  # free before the next mode loads: one model in memory at a time
    row = LoadQuality(mode, perplexity=math.exp(nll / count), weight_bytes=report.measured_weights, peak_bytes=peak,
                      tokens_per_s=rate, load_seconds=report.load_seconds,
                      loaded_as=report.loaded_mode if report.stayed_unquantized else None)  # fmt: skip
    return row, argmax, logprobs, count


class _quiet_bitsandbytes:
    """bitsandbytes' int8 matmul logs a cast warning once per layer and call on CPU: hundreds of lines."""

    logger = logging.getLogger("bitsandbytes.autograd._functions")

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def compare_loads(
    model_path: str, texts: list[str], loads: tuple[str, ...] | None = None, **load_kwargs
) -> LoadComparison:
    """Load ``model_path`` once per mode in ``loads`` (default: the device's 16-bit dtype, or fp32 on CPU,
    then int8 and nf4) and score each on ``texts``: perplexity, greedy agreement with the first mode,
    weight bytes and decode tokens/s. ``load_kwargs`` go to :func:`helpers.loading.load` (``check=False``...).

    A mode that cannot load (bitsandbytes missing, refused as too big) gets its reason in ``error``; the
    other modes' figures stand.
    """
    texts, loads = _check(texts, loads)
    comparison = LoadComparison(model=str(model_path), texts=len(texts), tokens=0)
    reference = None
    for mode in loads:
        try:
            with _quiet_bitsandbytes():
                row, argmax, logprobs, count = _measure(str(model_path), mode, texts, load_kwargs)
        except (LoadError, ImportError, RuntimeError) as e:
            comparison.rows.append(LoadQuality(mode, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        if reference is None and not comparison.rows:
            reference = (argmax, logprobs)
        if reference is not None:
            same = sum(int((a == b).sum()) for a, b in zip(argmax, reference[0]))
            row.agreement = same / max(sum(a.numel() for a in reference[0]), 1)
            row.kl = _kl(reference[1], logprobs)
        comparison.tokens = count
        comparison.rows.append(row)
    return comparison
