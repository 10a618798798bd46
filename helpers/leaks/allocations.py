"""CUDA: allocation history for PyTorch's memory visualizer, and the top allocation sites in it."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html import escape
from pathlib import Path

import torch

from ..core.arguments import regular_file
from ..core.errors import OomkitError
from ..core.html import table, theme_figure
from ..core.units import format_bytes

__all__ = [
    "AllocationSites", "AllocationTimeline", "SnapshotError", "allocation_timeline", "load_snapshot",
    "record_allocations", "top_allocation_sites",
]  # fmt: skip

# --------------------------------------------------------------------------------------------
# CUDA: allocation history for PyTorch's memory visualizer


@dataclass
class AllocationSites:
    """Live allocations in a memory snapshot, summed by the line of user code that made them."""

    sites: list[tuple[str, int, int]]  # (site, bytes, count), largest first
    total: int
    path: Path | None = None

    def __str__(self) -> str:
        head = f"{format_bytes(self.total)} allocated in {sum(c for _, _, c in self.sites)} blocks"
        if self.path is not None:
            head += f"; snapshot {self.path} (drop it on https://pytorch.org/memory_viz)"
        return "\n".join([head, *(f"{format_bytes(b):>11}  {c:>5} x  {s}" for s, b, c in self.sites)])

    def _repr_html_(self) -> str:
        return table(
            ["bytes", "blocks", "allocated at"],
            [[format_bytes(b), c, s] for s, b, c in self.sites],
            f"Top allocation sites ({format_bytes(self.total)} live)",
        )


def _site(frames: list[dict]) -> str:
    """The first frame outside torch and the libraries: the line the user can change."""

    def lib(f):
        fn = f.get("filename", "")
        # Snapshots list C/C++ frames too (allocator, libpython: "??", "Python/ceval.c", a .so path);
        # only Python source can be the user's line. Colab installs packages in dist-packages.
        python = fn.endswith(".py") or (fn.startswith("<") and not fn.startswith("<frozen"))
        return not python or "site-packages" in fn or "dist-packages" in fn or "/torch/" in fn

    pick = next((f for f in frames if not lib(f) and f.get("filename")), None)
    if pick is None:
        pick = next((f for f in frames if f.get("filename", "").endswith(".py")), frames[0] if frames else None)
    if pick is None:
        return "(allocated before recording started)"
    return f"{pick.get('filename')}:{pick.get('line')} {pick.get('name')}"


class SnapshotError(OomkitError, ValueError):
    """A memory snapshot file that cannot be read safely (or at all)."""


class _PlainUnpickler(pickle.Unpickler):
    # A memory snapshot is dicts, lists, strings and numbers only. Refusing every global means a
    # shared pickle cannot name a function to call while it loads (pickle's code-execution hole).
    def find_class(self, module: str, name: str):
        raise SnapshotError(f"it asks to load {module}.{name}, which a memory snapshot never holds")


def load_snapshot(path: str | Path, *, trusted: bool = False) -> dict:
    """Read a snapshot pickle; only plain data is admitted unless ``trusted`` (your own file)."""
    path = regular_file(path, "memory snapshot", SnapshotError)
    try:
        with path.open("rb") as f:
            data = pickle.load(f) if trusted else _PlainUnpickler(f).load()
    except SnapshotError as e:
        raise SnapshotError(
            f"{path} is not a plain memory snapshot: {e}. Loading it could run code; if you made this "
            "file yourself, pass trusted=True"
        ) from None
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise SnapshotError(f"cannot read {path} as a memory snapshot ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"{path} holds a {type(data).__name__}, not a memory snapshot (a dict)")
    return data


def top_allocation_sites(snapshot: dict | str | Path, n: int = 10, *, trusted: bool = False) -> AllocationSites:
    """Sum live blocks of a ``torch.cuda.memory._snapshot()`` (dict or pickle file) by allocation site.

    A file is read with an unpickler that admits plain data only (snapshots are shared between
    people, and a pickle can run code); ``trusted=True`` reads your own file without that guard."""
    path = None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SnapshotError(f"n is how many sites to list, a whole number >= 1; got {n!r:.60}")
    if not isinstance(snapshot, dict | str | os.PathLike):
        raise SnapshotError(
            f"snapshot must be torch.cuda.memory._snapshot()'s dict or its pickle file, got {snapshot!r:.60}"
        )
    if not isinstance(snapshot, dict):
        path = Path(snapshot)
        snapshot = load_snapshot(path, trusted=trusted)
    acc: dict[str, list[int]] = {}
    total = 0
    for seg in snapshot.get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            site = _site(block.get("frames") or [])
            a = acc.setdefault(site, [0, 0])
            a[0] += block.get("size", 0)
            a[1] += 1
            total += block.get("size", 0)
    sites = sorted(((s, b, c) for s, (b, c) in acc.items()), key=lambda r: -r[1])[:n]
    return AllocationSites(sites, total, path)


SITE_COLORS = ("#1a73e8", "#e8710a", "#188038", "#9334e6", "#c5221f", "#007b83")  # top sites; the rest grey


@dataclass
class AllocationTimeline:
    """One device's allocation events from a snapshot's ``device_traces``: the bytes allocated after
    each event (counted from the start of the recording) and the site of each allocation."""

    allocated: list[int]  # after each alloc/free event
    sites: list[str | None]  # the allocating site of each event (None for a free)
    top: list[tuple[str, int]]  # (site, bytes allocated in all), largest first
    device: int = 0

    def __str__(self) -> str:
        peak = max(self.allocated, default=0)
        head = f"device {self.device}: {len(self.allocated)} allocation events, peak {format_bytes(peak)} over the recording"
        return "\n".join([head, *(f"{format_bytes(b):>11}  {s}" for s, b in self.top)])

    def plot(self, title: str = "CUDA allocations over the recording"):
        """A matplotlib ``Figure``: allocated bytes after each event, each top site's allocations in its colour."""
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10.5, 3.4))
        plt.close(fig)  # shown once, as the cell's result
        peak = max(self.allocated, default=0) or 1
        scale, unit = (2**30, "GiB") if peak >= 2**30 else (2**20, "MiB")
        xs = range(len(self.allocated))
        ax.step(xs, [a / scale for a in self.allocated], where="post", color="#5f6368", lw=1, label="allocated")
        colors = {site: SITE_COLORS[i % len(SITE_COLORS)] for i, (site, _) in enumerate(self.top)}
        for site, color in colors.items():
            hits = [i for i, s in enumerate(self.sites) if s == site]
            ax.scatter(hits, [self.allocated[i] / scale for i in hits], s=10, color=color, zorder=3,
                       label=_short(site), gid=f"site:{site}")  # fmt: skip
        ax.set_xlabel("allocation event")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
        fig.tight_layout()
        return theme_figure(fig)


def _short(site: str, width: int = 60) -> str:
    return site if len(site) <= width else "…" + site[-(width - 1) :]


def allocation_timeline(snapshot: dict, device: int | None = None, top: int = 5) -> AllocationTimeline:
    """The allocation timeline of ``torch.cuda.memory._snapshot()``'s ``device_traces``: ``alloc`` adds a
    block's size, ``free_completed`` takes it off (the allocator's own segment events are left out); the
    ``top`` sites by bytes allocated are named. ``device``: the trace to read (default the first with events)."""
    traces = snapshot.get("device_traces") or []
    if device is None:
        device = next((i for i, t in enumerate(traces) if t), 0)
    events = traces[device] if device < len(traces) else []
    allocated, sites, now = [], [], 0
    by_site: dict[str, int] = {}
    for e in events:
        action, size = e.get("action"), int(e.get("size", 0))
        if action not in ("alloc", "free_completed"):
            continue
        site = _site(e.get("frames") or []) if action == "alloc" else None
        now += size if action == "alloc" else -size
        allocated.append(now)
        sites.append(site)
        if site is not None:
            by_site[site] = by_site.get(site, 0) + size
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return AllocationTimeline(allocated, sites, ranked, device)


@dataclass
class _Recording:
    path: Path
    sites: AllocationSites | None = None
    snapshot: dict | None = None  # what was dumped (None until the block ends)

    def __str__(self) -> str:
        if self.sites is None:
            return f"recording to {self.path}"
        return "\n".join(filter(None, [str(self.sites), str(self.timeline()) if self.snapshot else ""]))

    def timeline(self) -> AllocationTimeline | None:
        """The recorded allocations over time (None before the block ends)."""
        return allocation_timeline(self.snapshot) if self.snapshot is not None else None

    def plot(self):
        """PyTorch's own allocation history drawn in the cell (:meth:`AllocationTimeline.plot`)."""
        if self.snapshot is None:
            raise RuntimeError("nothing recorded yet: plot() after the `with record_allocations()` block ends")
        return self.timeline().plot()

    def _repr_html_(self) -> str:
        if self.sites is None:
            return f"<pre>recording to {escape(str(self.path))}</pre>"
        return self.sites._repr_html_() + (_figure_html(self.plot()) if self.snapshot else "")


def _figure_html(fig) -> str:
    """A matplotlib figure as an inline PNG ``<img>`` (an ``_repr_html_`` cannot return a Figure)."""
    import base64
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return f"<img alt='allocation timeline' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"


@contextmanager
def record_allocations(
    path: str | Path = "memory_snapshot.pickle", max_entries: int = 100_000, top: int = 10
) -> Iterator[_Recording]:
    """Record every CUDA allocation inside the block, then dump a snapshot for
    https://pytorch.org/memory_viz and summarize the top allocation sites (``rec.sites``).

    >>> with record_allocations("leak.pickle") as rec:   # doctest: +SKIP
    ...     for _ in range(20): train_step()
    >>> print(rec.sites)                                  # doctest: +SKIP
    >>> rec.plot()  # the allocation timeline in the cell  # doctest: +SKIP
    """
    if not torch.cuda.is_available():
        raise RuntimeError("record_allocations() needs a CUDA GPU; on CPU use census() and watch()")
    rec = _Recording(Path(path))
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield rec
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(rec.path))
            rec.snapshot = load_snapshot(rec.path, trusted=True)  # the file this call just wrote
            rec.sites = top_allocation_sites(rec.snapshot, top)
            rec.sites.path = rec.path
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
