"""Execute every notebook in ``notebooks/`` headless on the tiny local model; copies go to ``runs/``.

Parameters for each notebook come from ``tests/notebook_params/<stem>.json``: a list of runs,
each ``{"name": ..., "parameters": {...}}`` (one default run when the file is missing).
Placeholders in string values: ``{tiny_llama}``, ``{tiny_qwen2}``, ``{tiny_whisper}``, ``{repo}``, ``{runs}``, ``{data}``.

Usage: ``python scripts/run_notebooks.py [NAME_SUBSTRING ...]``
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
PARAMS = REPO / "tests" / "notebook_params"
RUNS = REPO / "runs"
PLACEHOLDERS = {
    "tiny_llama": str(REPO / "data" / "tiny" / "llama"),
    "tiny_qwen2": str(REPO / "data" / "tiny" / "qwen2"),
    "tiny_whisper": str(REPO / "data" / "tiny" / "whisper"),
    "repo": str(REPO),
    "runs": str(RUNS),
    "data": str(REPO / "data"),
}


@dataclass
class NotebookRun:
    notebook: Path
    name: str
    parameters: dict

    @property
    def label(self) -> str:
        return self.notebook.stem + (f"[{self.name}]" if self.name != "default" else "")

    @property
    def output(self) -> Path:
        suffix = "" if self.name == "default" else f"-{self.name}"
        return RUNS / f"{self.notebook.stem}{suffix}.ipynb"

    @property
    def log(self) -> Path:
        return self.output.with_suffix(".log")


@contextlib.contextmanager
def stderr_to(path: Path):
    """Send this process's stderr, and that of the kernels it starts, to ``path`` (kernel start-up noise)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _fill(value):
    if isinstance(value, str):
        return value.format(**PLACEHOLDERS)
    if isinstance(value, list):
        return [_fill(v) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v) for k, v in value.items()}
    return value


def planned_runs(filters: list[str] | None = None) -> list[NotebookRun]:
    runs = []
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        if filters and not any(f in nb.stem for f in filters):
            continue
        spec = PARAMS / f"{nb.stem}.json"
        entries = json.loads(spec.read_text()) if spec.exists() else [{"name": "default", "parameters": {}}]
        for e in entries:
            runs.append(NotebookRun(nb, e.get("name", "default"), _fill(e.get("parameters", {}))))
    return runs


def execute(run: NotebookRun, timeout: int = 600) -> float:
    """Run one notebook with papermill; raises papermill's PapermillExecutionError on a cell error."""
    import papermill

    RUNS.mkdir(exist_ok=True)
    started = time.perf_counter()
    with stderr_to(run.log):
        papermill.execute_notebook(
            str(run.notebook),
            str(run.output),
            parameters=run.parameters,
            kernel_name="python3",
            cwd=str(RUNS),
            progress_bar=False,
            execution_timeout=timeout,
        )
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    runs = planned_runs(argv if argv is not None else sys.argv[1:])
    failed = 0
    for run in runs:
        try:
            secs = execute(run)
            print(f"ok     {run.label:32s} {secs:6.1f} s  -> {run.output.relative_to(REPO)}", flush=True)
        except Exception as e:  # report every notebook, then fail at the end
            failed += 1
            first = str(e).strip().splitlines()
            reason = next((ln for ln in reversed(first) if ln.strip()), type(e).__name__)[:160]
            print(
                f"FAILED {run.label:32s} {reason}  (see {run.output.relative_to(REPO)} and "
                f"{run.log.relative_to(REPO)})",
                flush=True,
            )
    print(f"\n{len(runs) - failed} of {len(runs)} notebook runs passed; executed copies in {RUNS.relative_to(REPO)}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
