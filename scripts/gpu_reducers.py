"""The ``reducers`` stage of ``make gpu-check``: what each memory reducer saves on a real card, against
what the estimate says it saves (issue 35).

- QLoRA step of the big model in nf4 (seq 512, the T4's fp16 autocast) with the loss plain and chunked,
  and with activation offload on and off (without gradient checkpointing, where it matters): peak
  allocated vs ``TrainPlan(loss=..., offload_activations=...).estimate()``;
- generation (batch 4, prompt 2048, 256 new tokens) with the KV cache kinds this machine can run
  (dynamic, fp8, offload; int4/int2 with optimum-quanto or hqq): peak vs ``estimate(kv_cache=...)``.

Each row also carries the saving measured against its plain cell and the saving estimated, so the
result says whether the estimate prices the reducer right. Rows are written one by one (resumable).
"""

from __future__ import annotations

import torch
from gpu_stages import (
    big_model,
    bnb_skipped,
    error_pct,
    incomplete,
    model_note,
    partial_rows,
    peak_allocated,
    plan_for,
    qlora_row,
    save_partial,
    sync_peak_reset,
    without_context,
)

from helpers.core.reducers import kv_cache_available, kv_cache_kwargs
from helpers.estimator.core import estimate
from helpers.loading.loader import load
from helpers.oom.reclaim import unload

# (loss, offload_activations, gradient_checkpointing): the plain cell of each pair first
TRAIN_CELLS = (("plain", False, True), ("chunked", False, True), ("plain", False, False), ("plain", True, False))
KV_KINDS = ("dynamic", "fp8", "offload", "int4")


def stage_reducers(run) -> dict:
    """QLoRA steps with each training reducer and generations with each KV cache kind, estimate vs peak."""
    if skipped := bnb_skipped(run, "the reducers stage (7B in nf4)"):
        return skipped
    rows = partial_rows(run, "reducers")
    path = big_model(run)
    notes = model_note(path)
    base = tokenizer = None
    for cell in TRAIN_CELLS:
        if any(r.get("cell") == _name(cell) for r in rows) or run.time_left() < 120:
            continue
        if base is None:
            base, tokenizer, _ = load(plan_for(path, "nf4", run), check=False)
        row, base = _train_row(cell, path, base, tokenizer, run)
        rows.append({**row, **run.stamp()})
        save_partial(run, "reducers", rows)
    if base is not None:
        unload(base)
    kinds = [k for k in KV_KINDS if kv_cache_available(k, cuda=not run.dry)[0]]
    notes += [f"kv_cache={k}: {kv_cache_available(k, cuda=not run.dry)[1]}" for k in KV_KINDS if k not in kinds]
    rows += _kv_rows(run, path, kinds, rows)
    _with_savings(rows)
    return incomplete(rows, len(TRAIN_CELLS) + len(kinds), notes)


def _name(cell: tuple) -> str:
    loss, offload, checkpointing = cell
    return f"loss={loss}, offload={'on' if offload else 'off'}, checkpointing={'on' if checkpointing else 'off'}"


def _train_row(cell: tuple, path, base, tokenizer, run) -> tuple[dict, object]:
    from helpers.training.plan import TrainPlan

    loss, offload, checkpointing = cell
    plan = TrainPlan(str(path), load="nf4", micro_batch=1, batch_size=1, gradient_checkpointing=checkpointing,
                     optimizer="adamw_torch", seq_len=64 if run.dry else 512, max_steps=2, save_steps=1000,
                     loss=loss, offload_activations=offload, output_dir=str(run.state / "reducers-out"),
                     precision="fp32" if run.dry else "fp16")  # fmt: skip
    est = plan.estimate("cpu" if run.dry else "current")
    row, base = qlora_row(plan, est, base, tokenizer, run)
    row.pop("saved_census", None)
    return {"cell": _name(cell), "kind": "train", **row, "estimated_host_ram": est.host_total}, base


def _kv_rows(run, path, kinds: list[str], done: list[dict]) -> list[dict]:
    b, p, n = (2, 16, 8) if run.dry else (4, 2048, 256)
    rows, model = [], None
    for kind in kinds:
        name = f"kv_cache={kind}"
        if any(r.get("cell") == name for r in done) or run.time_left() < 90:
            continue
        if model is None:
            model, tokenizer, _ = load(plan_for(path, "nf4", run), check=False)
        est = estimate(str(path), load="nf4", batch_size=b, prompt_tokens=p, max_new_tokens=n, kv_cache=kind,
                       compute_dtype="fp32" if run.dry else "fp16", device="current")  # fmt: skip
        row = {"cell": name, "kind": "generate", "batch": b, "prompt": p, "new": n,
               "estimate": without_context(est), "estimated_kv": est.group_bytes("kv_cache")}  # fmt: skip
        row.update(_generate_peak(model, tokenizer, b, p, n, kind))
        row["error_pct"] = error_pct(row["estimate"], row.get("measured"))
        rows.append({**row, **run.stamp()})
        save_partial(run, "reducers", [*done, *rows])
    if model is not None:
        unload(model)
    return rows


def _generate_peak(model, tokenizer, b: int, p: int, n: int, kind: str) -> dict:
    ids = torch.randint(3, min(1000, tokenizer.vocab_size), (b, p), device=model.device)
    sync_peak_reset()
    try:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id, **kv_cache_kwargs(kind))  # fmt: skip
    except torch.OutOfMemoryError:
        sync_peak_reset()
        return {"measured": None, "note": "OOM under the T4 cap"}
    return {"measured": peak_allocated()}


def _with_savings(rows: list[dict]) -> None:
    """Each reducer's measured and estimated saving against the plain cell it pairs with."""
    by = {r["cell"]: r for r in rows}
    pairs = {_name(("chunked", False, True)): _name(("plain", False, True)),
             _name(("plain", True, False)): _name(("plain", False, False))}  # fmt: skip
    pairs |= {f"kv_cache={k}": "kv_cache=dynamic" for k in KV_KINDS if k != "dynamic"}
    for cell, plain in pairs.items():
        r, p = by.get(cell), by.get(plain)
        if not (r and p):
            continue
        r["saved_estimated"] = p["estimate"] - r["estimate"]
        if r.get("measured") and p.get("measured"):
            r["saved_measured"] = p["measured"] - r["measured"]
            r["saving_error_pct"] = error_pct(r["saved_estimated"], r["saved_measured"])
