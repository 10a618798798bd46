"""Leak detection: planted leaks and clean loops on the tiny Llama; recall, false positives, steps.

Each scenario runs STEPS steps of a small training or evaluation loop. After every step the
`GrowthDetector` records memory (tensor bytes on CPU, allocated bytes on CUDA); the pattern checks
run after the first step and at the end; a census at the end of warm-up and at the end names what
grew. A planted leak counts as found when the detector or its pattern check flags it, and as named
when the expected holder appears in the detector's top suspect or in the check's finding. A clean
loop is a false positive if the detector flags it at any step or any check warns.

Targets: every leak found and named, no false positive, detection within 20 steps.
Usage: ``python bench/leak_detection.py``
"""

from __future__ import annotations

import contextlib
import gc
import io
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _common import format_table, write_results  # noqa: E402

from helpers import census, census_diff, leak_checks  # noqa: E402
from helpers.leaks.growth import GrowthDetector  # noqa: E402

STEPS = 30
BATCH, SEQ = 2, 16


def load_model():
    from transformers import AutoModelForCausalLM

    path = REPO / "data" / "tiny" / "llama"
    if not path.exists():
        raise SystemExit("tiny model missing: run `python data/build_tiny_models.py` first")
    return AutoModelForCausalLM.from_pretrained(path)


def batch(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 1024, (BATCH, seq))


def train_step(ns: dict, x: torch.Tensor | None = None) -> torch.Tensor:
    x = batch() if x is None else x
    loss = ns["model"](x, labels=x).loss
    loss.backward()
    ns["opt"].step()
    ns["opt"].zero_grad(set_to_none=True)
    return loss


# ---- planted leaks: (setup, step, expected holder, pattern check that should fire)


def eval_losses_kept(ns, i):
    """Evaluation without no_grad, keeping the loss tensor: every graph stays alive."""
    ns["val_losses"].append(ns["model"](ns["x"], labels=ns["x"]).loss)


def running_total(ns, i):
    """`total += loss` without .item(): one graph chained to the next."""
    ns["total_loss"] = ns["total_loss"] + ns["model"](ns["x"], labels=ns["x"]).loss


def hook_setup(ns):
    feats = ns["feats"]
    ns["model"].model.layers[1].register_forward_hook(
        lambda m, i, o: feats.append((o[0] if isinstance(o, tuple) else o).detach())
    )


def hooked_train(ns, i):
    train_step(ns)


def shape_cache(ns, i):
    """A mask cache keyed by sequence length, every step a new length: unbounded."""
    seq = 8 + i
    key = f"{BATCH}x{seq}"
    if key not in ns["cache"]:
        ns["cache"][key] = torch.ones(BATCH, 4, seq, seq) * 0.5
    train_step(ns, batch(seq))


def risky_forward(model, x):
    hidden = model.model.embed_tokens(x).repeat(1, 8, 1)  # a large local the traceback keeps
    raise RuntimeError(f"bad batch of shape {tuple(hidden.shape)}")


def stored_errors(ns, i):
    try:
        risky_forward(ns["model"], ns["x"])
    except RuntimeError as e:
        ns["errors"].append(e)  # the exception keeps its traceback, the frames, their tensors


def shell_setup(ns):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.user_ns.update(ns)
    ns["_shell"] = shell


def displayed_logits(ns, i):
    """A notebook cell ending in an expression: IPython's Out keeps every result."""
    with contextlib.redirect_stdout(io.StringIO()):  # the shell prints Out[n]; keep the bench quiet
        ns["_shell"].run_cell("model(x).logits", store_history=True)


def grads_setup(ns):
    for _ in range(2):
        loss = ns["model"](ns["x"], labels=ns["x"]).loss
        loss.backward()  # training ends without zero_grad
    ns["model"].eval()


def eval_step(ns, i):
    with torch.no_grad():
        ns["model"](ns["x"])


# ---- clean loops


def clean_train(ns, i):
    ns["losses"].append(train_step(ns).item())


def bounded_cache(ns, i):
    """Six padded lengths: the cache fills during the first steps, then stays flat."""
    seq = ns["rng"].choice([8, 12, 16, 20, 24, 28])
    key = f"{BATCH}x{seq}"
    if key not in ns["cache"]:
        ns["cache"][key] = torch.ones(BATCH, 4, seq, seq) * 0.5
    ns["losses"].append(train_step(ns, batch(seq)).item())


def warmup_spike(ns, i):
    if i < 3:
        ns["warm"] = torch.zeros(4_000_000)  # e.g. a first-batch buffer, dropped after warm-up
    else:
        ns.pop("warm", None)
    ns["losses"].append(train_step(ns).item())


SCENARIOS = [
    # name, kind, setup, step, expected holder, check name
    ("graph kept in list (eval)", "leak", None, eval_losses_kept, "val_losses", "graph in container"),
    ("running total of losses", "leak", None, running_total, "total_loss", None),
    ("hook never removed", "leak", hook_setup, hooked_train, "feats", "hooks"),
    ("unbounded shape-keyed cache", "leak", None, shape_cache, "cache", "shape-keyed cache"),
    ("stored exceptions (traceback)", "leak", None, stored_errors, "errors", "stored traceback"),
    ("IPython Out history", "leak", shell_setup, displayed_logits, "Out", "output history"),
    ("grads left after eval", "leak", grads_setup, eval_step, "model", "grads after eval"),
    ("clean training loop", "clean", None, clean_train, None, None),
    ("cache grows then stabilizes", "clean", None, bounded_cache, None, None),
    ("warm-up spike", "clean", None, warmup_spike, None, None),
]


def namespace(model) -> dict:
    return {
        "model": model,
        "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "x": batch(),
        "val_losses": [],
        "total_loss": torch.zeros(()),
        "feats": [],
        "cache": {},
        "errors": [],
        "losses": [],
        "rng": random.Random(0),
    }


def run(name, kind, setup, step, holder, check_name) -> dict:
    torch.manual_seed(0)
    ns = namespace(load_model())
    if setup:
        setup(ns)
    view = ns["_shell"].user_ns if "_shell" in ns else ns  # where the notebook's names live
    det = GrowthDetector()
    baseline = None
    first_flag = None
    check_step = None
    warned_checks: set[str] = set()
    started = time.perf_counter()
    for i in range(STEPS):
        step(ns, i)
        if det.record() and first_flag is None:
            first_flag = i + 1
        if i + 1 == det.warmup:
            baseline = census(view)
        if i == 0:
            found = leak_checks(view).problems
            warned_checks |= {c.name for c in found}
            if check_name in warned_checks:
                check_step = 1
    report = det.report()
    final_checks = leak_checks(view)
    warned_checks |= {c.name for c in final_checks.problems}
    suspect = census_diff(baseline, census(view)).top_holder if report.leaking else None
    seconds = time.perf_counter() - started
    check_holders = []
    if check_name and check_name in warned_checks:
        check_holders = final_checks.check(check_name).data.get("holders", [])
    named = bool(holder) and (
        (suspect is not None and suspect.startswith(holder)) or any(h.startswith(holder) for h in check_holders)
    )
    detected_steps = [s for s in (report.detected_at, check_step) if s]
    if kind == "clean":
        false_positive = first_flag is not None or bool(warned_checks)
    else:
        false_positive = False
    if "_shell" in ns:
        ns["_shell"].displayhook.flush()
        ns["_shell"].reset(new_session=False)
    result = {
        "scenario": name,
        "kind": kind,
        "flagged_by_detector": report.leaking,
        "checks_warned": sorted(warned_checks),
        "found": (report.leaking or check_name in warned_checks) if kind == "leak" else None,
        "holder_named": named if kind == "leak" else None,
        "expected_holder": holder,
        "suspect": suspect,
        "check_holders": check_holders[:3],
        "steps_to_detect": min(detected_steps) if detected_steps else None,
        "detector_step": report.detected_at,
        "check_step": check_step,
        "check_warned": bool(check_name) and check_name in warned_checks,
        "bytes_per_step": int(report.bytes_per_step),
        "false_positive": false_positive,
        "seconds": round(seconds, 2),
    }
    del ns, view
    gc.collect()
    return result


def main() -> int:
    results = [run(*s) for s in SCENARIOS]
    leaks_ = [r for r in results if r["kind"] == "leak"]
    clean = [r for r in results if r["kind"] == "clean"]
    rows = []
    for r in results:
        trend = f"{r['bytes_per_step'] / 1024:.1f} KiB"
        if r["kind"] == "leak":
            who = (
                r["suspect"]
                if r["suspect"] and r["suspect"].startswith(r["expected_holder"])
                else (r["check_holders"][0] if r["check_holders"] else r["suspect"])
            )
            rows.append(
                [
                    r["scenario"],
                    "leak",
                    "yes" if r["found"] else "NO",
                    r["detector_step"] or "-",
                    r["check_step"] or ("end" if r["check_warned"] else "-"),
                    who or "-",
                    trend,
                ]
            )
        else:
            rows.append(
                [
                    r["scenario"],
                    "clean",
                    "FALSE POSITIVE" if r["false_positive"] else "no flag",
                    r["detector_step"] or "-",
                    ", ".join(r["checks_warned"]) or "-",
                    "-",
                    trend,
                ]
            )
    table = format_table(
        ["scenario", "kind", "flagged", "detector at step", "check at step", "holder named", "trend/step"], rows
    )
    steps = [r["steps_to_detect"] for r in leaks_ if r["steps_to_detect"]]
    summary = {
        "recall": sum(bool(r["found"]) for r in leaks_) / len(leaks_),
        "holders_named": sum(bool(r["holder_named"]) for r in leaks_) / len(leaks_),
        "false_positives": sum(r["false_positive"] for r in clean),
        "clean_loops": len(clean),
        "max_steps_to_detect": max(steps) if steps else None,
        "steps_per_scenario": STEPS,
    }
    targets = {
        "all leaks found": summary["recall"] == 1.0,
        "all holders named": summary["holders_named"] == 1.0,
        "no false positive": summary["false_positives"] == 0,
        "detected within 20 steps": summary["max_steps_to_detect"] is not None and summary["max_steps_to_detect"] <= 20,
    }
    print(table)
    print()
    print(
        f"recall {summary['recall']:.0%}, holders named {summary['holders_named']:.0%}, "
        f"false positives {summary['false_positives']} of {len(clean)} clean loops, "
        f"detection within {summary['max_steps_to_detect']} steps"
    )
    print("targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items()))
    path = write_results(
        "leak_detection", {"summary": summary, "targets": targets, "scenarios": results, "table": table}
    )
    print(f"results: {path.relative_to(REPO)}")
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
