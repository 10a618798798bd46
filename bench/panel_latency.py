"""How long the load panel takes to update after a slider move, cached vs uncached.

Each "move" sets ``max_new_tokens`` on a real ``LoadPanel`` (ipywidgets objects, no front end)
and includes the estimate, the fit verdict (and the top fix when it does not fit) and the HTML
redraw. Three ways to get the estimate, measured side by side in one run:

- uncached: what a naive panel does on every move: read the config again and count the
  parameters by instantiating the model on the meta device, then fit (suggestions included).
- new setting: the panel's path for a value not seen before: config and meta-device layout are
  cached per model, only the arithmetic (and the suggestion search, when it does not fit) runs.
- seen setting: moving back to a value seen before: a dictionary lookup plus the redraw.

Run: ``python bench/panel_latency.py``. Writes ``bench/results/panel_latency.json``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results  # noqa: E402

from helpers.estimator import fit  # noqa: E402
from helpers.estimator.layout import clear_layout_cache  # noqa: E402
from helpers.widgets import LoadPanel  # noqa: E402

MOVES = 40
CASES = [  # (label, model, device, panel settings)
    ("tiny Llama (4 layers), nf4, CPU", str(REPO / "data" / "tiny" / "llama"), "current", {"load": "nf4"}),
    ("Mistral-7B nf4 on T4: fits", "mistralai/Mistral-7B-v0.1", "t4", {"load": "nf4"}),
    ("Llama-3.1-8B fp16 on T4: does not fit (+ top fix)", "meta-llama/Llama-3.1-8B", "t4", {"load": "fp16"}),
]


def _ms(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_ms": statistics.median(s) * 1e3, "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3}


def _timed_moves(panel: LoadPanel, values: list[int]) -> list[float]:
    out = []
    for v in values:
        t = time.perf_counter()
        panel.controls["max_new_tokens"].value = v
        out.append(time.perf_counter() - t)
    return out


def _uncached_moves(panel: LoadPanel, model: str, values: list[int]) -> list[float]:
    """Re-read the config and recount on the meta device for every move (the layout cache cleared)."""
    out = []
    for v in values:
        clear_layout_cache()
        t = time.perf_counter()
        plan = panel.plan.replace(max_new_tokens=v)
        est = plan.estimate(panel._est_device)  # from the model id or path: config read again
        target = panel._capacity if panel._est_device == "cpu" else panel._est_device
        verdict = fit(est, target)
        html = verdict._repr_html_() + est._repr_html_()
        out.append(time.perf_counter() - t)
        assert html
    return out


def main() -> None:
    if not (REPO / "data" / "tiny" / "llama").exists():
        sys.exit("build the tiny models first: python data/build_tiny_models.py")
    results, rows = {}, []
    for label, model, device, settings in CASES:
        panel = LoadPanel(model, device=device, widgets=True, max_new_tokens=16, **settings)
        fresh = [16 * (2 + 2 * i) for i in range(MOVES)]  # values not seen before
        new = _timed_moves(panel, fresh)
        seen = _timed_moves(panel, list(reversed(fresh)))
        assert all(panel._cache)  # every moved-to value is cached now
        uncached = _uncached_moves(panel, model, [v + 16 for v in fresh[: MOVES // 2]])
        verdict = panel.state.verdict
        r = {"uncached": _ms(uncached), "new setting": _ms(new), "seen setting": _ms(seen), "verdict": verdict}
        results[label] = r
        rows.append(
            [
                label,
                verdict,
                f"{r['uncached']['median_ms']:.1f}",
                f"{r['new setting']['median_ms']:.2f}",
                f"{r['seen setting']['median_ms']:.2f}",
                f"{r['uncached']['median_ms'] / r['seen setting']['median_ms']:.0f}x",
            ]
        )
    table = format_table(
        [
            "panel (max_new_tokens slider moves)",
            "verdict",
            "uncached ms",
            "new setting ms",
            "seen setting ms",
            "uncached / seen",
        ],
        rows,
    )
    print(table)
    path = write_results("panel_latency", {"moves": MOVES, "cases": results, "table": table})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
