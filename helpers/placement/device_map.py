"""The architecture on the meta device and the device map transformers computes for it.

:func:`placement_model` builds the model on the meta device (no memory, no download), once per config, load
mode and dtype, with the ids of the parameters bitsandbytes quantizes; :func:`device_map_for` runs the
placement ``from_pretrained(device_map=...)`` runs (transformers 5's copy of accelerate's balanced
``max_memory`` and ``infer_auto_device_map``, else accelerate's), reading module sizes from one cached
:class:`ModuleSizes` per model. :class:`PlacementError`: an architecture that cannot be planned so.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections import defaultdict
from typing import Any

import torch

from ..core.compat import supported_kwargs
from ..core.errors import OomkitError
from ..core.vocab import (
    MODES,
    QUANTIZED,
)
from ..estimator.families import auto_class
from ..estimator.layout import layout, should_convert

__all__ = [
    "BNB_MARGIN",
    "PlacementError",
    "placement_model",
    "is_placement_model",
    "module_sizes",
    "element_sizes",
    "ModuleSizes",
    "SIZES_SIGNATURE",
    "device_map_for",
]


BNB_MARGIN = 0.90  # bitsandbytes' quantizers keep 10 % of every device's max_memory for their buffers


class PlacementError(OomkitError, ValueError):
    """A placement that cannot be planned (bad devices, an architecture that cannot be built)."""


_MODELS: dict[tuple, tuple[torch.nn.Module, set[int]]] = {}


_SIZES: dict[int, ModuleSizes] = {}  # id(placement model) -> its module sizes (both caches keep the model alive)


def is_placement_model(model) -> bool:
    """``model`` is one :func:`placement_model` built and keeps (never edited, so what is read off it may be kept)."""
    sizes = _SIZES.get(id(model))
    return sizes is not None and sizes.model is model


def _placement_key(config, load: str, dtype: torch.dtype) -> tuple:
    # the whole config (sizes, tie_word_embeddings, quantization_config and its skip modules), the load mode
    # (which weights are quantized, and to how many bytes) and the dtype the rest is built in: everything the
    # meta model and its module sizes depend on
    return config.to_json_string(use_diff=False), load, str(dtype)


def placement_model(config, load: str, dtype: torch.dtype) -> tuple[torch.nn.Module, set[int]]:
    """The architecture on the meta device in ``dtype`` and the ids of the parameters bitsandbytes
    quantizes for ``load`` (cached per config, load mode and dtype)."""
    return _placement_model(_placement_key(config, load, dtype), config, load, dtype)


def _placement_model(key: tuple, config, load: str, dtype: torch.dtype) -> tuple[torch.nn.Module, set[int]]:
    from transformers.initialization import no_init_weights

    if key not in _MODELS:
        lay = layout(config)
        if lay.approximate:
            raise PlacementError(f"cannot build this architecture on the meta device ({lay.missing[0]})")
        try:
            # every tensor made on the meta device, as the estimator's layout is built: accelerate's
            # init_empty_weights() creates each parameter on the CPU first (a fused MoE's experts are really
            # allocated); no_init_weights: initialising meta tensors computes nothing but costs ~0.3 s per model
            with torch.device("meta"), no_init_weights(), contextlib.redirect_stderr(None):
                model = auto_class(config).from_config(copy.deepcopy(config), dtype=dtype)
        except (ValueError, KeyError, ImportError, TypeError) as e:  # no generative class for it (CLIP, BERT, ...)
            raise PlacementError(f"cannot build this architecture on the meta device ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:120]})") from None  # fmt: skip
        model.tie_weights()  # tied embeddings count once, as transformers counts them
        params = dict(model.named_parameters())
        quantized = {
            id(params[e.name])
            for e in lay.entries
            if load in QUANTIZED and e.linear and e.module != "buffer" and should_convert(e.module, lay.not_convert)
            and e.name in params
        }  # fmt: skip
        _MODELS[key] = (model, quantized)
        _SIZES[id(model)] = ModuleSizes(model, load, quantized)
    return _MODELS[key]


def module_sizes(config, load: str, dtype: torch.dtype) -> ModuleSizes:
    """The module sizes of ``config``'s model loaded as ``load`` (built in ``dtype``), as transformers' placement
    counts them: the one answer ``plan_devices`` and every placement it runs read (cached with the meta model,
    under the same key: a changed config, load mode or dtype is another model with its own sizes)."""
    model, _ = placement_model(config, load, dtype)
    return _SIZES[id(model)]


def element_sizes(load: str, quantized: set[int]):
    """Bytes per element as transformers' bitsandbytes quantizers count them (0.5 for 4-bit, 1 for int8)."""
    q = MODES[load].weight_bytes if load in MODES else 0.5

    class _Sizes:  # the two methods transformers' placement asks a quantizer for
        def param_element_size(self, model, name, param):
            return q if id(param) in quantized else param.element_size()

        def adjust_max_memory(self, max_memory):
            return {k: v * BNB_MARGIN for k, v in max_memory.items()}

    return _Sizes() if load in QUANTIZED else None


class ModuleSizes:
    """Bytes per module of one model under one load mode: transformers' ``compute_module_sizes`` (what its
    placement sums: quantized weights at :func:`element_sizes`), computed once per module and kind and kept.

    A placement calls that function once to balance, once to place and once per module it places (its
    buffers): ~130 walks over every parameter of a 126-layer model per plan, and a panel move plans several.
    Passed to transformers as the quantizer (``hf_quantizer``), it answers the same questions; ``computed``
    counts the walks actually done. Only for a model nobody changes: the placement models are cached, never
    edited, and a model of the caller's gets a fresh one per placement (:func:`device_map_for`)."""

    def __init__(self, model: torch.nn.Module, load: str, quantized: set[int]):
        self.model, self.load, self.quantized = model, load, quantized
        self._elements = element_sizes(load, quantized)
        self._owned = {id(m) for m in model.modules()}
        self._cache: dict[tuple, tuple[dict, dict]] = {}
        self.computed = 0

    def param_element_size(self, model, name: str, param) -> float:
        return param.element_size() if self._elements is None else self._elements.param_element_size(model, name, param)

    def adjust_max_memory(self, max_memory: dict) -> dict:
        """bitsandbytes' margin on every device (int8/4-bit loads only)."""
        return max_memory if self._elements is None else self._elements.adjust_max_memory(max_memory)

    def owns(self, module) -> bool:
        return id(module) in self._owned

    def of(self, module=None, *, buffers_only: bool = False, only_modules: bool = True) -> tuple[dict, dict]:
        """``compute_module_sizes(module, ...)`` of the model or one of its modules (copies: callers may add keys)."""
        from transformers.integrations import accelerate as hf

        module = self.model if module is None else module
        key = (id(module), buffers_only, only_modules)
        if key not in self._cache:
            self._cache[key] = _ORIGINAL_SIZES.get("fn", hf.compute_module_sizes)(
                module, self, buffers_only=buffers_only, only_modules=only_modules
            )
            self.computed += 1
        every, leaves = self._cache[key]
        return defaultdict(int, every), defaultdict(int, leaves)


_ORIGINAL_SIZES: dict[str, Any] = {}  # transformers' compute_module_sizes while _sizes_from is in force


@contextlib.contextmanager
def _sizes_from(sizes: ModuleSizes):
    """transformers' placement functions read their module sizes from ``sizes`` (they look the function up in their
    module at each call). Any other model, quantizer or argument goes to transformers' own function."""
    try:
        from transformers.integrations import accelerate as hf
    except ImportError:
        yield
        return
    original = getattr(hf, "compute_module_sizes", None)
    if original is None or _ORIGINAL_SIZES or list(inspect.signature(original).parameters) != SIZES_SIGNATURE:
        yield  # another transformers (or a nested placement): its own function, uncached
        return

    def cached(model, hf_quantizer=None, buffers_only=False, only_modules=True):
        if hf_quantizer is sizes and sizes.owns(model):
            return sizes.of(model, buffers_only=buffers_only, only_modules=only_modules)
        return original(model, hf_quantizer, buffers_only=buffers_only, only_modules=only_modules)

    _ORIGINAL_SIZES["fn"], hf.compute_module_sizes = original, cached
    try:
        yield
    finally:
        hf.compute_module_sizes = original
        _ORIGINAL_SIZES.clear()


SIZES_SIGNATURE = ["model", "hf_quantizer", "buffers_only", "only_modules"]  # transformers 5's compute_module_sizes


def _special_dtypes(model, load: str, quantized: set[int]) -> dict | None:
    from accelerate.utils import CustomDtype

    if load not in QUANTIZED:
        return None
    target = torch.int8 if MODES[load].bits == 8 else CustomDtype.INT4
    return {n: target for n, p in model.named_parameters() if id(p) in quantized}


@contextlib.contextmanager
def _quiet_fake_devices():
    # accelerate warns "Device 0 is not available" for every planned GPU this machine lacks. A filter, not
    # setLevel: each setLevel clears every logger's cache (~1 ms a plan)
    logs = [logging.getLogger(n) for n in ("accelerate.utils.modeling", "transformers.integrations.accelerate")]
    for lg in logs:
        lg.addFilter(_errors_only)
    try:
        yield
    finally:
        for lg in logs:
            lg.removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def device_map_for(
    model, load: str, quantized: set[int], max_memory: dict, strategy: str = "auto"
) -> tuple[dict, dict]:
    """``(device_map, placed_max_memory)`` as ``from_pretrained(device_map=strategy, max_memory=...)`` computes
    them: transformers' ``_get_device_map`` step by step (balanced caps unless ``"sequential"``, which takes the
    caps as they are; then bitsandbytes' margin; then ``infer_auto_device_map``), on the model's module sizes
    (:class:`ModuleSizes`: kept with a placement model, counted once per call for any other)."""
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    with _quiet_fake_devices():
        try:  # transformers >= 5 places with its own copy of accelerate's functions
            from transformers.integrations.accelerate import (
                get_balanced_memory,
                get_max_memory,
                infer_auto_device_map,
            )
        except ImportError:
            return _accelerate_map(model, load, quantized, max_memory, no_split, strategy)
        sizes = _SIZES.get(id(model))
        if sizes is None or sizes.model is not model or sizes.load != load or sizes.quantized is not quantized:
            sizes = ModuleSizes(model, load, quantized)
        with _sizes_from(sizes):
            if strategy == "sequential":
                placed = get_max_memory(dict(max_memory))
            else:
                placed = get_balanced_memory(model, dict(max_memory), no_split, hf_quantizer=sizes,
                                             low_zero=strategy == "balanced_low_0")  # fmt: skip
            placed = sizes.adjust_max_memory(placed)
            extra = supported_kwargs(
                infer_auto_device_map, no_placement_params=getattr(model, "_no_placement_params", None)
            )
            dm = infer_auto_device_map(model, max_memory=dict(placed), no_split_module_classes=no_split,
                                       hf_quantizer=sizes, **extra)  # fmt: skip
    return dict(dm), placed


def _accelerate_map(model, load, quantized, max_memory, no_split, strategy: str = "auto") -> tuple[dict, dict]:
    """transformers 4's placement (accelerate's functions, quantized sizes as ``special_dtypes``)."""
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

    sd = _special_dtypes(model, load, quantized)
    if strategy == "sequential":
        placed = get_max_memory(dict(max_memory))
    else:
        placed = get_balanced_memory(model, dict(max_memory), no_split, special_dtypes=sd,
                                     low_zero=strategy == "balanced_low_0")  # fmt: skip
    if load in QUANTIZED:
        placed = {k: v * BNB_MARGIN for k, v in placed.items()}
    dm = infer_auto_device_map(model, max_memory=dict(placed), no_split_module_classes=no_split, special_dtypes=sd)
    return dict(dm), placed
