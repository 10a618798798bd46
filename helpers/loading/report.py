"""What a load did: :func:`placement` (bytes per device, quantization state included) and :class:`LoadReport`
(estimated against measured memory, where each part landed, the warnings and notes), as text and HTML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.devices import (
    DISK_BYTES_PER_S,
    PCIE_BYTES_PER_S,
)
from ..core.html import colored, table
from ..core.units import format_bytes, percent
from ..core.vocab import QUANTIZED
from ..estimator.footprint import footprint_by_device
from ..placement.device_plan import DevicePlan
from .plan import LoadPlan

__all__ = ["LoadReport", "placement", "offload_warnings"]


def placement(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters, buffers and quantization state per device (``"cuda:0"``, ``"cpu"``,
    ``"disk"``, ``"meta"``): the same count as ``footprint(model)``, split by where it lives."""
    device_map = getattr(model, "hf_device_map", None) or {}
    out: dict[str, int] = {}
    if len(set(map(str, device_map.values()))) > 1:
        for name, dev in device_map.items():
            sub = model.get_submodule(name) if name else model
            key = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
            out[key] = out.get(key, 0) + sum(footprint_by_device(sub).values())
        return out
    return footprint_by_device(model)


def offload_warnings(where: dict[str, int]) -> list[str]:
    """Warnings for weights a load placed in CPU RAM or on disk (``where`` is :func:`placement`'s)."""
    warnings = []
    on_cpu, on_disk = where.get("cpu", 0), where.get("disk", 0)
    if any(k.startswith("cuda") for k in where) and on_cpu:
        ms = on_cpu / PCIE_BYTES_PER_S * 1000
        warnings.append(
            f"{format_bytes(on_cpu)} of weights were offloaded to CPU RAM: every generated token "
            f"copies them to the GPU (~{ms:.0f} ms per token at {format_bytes(PCIE_BYTES_PER_S)}/s "
            "PCIe, typically 5-20x slower generation). Quantize (int8/nf4) to keep it all on the GPU."
        )
    if on_disk:
        s = on_disk / DISK_BYTES_PER_S
        warnings.append(
            f"{format_bytes(on_disk)} of weights were offloaded to disk: ~{s:.1f} s per generated "
            "token just to read them back. This is not a fix; use a smaller model or nf4."
        )
    return warnings


@dataclass(repr=False)
class LoadReport:
    """Estimated vs measured memory of a load, how long it took, where modules went, and warnings."""

    plan: LoadPlan
    estimated_weights: int
    measured_weights: int
    estimated_total: int
    load_seconds: float
    placement: dict[str, int]
    cuda_allocated: int | None = None  # memory_allocated() growth during the load, all GPUs (CUDA only)
    adapter_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    estimate: Any = field(default=None, repr=False)
    tokenizer_note: str = ""
    split: DevicePlan | None = field(default=None, repr=False)  # the placement over several GPUs, if planned
    notes: list[str] = field(default_factory=list)
    # the load mode as loaded (loading.fingerprint.loaded_mode): a bitsandbytes load that quantized no layer
    # loaded as its dtype, and its weights are compared with that dtype's estimate
    loaded_as: str | None = None

    def __post_init__(self) -> None:
        # the weights and total estimated for the mode the weights loaded as (None: not known)
        self._expected, self._expected_total = self.estimated_weights, self.estimated_total
        if self.stayed_unquantized:
            try:
                as_loaded = self.estimate.replace(load=self.loaded_as)
                self._expected, self._expected_total = as_loaded.weights, as_loaded.total
            except Exception:  # noqa: BLE001 - no estimate for that dtype: the difference is not known
                self._expected = self._expected_total = None

    @property
    def stayed_unquantized(self) -> bool:
        """A bitsandbytes mode was asked and no layer was quantized (weights loaded in ``loaded_as``)."""
        return self.plan.quantized and self.loaded_as is not None and self.loaded_as.split("+")[0] not in QUANTIZED

    @property
    def loaded_mode(self) -> str:
        """The load mode the weights are in: the plan's, or the dtype a bitsandbytes load stayed in."""
        return self.loaded_as if self.stayed_unquantized else self.plan.load

    def unquantized_note(self) -> str:
        """Why a bitsandbytes load stayed unquantized, in words (empty when it did not)."""
        if not self.stayed_unquantized:
            return ""
        on_gpu = any(k.startswith("cuda") for k in self.placement)
        why = ("bitsandbytes found no linear layer to quantize" if on_gpu else
               "bitsandbytes leaves the layers a device map puts on the CPU unquantized")  # fmt: skip
        return (
            f"{self.plan.load} was asked, but no layer was quantized ({why}): the weights are {self.loaded_as}, "
            f"and are compared with the {self.loaded_as} estimate"
        )

    @property
    def weights_error(self) -> float | None:
        """(measured - estimated) / estimated weights, in percent; the estimate is for the mode as loaded."""
        if self._expected is None:
            return None
        return percent(self.measured_weights - self._expected, self._expected)

    def rows(self) -> list[list[str]]:
        err, expected = self.weights_error, self._expected
        rows = [
            [
                "weights",
                format_bytes(expected) if expected is not None else "n/a",
                format_bytes(self.measured_weights),
                "n/a" if err is None else f"{err:+.2f} %",
            ]
        ]
        if self.cuda_allocated is not None and expected:
            rows.append(
                [
                    "CUDA allocated by the load",
                    format_bytes(expected),
                    format_bytes(self.cuda_allocated),
                    f"{percent(self.cuda_allocated - expected, expected):+.2f} %",
                ]
            )
        if self.adapter_bytes:
            rows.append(["adapter", "", format_bytes(self.adapter_bytes), ""])
        if self._expected_total is not None:
            rows.append(["total while generating (estimate)", format_bytes(self._expected_total), "", ""])
        return rows

    def placement_rows(self) -> list[list[str]]:
        """Per device: the bytes measured there, and the split's estimate when the load was split."""
        planned = {}
        if self.split is not None:
            planned = {(f"cuda:{s.device}" if isinstance(s.device, int) else str(s.device)): s.weights
                       for s in self.split.shares if s.weights}  # fmt: skip
        keys = list(dict.fromkeys([*planned, *self.placement]))
        return [[k, format_bytes(planned[k]) if k in planned else "", format_bytes(self.placement.get(k, 0))]
                for k in keys]  # fmt: skip

    def _asked(self) -> str:
        return f" ({self.plan.load} asked: stayed unquantized)" if self.stayed_unquantized else ""

    def __str__(self) -> str:
        head = f"loaded {self.plan.model} as {self.loaded_mode}{self._asked()} in {self.load_seconds:.1f} s"
        lines = [head]
        for name, est, meas, err in self.rows():
            lines.append(f"  {name:<36} estimated {est or '-':>11}  measured {meas or '-':>11}  {err}")
        if self.split is None:
            lines.append("  placement: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.placement.items()))
        else:
            lines += [f"  {'on ' + dev:<36} estimated {est or '-':>11}  measured {meas:>11}"
                      for dev, est, meas in self.placement_rows()]  # fmt: skip
        if self.tokenizer_note:
            lines.append(f"  tokenizer: {self.tokenizer_note}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  WARNING: {w}" for w in [self.unquantized_note(), *self.warnings] if w]
        return "\n".join(lines)

    def __repr__(self) -> str:  # the text a notebook shows without HTML (papermill, a terminal)
        return self.__str__()

    def _repr_html_(self) -> str:
        from html import escape

        title = f"{self.plan.model} as {self.loaded_mode}{self._asked()}, loaded in {self.load_seconds:.1f} s"
        html = table(["", "estimated", "measured", "difference"], self.rows(), title=title)
        if self.split is None:
            html += table(["device", "bytes"], [[k, format_bytes(v)] for k, v in self.placement.items()],
                          title="where the weights went")  # fmt: skip
        else:
            html += table(["device", "estimated", "measured"], self.placement_rows(), title="where the weights went")
        for n in self.notes:
            html += f"<div style='font-family:monospace'>{escape(n)}</div>"
        for w in [self.unquantized_note(), *self.warnings]:
            if w:
                html += f"<div style='font-family:monospace'>{colored('⚠ ' + w, 'warn')}</div>"
        return html
