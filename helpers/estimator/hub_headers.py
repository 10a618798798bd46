"""Exact weight sizes of a hub repo before any download: the dtype and shape of every tensor, read from
the JSON headers of its safetensors files (HTTP range requests of a few kB each, never the weights),
each read bounded in time, bytes and requests (:func:`helpers.sources.http_get`).

Pre-quantized checkpoints (bitsandbytes, GPTQ, AWQ) load onto the GPU as they are stored, so their
headers are the loaded bytes; an ordinary checkpoint's floating-point tensors are cast to the load dtype.
"""

from __future__ import annotations

import copy
import json
import math
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..core.sources import (
    SAFE_INDEX,
    SAFE_WEIGHTS,
    HttpReply,
    NetBudget,
    NetError,
    SourceError,
    http_get,
    hub_offline_reason,
)
from ..core.vocab import FP32
from .layout import Layout, fp32_modules
from .rows import EstimateRow

__all__ = [
    "HeaderTensor",
    "HeaderWeights",
    "read_hub_headers",
    "header_rows",
    "clear_header_cache",
    "HEADER_NOTE",
    "parse_safetensors_header",
    "read_hub_json",
]

HEADER_NOTE = "from the safetensors headers"
# Tensors a pre-quantized checkpoint stores beside each packed weight; they stay in their stored dtype.
QUANT_STATE_SUFFIXES = (
    ".qzeros", ".scales", ".g_idx", ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".SCB",
    ".weight_format",
    "_scales",  # mxfp4: one uint8 (e8m0) per 32 values, beside each expert tensor's ``_blocks``
    ".weight_scale_inv", ".weight_scale", ".input_scale",  # fp8 and compressed-tensors: fp32 scales
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
    start: int = 0  # where its data begins, after the header

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
    """Forget the headers and configs read so far (the next estimate of each repo asks the hub again)."""
    _CACHE.clear()
    _JSON_CACHE.clear()


# Bounds of one repo's header read (each breach is a note and the config formula, never a hang)
FIRST_READ = 100_000  # bytes of the first request: the whole header of most files (huggingface_hub asks as many)
MAX_HEADER_BYTES = 100 << 20  # a declared header length above this is no checkpoint's (bloom-176b's: ~100 kB)
MAX_INDEX_BYTES = 32 << 20  # a model.safetensors.index.json (bloom-176b's: 0.1 MiB)
MAX_SHARDS = 256  # shards an index may list (the largest public checkpoints have ~200)
_MAX_BYTES = 512 << 20  # every body of one repo's read together
_WORKERS = 8  # shard headers read at once: 100 shards in ~2 s on a hub answering in 0.15 s
_NOT_CACHED = ("connection", "http", "gated")  # a hiccup or a gate the user may pass: ask again next time


def parse_safetensors_header(blob: bytes, where: str) -> dict[str, HeaderTensor]:
    """The tensors of a safetensors header (the JSON after its 8-byte length); raises :class:`SourceError`
    naming ``where`` for anything that is not one (not JSON, no dtype/shape/data_offsets, offsets that run
    backwards). Read from the hub here, from a local folder by :mod:`helpers.load_checks`."""
    try:
        header = json.loads(blob)
    except (ValueError, RecursionError):
        raise SourceError(f"{where}: its header is not JSON, so it is no safetensors file") from None
    if not isinstance(header, dict):
        raise SourceError(f"{where}: its header is a JSON {type(header).__name__}, not a table of tensors")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        info = info if isinstance(info, dict) else {}
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        ints = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        span = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if not isinstance(dtype, str) or not ints or not span or not 0 <= offsets[0] <= offsets[1]:
            raise SourceError(f"{where}: tensor {str(name)[:80]!r} has no valid dtype, shape and data_offsets "
                              f"({str(info)[:80]})")  # fmt: skip
        entries[name] = HeaderTensor(dtype, math.prod(shape), offsets[1] - offsets[0], offsets[0])
    return entries


def _url(repo: str, revision: str | None, filename: str) -> str:
    from huggingface_hub import constants

    rev = urllib.parse.quote(revision or "main", safe="")
    repo, filename = urllib.parse.quote(repo, safe="/"), urllib.parse.quote(filename)
    return f"{constants.ENDPOINT.rstrip('/')}/{repo}/resolve/{rev}/{filename}"


def _hub_get(repo, revision, filename: str, budget: NetBudget, auth: dict, size: int) -> HttpReply | None:
    """The first ``size`` bytes of a repo file (a Range request), or ``None`` where the hub has no such file."""
    url = _url(repo, revision, filename)
    reply = http_get(url, budget, headers=auth | {"Range": f"bytes=0-{size - 1}"}, max_bytes=size)
    code = reply.headers.get("x-error-code", "")
    if reply.status in (200, 206):
        return reply
    if code == "GatedRepo":
        raise NetError(f"{repo} is gated: accept its license on the hub and log in (hf auth login) to read "
                       "its headers", "gated")  # fmt: skip
    # the hub answers a missing repo's files as missing too (401 without a token)
    if reply.status == 404 or code in ("RepoNotFound", "EntryNotFound", "RevisionNotFound"):
        return None
    if reply.status in (401, 403):
        raise NetError(f"the hub refused to show {repo} (HTTP {reply.status}): log in (hf auth login)", "gated")
    raise NetError(f"the hub answered HTTP {reply.status} for {filename}", "http")


def _file_header(repo, revision, filename: str, budget: NetBudget, auth: dict) -> dict[str, HeaderTensor] | None:
    """One safetensors file's tensors, in one request (two for a header over ``FIRST_READ``)."""
    reply = _hub_get(repo, revision, filename, budget, auth, FIRST_READ)
    if reply is None:
        return None
    where = f"{repo}/{filename}"
    if len(reply.body) < 8:
        raise NetError(f"{where} is {len(reply.body)} bytes long: no safetensors file", "format")
    n = int.from_bytes(reply.body[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise NetError(f"{where} declares a header of {n:,} bytes (over {MAX_HEADER_BYTES >> 20} MiB): "
                       "no safetensors file oomkit reads", "size")  # fmt: skip
    body = reply.body
    if len(body) < 8 + n:  # asked from byte 0 again: a server that ignores Range still gives the right bytes
        body = _hub_get(repo, revision, filename, budget, auth, 8 + n).body
    if len(body) < 8 + n:
        raise NetError(f"{where} ends inside its own header ({len(body):,} of {8 + n:,} bytes)", "format")
    try:
        return parse_safetensors_header(body[8 : 8 + n], where)
    except SourceError as e:
        raise NetError(str(e), "format") from None


def _shards(repo, revision, budget: NetBudget, auth: dict) -> list[str] | None:
    """The shard files the repo's index lists (``None`` without an index); at most ``MAX_SHARDS``."""
    index = _capped_json(repo, revision, SAFE_INDEX, budget, auth, MAX_INDEX_BYTES, "weight index")
    if index is None:
        return None
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise NetError(f"{repo}/{SAFE_INDEX} has no weight_map of tensor names to shard files", "format")
    shards = sorted(set(weight_map.values()))
    if len(shards) > MAX_SHARDS:
        raise NetError(f"{repo}/{SAFE_INDEX} lists {len(shards):,} shard files (over {MAX_SHARDS}): not read, "
                       "one request each", "requests")  # fmt: skip
    bad = [s for s in shards if s.startswith("/") or ".." in s.split("/") or not s.endswith(".safetensors")]
    if bad or not shards:
        raise NetError(f"{repo}/{SAFE_INDEX} names {bad[0][:80]!r} as a shard" if bad else
                       f"{repo}/{SAFE_INDEX} lists no shards", "format")  # fmt: skip
    return shards


def _capped_json(repo, revision, filename: str, budget: NetBudget, auth: dict, cap: int, what: str) -> dict | None:
    """A repo's JSON object of at most ``cap`` bytes (its weight index, its config) in one request; ``None`` where
    the hub has no such file. :class:`NetError` when it is larger (``size``) or no JSON object (``format``)."""
    reply = _hub_get(repo, revision, filename, budget, auth, cap + 1)
    if reply is None:
        return None
    if len(reply.body) > cap:
        raise NetError(f"{repo}/{filename} is over {cap >> 20} MiB: no {what}", "size")
    try:
        data = json.loads(reply.body)
    except (ValueError, RecursionError):
        raise NetError(f"{repo}/{filename} is not JSON", "format") from None
    if not isinstance(data, dict):
        raise NetError(f"{repo}/{filename} holds a JSON {type(data).__name__}, not an object", "format")
    return data


def _auth() -> dict:
    """The request headers of every hub read: a token where one is saved (not huggingface_hub's build_hf_headers:
    it asks the endpoint for a registry of agents, unbounded)."""
    from huggingface_hub import get_token

    token = get_token()
    return {"User-Agent": "oomkit"} | ({"Authorization": f"Bearer {token}"} if token else {})


def _read_repo(repo: str, revision: str | None, budget: NetBudget) -> HeaderWeights:
    auth = _auth()
    single = _file_header(repo, revision, SAFE_WEIGHTS, budget, auth)
    if single is not None:
        return HeaderWeights(repo, [SAFE_WEIGHTS], single)
    shards = _shards(repo, revision, budget, auth)
    if shards is None:
        raise NetError(f"{repo} has no {SAFE_WEIGHTS} or {SAFE_INDEX} at its root (.bin weights only?)", "missing")
    entries: dict[str, HeaderTensor] = {}
    pool = ThreadPoolExecutor(min(_WORKERS, len(shards)))
    try:
        for shard, found in zip(shards, pool.map(lambda s: _file_header(repo, revision, s, budget, auth), shards)):
            if found is None:
                raise NetError(f"{repo}/{SAFE_INDEX} lists {shard}, which the hub does not have", "format")
            entries |= found
    except NetError as e:
        raise budget.fail(e) from None  # the other shards stop at their next read, or at the deadline
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # one failed shard answers now: no wait for the rest
    return HeaderWeights(repo, shards, entries)


MAX_CONFIG_BYTES = 4 << 20  # a config.json (a few kB; a multimodal one tens of kB)
_JSON_CACHE: dict[tuple[str, str, str | None, str], dict] = {}


def read_hub_json(
    repo: str, filename: str = "config.json", *, revision: str | None = None, timeout_s: float | None = None
) -> dict:
    """A repo's small JSON file (its ``config.json``) in one bounded request: ``timeout_s`` seconds (default
    ``$OOMKIT_NET_TIMEOUT`` or 15), at most ``MAX_CONFIG_BYTES``. Raises :class:`NetError`: kind ``missing``
    (no such repo or file), ``gated``, or a bound or failure of the read. Read once per session."""
    from huggingface_hub import constants

    key = (constants.ENDPOINT, repo, revision, filename)
    if key not in _JSON_CACHE:
        budget = NetBudget(timeout_s, max_bytes=MAX_CONFIG_BYTES + 1, max_requests=8)
        data = _capped_json(repo, revision, filename, budget, _auth(), MAX_CONFIG_BYTES, "config")
        if data is None:
            raise NetError(f"the hub has no {filename} for {repo!r} (a typo, or a private repo?)", "missing")
        _JSON_CACHE[key] = data
    return copy.deepcopy(_JSON_CACHE[key])  # callers change what they get; the next one starts from the file


def read_hub_headers(
    repo: str, revision: str | None = None, *, timeout_s: float | None = None
) -> tuple[HeaderWeights | None, str | None]:
    """``(headers, None)`` for a readable safetensors repo; ``(None, why)`` when the hub answered but the
    headers cannot be read (gated, missing, .bin only, or a read past its bounds: ``timeout_s`` seconds in
    all, default ``$OOMKIT_NET_TIMEOUT`` or 15, ``MAX_HEADER_BYTES`` a header, ``MAX_SHARDS`` shards);
    ``(None, None)`` offline, where nothing is asked. Never raises for what the server does."""
    if hub_offline_reason() is not None:
        return None, None
    from huggingface_hub import constants

    key = (constants.ENDPOINT, repo, revision)
    if key in _CACHE:
        return _CACHE[key]
    try:
        budget = NetBudget(timeout_s, max_bytes=_MAX_BYTES, max_requests=2 * MAX_SHARDS + 4)
        result = _read_repo(repo, revision, budget), None
    except NetError as e:
        result = None, (str(e) if e.kind in ("missing", "gated") else f"its safetensors headers could not be read: {e}")
        if e.kind in _NOT_CACHED:
            return result
        if e.kind not in ("missing", "format"):  # a hostile or stalled server: say how to ask again
            result = None, result[1] + " (clear_header_cache() asks again)"
    _CACHE[key] = result
    return result


def _is_packed(name: str, entries: dict[str, HeaderTensor]) -> bool:
    """A quantized weight: GPTQ/AWQ ``qweight``, a bitsandbytes weight stored with its absmax or SCB, an mxfp4
    expert tensor's ``_blocks`` (two fp4 values a byte), or an fp8 weight (one byte a value)."""
    return (
        name.endswith((".qweight", "_blocks"))
        or entries[name].dtype.startswith("F8")
        or (name + ".absmax" in entries)
        or (name.removesuffix(".weight") + ".SCB" in entries)
    )


def header_rows(
    h: HeaderWeights, lay: Layout, load: str, dtype_bytes: int, prequantized: bool, method: str | None = None
) -> list[EstimateRow]:
    """The weight rows from the headers: a pre-quantized checkpoint's packed weights and state as stored,
    and its other floating tensors in the compute dtype; an ordinary checkpoint's floating tensors in the
    load dtype (fp32 where the model keeps them so). Buffers the checkpoint lacks (rotary tables) come
    from the architecture. ``method`` "mxfp4": the expert biases are held in fp32 (``Mxfp4GptOssExperts``
    declares them so), whatever the checkpoint stores."""
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
        elif method == "mxfp4" and ".experts." in f".{name}":
            plain += 4 * t.numel
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
