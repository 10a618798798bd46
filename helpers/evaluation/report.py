"""What ``safe_generate`` did: :class:`EvalReport` (counts, throughput, OOM retries, batch sizes and memory
over time, scores, failures), as text, an HTML table and a matplotlib figure; and two runs' answers to the same
prompts side by side (:func:`side_by_side`: before and after training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..core.html import theme_figure
from ..core.units import format_bytes

__all__ = ["EvalReport", "mean_of_finite", "SideBySide", "side_by_side"]

SHOWN_CHARS = 160  # of each prompt and answer in the comparison (the whole text stays in its lists)


def mean_of_finite(values: list[float]) -> tuple[float, int]:
    """(the mean of the finite values, how many were NaN or infinite); the mean is NaN when none is finite.

    A score function that returns NaN for one sample (an empty reference, a 0/0 ratio) would make the
    mean NaN, and an inf would make it inf: those samples are left out, and counted so the report says so.
    """
    finite = [v for v in values if math.isfinite(v)]
    return (sum(finite) / len(finite) if finite else math.nan), len(values) - len(finite)


@dataclass(repr=False)
class EvalReport:
    """What ``safe_generate`` did.

    Attributes:
        total: prompts given; done: generated in this run; skipped: already in the results file.
        truncated: samples recorded with fewer new tokens than asked (context length or memory).
        new_tokens, seconds, tokens_per_s: generated in this run.
        oom_retries: batches that ran out of memory and were retried; cache_empties: how often the
            allocator cache was emptied (only after an OOM or when much memory sat cached unused);
            full_collections: OOMs after which the failed batch was still alive, so ``gc.collect()`` ran.
        batch_sizes: the size of every batch that ran, in order; timeline: (seconds, batch size,
            memory bytes) per batch; oom_timeline: (seconds, batch size) of every batch that ran out
            of memory; peak_memory: peak GPU allocated (CUDA; every card added up) or process RSS (CPU);
            peak_by_gpu: each card's own peak, on a machine with more than one.
        started_from: the first batch size and where it came from (cache, estimate, given, first guess).
        scores: the mean of each score over samples with a reference (NaN and inf scores left out).
        nonfinite_scores: per score, how many samples scored NaN or inf (left out of ``scores``).
        records: every result for these prompts (this run and earlier ones), in prompt order.
        failures, failed: prompts recorded as failed (``error: "does not fit"``: not even one new
            token fits in memory with the prompt alone), with their ``prompt_tokens``; a rerun tries
            them again.
        failed_again: of those, the ones this run tried again and that failed as an earlier run with
            the same model and settings had recorded: their record is not written a second time.
    """

    results_path: Path
    total: int = 0
    done: int = 0
    skipped: int = 0
    truncated: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    oom_retries: int = 0
    cache_empties: int = 0
    full_collections: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    oom_timeline: list[tuple[float, int]] = field(default_factory=list)
    peak_memory: int | None = None
    peak_by_gpu: dict[int, int] = field(default_factory=dict)  # each card's own peak, with more than one
    memory_kind: str = "process RSS"
    repaired: bool = False
    backup: Path | None = None  # where resume=False moved the earlier results
    started_from: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    nonfinite_scores: dict[str, int] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    failed_again: int = 0

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def outputs(self) -> list[str]:
        return [r["output"] for r in self.records]

    def _peak_text(self) -> str:
        cards = "; ".join(f"GPU {d} {format_bytes(b)}" for d, b in self.peak_by_gpu.items())
        return format_bytes(self.peak_memory) + (f" ({cards})" if cards else "")

    def _lines(self) -> list[tuple[str, str]]:
        sizes = sorted(set(self.batch_sizes))
        rows = [
            ("samples", f"{self.done} generated, {self.skipped} already done, {self.total} in all"),
            ("truncated", f"{self.truncated} (recorded with fewer new tokens)"),
            ("throughput", f"{self.new_tokens} new tokens in {self.seconds:.1f} s = {self.tokens_per_s:.1f} tokens/s"),
            (
                "OOM retries",
                f"{self.oom_retries}; cache emptied {self.cache_empties}x, "
                f"gc.collect() needed {self.full_collections}x",
            ),
            (
                "batch sizes",
                (f"{len(self.batch_sizes)} batches, sizes {sizes[0]}..{sizes[-1]}" if sizes else "none")
                + (f"; started at {self.started_from}" if self.started_from else ""),
            ),
            (
                f"peak memory ({self.memory_kind})",
                self._peak_text(),
            ),
            (
                "results",
                f"{self.results_path}{' (torn last line repaired)' if self.repaired else ''}"
                + (f"; the earlier results moved to {self.backup}" if self.backup else ""),
            ),
        ]
        if self.failures:
            shown = ", ".join(f"{r['id']} ({r['prompt_tokens']} tokens)" for r in self.failures[:5])
            again = f"; {self.failed_again} failed before too (recorded once)" if self.failed_again else ""
            rows.insert(2, ("failed", f"{self.failed}: {self.failures[0]['error']}: {shown}{again}"))
        rows += [(f"score: {k}", f"{v:.3f}" + self._left_out(k)) for k, v in self.scores.items()]
        return rows

    def _left_out(self, name: str) -> str:
        n = self.nonfinite_scores.get(name, 0)
        return f" ({n} not finite: NaN or inf, left out of the mean)" if n else ""

    def __repr__(self) -> str:
        failed = f", {self.failed} failed" if self.failures else ""
        return (
            f"<EvalReport {self.done} done, {self.skipped} skipped{failed}, {self.oom_retries} OOM retries: "
            f"{self.results_path}>"
        )

    def __str__(self) -> str:
        return "EvalReport\n" + "\n".join(f"  {k:<26} {v}" for k, v in self._lines())

    def _repr_html_(self) -> str:
        from ..core.html import table

        return table(["", ""], self._lines(), title="safe_generate")

    def plot(self):
        """A matplotlib figure of this run: the batch size over time (OOMs marked) and memory per batch."""
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        fig, ax = plt.subplots(figsize=(7.5, 3.2))
        plt.close(fig)  # shown once, as the cell's result
        t = [p[0] for p in self.timeline]
        ax.step(t, [p[1] for p in self.timeline], where="post", color="tab:blue", label="batch size that ran")
        if self.oom_timeline:
            ax.scatter(*zip(*self.oom_timeline, strict=True), marker="x", color="#c0392b", zorder=3,
                       label="batch that ran out of memory (retried smaller)")  # fmt: skip
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # batch sizes are whole numbers
        ax.set_ylim(bottom=0)
        ax.set_xlabel("seconds into this run")
        ax.set_ylabel("batch size", color="tab:blue")
        mem = ax.twinx()
        peak = max((p[2] for p in self.timeline), default=0)
        scale, unit = (2**30, "GiB") if peak >= 2**30 else (2**20, "MiB")
        mem.plot(t, [p[2] / scale for p in self.timeline], color="tab:orange", marker=".", lw=1)
        mem.set_ylim(0, max(peak / scale * 1.15, 1e-9))  # from zero: a flat line reads as flat, not as a cliff
        mem.set_ylabel(f"{self.memory_kind} ({unit})", color="tab:orange")
        earlier = f", {self.skipped} done before" if self.skipped else ""
        ax.set_title(
            f"this run: {self.done} samples in {len(self.batch_sizes)} batches{earlier}; "
            f"{self.oom_retries} OOM {'retry' if self.oom_retries == 1 else 'retries'}",
            fontsize=10,
        )
        if self.oom_timeline:
            ax.legend(loc="lower left", fontsize=8)
        fig.tight_layout()
        return theme_figure(fig)


@dataclass(repr=False)
class SideBySide:
    """Two runs' answers to the same prompts (before and after training), one row per prompt: a table with a
    column per run, where the 39-line dump of ``print`` gave each answer its own block."""

    prompts: list[str]
    before: list[str]
    after: list[str]
    references: list[str | None] = field(default_factory=list)
    labels: tuple[str, str] = ("before", "after")

    @property
    def changed(self) -> int:
        """How many answers differ between the two runs (whitespace at the ends aside)."""
        return sum(a.strip() != b.strip() for a, b in zip(self.before, self.after, strict=True))

    def _head(self) -> str:
        return f"{len(self.prompts)} prompts: {self.changed} answers changed from {self.labels[0]} to {self.labels[1]}"

    def _rows(self) -> list[list[str]]:
        refs = self.references or [None] * len(self.prompts)
        return [[_cut(q), *([_cut(r or "")] if self.references else []), _cut(a), _cut(b)]
                for q, r, a, b in zip(self.prompts, refs, self.before, self.after, strict=True)]  # fmt: skip

    def _header(self) -> list[str]:
        return ["prompt", *(["reference"] if self.references else []), *self.labels]

    def __str__(self) -> str:
        lines = [self._head()]
        w = max(len(h) for h in self._header())
        for row in self._rows():
            lines.append(f"> {row[0]}")
            lines += [f"  {h:<{w}}  {c}" for h, c in zip(self._header()[1:], row[1:], strict=True)]
        return "\n".join(lines)

    def __repr__(self) -> str:  # the text a notebook shows without HTML (papermill, a terminal)
        return self.__str__()

    def _repr_html_(self) -> str:
        from ..core.html import table

        return table(self._header(), self._rows(), title=self._head())


def _cut(text: str) -> str:
    """One line of at most ``SHOWN_CHARS``: newlines as spaces, an ellipsis where it was cut."""
    flat = " ".join(text.split())
    return flat if len(flat) <= SHOWN_CHARS else flat[: SHOWN_CHARS - 1] + "…"


def side_by_side(before, after, prompts: list[str] | None = None, *, labels: tuple[str, str] = ("before", "after"),
                 ) -> SideBySide:  # fmt: skip
    """Two runs' answers beside each other, one row per prompt.

    ``before`` and ``after`` are lists of answers to ``prompts`` (``answer(...)``'s), or two :class:`EvalReport`
    of ``safe_generate`` over the same prompts, matched by id (their prompts and references come from the
    records). Raises ``ValueError`` when the two do not answer the same prompts.
    """
    if isinstance(before, EvalReport) and isinstance(after, EvalReport):
        old, new = ({r["id"]: r for r in rep.records} for rep in (before, after))
        if set(old) != set(new):
            raise ValueError(
                f"side_by_side: the reports answer different prompts ({len(set(old) ^ set(new))} ids in one only): "
                "run both over the same prompts (and let a resumed run finish)"
            )
        ids = sorted(old, key=str)
        refs = [old[i].get("reference") for i in ids]
        return SideBySide([str(old[i].get("prompt") or i) for i in ids], [old[i]["output"] or "" for i in ids],
                          [new[i]["output"] or "" for i in ids], refs if any(refs) else [], labels)  # fmt: skip
    if isinstance(before, EvalReport) or isinstance(after, EvalReport):
        raise TypeError("side_by_side takes two EvalReports, or two lists of answers with their prompts")
    before, after = list(before), list(after)
    prompts = list(prompts) if prompts is not None else [f"#{i}" for i in range(len(before))]
    if not len(before) == len(after) == len(prompts):
        raise ValueError(
            f"side_by_side: {len(prompts)} prompts, {len(before)} answers {labels[0]} and {len(after)} {labels[1]}: "
            "pass one answer per prompt in each"
        )
    return SideBySide([str(q) for q in prompts], [str(a) for a in before], [str(a) for a in after], [], labels)
