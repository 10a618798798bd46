"""The first oomkit cell of a notebook, against the first cell a notebook without oomkit would run.

Target (issue 44 item 3): ``%load_ext helpers`` + ``preflight()`` of the tiny model shows its first check line
within 1.5x a bare ``import transformers``, and finishes within 1.5x the fair baseline: what a notebook without
oomkit runs to answer "does it fit": ``import torch, transformers``, read the config, build the model on the meta
device and count its weights (accelerate's ``estimate-memory`` does this). The row of the config alone
(``AutoConfig.from_pretrained``, which imports torch) is shown too, and the bare import the target names, even
where the cell loses to them.

Each measurement runs in a fresh process (a kernel's first cell: nothing imported yet) with an IPython shell
already started (a kernel is up before the user runs a cell; not timed); the cell times ``%load_ext helpers``
and ``preflight(model, show=True)`` (the notebooks' call), and when its first check line appeared (preflight
streams its checks) and whether torch was imported by then. The kinds alternate, in a rotated order each of
``ROUNDS`` rounds; each ratio is per round (the cell over the baseline of the same round), median and range.
Run: ``python bench/first_cell.py`` (one to three minutes). Writes ``bench/results/first_cell.json``.
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


class Lines(io.StringIO):  # when preflight's first check line reached the screen, and was torch imported then
    first = None
    torch = None

    def write(self, text):
        if Lines.first is None and text.startswith("["):
            Lines.first, Lines.torch = time.perf_counter(), "torch" in sys.modules
        return super().write(text)


CELLS = {
    "baseline": "import transformers",
    "config": "import torch, transformers\\nconfig = transformers.AutoConfig.from_pretrained(MODEL)",
    "meta": "import torch, transformers\\nconfig = transformers.AutoConfig.from_pretrained(MODEL)\\n"
            "with torch.device('meta'):\\n    m = transformers.AutoModelForCausalLM.from_config(config)\\n"
            "weights = sum(p.numel() * p.element_size() for p in m.parameters())",
}
shell.user_ns["MODEL"] = model
out, sys.stdout = sys.stdout, Lines()
t0 = time.perf_counter()
if kind == "cell":
    shell.run_line_magic("load_ext", "helpers")
    after_ext = "torch" in sys.modules
    ok = shell.run_cell(f"from helpers import preflight\\nreport = preflight({model!r}, show=True)").success
else:
    after_ext = None
    ok = shell.run_cell(CELLS[kind]).success
t1 = time.perf_counter()
text, sys.stdout = sys.stdout.getvalue(), out
print("RESULT " + json.dumps({"ok": ok, "error": text[-1500:], "seconds": t1 - t0, "first_line": (Lines.first or t1) - t0,
                              "torch_at_first_line": Lines.torch, "torch_after_load_ext": after_ext,
                              "bitsandbytes": "bitsandbytes" in sys.modules, "lines": text.count("\\n")}))
"""


def run(kind: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(MODEL)], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=600)  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{kind}: the child failed\n{out.stderr[-2000:]}")
    result = json.loads(line[7:])
    if not result["ok"]:
        raise RuntimeError(f"{kind}: the cell failed\n{result['error']}")
    return result


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


KINDS = {
    "baseline": "`import transformers` (baseline)",
    "config": "`import torch, transformers` + `AutoConfig` (config read)",
    "meta": "+ model on the meta device, weights counted (fair baseline)",
}


def main() -> None:
    if not MODEL.exists():
        raise SystemExit(f"{MODEL} is missing: run `python data/build_tiny_models.py` (or `make demo`) first")
    run("cell")  # the first process after a change compiles helpers' bytecode: a cost no installed user pays
    kinds = [*KINDS, "cell"]
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(ROUNDS):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotated: no kind always runs first
            print(f"round {r + 1}/{ROUNDS}: {kind}", file=sys.stderr, flush=True)
            got[kind].append(run(kind))
    secs = {k: spread([x["seconds"] for x in v]) for k, v in got.items()}
    cell = got["cell"]
    first = spread([x["first_line"] for x in cell])
    over = {k: spread([c["seconds"] / b["seconds"] for c, b in zip(cell, got[k])]) for k in KINDS}
    first_over = spread([c["first_line"] / b["seconds"] for c, b in zip(cell, got["baseline"])])
    fmt = lambda s, unit="s": f"{s['median']:.2f} {unit} ({s['min']:.2f}-{s['max']:.2f})".replace(" x", "x")  # noqa: E731
    yes = lambda s: "yes" if s["median"] <= TARGET else "no"  # noqa: E731
    rows = [[KINDS[k], fmt(secs[k]), fmt(spread([b["seconds"] / a["seconds"] for a, b in zip(got["baseline"], got[k])]), "x"),
             "", ""] for k in KINDS]  # fmt: skip
    rows += [
        ["oomkit: first check line on screen", fmt(first), fmt(first_over, "x"), "", yes(first_over)],
        ["oomkit: `%load_ext helpers` + `preflight(tiny)`", fmt(secs["cell"]), fmt(over["baseline"], "x"),
         fmt(over["meta"], "x"), yes(over["meta"])],
    ]  # fmt: skip
    head = ["step (fresh process)", "seconds, median (range)", "x `import transformers`", "x fair baseline",
            f"<= {TARGET}x"]  # fmt: skip
    table = format_table(head, rows)
    bnb = any(x["bitsandbytes"] for x in cell)
    torch_ext = any(x["torch_after_load_ext"] for x in cell)
    torch_first = any(x["torch_at_first_line"] for x in cell)
    table += (f"\n\nThe cell over the config read alone: {fmt(over['config'], 'x')}. Imported by `%load_ext helpers`: "
              f"torch {'yes' if torch_ext else 'no'}; by the first check line: torch {'yes' if torch_first else 'no'}; "
              f"by the cell: bitsandbytes {'yes' if bnb else 'no'} ({ROUNDS} rounds, interleaved, rotated order).")  # fmt: skip
    print(table)
    path = write_results("first_cell", {
        "rounds": ROUNDS, "target_ratio": TARGET, "baseline_s": secs["baseline"], "config_s": secs["config"],
        "meta_s": secs["meta"], "cell_s": secs["cell"], "first_line_s": first, "ratio": over["baseline"],
        "ratio_config": over["config"], "ratio_fair": over["meta"], "first_line_ratio": first_over,
        "bitsandbytes_imported": bnb, "torch_after_load_ext": torch_ext, "torch_at_first_line": torch_first,
        "table": table})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
