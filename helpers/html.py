"""Small HTML pieces shared by every ``_repr_html_``: a usage bar and a table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape

from .units import format_bytes

COLORS = {"ok": "#34a853", "pass": "#34a853", "warn": "#fbbc04", "tight": "#fbbc04",
          "fail": "#ea4335", "info": "#4285f4", "none": "#9aa0a6"}  # fmt: skip


def level_color(fraction: float) -> str:
    """Green below 85 % used, amber to 95 %, red above: the headroom rules of thumb users know."""
    if fraction < 0.85:
        return COLORS["ok"]
    return COLORS["warn"] if fraction < 0.95 else COLORS["fail"]


def bar(used: int | None, total: int | None, label: str, color: str | None = None, width: int = 260) -> str:
    """A Colab-style bar: ``label  [#####.....]  used / total``."""
    if used is None or not total:
        return f"<div style='font-family:monospace'>{escape(label)}: n/a</div>"
    frac = max(0.0, min(1.0, used / total))
    color = color or level_color(frac)
    return (
        "<div style='display:flex;align-items:center;gap:8px;font-family:monospace;margin:2px 0'>"
        f"<span style='min-width:150px'>{escape(label)}</span>"
        f"<span style='display:inline-block;width:{width}px;height:12px;background:#e8eaed;border-radius:3px'>"
        f"<span style='display:block;width:{frac * 100:.1f}%;height:100%;background:{color};border-radius:3px'></span>"
        "</span>"
        f"<span>{format_bytes(used)} / {format_bytes(total)} ({frac * 100:.0f}%)</span></div>"
    )


def table(header: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None) -> str:
    """A plain HTML table; cells are escaped unless they are already ``Markup`` (str subclass)."""

    def cell(v: object) -> str:
        return str(v) if isinstance(v, Markup) else escape(str(v))

    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px'>{cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    cap = (
        f"<caption style='text-align:left;font-weight:bold;white-space:nowrap'>{escape(title)}</caption>"
        if title
        else ""
    )
    return f"<table style='border-collapse:collapse;font-family:monospace'>{cap}<tr>{head}</tr>{body}</table>"


class Markup(str):
    """A string that is already HTML and must not be escaped by :func:`table`."""


def badge(status: str) -> Markup:
    color = COLORS.get(status, COLORS["none"])
    return Markup(
        f"<span style='background:{color};color:white;padding:0 6px;border-radius:3px'>{escape(status)}</span>"
    )
