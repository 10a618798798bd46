"""Where a loaded model's memory sits: embeddings, each decoder layer, the LM head and the rest.

:func:`module_memory` groups :func:`helpers.estimator.footprint_by_name` (parameters, buffers and
bitsandbytes' quantization state, shared storage counted once) by module, so the parts add up to
:func:`helpers.footprint` exactly. The result prints as a text table and shows in a notebook as a
stacked bar, one segment per part and one per decoder layer.

    >>> module_memory(model)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

import torch

from ..core.html import TRACK_COLOR, Markup, table
from ..core.units import format_bytes
from ..estimator.footprint import footprint_by_name

__all__ = ["MemorySegment", "ModuleMemory", "module_memory"]

# fills per kind (areas, no text on them); the decoder layers alternate two shades of one hue so each
# layer shows as its own segment while the group still reads as one
FILLS = {"embeddings": "#9334e6", "layer": ("#1a73e8", "#8ab4f8"), "lm_head": "#e8710a", "other": "#80868b"}
SHOWN_MODULES = 4  # module names listed per segment in the table before "…"


@dataclass(frozen=True)
class MemorySegment:
    """One part of the model: ``kind`` is ``embeddings``, ``layer``, ``lm_head`` or ``other``;
    ``modules`` the module paths whose tensors it holds (bytes: what they hold, counted once)."""

    name: str
    kind: str
    bytes: int
    modules: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.name}: {format_bytes(self.bytes)}"


@dataclass(frozen=True)
class ModuleMemory:
    """A model's bytes per part, in model order: embeddings, each decoder layer, lm_head, other.

    ``total`` equals :func:`helpers.footprint` of the model; ``layers_path`` names the decoder
    layers' ``ModuleList`` (None when the model has none); ``tied`` says the LM head shares the
    embeddings' storage (its bytes are counted once, under the embeddings).
    """

    model_name: str
    segments: tuple[MemorySegment, ...]
    layers_path: str | None = None
    tied: bool = False

    @property
    def total(self) -> int:
        return sum(s.bytes for s in self.segments)

    @property
    def layers(self) -> list[MemorySegment]:
        """One segment per decoder layer, in order."""
        return [s for s in self.segments if s.kind == "layer"]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_of(self, kind: str) -> int:
        """Bytes of every segment of ``kind`` (``"layer"``: all decoder layers together)."""
        return sum(s.bytes for s in self.segments if s.kind == kind)

    def rows(self) -> list[tuple[str, str, int, str]]:
        """(part, modules, bytes, note) per line of the table: the decoder layers on one line."""
        out = []
        for kind in ("embeddings", "layer", "lm_head", "other"):
            parts = [s for s in self.segments if s.kind == kind]
            if not parts:
                continue
            if kind == "layer":
                sizes = [s.bytes for s in parts]
                each = (
                    format_bytes(sizes[0])
                    if len(set(sizes)) == 1
                    else f"{format_bytes(min(sizes))} to {format_bytes(max(sizes))}"
                )
                out.append((f"decoder layers × {len(parts)}", self.layers_path or "", sum(sizes), f"each {each}"))
                continue
            note = "tied to the embeddings: counted there" if kind == "lm_head" and self.tied else ""
            out.append((parts[0].name, _listed(parts[0].modules), parts[0].bytes, note))
        return out

    def __str__(self) -> str:
        total = self.total or 1
        lines = [f"module memory of {self.model_name}: {format_bytes(self.total)}"]
        rows = self.rows()
        width = max((len(r[0]) for r in rows), default=0)
        mods = max((len(r[1]) for r in rows), default=0)
        for part, modules, n, note in rows:
            tail = f"  ({note})" if note else ""
            lines.append(f"  {part:<{width}}  {modules:<{mods}}  {format_bytes(n):>10}  {n / total:>4.0%}{tail}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        total = self.total or 1
        swatches = {"decoder": _swatch(FILLS["layer"][0])}
        rows = [
            [swatches.get(part.split()[0], _swatch(_fill(_kind_of(part), 0))), part, modules, format_bytes(n),
             f"{n / total:.0%}", note]
            for part, modules, n, note in self.rows()
        ]  # fmt: skip
        title = f"{self.model_name}: {format_bytes(self.total)} in memory"
        return _stacked_bar(self.segments, total) + table(["", "part", "modules", "bytes", "share", ""], rows, title)


def _kind_of(part: str) -> str:
    return {"embeddings": "embeddings", "lm_head": "lm_head"}.get(part, "other")


def _fill(kind: str, index: int) -> str:
    fill = FILLS[kind]
    return fill[index % 2] if isinstance(fill, tuple) else fill


def _swatch(color: str) -> Markup:
    return Markup(f"<span style='display:inline-block;width:10px;height:10px;background:{color}'></span>")


def _stacked_bar(segments: tuple[MemorySegment, ...], total: int, width: int = 640) -> str:
    """One bar, a segment per part (each decoder layer its own), sized by bytes; names in the tooltips."""
    spans = []
    for i, s in enumerate(seg for seg in segments if seg.bytes):
        tip = escape(f"{s.name} ({_listed(s.modules)}): {format_bytes(s.bytes)}", quote=True)
        color = _fill(s.kind, i if s.kind == "layer" else 0)
        spans.append(
            f'<span title="{tip}" style=\'display:block;width:{100 * s.bytes / total:.3f}%;'
            f"height:100%;background:{color}'></span>"
        )
    return (
        f"<div style='display:flex;width:{width}px;max-width:100%;height:16px;background:{TRACK_COLOR};"
        f"border-radius:3px;overflow:hidden;margin:4px 0'>{''.join(spans)}</div>"
    )


def _listed(modules: tuple[str, ...]) -> str:
    shown = ", ".join(modules[:SHOWN_MODULES])
    return shown + (f", … ({len(modules) - SHOWN_MODULES} more)" if len(modules) > SHOWN_MODULES else "")


def _module_name(model: torch.nn.Module, getter: str) -> str | None:
    """The path of ``model.get_input_embeddings()`` / ``get_output_embeddings()``, None without one."""
    try:
        module = getattr(model, getter)()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    if module is None:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)


def _decoder_layers(model: torch.nn.Module, by_name: dict[str, int]) -> str | None:
    """The path of the ``ModuleList`` holding the most bytes (a decoder's layers), None without one."""
    best, best_bytes = None, -1
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or not len(module) or not name:
            continue
        held = sum(n for owner, n in by_name.items() if owner.startswith(name + "."))
        if held > best_bytes:
            best, best_bytes = name, held
    return best


def _under(owner: str, prefix: str | None) -> bool:
    return prefix is not None and (owner == prefix or owner.startswith(prefix + "."))


def _classify(owner: str, layers: str | None, embeds: list[str], head: str | None) -> tuple[str, int]:
    """(kind, layer index) of one tensor name."""
    if _under(owner, layers):
        return "layer", int(owner[len(layers) + 1 :].split(".", 1)[0])
    if any(_under(owner, e) for e in embeds):
        return "embeddings", 0
    if _under(owner, head):
        return "lm_head", 0
    return "other", 0


def module_memory(model: torch.nn.Module) -> ModuleMemory:
    """Bytes held per part of a loaded model: embeddings, each decoder layer, lm_head, other.

    Parameters, buffers and bitsandbytes' quantization state (nf4 absmax and nested code, int8 row
    scales) count, shared storage once: the segments add up to :func:`helpers.footprint` exactly.
    The decoder layers are the ``ModuleList`` holding the most bytes; the embeddings are the input
    embeddings and any module outside the layers with ``embed`` in its name; tied LM heads hold 0.
    """
    by_name = footprint_by_name(model)
    layers = _decoder_layers(model, by_name)
    head = _module_name(model, "get_output_embeddings")
    first = _module_name(model, "get_input_embeddings")
    embeds = [first] if first else []
    embeds += [
        n for n, _ in model.named_modules() if "embed" in n.rsplit(".", 1)[-1] and n != first and not _under(n, layers)
    ]
    sums: dict[tuple[str, int], int] = {}
    modules: dict[tuple[str, int], dict[str, None]] = {}
    for owner, n in by_name.items():
        key = _classify(owner, layers, embeds, head)
        sums[key] = sums.get(key, 0) + n
        modules.setdefault(key, {})[owner.rsplit(".", 1)[0] if "." in owner else owner] = None
    count = len(model.get_submodule(layers)) if layers else 0
    segments = [_segment("embeddings", "embeddings", 0, sums, modules, embeds)]
    segments += [_segment(f"layer {i}", "layer", i, sums, modules, [f"{layers}.{i}"]) for i in range(count)]
    segments.append(_segment("lm_head", "lm_head", 0, sums, modules, [head] if head else []))
    segments.append(_segment("other", "other", 0, sums, modules, []))
    tied = _tied(model)
    keep = [s for s in segments if s.bytes or s.kind == "layer" or (s.kind == "lm_head" and (head or tied))]
    return ModuleMemory(type(model).__name__, tuple(keep), layers, tied)


def _segment(name, kind, index, sums, modules, fallback) -> MemorySegment:
    held = modules.get((kind, index))
    return MemorySegment(name, kind, sums.get((kind, index), 0), tuple(held) if held else tuple(fallback))


def _tied(model: torch.nn.Module) -> bool:
    """True when the LM head's weight is the input embeddings' (one storage)."""
    try:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        return False
    w_head, w_embed = getattr(head, "weight", None), getattr(embed, "weight", None)
    if not isinstance(w_head, torch.Tensor) or not isinstance(w_embed, torch.Tensor):
        return False
    return w_head is w_embed or (w_head.device.type != "meta" and w_head.data_ptr() == w_embed.data_ptr())
