"""The recovery checks of ``scripts/gpu_check.py``'s ``recovery`` stage: real OOMs, real cleanup.

``safe_generate`` runs over ``run.prompts`` prompts (``--prompts``, 200 by default) on a GPU.

Each returns ``{"check", "goal", "result", "met", ...figures}``. On a GPU the OOMs come from the
allocator under the T4 cap; in the dry run from ``helpers.testing.simulated_budget`` (a real
``torch.OutOfMemoryError`` past a token budget) and a CPU allocation larger than the machine.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time

import psutil
import torch
from gpu_cap import uncapped

from helpers import cleanup, explain_oom, find_max_batch_size, safe_generate
from helpers.core.units import GiB, MiB, format_bytes
from helpers.evaluation.results_file import is_record
from helpers.monitoring.monitor import MemoryMonitor
from helpers.oom.retry import attempt
from helpers.testing import simulated_budget

DRY_BUDGET_TOKENS = 400  # the dry run's simulated card: batch x (prompt + new tokens) <= 400


def _generate_step(model, tokenizer, prompt: int, new: int):
    def step(batch: int):
        ids = torch.randint(3, min(1000, tokenizer.vocab_size), (batch, prompt), device=model.device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip

    return step


def _budget(model, run, oom_rate: float = 0.0):
    return simulated_budget(model, DRY_BUDGET_TOKENS, oom_rate=oom_rate) if run.dry else contextlib.nullcontext()


def batch_search(model, tokenizer, run) -> dict:
    """find_max_batch_size on real OOMs vs the true maximum, found by trying every size above it."""
    prompt, new = (16, 8) if run.dry else (512, 64)
    step = _generate_step(model, tokenizer, prompt, new)
    limit = 256
    with _budget(model, run):
        found = find_max_batch_size(step, limit=limit)
        true = found.max_ok
        while true < limit and attempt(step, true + 1).ok:  # exhaustive above what the search returned
            true += 1
    share = found.max_ok / true if true else 0.0
    return {"check": "batch finder vs true maximum", "goal": ">= 0.90", "met": share >= 0.9,
            "result": f"found {found.max_ok} of {true} ({share:.2f}) in {len(found.trials)} tries; "
                      f"hands back {found.batch_size} after its margin",
            "found": found.max_ok, "true_max": true, "tries": len(found.trials)}  # fmt: skip


def _prompts(n: int, words: tuple[int, int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    vocab = "memory tensor batch cache token layer model weight gradient kernel".split()
    return [{"id": f"p{i}", "prompt": " ".join(rng.choice(vocab) for _ in range(rng.randint(*words)))}
            for i in range(n)]  # fmt: skip


def no_result_lost(model, tokenizer, run) -> dict:
    """safe_generate over many prompts with real OOMs: every prompt once, outputs as an OOM-free run's."""
    n, words, new = (60, (2, 30), 8) if run.dry else (run.prompts, (200, 1200), 32)
    prompts = _prompts(n, words)
    capped, free = run.state / "eval_capped.jsonl", run.state / "eval_reference.jsonl"
    for f in (capped, free):
        f.unlink(missing_ok=True)
    with _budget(model, run, oom_rate=0.1):
        report = safe_generate(model, tokenizer, prompts, max_new_tokens=new, results=capped, max_batch_size=256,
                               progress=False)  # fmt: skip
    with _uncapped(run):
        safe_generate(model, tokenizer, prompts, max_new_tokens=new, results=free, batch_size=8, progress=False)
    got = [r for r in map(json.loads, capped.read_text().splitlines()) if is_record(r)]  # headers are not results
    ref = {r["id"]: r["output"] for r in map(json.loads, free.read_text().splitlines()) if is_record(r)}
    ids = [r["id"] for r in got]
    lost, dup = len({p["id"] for p in prompts} - set(ids)), len(ids) - len(set(ids))
    equal = sum(ref.get(r["id"]) == r["output"] for r in got)
    return {"check": "safe_generate under real OOMs", "goal": "0 lost, 0 duplicated", "met": lost == dup == 0,
            "result": f"{n} prompts, {report.oom_retries} OOM retries: {lost} lost, {dup} duplicated, "
                      f"{equal}/{n} outputs equal to an OOM-free run", "lost": lost, "duplicated": dup,
            "oom_retries": report.oom_retries, "equal_outputs": equal}  # fmt: skip


def _uncapped(run):
    """The reference run of the comparison: the whole card, so no OOM happens (nothing to lift in a dry run)."""
    if run.dry:
        return contextlib.nullcontext()
    return uncapped()


def _too_big(run) -> int:
    if run.dry:
        return 1 << 45  # 32 TiB: the CPU allocator refuses it for real
    return int(torch.cuda.get_device_properties(0).total_memory * 1.05)


def live_explanation(run) -> dict:
    """A T4-sized OOM for real: on a GPU, 55 % of the cap held and 55 % more asked for (the allocator
    refuses under the cap, as on a full T4); explain_oom must read the figures and name a cause."""
    device = "cpu" if run.dry else "cuda"
    cap = run.cap.get("cap_bytes")
    held = None
    try:
        if cap:
            held = torch.empty(int(cap * 0.55), dtype=torch.uint8, device=device)
        torch.empty(int(cap * 0.55) if cap else _too_big(run), dtype=torch.uint8, device=device)
        return {"check": "explain_oom on a live OOM", "goal": "figures and cause", "met": False,
                "result": "the allocation did not fail"}  # fmt: skip
    except (torch.OutOfMemoryError, RuntimeError) as e:
        report = explain_oom(e)
        message = str(e).splitlines()[0][:300]
    finally:
        del held
    figures = {k: getattr(report, k) for k in ("requested", "total", "free", "allocated", "reserved", "process_cap")}
    filled = [k for k, v in figures.items() if v is not None]
    met = report.requested is not None and (run.dry or report.total is not None)
    return {"check": "explain_oom on a live OOM", "goal": "figures and cause", "met": met,
            "result": f"cause: {report.cause}; figures read: {', '.join(filled) or 'none'}",
            "figures": figures, "message": message, "explanation": str(report)[:1500]}  # fmt: skip


def _held_by_a_failed_call(run, size: int) -> None:
    device = "cpu" if run.dry else "cuda"

    def work():
        held = torch.ones(size, dtype=torch.uint8, device=device)  # noqa: F841 - pinned by the traceback
        torch.empty(_too_big(run), dtype=torch.uint8, device=device)

    try:
        work()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__  # as a notebook keeps it


def cleanup_after_oom(run) -> dict:
    """What an OOM's traceback pins (a tensor local to the failed call) comes back with cleanup():
    allocated memory back to its level before the OOM, and the reserved memory returned to the card."""
    size = 64 * MiB if run.dry else 2 * GiB
    from helpers.leaks.tensors import tensor_bytes

    allocated = tensor_bytes if run.dry else torch.cuda.memory_allocated
    reserved = tensor_bytes if run.dry else torch.cuda.memory_reserved
    base, base_reserved = allocated(), reserved()
    _held_by_a_failed_call(run, size)
    pinned, pinned_reserved = allocated(), reserved()
    report = cleanup()
    after, after_reserved = allocated(), reserved()
    regained = (pinned - after) / size
    back = after <= base
    return {"check": "cleanup() after an OOM", "goal": "allocated back to before the OOM", "met": back and regained >= 0.95,
            "result": f"allocated {format_bytes(base)} before, {format_bytes(pinned)} pinned after the OOM, "
                      f"{format_bytes(after)} after cleanup() ({regained:.0%} of the pinned {format_bytes(size)} "
                      f"regained); reserved {format_bytes(pinned_reserved)} -> {format_bytes(after_reserved)}",
            "allocated_before": base, "allocated_after_oom": pinned, "allocated_after_cleanup": after,
            "reserved_before": base_reserved, "reserved_after_oom": pinned_reserved,
            "reserved_after_cleanup": after_reserved, "regained_share": round(regained, 3),
            "cleanup": str(report).splitlines()[0]}  # fmt: skip


def monitor_vs_allocator(run) -> dict:
    size = 256 * MiB if run.dry else 1 * GiB
    key = "process_rss" if run.dry else "allocated"
    if not run.dry:  # the peak so far holds the batch search's: compare with this check's own
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with MemoryMonitor(interval=0.01, warn=False) as monitor:
        t = torch.ones(size, dtype=torch.uint8, device="cpu" if run.dry else "cuda")
        time.sleep(0.3)
        truth = psutil.Process().memory_info().rss if run.dry else torch.cuda.max_memory_allocated()
        del t
    seen = monitor.peak()[key]
    err = abs(seen - truth) / truth
    return {"check": "MemoryMonitor vs the allocator", "goal": "peak within 5 %", "met": err <= 0.05,
            "result": f"monitor peak {format_bytes(seen)} vs {format_bytes(truth)} ({err:.1%})"}  # fmt: skip
