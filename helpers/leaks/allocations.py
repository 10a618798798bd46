"""CUDA: allocation history for PyTorch's memory visualizer, and the top allocation sites in it."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import OomkitError
from ..html import table
from ..units import format_bytes

__all__ = ["AllocationSites", "SnapshotError", "load_snapshot", "record_allocations", "top_allocation_sites"]

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
    path = Path(path)
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


@dataclass
class _Recording:
    path: Path
    sites: AllocationSites | None = None

    def __str__(self) -> str:
        return str(self.sites) if self.sites is not None else f"recording to {self.path}"


@contextmanager
def record_allocations(
    path: str | Path = "memory_snapshot.pickle", max_entries: int = 100_000, top: int = 10
) -> Iterator[_Recording]:
    """Record every CUDA allocation inside the block, then dump a snapshot for
    https://pytorch.org/memory_viz and summarize the top allocation sites (``rec.sites``).

    >>> with record_allocations("leak.pickle") as rec:   # doctest: +SKIP
    ...     for _ in range(20): train_step()
    >>> print(rec.sites)                                  # doctest: +SKIP
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
            rec.sites = top_allocation_sites(rec.path, top, trusted=True)  # the file this call just wrote
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
