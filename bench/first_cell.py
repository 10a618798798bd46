"""The first oomkit cell of a notebook, as a multiple of a bare ``import transformers``.

Target (issue 44 item 3): ``%load_ext helpers`` + ``preflight()`` of the tiny model within 1.5x ``import
transformers``. Each measurement runs in a fresh process (a kernel's first cell: nothing imported yet) with an
IPython shell already started (a kernel is up before the user runs a cell; not timed): the baseline times
``import transformers``, the cell times ``%load_ext helpers`` and ``preflight(model, show=True)`` (the
notebooks' call), and when its first check line appeared (preflight streams its checks). The two alternate,
``ROUNDS`` rounds; per round the cell over the baseline of the same round. Run: ``python bench/first_cell.py``
(about a minute). Writes ``bench/results/first_cell.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "data" / "tiny" / "llama"
ROUNDS = 7
TARGET = 1.5

CHILD = """
import io, json, sys, time
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
kind, model = sys.argv[1], sys.argv[2]


class Lines(io.StringIO):  # when preflight's first check line reached the screen
    first = None

    def write(self, text):
        if Lines.first is None and text.startswith("["):
            Lines.first = time.perf_counter()
        return super().write(text)


out, sys.stdout = sys.stdout, Lines()
t0 = time.perf_counter()
if kind == "baseline":
    shell.run_cell("import transformers")
else:
    shell.run_line_magic("load_ext", "helpers")
    shell.run_cell(f"from helpers import preflight\\nreport = preflight({model!r}, show=True)")
t1 = time.perf_counter()
text, sys.stdout = sys.stdout.getvalue(), out
print("RESULT " + json.dumps({"seconds": t1 - t0, "first_line": (Lines.first or t1) - t0,
                              "bitsandbytes": "bitsandbytes" in sys.modules, "lines": text.count("\\n")}))
"""


def run(kind: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(MODEL)], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=600)  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{kind}: the child failed\n{out.stderr[-2000:]}")
    return json.loads(line[7:])


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main() -> None:
    if not MODEL.exists():
        raise SystemExit(f"{MODEL} is missing: run `python data/build_tiny_models.py` (or `make demo`) first")
    run("cell")  # the first process after a change compiles helpers' bytecode: a cost no installed user pays
    base, cell = [], []
    for r in range(ROUNDS):
        order = ["baseline", "cell"] if r % 2 == 0 else ["cell", "baseline"]
        for kind in order:
            print(f"round {r + 1}/{ROUNDS}: {kind}", file=sys.stderr, flush=True)
            (base if kind == "baseline" else cell).append(run(kind))
    b = spread([x["seconds"] for x in base])
    c = spread([x["seconds"] for x in cell])
    first = spread([x["first_line"] for x in cell])
    ratio = spread([x["seconds"] / y["seconds"] for x, y in zip(cell, base)])
    first_ratio = spread([x["first_line"] / y["seconds"] for x, y in zip(cell, base)])
    bnb = any(x["bitsandbytes"] for x in cell)
    fmt = lambda s, unit="s": f"{s['median']:.2f} {unit} ({s['min']:.2f}-{s['max']:.2f})".replace(" x", "x")  # noqa: E731
    rows = [
        ["`import transformers` (baseline)", fmt(b), "1.00x", ""],
        ["first check line on screen", fmt(first), fmt(first_ratio, "x"), "yes" if first_ratio["median"] <= TARGET else "no"],
        ["`%load_ext helpers` + `preflight(tiny)`", fmt(c), fmt(ratio, "x"), "yes" if ratio["median"] <= TARGET else "no"],
    ]  # fmt: skip
    table = format_table(["step (fresh process)", "seconds, median (range)", "x baseline", f"<= {TARGET}x"], rows)
    table += f"\n\nbitsandbytes imported by the cell: {'yes' if bnb else 'no'} ({ROUNDS} rounds, interleaved)."
    print(table)
    path = write_results("first_cell", {"rounds": ROUNDS, "target_ratio": TARGET, "baseline_s": b, "cell_s": c,
                                        "first_line_s": first, "ratio": ratio, "first_line_ratio": first_ratio,
                                        "bitsandbytes_imported": bnb, "table": table})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
