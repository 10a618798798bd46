"""Panel states over several GPUs: one bar per GPU, placed as :func:`helpers.load` places a plan.

:class:`SplitState` is a plan split across the GPUs (:func:`helpers.plan_devices`, the map
``from_pretrained(device_map="auto")`` computes): each GPU's weights, KV cache, activations and
overheads against its capacity, the layer runs, what finds no room. :class:`FirstGpuState` is a plan
on GPU 0 alone, the other cards free (what ``load()`` does with a model that fits the first card).
The helpers here turn a panel's ``device`` (``"kaggle-2xt4"``, ``["t4", "t4"]``, ``{0: bytes}``,
``"current"`` with several GPUs) into its GPUs, and a single GPU into its multi-GPU set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from ..core.devices import DEVICE_SETS, DEVICES, resolve_device, resolve_devices
from ..core.html import STYLE, color_attrs
from ..core.units import format_bytes
from ..core.vocab import FITS, VERDICT_STATUS, verdict
from ..placement.device_plan import DevicePlan, DeviceShare
from .state import SEGMENTS, PanelState, stacked_bar

__all__ = [
    "Alternative", "FirstGpuState", "SplitFix", "SplitState", "gpu_specs", "layer_ranges", "multi_gpu_set",
    "ranges_text", "split_gpus", "split_target", "hashable_devices",
]  # fmt: skip

SHARE_FIELDS = ("weights", "kv_cache", "activations", "overhead")  # DeviceShare's, in SEGMENTS' order


def _device_set_name(device: Any) -> str | None:
    """The ``DEVICE_SETS`` key ``device`` names (spelled as ``resolve_devices`` accepts it), else None."""
    if not isinstance(device, str):
        return None
    key = device.lower().replace(" ", "").replace("_", "-").replace("×", "x")
    return key if key in DEVICE_SETS else None


def split_gpus(device: Any) -> list[tuple[str, dict]] | None:
    """The GPUs a panel splits the model across: a device set, a list or ``{index: bytes}`` of GPUs, or
    ``"current"`` where torch sees more than one GPU. None for one device (the single-bar panel)."""
    import torch

    if _device_set_name(device) or isinstance(device, list | tuple | dict):
        return resolve_devices(device)
    if isinstance(device, str) and device.strip().lower() == "current":
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            return resolve_devices("current")
    return None


def split_target(device: Any, gpus: list[tuple[str, dict]]) -> tuple[int, str, Any]:
    """(capacity of all the GPUs, label, one of them for the whole-model estimate)."""
    name = _device_set_name(device)
    if name is not None:
        return sum(d["capacity"] for _, d in gpus), name, DEVICE_SETS[name][0]
    if isinstance(device, str):  # "current"
        return sum(d["capacity"] for _, d in gpus), "this machine", "current"
    first = device[0]  # a list, or a dict keyed 0, 1, ...
    return sum(d["capacity"] for _, d in gpus), f"{len(gpus)} GPUs", first


def gpu_specs(device: Any, gpus: list[tuple[str, dict]]) -> list:
    """One ``plan_devices`` device per GPU, as given (``"t4"``, bytes), so the first N can be planned alone;
    ``"current"``'s GPUs as read (a dict ``resolve_device`` takes)."""
    name = _device_set_name(device)
    if name is not None:
        return list(DEVICE_SETS[name])
    if isinstance(device, dict):
        return [device[i] for i in range(len(device))]
    return list(device) if isinstance(device, list | tuple) else [d for _, d in gpus]


def _preset_of(device: Any) -> str | None:
    """The ``DEVICES`` preset ``device`` is: its name, or for ``"current"`` the preset of the same capacity
    (presets hold what each card reports, to the byte, so a Colab T4 is ``"t4"``)."""
    import torch

    if not isinstance(device, str):
        return None
    key = device.lower().replace(" ", "").replace("_", "-")
    if key in DEVICES:
        return key
    if key != "current" or not torch.cuda.is_available():
        return None
    capacity = resolve_device("current")[1]["capacity"]
    return next((k for k, d in DEVICES.items() if d["capacity"] == capacity), None)


def multi_gpu_set(device: Any) -> str | None:
    """The smallest ``DEVICE_SETS`` entry made of ``device``'s GPU (``"t4"`` -> ``"kaggle-2xt4"``), or None."""
    preset = _preset_of(device)
    sets = sorted((len(members), name) for name, members in DEVICE_SETS.items() if set(members) == {preset})
    return sets[0][1] if sets else None


def hashable_devices(devices: Any) -> Any:
    """``devices`` as a cache key: lists and dicts (of presets, sizes or GPU dicts) as nested tuples."""
    if isinstance(devices, dict):
        return tuple(sorted((k, hashable_devices(v)) for k, v in devices.items()))
    return tuple(map(hashable_devices, devices)) if isinstance(devices, list | tuple) else devices


def layer_ranges(placement: DevicePlan) -> dict[Any, tuple[int, int]]:
    """``{device: (first, last)}`` decoder layer of each device holding any. ``device_map="auto"`` fills the
    devices in order (GPU 0, 1, ..., then CPU, disk), so each holds one run and the counts locate it."""
    out, start = {}, 0
    for share in placement.shares:
        if share.layers:
            out[share.device] = (start, start + share.layers - 1)
            start += share.layers
    return out


def _span(first: int, last: int) -> str:
    return f"{first}-{last}" if last > first else str(first)


def _device_name(device: Any) -> str:
    return f"GPU {device}" if isinstance(device, int) else str(device)


def ranges_text(placement: DevicePlan) -> str:
    """``"layers 0-15 on GPU 0, 16-31 on GPU 1"``."""
    spans = [f"{_span(*r)} on {_device_name(d)}" for d, r in layer_ranges(placement).items()]
    return "layers " + ", ".join(spans) if spans else "no decoder layers"


def _fullest(placement: DevicePlan) -> DeviceShare:
    return max(placement.gpus, key=lambda s: s.total / s.capacity)


def _where(n_gpus: int, label: str) -> str:
    """``"across 2 GPUs (kaggle-2xt4)"``; the label is left out where it only repeats the count."""
    where = f"across {n_gpus} GPUs" if n_gpus > 1 else "on 1 GPU"
    return where if label == f"{n_gpus} GPUs" else f"{where} ({label})"


@dataclass
class SplitFix:
    """The top fix over several GPUs: a change checked by placing the changed plan as ``load()`` would
    (``result`` its verdict; ``placement`` its split, None when it then fits GPU 0 alone), applied by
    ``panel.set(**fix.kwargs)``; or, when none of the few tried fits, the split's own advice (no ``result``)."""

    change: str
    kwargs: dict = field(default_factory=dict)
    result: str | None = None
    placement: DevicePlan | None = None

    def __str__(self) -> str:
        if self.result is None:
            return self.change
        if self.placement is None:
            return f"{self.change} (then {self.result} on GPU 0 alone)"
        n = len(self.placement.gpus)
        return f"{self.change} (then {self.result} {_where(n, f'{n} GPUs')})"


@dataclass
class Alternative:
    """A way to split a plan that does not fit one GPU across several (``how``: ``"device='kaggle-2xt4'"``
    for a machine with more of this GPU, ``"gpus=2"`` for this one) where the split would fit."""

    how: str
    placement: DevicePlan

    def __str__(self) -> str:
        n = len(self.placement.gpus)
        return f"Would fit split across {n} GPUs with {self.how}: {ranges_text(self.placement)}"


def _share_parts(share: DeviceShare) -> list[tuple[str, int, float]]:
    return [(label, getattr(share, f), alpha) for (label, _, alpha), f in zip(SEGMENTS, SHARE_FIELDS, strict=True)]


def _layers_of(share: DeviceShare, ranges: dict) -> str:
    if share.device not in ranges:
        return "no decoder layers"
    first, last = ranges[share.device]
    return f"layers {_span(first, last)}" if last > first else f"layer {first}"


@dataclass
class SplitState(PanelState):
    """A panel state over several GPUs: the whole-model estimate, and each GPU's share of the split
    ``from_pretrained(device_map="auto")`` makes (:func:`helpers.plan_devices`): one bar each."""

    placement: DevicePlan | None = None
    fix: SplitFix | None = None

    @property
    def headroom(self) -> int:
        """The fullest GPU's headroom: where the next token's KV cache runs out first."""
        return min(s.capacity - s.total for s in self.placement.gpus)

    def _head(self) -> tuple[str, str]:
        """(verdict word, what follows it) of the verdict line, as plain text."""
        p = self.placement
        where = _where(len(p.gpus), self.device)
        if not p.fits:
            return self.verdict.upper(), f"{where}: {p.reasons[0]}"
        f = _fullest(p)
        return self.verdict.upper(), (
            f"{where}: {ranges_text(p)}; fullest GPU {f.device}: {format_bytes(f.total)} of "
            f"{format_bytes(f.capacity)} (headroom {format_bytes(f.capacity - f.total)})"
        )

    def verdict_text(self) -> str:
        word, rest = self._head()
        return f"{word} {rest}" + (f". Top fix: {self.fix}" if self.fix is not None else "")

    def verdict_html(self) -> str:
        word, rest = self._head()
        fix = f"<div class='oomkit-suggestion'>Top fix: <b>{escape(str(self.fix))}</b></div>" if self.fix else ""
        notes = "".join(f"<div class='oomkit-note'>note: {escape(n)}</div>" for n in self.notes())
        return (
            f"<div class='oomkit-verdict-text' data-verdict='{escape(self.verdict)}' "
            f"data-gpus='{len(self.placement.gpus)}' style='font-family:monospace'>"
            f"{STYLE}<b {color_attrs(VERDICT_STATUS[self.verdict])}>{escape(word)}</b> {escape(rest)}{fix}{notes}</div>"
        )

    def bar_html(self, width: int = 420) -> str:
        """One bar per GPU (weights, KV cache, activations, overheads against its capacity), then what is left over."""
        ranges = layer_ranges(self.placement)
        bars = []
        for s in self.placement.gpus:
            caption = (
                f"GPU {escape(s.label)}, {_layers_of(s, ranges)}: total {format_bytes(s.total)} / "
                f"{format_bytes(s.capacity)}"
            )
            attrs = f" class='oomkit-gpu-bar' data-gpu='{s.device}'"
            v = verdict(s.total, s.capacity)
            bars.append(stacked_bar(_share_parts(s), s.total, s.capacity, v, caption, width=width, attrs=attrs))
        left = [s for s in self.placement.shares if not isinstance(s.device, int)]
        bars += [
            f"<div class='oomkit-left-over' style='font-family:monospace'><span {color_attrs('fail')}>"
            f"{escape(_left_over(s, ranges))}</span></div>"
            for s in left
        ]
        return f"<div class='oomkit-gpus'>{''.join(bars)}</div>"

    def text_lines(self) -> list[str]:
        segs = ", ".join(f"{label} {format_bytes(b)}" for label, b in self.segments())
        ranges = layer_ranges(self.placement)
        lines = [f"estimate (whole model): {segs}"]
        for s in self.placement.gpus:
            parts = ", ".join(f"{label} {format_bytes(n)}" for label, n, _ in _share_parts(s))
            lines.append(
                f"GPU {s.label}, {_layers_of(s, ranges)}: {parts}; total {format_bytes(s.total)} of "
                f"{format_bytes(s.capacity)} ({verdict(s.total, s.capacity)})"
            )
        lines += [_left_over(s, ranges) for s in self.placement.shares if not isinstance(s.device, int)]
        return [*lines, self.verdict_text()]

    def notes(self) -> list[str]:
        return list(self.placement.notes)


def _left_over(share: DeviceShare, ranges: dict) -> str:
    """A CPU or disk share of a split that is refused: what found no room on the GPUs."""
    what = _layers_of(share, ranges) if share.device in ranges else "modules outside the decoder layers"
    return f"no room on the GPUs for {format_bytes(share.weights)} of weights ({what}; placed on {share.device})"


@dataclass
class FirstGpuState(PanelState):
    """Several GPUs, the plan on GPU 0 alone: what ``load()`` does with a model that fits the first card
    (or with ``gpus=1``), so the others stay free. The estimate is judged against GPU 0, as on one GPU."""

    gpu0: str = ""  # GPU 0's label ("0: t4")
    free: list[tuple[str, int]] = field(default_factory=list)  # (label, capacity) of the GPUs left free

    def _free_text(self) -> str:
        n = len(self.free) + 1
        others = "GPU 1 stays free" if n == 2 else f"GPUs 1-{n - 1} stay free"
        if self.plan.gpus is not None:
            return f"{others} (gpus={self.plan.gpus})"
        return f"{others} (for a second model, or DDP); gpus={n} splits the model across {'both' if n == 2 else f'all {n}'}"

    def _rest(self) -> str:
        """The verdict line after its verdict word, as plain text."""
        text = (
            f"on GPU 0 alone ({self.device}): {format_bytes(self.estimate.total)} of {format_bytes(self.capacity)} "
            f"(headroom {format_bytes(self.headroom)})"
        )
        text += f"{self.fix_text()}. {self._free_text()}"
        return text + (f". {self.alternative}" if self.alternative is not None else "")

    def verdict_text(self) -> str:
        return f"{self.verdict.upper()} {self._rest()}"

    def verdict_html(self) -> str:
        return (
            f"<div class='oomkit-verdict-text' data-verdict='{escape(self.verdict)}' data-gpus='1' "
            f"style='font-family:monospace'>{STYLE}<b {color_attrs(VERDICT_STATUS[self.verdict])}>"
            f"{escape(self.verdict.upper())}</b> "
            f"{escape(self._rest())}</div>"
        )

    def bar_html(self, width: int = 420) -> str:
        """GPU 0's bar (the whole estimate against its capacity), then an empty bar per free GPU."""
        parts = [
            (label, n, alpha) for (label, n), (_, _, alpha) in zip(self.segments(), self.segments_spec, strict=True)
        ]
        caption = f"GPU {escape(self.gpu0)}: total {format_bytes(self.estimate.total)} / {format_bytes(self.capacity)}"
        bars = [stacked_bar(parts, self.estimate.total, self.capacity, self.verdict, caption, width=width,
                            attrs=" class='oomkit-gpu-bar' data-gpu='0'")]  # fmt: skip
        for i, (label, capacity) in enumerate(self.free, 1):
            caption = f"GPU {escape(label)}: free ({format_bytes(capacity)})"
            bars.append(stacked_bar([], 0, capacity, FITS, caption, width=width,
                                    attrs=f" class='oomkit-gpu-bar' data-gpu='{i}'"))  # fmt: skip
        return f"<div class='oomkit-gpus'>{''.join(bars)}</div>"

    def text_lines(self) -> list[str]:
        segs = ", ".join(f"{label} {format_bytes(b)}" for label, b in self.segments())
        lines = [f"estimate: {segs}"]
        lines.append(f"GPU {self.gpu0}: the whole model, {format_bytes(self.estimate.total)} of "
                     f"{format_bytes(self.capacity)} ({self.verdict})")  # fmt: skip
        lines += [f"GPU {label}: free ({format_bytes(capacity)})" for label, capacity in self.free]
        return [*lines, self.verdict_text()]
