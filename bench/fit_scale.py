"""How long ``fit()`` takes as models grow: the largest shipped config (Llama-4-Scout), gpt-oss-20b as saved,
a machine's split, and 80- and
1,024-layer configs of a 70B's width that do not fit (their fixes plan an offload over hundreds of layers).

Target (issue 47): any config's ``fit()`` in seconds, under 30 s here. Each case runs in a fresh process
(a first call: the layouts, the placement model and the fixes' re-estimates are all built), ``ROUNDS`` rounds,
the cases interleaved; per case the median and range of ``estimate()`` and of ``fit()`` (wall time), and
``fit()`` as a multiple of ``estimate()`` measured in the same process. Run: ``python bench/fit_scale.py``
(a minute or two). Writes ``bench/results/fit_scale.json``.
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
ROUNDS = 3
TARGET_S = 30
WIDE = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8)
# (label, model: a shipped id or the number of layers of a 70B-wide Llama, load, device)
CASES = [
    (
        "Llama-4-Scout-17B-16E (largest shipped: 109 B, MoE + vision)",
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        "auto",
        "t4",
    ),  # fmt: skip
    ("gpt-oss-20b, as saved", "openai/gpt-oss-20b", "auto", "t4"),
    ("Llama-3.1-8B fp16 on a 2xT4 machine", "meta-llama/Llama-3.1-8B", "fp16", "kaggle-2xt4"),
    ("80 layers, 70B-wide, nf4", 80, "nf4", "t4"),
    ("1,024 layers, 70B-wide, nf4", 1024, "nf4", "t4"),
]

CHILD = """
import json, sys, time
from transformers import LlamaConfig
from helpers import estimate, fit
from helpers.core.sources import shipped_config
model, load, device, wide = json.loads(sys.argv[1])
if isinstance(model, int):
    d = json.loads(shipped_config("meta-llama/Llama-3.1-8B").read_text())
    d.update(wide, num_hidden_layers=model)
    model = LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"})
t0 = time.perf_counter()
est = estimate(model, load=load)
t1 = time.perf_counter()
verdict = fit(est, device)
t2 = time.perf_counter()
print("RESULT " + json.dumps({"estimate_s": t1 - t0, "fit_s": t2 - t1, "verdict": verdict.verdict,
                              "fixes": len(verdict.suggestions)}))
"""


def run(model, load: str, device: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([model, load, device, WIDE])], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model} {load} {device}: the child failed\n{out.stderr[-2000:]}")
    return json.loads(line[7:])


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main() -> None:
    got: dict[str, list[dict]] = {label: [] for label, *_ in CASES}
    for r in range(ROUNDS):
        order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]
        for label, model, load, device in order:
            print(f"round {r + 1}/{ROUNDS}: {label}", file=sys.stderr, flush=True)
            got[label].append(run(model, load, device))
    cases, rows = [], []
    for label, model, load, device in CASES:
        runs = got[label]
        est = spread([x["estimate_s"] for x in runs])
        fit_ = spread([x["fit_s"] for x in runs])
        ratio = spread([x["fit_s"] / x["estimate_s"] for x in runs])
        within = fit_["max"] < TARGET_S
        cases.append({"case": label, "model": model if isinstance(model, str) else f"{model} layers", "load": load,
                      "device": device, "estimate_s": est, "fit_s": fit_, "fit_over_estimate": ratio,
                      "verdict": runs[0]["verdict"], "fixes": runs[0]["fixes"], "within_target": within})  # fmt: skip
        rows.append([label, device, runs[0]["verdict"], f"{est['median']:.2f} s ({est['min']:.2f}-{est['max']:.2f})",
                     f"{fit_['median']:.2f} s ({fit_['min']:.2f}-{fit_['max']:.2f})",
                     f"{ratio['median']:.1f}x", "yes" if within else "NO"])  # fmt: skip
    header = ["case", "device", "verdict", "estimate()", "fit(), first call", "fit / estimate", f"< {TARGET_S} s"]
    table = format_table(header, rows)
    print(table)
    path = write_results("fit_scale", {"rounds": ROUNDS, "target_s": TARGET_S, "cases": cases, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
