"""Resume at scale: ``safe_generate`` on a results file that already holds 10,000 or 100,000 finished rows.

Each row runs in a fresh process on the tiny Llama: the prompts (``--done`` of them, all finished in the
file, plus ``--new`` not yet) are built and the model loaded first; then ``safe_generate(..., resume=True)``
is timed from outside the call (wall clock, and the process's CPU time: the machine may be shared), and the extra memory is the process's peak RSS during the call
minus its RSS just before (the peak is reset first through ``/proc/self/clear_refs``, Linux). The file is
written in the current format (one header, compact records) and, at each size, in the format
before headers (settings and model identity in every record), which must still resume.

Before (issue 48): 100,000 rows resumed in 49-550 s with +0.8-1.2 GiB RSS. Target: under 5 s, under 100 MiB.

Run: ``python bench/resume_scale.py [--sizes 10000 100000] [--new 4]``. Writes ``bench/results/resume_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from _common import format_table, write_results  # noqa: E402

MODEL = ROOT / "data" / "tiny" / "llama"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak ru_maxrss reports
        return True
    except OSError:
        return False


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write_file(path: Path, done: int, old_format: bool, model, tok) -> list[dict]:
    """A results file of ``done`` finished rows made by this model and settings; the prompts to resume."""
    from helpers.evaluation.evaluate import safe_generate
    from helpers.evaluation.results_file import MADE, is_record

    seed = path.with_suffix(".seed.jsonl")
    safe_generate(model, tok, ["a seed prompt"], max_new_tokens=4, results=seed, progress=False)
    lines = [json.loads(line) for line in seed.read_text().splitlines()]
    header = next(r for r in lines if MADE in r)
    template = next(r for r in lines if is_record(r))
    prompts = [{"id": f"q{k}", "prompt": f"Question {k}: what does a results file of many rows cost to resume?"}
               for k in range(done)]  # fmt: skip
    with path.open("w", encoding="utf-8") as f:
        if not old_format:
            f.write(json.dumps(header) + "\n")
        for p in prompts:
            rec = {**template, "id": p["id"], "prompt": p["prompt"], "output": f" An answer to {p['id']}."}
            if old_format:
                rec.pop("made")
                rec.update(settings=header["settings"], model=header["model"])
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return prompts


def child(done: int, new: int, old_format: bool) -> dict:
    """One row, in this (fresh) process."""
    import torch

    from helpers.evaluation.evaluate import safe_generate
    from helpers.loading.loader import load

    torch.set_num_threads(1)
    model, tok, _ = load(str(MODEL), load="fp32", check=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.jsonl"
        prompts = _write_file(path, done, old_format, model, tok)
        prompts += [{"id": f"new{k}", "prompt": f"A new question {k}"} for k in range(new)]
        size = path.stat().st_size
        before = _rss()
        exact = _reset_peak()
        started, cpu = time.perf_counter(), time.process_time()
        report = safe_generate(model, tok, prompts, max_new_tokens=4, results=path, progress=False)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        extra = _peak() - before
        assert report.skipped == done and report.done == new and len(report.records) == done + new
    return {"done": done, "new": new, "format": "before headers" if old_format else "header",
            "file_bytes": size, "bytes_per_row": round(size / done), "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3),
            "extra_rss_mib": round(extra / 2**20, 1), "peak_reset": exact}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(int(a.child[0]), int(a.child[1]), a.child[2] == "old")))
        return
    cases = [(n, "header") for n in a.sizes] + [(n, "old") for n in a.sizes]
    rows = []
    for done, kind in cases:
        out = subprocess.run([sys.executable, __file__, "--child", str(done), str(a.new), kind],
                             capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = [[f"{r['done']:,}", r["format"], r["new"], r["bytes_per_row"], f"{r['seconds']:.2f}",
              f"{r['cpu_seconds']:.2f}", f"{r['extra_rss_mib']:.0f}"] for r in rows]  # fmt: skip
    header = ["done rows", "file format", "new prompts", "bytes/row", "resume s (wall)", "CPU s", "extra RSS MiB"]
    print(format_table(header, table))
    path = write_results(
        "resume_scale", {"rows": rows, "target": {"rows": 100_000, "seconds": 5, "extra_rss_mib": 100}}
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
