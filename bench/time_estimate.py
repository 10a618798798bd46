"""Time estimates vs measured, on this machine's CPU, after ``calibrate()``: decode, prefill, a LoRA step.

For each tiny model (data/tiny: random weights, so generation never stops early; ``eos_token_id=None``
makes every call produce exactly its tokens):

- decode tokens/s at batch 1 and 8: ``generate()`` of ``--new`` tokens less ``generate()`` of 1 (the
  prefill), against :func:`helpers.estimator.timing.decode_step_seconds` at the mean context;
- prefill tokens/s: one forward pass of batch 4 x 128 tokens, against ``prefill_seconds``;
- a LoRA step (peft, all-linear, r=8, AdamW; micro-batch 4 x 128 tokens), with and without gradient
  checkpointing, against ``lora_step_seconds``;
- decode's speed-up from batch 1 to 8 within a round: the batch dependence alone (KV cache passes, logits,
  FLOPs per sequence, the CPU's packed GEMM), whatever level the round's calibration measured.

Each round recalibrates (``calibrate(refresh=True)``) and then measures every case once (the machine is
shared: a round's prediction and measurement see the same load); ratios predicted / measured are taken
within a round and their min / median / max over ``--repeats`` rounds reported. The op counts the estimates
use (``DECODE_OPS``, ``FORWARD_OPS``, ``LORA_STEP_OPS``) are recounted here and printed beside them.

Tiny models on a CPU are dominated by per-op overhead (PyTorch dispatch and transformers' Python): the
calibration measures it (a per-op and a per-generate-step term), so what this bench checks is mostly that
overhead model plus the matmul term at batch 4 x 128.

Run: ``python bench/time_estimate.py [--repeats 4] [--threads 1] [--new 32]``.
Writes ``bench/results/time_estimate.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _common import format_table, write_results  # noqa: E402

from helpers.estimator.calibration import calibrate, count_ops  # noqa: E402
from helpers.estimator.configs import resolve_config  # noqa: E402
from helpers.estimator.core import estimate  # noqa: E402
from helpers.estimator.layout import layout  # noqa: E402
from helpers.estimator.timing import (  # noqa: E402
    DECODE_OPS,
    FORWARD_OPS,
    LORA_STEP_OPS,
    decode_step_seconds,
    lora_step_seconds,
    model_shape,
    prefill_seconds,
    speed_for,
)
from helpers.estimator.training import LoraTraining  # noqa: E402

MODELS = ("llama", "qwen2")
PROMPT, BATCH, SEQ = 16, 4, 128


def _best(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _decode(model, batch: int, new: int) -> tuple[float, float]:
    """(seconds per decode step, aten ops per step)."""
    ids = torch.randint(4, 1000, (batch, PROMPT))
    mask = torch.ones_like(ids)

    def gen(n):
        return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip

    with torch.no_grad():
        seconds = (_best(gen(new + 1)) - _best(gen(1))) / new
        ops = (count_ops(gen(9)) - count_ops(gen(1))) / 8 if batch == 1 else None
    return seconds, ops


def _prefill(model) -> tuple[float, int]:
    ids = torch.randint(4, 1000, (BATCH, SEQ))
    with torch.no_grad():
        return _best(lambda: model(input_ids=ids, use_cache=True)), count_ops(lambda: model(input_ids=ids))


def _lora_step(path: str, checkpointing: bool) -> tuple[float, int]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(4, 1000, (BATCH, SEQ))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return _best(step), count_ops(step)


def _round(name: str, new: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    path = str(ROOT / "data" / "tiny" / name)
    speed = speed_for(calibration=calibrate(refresh=True))
    config = resolve_config(path)[0]
    est = estimate(path, load="fp32", device="cpu")
    lora = LoraTraining(r=8, targets="all-linear", micro_batch=BATCH, seq_len=SEQ)
    shape = model_shape(config, layout(config), est.weights, 4, lora)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = []
    for batch in (1, 8):
        measured, ops = _decode(model, batch, new)
        predicted = decode_step_seconds(shape, speed, batch=batch, context=PROMPT + new / 2, load="fp32")
        counted = DECODE_OPS[0] * shape.layers + DECODE_OPS[1]
        rows.append({"case": f"decode tokens/s, batch {batch}", "measured": batch / measured,
                     "predicted": batch / predicted, "ops": ops, "ops_model": counted if ops else None})  # fmt: skip
    measured, ops = _prefill(model)
    predicted = prefill_seconds(shape, speed, batch=BATCH, tokens=SEQ, load="fp32")
    rows.append({"case": f"prefill tokens/s, {BATCH} x {SEQ}", "measured": BATCH * SEQ / measured,
                 "predicted": BATCH * SEQ / predicted, "ops": ops,
                 "ops_model": FORWARD_OPS[0] * shape.layers + FORWARD_OPS[1]})  # fmt: skip
    for ckpt in (False, True):
        measured, ops = _lora_step(path, ckpt)
        predicted = lora_step_seconds(shape, speed, batch=BATCH, tokens=SEQ, checkpointing=ckpt)
        per_layer, fixed = LORA_STEP_OPS[ckpt]
        rows.append({"case": f"LoRA step ms, {BATCH} x {SEQ}" + (", checkpointing" if ckpt else ""),
                     "measured": measured * 1000, "predicted": predicted * 1000, "ops": ops,
                     "ops_model": per_layer * shape.layers + fixed})  # fmt: skip
    for r in rows:
        r["model"] = name
        r["ratio"] = r["predicted"] / r["measured"]
    # the batch dependence alone: batch 8's speed-up over batch 1, within the round (the calibration's level,
    # which moves between rounds on a shared machine, cancels out)
    one, eight = rows[0], rows[1]
    rows.append({"case": "decode speed-up, batch 8 / batch 1", "measured": eight["measured"] / one["measured"],
                 "predicted": eight["predicted"] / one["predicted"], "ops": None, "ops_model": None, "model": name})  # fmt: skip
    rows[-1]["ratio"] = rows[-1]["predicted"] / rows[-1]["measured"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    rounds, calibrations = [], []
    for _ in range(args.repeats):
        rounds.append([row for name in MODELS for row in _round(name, args.new)])
        calibrations.append(calibrate().__dict__)
    table, results = [], []
    for i, first in enumerate(rounds[0]):
        same = [r[i] for r in rounds]
        ratios = sorted(r["ratio"] for r in same)
        result = {"model": first["model"], "case": first["case"], "measured_median": statistics.median(r["measured"] for r in same),
                  "predicted_median": statistics.median(r["predicted"] for r in same), "ratio_min": ratios[0], "ratio_median": statistics.median(ratios),
                  "ratio_max": ratios[-1], "within_30_percent": abs(statistics.median(ratios) - 1) <= 0.3,
                  "ops_counted": first["ops"], "ops_model": first["ops_model"]}  # fmt: skip
        results.append(result)
        table.append([first["model"], first["case"], f"{result['measured_median']:,.1f}",
                      f"{result['predicted_median']:,.1f}",
                      f"{result['ratio_median']:.2f} ({result['ratio_min']:.2f}-{result['ratio_max']:.2f})",
                      "yes" if result["within_30_percent"] else "MISS",
                      f"{first['ops']:.0f} / {first['ops_model']}" if first["ops"] else ""])  # fmt: skip
    header = ["model", "case", "measured", "predicted", "predicted / measured (min-max)", "within 30 %",
              "aten ops counted / model"]  # fmt: skip
    markdown = format_table(header, table)
    print(markdown)
    for c in calibrations:
        print(f"calibration: {c['bandwidth'] / 1e9:.1f} GB/s, {c['flops'] / 1e9:.1f} GFLOP/s, "
              f"{c['op_seconds'] * 1e6:.2f} us/op, {c['decode_step_seconds'] * 1e3:.2f} ms/generate step")  # fmt: skip
    path = write_results("time_estimate", {
        "args": vars(args), "seconds": time.perf_counter() - started, "calibrations": calibrations,
        "results": results, "rounds": rounds, "table": markdown,
    })  # fmt: skip
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
