"""Plan a model across several GPUs (and CPU/disk offload): the device map transformers will use.

:func:`plan_devices` builds the architecture on the meta device (``torch.device("meta")``: no memory,
no download) and runs the placement that ``from_pretrained(device_map="auto")`` runs: the balanced
``max_memory`` (``get_balanced_memory``), bitsandbytes' 10 % margin for its buffers, then
``infer_auto_device_map`` with the model's ``_no_split_modules``. Quantized linear weights count
0.5 (4-bit) or 1 (int8) byte per element, as transformers' quantizers count them. transformers 5
ships its own copy of accelerate's two functions (with a different balancing buffer); the plan uses
that copy where it exists, so the map is the one ``from_pretrained`` computes, and accelerate's
functions otherwise (``special_dtypes``). Per device it then adds up the exact weights (the
estimator's per-module layout: quantization state included), the KV cache of the layers placed
there, the activations and the CUDA context, and refuses what transformers or bitsandbytes would
refuse (int8/4-bit offload needs ``llm_int8_enable_fp32_cpu_offload``; 4-bit cannot go to disk).

    >>> plan = plan_devices("meta-llama/Llama-2-7b-hf", load="fp16", devices="kaggle-2xt4")  # doctest: +SKIP
    >>> plan.fits, plan.device_map, plan.max_memory                                         # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from dataclasses import dataclass, field
from html import escape
from typing import Any

import psutil
import torch

from ..core.arguments import flag, number
from ..core.devices import (
    CUBLAS_WORKSPACE,
    CUDA_CONTEXT,
    GPU_MARGIN,
    OFFLOAD_RAM_SHARE,
    PCIE_BYTES_PER_S,
    resolve_devices,
)
from ..core.html import Markup, table
from ..core.units import format_bytes, parse_bytes
from ..core.vocab import (
    DEFAULTS,
    DTYPE_BYTES,
    FOUR_BIT,
    FP32,
    QUANTIZED,
    half_dtype,
    lighter_load,
    load_mode_name,
    torch_dtype,
)
from ..estimator.configs import resolve_config
from ..estimator.core import FRAGMENTATION, estimate
from ..estimator.layout import Layout, dims, layout, weight_rows
from ..estimator.timing import offload_seconds
from .device_map import PlacementError, device_map_for, is_placement_model, placement_model

__all__ = [
    "reference_configs",
    "DevicePlan", "DeviceShare", "DeviceMapError", "plan_devices", "one_move", "once_per_move", "frozen_key",
    "bnb_prequantized", "PREQUANTIZED_OFFLOAD",
    "PREQUANTIZED_OFFLOAD_FIX", "DEVICE_MAP_STRATEGIES",
]  # fmt: skip

# the device_map strings from_pretrained places by itself (transformers' _get_device_map): "auto" and "balanced"
# balance the weights over the GPUs, "balanced_low_0" leaves GPU 0 as little as the others cannot hold (room for
# generate's work there), "sequential" fills GPU 0, then GPU 1, ... each up to its max_memory
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
# the strategies that put more than an even share of the layers on one card, and so of the KV cache
UNEVEN_STRATEGIES = ("balanced_low_0", "sequential")

# transformers (5.1 to 5.23) loads a saved bitsandbytes checkpoint with its own quantization_config and ignores one
# passed to from_pretrained (it warns; BitsAndBytesConfig is not among the configs whose loading attributes it merges),
# so the offload flag cannot be passed that way. Set in the checkpoint's own config instead, it builds the layers a
# device_map dict offloads as plain nn.Linear, which the saved packed weights do not fit (5.23: size mismatch at load;
# 5.1 and int8: the load succeeds, the first forward fails); with device_map="auto" the layers are replaced before the
# map exists, and an offloaded one quantizes the saved packed bytes again at its first forward (seen with disk offload)
PREQUANTIZED_OFFLOAD = (
    "a checkpoint saved quantized by bitsandbytes cannot be offloaded to CPU or disk (transformers refuses it without "
    "llm_int8_enable_fp32_cpu_offload, and with it the offloaded layers cannot take the saved 4-bit/8-bit weights)"
)
PREQUANTIZED_OFFLOAD_FIX = (
    "load the original (unquantized) checkpoint with load='nf4' instead: bitsandbytes then quantizes it while loading "
    "and can offload what does not fit"
)


def bnb_prequantized(est) -> bool:
    """Whether the estimate is of a checkpoint saved quantized by bitsandbytes (a ``*-bnb-4bit`` repo): its
    layers can only be loaded where they fit, never offloaded (see ``PREQUANTIZED_OFFLOAD``)."""
    return getattr(est, "quantized_by", None) == "bitsandbytes"


class DeviceMapError(PlacementError):
    """A device map or ``max_memory`` that cannot be right: a device the plan lacks, a weight left out."""


@dataclass
class DeviceShare:
    """What one device holds under a plan: weights, its layers' KV cache, activations, context."""

    device: Any  # 0, 1, ... "cpu", "disk"
    label: str
    capacity: int | None
    weights: int = 0
    kv_cache: int = 0
    activations: int = 0
    overhead: int = 0
    layers: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.overhead

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity

    def row(self) -> list[str]:
        cap = format_bytes(self.capacity) if self.capacity else "-"
        cells = [self.weights, self.kv_cache, self.activations, self.overhead, self.total]
        verdict = "" if self.capacity is None else ("fits" if self.fits else "DOES NOT FIT")
        return [self.label, str(self.layers), *map(format_bytes, cells), cap, verdict]


@dataclass
class DevicePlan:
    """Where every module goes, what each device holds, and whether transformers would accept it.

    ``device_map`` and ``max_memory`` are the arguments for ``from_pretrained`` (see
    :meth:`from_pretrained_kwargs`); ``placed_max_memory`` is what the placement itself saw (balanced,
    and with bitsandbytes' margin)."""

    model: str
    load: str
    compute_dtype: str
    shares: list[DeviceShare]
    device_map: dict[str, Any]
    max_memory: dict
    placed_max_memory: dict
    weights: int  # single-device estimate of the weights, the sum of the shares' weights
    crossings: list[tuple[Any, Any, int]] = field(default_factory=list)  # (from, to, bytes per token)
    reasons: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    quantization_changes: dict = field(default_factory=dict)
    offload_folder: str | None = None

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def gpus(self) -> list[DeviceShare]:
        return [s for s in self.shares if isinstance(s.device, int)]

    def offloaded(self, where: str = "cpu") -> int:
        """Bytes of weights placed on ``"cpu"`` or ``"disk"``."""
        return sum(s.weights for s in self.shares if s.device == where)

    @property
    def slowdown(self) -> str:
        """The rule of thumb for what offload costs per generated token ('' without offload)."""
        cpu, disk = self.offloaded("cpu"), self.offloaded("disk")
        parts = []
        if cpu:  # the one figure: estimator.timing.offload_seconds, as fit()'s fixes time an offload
            parts.append(f"{format_bytes(cpu)} cross PCIe every token: ~{offload_seconds(cpu) * 1000:.0f} ms/token "
                         f"at {format_bytes(PCIE_BYTES_PER_S)}/s, typically 5-20x slower than all on GPU")  # fmt: skip
        if disk:
            parts.append(f"{format_bytes(disk)} read from disk every token: ~{offload_seconds(0, disk):.1f} s/token")
        return "; ".join(parts)

    @property
    def summary(self) -> str:
        """One line: the verdict, each GPU's share and the offload."""
        gpus = ", ".join(f"GPU {s.device} {format_bytes(s.total)}/{format_bytes(s.capacity)}" for s in self.gpus)
        off = f"; {self.slowdown}" if self.slowdown else ""
        verdict = "fits" if self.fits else "does not fit: " + self.reasons[0]
        return f"{self.model} {self.load} on {len(self.gpus)} GPU(s) {verdict} ({gpus or 'CPU only'}){off}"

    def cpu_device_map(self) -> dict[str, str]:
        """The same split with every part on the CPU: rehearse the load on a machine without GPUs."""
        return {k: "cpu" for k in self.device_map}

    def from_pretrained_kwargs(self, plan=None) -> dict[str, Any]:
        """Keyword arguments for ``from_pretrained``: a :class:`helpers.LoadPlan`'s (when given)
        with this ``device_map``, ``max_memory``, offload folder and bitsandbytes' offload flag."""
        kwargs = plan.replace(device_map=None).from_pretrained_kwargs() if plan is not None else {}
        kwargs.update(device_map=dict(self.device_map), max_memory=dict(self.max_memory))
        if self.offload_folder:
            kwargs["offload_folder"] = self.offload_folder
        qc = kwargs.get("quantization_config")
        for k, v in self.quantization_changes.items():
            if qc is not None:
                setattr(qc, k, v)
        return kwargs

    def rows(self) -> list[list[str]]:
        return [s.row() for s in self.shares]

    def copy(self) -> DevicePlan:
        """A plan whose lists, maps and shares are its own (callers add notes, reasons and fixes)."""
        return dataclasses.replace(
            self, shares=[dataclasses.replace(x) for x in self.shares], device_map=dict(self.device_map),
            max_memory=dict(self.max_memory), placed_max_memory=dict(self.placed_max_memory),
            crossings=list(self.crossings), reasons=list(self.reasons), fixes=list(self.fixes), notes=list(self.notes),
            quantization_changes=dict(self.quantization_changes),
        )  # fmt: skip

    def __str__(self) -> str:
        head = ["device", "layers", "weights", "KV cache", "activations", "context+margin", "total", "capacity", ""]
        rows = [head, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [f"{self.model} as {self.load} ({self.compute_dtype} compute) on {len(self.gpus)} GPU(s): {verdict}"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines += [f"  crosses {a} -> {b}: {format_bytes(n)} per token" for a, b, n in self.crossings]
        lines += [f"  offload: {self.slowdown}"] if self.slowdown else []
        lines += [f"  refused: {r}" for r in self.reasons] + [f"  fix: {f}" for f in self.fixes]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  max_memory={_mm_text(self.max_memory)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.__str__()

    def _repr_html_(self) -> str:
        title = f"{self.model} as {self.load}: {'fits' if self.fits else 'does not fit'}"
        head = ["device", "layers", "weights", "KV cache", "activations", "context+margin", "total", "capacity", ""]
        html = table(head, self.rows(), title=title)
        extra = [f"crosses {a} &rarr; {b}: {format_bytes(n)} per token" for a, b, n in self.crossings]
        extra += [f"offload: {escape(self.slowdown)}"] if self.slowdown else []
        extra += [f"<b>refused</b>: {escape(r)}" for r in self.reasons] + [f"fix: {escape(f)}" for f in self.fixes]
        extra += [f"note: {escape(n)}" for n in self.notes]
        extra.append(f"<code>max_memory={escape(_mm_text(self.max_memory))}</code>")
        return html + "".join(f"<div>{Markup(x)}</div>" for x in extra)


def _mm_text(mm: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {format_bytes(int(v))!r}" for k, v in mm.items()) + "}"


# ----------------------------------------------------------------------------- one answer per question within a move


_SCOPES: list[dict] = []  # the memo of the outermost open one_move() scope


@contextlib.contextmanager
def one_move():
    """Within it, each placement question (``split_plan``, the estimate a plan sizes, the decision's fixes) is
    answered once per subject and arguments: a panel move or a ``fit()`` asks the same ones from several places
    (the decision, its fix, the panel's tries, the split beside the one-card offload). Nothing outlives the scope, so no answer can be stale: a config changed in
    place, a new load mode or dtype is asked afresh by the next move. Scopes nest (the outermost one keeps)."""
    if _SCOPES:
        yield
        return
    _SCOPES.append({})
    try:
        yield
    finally:
        _SCOPES.clear()


def once_per_move(kind: str, subject, args: tuple | None, compute):
    """``compute()``, or its answer for the same ``subject`` object (an estimate, a model) and ``args`` within
    :func:`one_move` (the memo keeps the subject alive, so its id is not reused); a plan is copied each time,
    as the caller may edit it. ``args`` None (unhashable): not memoised."""
    if not _SCOPES or args is None:
        return compute()
    memo = _SCOPES[0]
    key = (kind, id(subject), args)
    if key not in memo:
        try:
            memo[key] = (subject, compute(), None)
        except PlacementError as e:  # asked again, it fails again: the same error
            memo[key] = (subject, None, e)
    _, answer, error = memo[key]
    if error is not None:
        raise error
    return answer.copy() if isinstance(answer, DevicePlan) else answer


def frozen_key(args: tuple) -> tuple | None:
    """Arguments as a key (dicts as their items, lists as tuples); None where one cannot be (not memoised)."""

    def freeze(x):
        if isinstance(x, dict):
            return ("dict", tuple((k, freeze(v)) for k, v in x.items()))
        if isinstance(x, list | tuple):
            return ("seq", tuple(freeze(v) for v in x))
        hash(x)
        return x

    try:
        return freeze(args)
    except TypeError:
        return None


# ----------------------------------------------------------------------------- the plan


def _compute_dtype(load: str, compute_dtype: str, gpus: list[tuple[str, dict]]) -> str:
    if compute_dtype != "auto":
        return compute_dtype
    if load in DTYPE_BYTES:
        return load
    if not gpus:
        return FP32
    return half_dtype(all(d["bf16"] for _, d in gpus))


def _where(name: str, device_map: dict) -> Any:
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    raise PlacementError(f"{name} is not covered by the device map")


def _headroom(headroom: Any, runtime: int) -> int:
    if headroom in (None, "auto"):
        return runtime
    value = parse_bytes(headroom) if isinstance(headroom, str) else headroom
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise PlacementError(f"headroom is bytes per GPU ('2GiB', 2 * GiB) or 'auto', got {headroom!r}")
    return int(value)


def _layer_devices(model, device_map: dict) -> list[Any]:
    """The device of each decoder layer (the model's no-split blocks), in order."""
    return [_where(n, device_map) for n in _structure(model)[0]]


_STRUCTURES: dict[int, tuple[list[str], frozenset[str]]] = {}  # per placement model (kept, never edited)


def _structure(model) -> tuple[list[str], frozenset[str]]:
    """(the no-split blocks' names in order, every module's name): a walk over every module, once per placement
    model (a caller's own model is walked each time: it may change)."""
    if id(model) in _STRUCTURES and is_placement_model(model):
        return _STRUCTURES[id(model)]
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if type(m).__name__ in no_split]
    names.sort(key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"\.", n)])
    out = (names, frozenset(modules))
    if is_placement_model(model):
        _STRUCTURES[id(model)] = out
    return out


# a skip pattern every module name matches (transformers' rule also skips a name that ends with the pattern)
EVERY_MODULE = [""]


def _weights_by_device(
    lay: Layout, device_map: dict, load: str, b: int, double_quant: bool, offload: bool = True
) -> dict[Any, int]:
    """Exact weight bytes per device; int8/4-bit modules offloaded to CPU/disk stay unquantized (as transformers
    loads them with ``llm_int8_enable_fp32_cpu_offload``)."""
    groups: dict[Any, list] = {}
    owners: dict[str, Any] = {}  # a module's device, looked up once for all its parameters

    def device_of(name: str) -> Any:
        if name in device_map:  # a parameter placed by its own name (the map split its module)
            return device_map[name]
        owner = name.rpartition(".")[0]
        if owner not in owners:
            owners[owner] = _where(owner, device_map)
        return owners[owner]

    for e in lay.entries:
        groups.setdefault(device_of(e.name), []).append(e)
    out = {}
    for dev, entries in groups.items():
        sub = Layout(lay.params, entries, lay.not_convert, lay.keep_fp32, lay.n_layers)
        # every module of an offloaded group stays unquantized: one pattern says so, where naming each offloaded
        # device-map key cost a regex per module per key (120 s for a 1,024-layer nf4 fit())
        skip = EVERY_MODULE if offload and dev in ("cpu", "disk") and load in QUANTIZED else None
        out[dev] = sum(r.bytes for r in weight_rows(sub, load, b, double_quant, skip))
    return out


def _runtime(est, n_gpus: int) -> dict[str, int]:
    """What a GPU needs besides weights while generating: its KV share, activations, context, margins."""
    kv = est.group_bytes("kv_cache")
    logits = est.row("activations.logits").bytes
    # prefill and what kernels add to it (a 4-bit layer's dequantized copy, int8's product, eager scores)
    act = est.group_bytes("activations") - logits
    context = CUDA_CONTEXT + CUBLAS_WORKSPACE
    return {"kv": kv, "act": act, "logits": logits, "context": context,
            "headroom": context + act + logits + kv // max(1, n_gpus) + int((kv / max(1, n_gpus) + act) * FRAGMENTATION)
            + GPU_MARGIN}  # fmt: skip


def plan_devices(
    model: Any,
    *,
    load: str,
    devices: Any = "current",
    cpu_offload: bool = False,
    disk_offload: bool = False,
    headroom: Any = "auto",
    cpu_memory: int | None = None,
    compute_dtype: str = "auto",
    double_quant: bool = True,
    batch_size: int = DEFAULTS.batch_size,
    prompt_tokens: int = DEFAULTS.prompt_tokens,
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    offload_folder: str = "offload",
    device_map: dict | None = None,
    max_memory: dict | None = None,
    strategy: str = "auto",
    kv_cache: str = "dynamic",
) -> DevicePlan:
    """Plan ``model`` in ``load`` mode across ``devices`` as ``from_pretrained(device_map=strategy)`` places it.

    Args:
        model: what :func:`helpers.estimate` takes (hub id, shipped config name, folder, config).
        load: fp32, fp16, bf16, int8, nf4 or fp4.
        devices: ``"current"`` (this machine's GPUs), a set such as ``"kaggle-2xt4"``, a list of presets
            or sizes (``["t4", "t4"]``) or ``{0: bytes, 1: bytes}``.
        cpu_offload, disk_offload: let modules that do not fit the GPUs go to CPU RAM, then to disk.
        headroom: bytes kept free on every GPU for the KV cache, activations and the CUDA context;
            ``"auto"`` sizes it from the generation budget (``batch_size``, ``prompt_tokens``, ``max_new_tokens``).
        cpu_memory: RAM offloaded weights may use (default 80 % of the available RAM).
        device_map: a map chosen by hand (``{"model.layers.0": 0, ..., "lm_head": 1}``) to check instead of
            computing accelerate's; its ``"cpu"`` and ``"disk"`` entries count as asked-for offload.
        max_memory: caps of your own for the placement (``{0: "13GiB", 1: "13GiB", "cpu": "20GiB"}``), as
            ``from_pretrained`` takes them; each card is still checked against ``devices``' capacity.
        strategy: the ``device_map`` string to place as: ``"auto"`` (= ``"balanced"``), ``"balanced_low_0"``
            or ``"sequential"``. With the automatic headroom and no ``max_memory`` of yours, a strategy that
            stacks layers on one card (the last two) gets that card's cap lowered until its KV cache fits.
        kv_cache: the KV cache ``generate()`` keeps (``LoadPlan(kv_cache=...)``): a quantized or offloaded
            one leaves each GPU more room for layers, as the estimate prices it.
    """
    load = load_mode_name(load, error=PlacementError)
    if strategy not in DEVICE_MAP_STRATEGIES:
        raise PlacementError(f"unknown strategy {strategy!r}; use one of {', '.join(DEVICE_MAP_STRATEGIES)}")
    flag("cpu_offload", cpu_offload, error=PlacementError)
    flag("disk_offload", disk_offload, error=PlacementError)
    number("cpu_memory (bytes)", cpu_memory, low=0, none_ok=True, error=PlacementError)
    config, name, _ = resolve_config(model)
    gpus = resolve_devices(devices)
    cd = _compute_dtype(load, compute_dtype, gpus)
    b = DTYPE_BYTES[cd]
    sized = (load, double_quant, cd, batch_size, prompt_tokens, max_new_tokens, kv_cache)
    est = once_per_move("estimate", model, frozen_key(sized), lambda: estimate(
        config, load=load, double_quant=double_quant, compute_dtype=cd, batch_size=batch_size,
        prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, kv_cache=kv_cache, device=None))  # fmt: skip
    rt = _runtime(est, len(gpus))
    room = _headroom(headroom, rt["headroom"])
    ram = int(psutil.virtual_memory().available * OFFLOAD_RAM_SHARE) if cpu_memory is None else int(cpu_memory)
    caps = _user_caps(max_memory, len(gpus)) if max_memory is not None else None
    if caps is not None:
        cpu_offload = cpu_offload or "cpu" in caps
        ram = caps.get("cpu", ram)
    max_memory = {i: max(0, d["capacity"] - room) if caps is None else caps.get(i, 0) for i, (_, d) in enumerate(gpus)}
    if cpu_offload or not gpus:
        max_memory["cpu"] = ram
    meta, quantized = placement_model(config, load, torch_dtype(cd))
    given = device_map is not None
    if given:
        device_map = _given_map(device_map, meta, len(gpus))
        cpu_offload = cpu_offload or "cpu" in device_map.values()
        disk_offload = disk_offload or "disk" in device_map.values()
        if cpu_offload and "cpu" not in max_memory:
            max_memory["cpu"] = ram

    def place(mm: dict) -> DevicePlan:
        if given:
            dm, placed = device_map, dict(mm)
        elif gpus:
            dm, placed = device_map_for(meta, load, quantized, mm, strategy)
        else:
            dm, placed = {"": "cpu"}, dict(mm)
        out = DevicePlan(str(name), load, cd, [], dm, mm, placed, est.weights,
                         offload_folder=offload_folder if disk_offload else None)  # fmt: skip
        _fill_shares(out, meta, config, est, gpus, rt, b, double_quant, ram, cpu_offload or disk_offload)
        return out

    plan = place(max_memory)
    if strategy in UNEVEN_STRATEGIES and not given and caps is None and headroom in (None, "auto"):
        plan = _settle_uneven(plan, place)
    _check_rules(plan, gpus, cpu_offload, disk_offload, bnb_prequantized(est))
    return plan


def _settle_uneven(plan: DevicePlan, place) -> DevicePlan:
    """The automatic caps keep every GPU an even share of the KV cache free; "sequential" and "balanced_low_0"
    give one card more layers than that, and so more cache. Lower each overflowing card's cap by what it
    overflows and place again (what you would do by hand: a lower ``max_memory`` for the card that ran out),
    until every card holds its share or the caps stop changing; ``place(max_memory)`` re-plans."""
    for _ in range(8):  # a card's overflow shrinks every round (a layer moves off it); a few rounds settle it
        over = {s.device: s.total - s.capacity for s in plan.gpus if not s.fits}
        if not over:
            break
        caps = {k: max(0, v - over.get(k, 0)) if isinstance(k, int) else v for k, v in plan.max_memory.items()}
        if caps == plan.max_memory:
            break
        plan = place(caps)
    return plan


def _user_caps(max_memory: dict, n_gpus: int) -> dict:
    """``max_memory`` as ``{gpu index: bytes, "cpu": bytes}`` (sizes such as ``"13GiB"`` read)."""
    out: dict[Any, int] = {}
    for key, value in max_memory.items():
        dev = key if isinstance(key, int) and not isinstance(key, bool) else str(key)
        if isinstance(dev, str) and dev.startswith("cuda"):
            dev = int(dev.partition(":")[2] or 0)
        if dev == "disk":
            continue
        if dev != "cpu" and not (isinstance(dev, int) and 0 <= dev < n_gpus):
            raise DeviceMapError(f"max_memory caps {key!r}: this plan has GPUs 0-{n_gpus - 1} and 'cpu'")
        out[dev] = parse_bytes(value) if isinstance(value, str) else int(value)
    return out


def _given_map(device_map: dict, meta: torch.nn.Module, n_gpus: int) -> dict:
    """``device_map`` checked: every value a GPU of the plan, ``"cpu"`` or ``"disk"``; every weight covered."""
    out = {}
    for name, dev in device_map.items():
        if isinstance(dev, torch.device):
            dev = (dev.index or 0) if dev.type == "cuda" else dev.type
        if isinstance(dev, str) and dev.startswith("cuda"):
            dev = int(dev.partition(":")[2] or 0)
        if dev not in ("cpu", "disk") and not (isinstance(dev, int) and 0 <= dev < n_gpus):
            raise DeviceMapError(f"device_map puts {name or 'the model'!r} on {dev!r}: this plan has GPUs "
                                 f"0-{n_gpus - 1}, 'cpu' and 'disk'")  # fmt: skip
        out[name] = dev
    for name, _ in meta.named_parameters():
        try:
            _where(name, out)
        except PlacementError:
            raise DeviceMapError(f"the device_map leaves {name} out: name a device for every module") from None
    return out


def _fill_shares(plan: DevicePlan, meta, config, est, gpus, rt: dict, b: int, double_quant: bool, ram: int,
                 offload: bool) -> None:  # fmt: skip
    lay = layout(config)
    weights = _weights_by_device(lay, plan.device_map, plan.load, b, double_quant, offload)
    layer_devs = _layer_devices(meta, plan.device_map)
    n_layers = max(1, len(layer_devs))
    head = _where("lm_head", plan.device_map) if "lm_head" in _structure(meta)[1] else None
    used = [d for d in ("cpu", "disk") if d in weights]
    for dev in [*range(len(gpus)), *used]:
        gpu = isinstance(dev, int)
        label = gpus[dev][0] if gpu else dev
        cap = gpus[dev][1]["capacity"] if gpu else (ram if dev == "cpu" else None)
        share = DeviceShare(dev, label, cap, weights.get(dev, 0), layers=layer_devs.count(dev))
        # offloaded layers run on GPU 0 (accelerate's hooks copy them in): their cache and activations stay there
        runs_here = share.layers + (sum(layer_devs.count(d) for d in used) if dev == 0 else 0)
        if gpu and (runs_here or share.weights):
            share.kv_cache = rt["kv"] * runs_here // n_layers
            share.activations = (rt["act"] if runs_here else 0) + (rt["logits"] if head in (dev, "cpu", "disk") else 0)
            share.overhead = rt["context"] + int((share.kv_cache + share.activations) * FRAGMENTATION)
        plan.shares.append(share)
    d = dims(config)
    order = [x for i, x in enumerate(layer_devs) if i == 0 or layer_devs[i - 1] != x]
    hidden = d["h"] * b  # one token's hidden state per sequence crosses at each boundary
    plan.crossings = [(a, c, hidden) for a, c in zip(order, order[1:])]
    if len(plan.gpus) > 1 and any(isinstance(a, int) and isinstance(c, int) for a, c, _ in plan.crossings):
        plan.notes.append("the hidden state crosses devices between consecutive layers only (pipeline, one GPU "
                          "busy at a time): the cards together hold a bigger model, they do not generate faster")  # fmt: skip


def _check_rules(plan: DevicePlan, gpus, cpu_offload: bool, disk_offload: bool, prequantized: bool) -> None:
    cpu, disk = plan.offloaded("cpu"), plan.offloaded("disk")
    if not gpus:
        plan.notes.append("no GPU: every module on the CPU")
        if plan.shares and not plan.shares[0].fits:
            plan.reasons.append(
                f"the weights ({format_bytes(cpu)}) exceed the RAM offered ({format_bytes(plan.shares[0].capacity)})"
            )
            plan.fixes.append("use a smaller model or a 4-bit load")
        return
    spill = cpu + disk
    if spill and not (cpu_offload or disk_offload):
        plan.reasons.append(f"{format_bytes(spill)} of weights do not fit on the {len(gpus)} GPU(s)")
        plan.fixes.append(_more_room_fix(plan, prequantized))
        return
    if spill and prequantized:
        plan.reasons.append(PREQUANTIZED_OFFLOAD)
        plan.fixes.append(_more_room_fix(plan, prequantized))
        return
    if disk and not disk_offload:
        plan.reasons.append(f"{format_bytes(disk)} of weights do not fit the GPUs and the CPU RAM offered")
        plan.fixes.append("disk_offload=True (seconds per token), more GPUs, or a 4-bit load")
    if disk and plan.load in FOUR_BIT:
        plan.reasons.append("bitsandbytes 4-bit weights cannot be offloaded to disk")
        plan.fixes.append("give the CPU enough RAM (cpu_memory) for the offloaded layers, add GPUs, or load int8/fp16")
    if plan.load in QUANTIZED and spill:
        plan.quantization_changes["llm_int8_enable_fp32_cpu_offload"] = True
        plan.notes.append("int8/4-bit offload needs BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True) and this "
                          "device_map; offloaded modules stay unquantized (counted so)")  # fmt: skip
    for s in plan.gpus:
        if not s.fits:
            plan.reasons.append(f"GPU {s.device} needs {format_bytes(s.total)} of {format_bytes(s.capacity)}")
            plan.fixes.append("lower headroom needs (max_new_tokens, batch_size) or add a GPU")
    ram_share = next((s for s in plan.shares if s.device == "cpu"), None)
    if ram_share is not None and not ram_share.fits:
        # accelerate sized the offload at the quantized width; bitsandbytes leaves offloaded modules unquantized
        plan.reasons.append(f"the {format_bytes(ram_share.weights)} of weights offloaded to CPU RAM exceed the "
                            f"{format_bytes(ram_share.capacity)} offered")  # fmt: skip
        plan.fixes.append("a 4-bit load, more GPUs, or a smaller model")


def _more_room_fix(plan: DevicePlan, prequantized: bool) -> str:
    if prequantized:  # its load mode is the saved one, and it cannot be offloaded
        return f"more GPUs; or {PREQUANTIZED_OFFLOAD_FIX}"
    smaller = lighter_load(plan.load)
    options = ["cpu_offload=True (slow: see the slowdown)", "more GPUs"]
    if smaller:
        options.insert(0, f"load={smaller!r}")
    return "; ".join(options)


# ----------------------------------------------------------------------------- the README table's models (placement.fits)


# Llama 2's published dimensions (Touvron et al. 2023, table 1 and the hub configs); 7B ships in helpers/data
_LLAMA2 = {
    "Llama-2-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        intermediate_size=13824),
    "Llama-2-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=28672),
}  # fmt: skip


def reference_configs() -> dict[str, Any]:
    """Llama-2 7B (the shipped config), 13B and 70B (its config with the published dimensions)."""
    base, _, _ = resolve_config("meta-llama/Llama-2-7b-hf")
    out = {"Llama-2-7b": base}
    for name, dims_ in _LLAMA2.items():
        c = copy.deepcopy(base)
        for k, v in dims_.items():
            setattr(c, k, v)
        c._name_or_path = f"meta-llama/{name}-hf"
        out[name] = c
    return out
