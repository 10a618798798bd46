"""Exact weight sizes of a hub repo before any download: the dtype and shape of every tensor, read from
the JSON headers of its safetensors files (HTTP range requests of a few kB each, never the weights).

Pre-quantized checkpoints (bitsandbytes, GPTQ, AWQ) load onto the GPU as they are stored, so their
headers are the loaded bytes; an ordinary checkpoint's floating-point tensors are cast to the load dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.sources import hub_offline_reason
from ..core.vocab import FP32
from .layout import Layout, fp32_modules
from .rows import EstimateRow

__all__ = ["HeaderTensor", "HeaderWeights", "read_hub_headers", "header_rows", "clear_header_cache", "HEADER_NOTE"]

HEADER_NOTE = "from the safetensors headers"
# Tensors a pre-quantized checkpoint stores beside each packed weight; they stay in their stored dtype.
QUANT_STATE_SUFFIXES = (
    ".qzeros", ".scales", ".g_idx", ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".SCB",
    ".weight_format",
)  # fmt: skip
# bitsandbytes saves each 4-bit layer's QuantState as a small uint8 JSON blob that load() parses into
# Python values: it never becomes a GPU tensor
BNB_STATE_BLOB = ".quant_state.bitsandbytes__"


@dataclass
class HeaderTensor:
    """One tensor of a safetensors header: its dtype name (``F16``, ``I32``, ...), element count and bytes."""

    dtype: str
    numel: int
    nbytes: int

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("F", "BF"))


@dataclass
class HeaderWeights:
    """The tensors of a hub repo's safetensors files, as their headers state them."""

    repo: str
    files: list[str]
    entries: dict[str, HeaderTensor] = field(repr=False)

    @property
    def tensors(self) -> int:
        return len(self.entries)

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor as stored (the checkpoint's size without its headers)."""
        return sum(t.nbytes for t in self.entries.values())

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.entries.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return out

    @property
    def source(self) -> str:
        return f"{HEADER_NOTE} of {', '.join(self.files[:2])}{' ...' if len(self.files) > 2 else ''}"


_CACHE: dict[tuple[str, str, str | None], tuple[HeaderWeights | None, str | None]] = {}


def clear_header_cache() -> None:
    """Forget the headers read so far (the next estimate of each repo asks the hub again)."""
    _CACHE.clear()


def _from_metadata(repo: str, meta) -> HeaderWeights:
    entries = {}
    for fm in meta.files_metadata.values():
        for name, info in fm.tensors.items():
            start, end = info.data_offsets
            entries[name] = HeaderTensor(str(info.dtype), int(info.parameter_count), int(end) - int(start))
    return HeaderWeights(repo, sorted(meta.files_metadata), entries)


def _why(repo: str, e: Exception) -> str:
    """A sentence for a failed header read, by the kind of failure (never the library's traceback)."""
    from huggingface_hub.errors import GatedRepoError, NotASafetensorsRepoError, RepositoryNotFoundError

    if isinstance(e, GatedRepoError):
        return f"{repo} is gated: accept its license on the hub and log in (hf auth login) to read its headers"
    if isinstance(e, RepositoryNotFoundError):
        return f"the hub has no repo {repo} you can read (private, or a typo?)"
    if isinstance(e, NotASafetensorsRepoError):
        # the hub answers a missing repo's files as missing too: the config was read, so the repo exists
        return f"{repo} has no model.safetensors or model.safetensors.index.json at its root (.bin weights only?)"
    return f"its safetensors headers could not be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def read_hub_headers(repo: str, revision: str | None = None) -> tuple[HeaderWeights | None, str | None]:
    """``(headers, None)`` for a readable safetensors repo; ``(None, why)`` when the hub answered but the
    headers cannot be read (gated, missing, .bin only); ``(None, None)`` offline, where nothing is asked."""
    if hub_offline_reason() is not None:
        return None, None
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import NotASafetensorsRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    key = (constants.ENDPOINT, repo, revision)
    if key in _CACHE:
        return _CACHE[key]
    quiet = are_progress_bars_disabled()
    disable_progress_bars()  # a "Parse safetensors files" bar per estimate would clutter the notebook
    try:
        meta = HfApi(endpoint=constants.ENDPOINT).get_safetensors_metadata(repo, revision=revision)
        result = _from_metadata(repo, meta), None
    except Exception as e:  # noqa: BLE001 - any failure falls back to the config, with the reason as a note
        result = None, _why(repo, e)
        if not isinstance(e, RepositoryNotFoundError | NotASafetensorsRepoError):
            return result  # a network hiccup or a gate: ask again next time
    finally:
        if not quiet:
            enable_progress_bars()
    _CACHE[key] = result
    return result


def _is_packed(name: str, entries: dict[str, HeaderTensor]) -> bool:
    """A quantized weight: GPTQ/AWQ ``qweight``, or a bitsandbytes weight stored with its absmax or SCB."""
    return (
        name.endswith(".qweight") or (name + ".absmax" in entries) or (name.removesuffix(".weight") + ".SCB" in entries)
    )


def header_rows(h: HeaderWeights, lay: Layout, load: str, dtype_bytes: int, prequantized: bool) -> list[EstimateRow]:
    """The weight rows from the headers: a pre-quantized checkpoint's packed weights and state as stored,
    and its other floating tensors in the compute dtype; an ordinary checkpoint's floating tensors in the
    load dtype (fp32 where the model keeps them so). Buffers the checkpoint lacks (rotary tables) come
    from the architecture."""
    half = 4 if load == FP32 else dtype_bytes
    fp32 = fp32_modules(lay, load)
    packed = state = plain = 0
    n_packed = blobs = 0
    for name, t in h.entries.items():
        if prequantized and BNB_STATE_BLOB in name:
            blobs += 1
        elif prequantized and _is_packed(name, h.entries):
            packed, n_packed = packed + t.nbytes, n_packed + 1
        elif prequantized and name.endswith(QUANT_STATE_SUFFIXES):
            state += t.nbytes
        elif not t.floating:
            plain += t.nbytes
        else:
            plain += t.numel * (4 if any(k in name for k in fp32) else half)
    buffers = sum(
        e.numel * (e.fixed_bytes or half) for e in lay.entries if e.module == "buffer" and e.name not in h.entries
    )
    note = f"{HEADER_NOTE}: {h.tensors} tensors in {len(h.files)} file(s)"
    rows = []
    if prequantized:
        rows += [
            EstimateRow("weights.quantized", "weights: packed quantized layers", packed, "exact",
                        f"{n_packed} layers, as stored ({HEADER_NOTE})"),
            EstimateRow("weights.quant_state", "weights: quantization state (zeros, scales, absmax)", state, "exact",
                        HEADER_NOTE + (f"; {blobs} QuantState blobs are parsed, not loaded" if blobs else "")),
        ]  # fmt: skip
    label = "weights: unquantized (embeddings, norms, lm_head)" if prequantized else f"weights: {load}"
    rows.append(EstimateRow("weights.unquantized", label, plain, "exact", note))
    rows.append(EstimateRow("weights.buffers", "weights: buffers", buffers, "exact", "rotary tables, masks"))
    return rows
