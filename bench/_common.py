"""Shared by the benchmarks: where results go, what they measured, and how a table is printed.

Each results file records the source of the modules its figures are about (``measures``: paths under
the repository, files or folders), as git blob hashes of their contents when the bench ran. A later
change to one of them makes the published figures stale: ``tests/test_bench_results.py`` fails until
the bench is rerun (``python bench/<name>.py``) and ``make docs`` renders the new figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]

# A user's install carries compiled bytecode (pip compiles the wheel; Python caches the rest on first
# import). A machine that sets PYTHONDONTWRITEBYTECODE (ours do) would charge every fresh process a bench
# starts the compile of helpers' sources (about 90 ms for helpers.monitoring.monitor), a cost no user pays: the
# benches and the processes they start write the cache and reuse it from the second run on.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


# What each bench's figures are about: the repository paths whose change makes them stale (the bench's
# own file is added). The modules the figures measure, not every import: panel_latency times the panel's
# code, so an estimator change alone does not stale it, though it could move the figure a little.
MEASURES: dict[str, list[str]] = {
    "batch_finder": ["helpers/oom/batch_size.py", "helpers/oom/retry.py"],
    "estimate_accuracy": ["helpers/estimator", "helpers/training/plan.py", "helpers/training/adapters.py", "helpers/loading/plan.py"],
    "fingerprint_cost": ["helpers/loading/fingerprint.py"],
    "fit_scale": ["helpers/estimator", "helpers/placement"],
    "eval_throughput": ["helpers/evaluation/evaluate.py", "helpers/evaluation/batching.py", "helpers/loading/generation.py",
                        "helpers/oom/batch_size.py", "helpers/oom/retry.py"],
    "hot_spots": ["helpers/estimator", "helpers/oom/batch_size.py", "helpers/oom/reclaim.py", "helpers/leaks", "helpers/leaks/tensors.py",
                  "helpers/monitoring/monitor.py", "helpers/evaluation/evaluate.py"],
    "leak_detection": ["helpers/leaks", "helpers/leaks/tensors.py"],
    "monitor_overhead": ["helpers/monitoring/monitor.py", "helpers/monitoring/memory_callback.py"],
    "panel_latency": ["helpers/panels/widgets.py", "helpers/panels/state.py", "helpers/panels/gpus.py", "helpers/placement"],
    "readout_overhead": ["helpers/core/memory.py"],
    "resume_scale": ["helpers/evaluation/results_file.py", "helpers/evaluation/evaluate.py",
                     "helpers/loading/fingerprint.py"],
}  # fmt: skip
MEASURES["oom_parse_cost"] = ["helpers/oom/messages.py", "helpers/oom/diagnosis.py", "helpers/oom/causes.py"]
MEASURES["time_estimate"] = ["helpers/estimator/timing.py", "helpers/estimator/calibration.py"]
MEASURES["first_cell"] = ["helpers/environment.py", "helpers/__init__.py", "helpers/oom/hook.py",
                          "helpers/monitoring/cellstats.py", "helpers/core/memory.py"]  # fmt: skip


def _blob_hash(data: bytes) -> str:
    """What ``git hash-object`` prints for a file with these bytes (so ``git log`` finds the version)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def source_hashes(measures: list[str]) -> dict[str, str]:
    """``{path: blob hash}`` of every ``.py`` file under ``measures`` (repository-relative) as it is now."""
    files: dict[str, str] = {}
    for entry in measures:
        path = REPO / entry
        if not path.exists():
            raise FileNotFoundError(f"a bench measures {entry!r}, which is not in the repository")
        for f in sorted([path] if path.is_file() else path.rglob("*.py")):
            if "__pycache__" not in f.parts:
                files[f.relative_to(REPO).as_posix()] = _blob_hash(f.read_bytes())
    return files


def stale_files(recorded: dict) -> list[str]:
    """The files of a results file's ``source`` that changed (or appeared, or went) since it was measured."""
    now = source_hashes(recorded["measures"])
    return sorted(f for f in set(now) | set(recorded["files"]) if now.get(f) != recorded["files"].get(f))


def machine() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def write_results(name: str, payload: dict) -> Path:
    """Write ``bench/results/<name>.json`` with the machine description and the source of what it measured
    (:data:`MEASURES` and the bench itself) added."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    measures = [*MEASURES[name], f"bench/{name}.py"]
    source = {"measures": measures, "files": source_hashes(measures)}
    path.write_text(json.dumps({"machine": machine(), "source": source, **payload}, indent=2, default=str) + "\n")
    return path


def format_table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table (printed, and pasted into the README as is)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
