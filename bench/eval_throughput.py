"""Evaluation throughput: safe_generate vs the seeds' naive loop vs a fixed batch of 8, same memory budget.

200 prompts of varied length (4 to ~130 tokens, built from data/eval/prompts.jsonl and the corpus),
greedy decoding, ``--new`` new tokens each, on the tiny Llama. All three run side by side in one
process under the same simulated memory budget (``helpers.testing.simulated_budget``: a generate
call with batch x (prompt + new tokens) above ``--budget`` tokens raises a real OOM; run at the
budget and at half of it):

- naive: the seeds' advice, batch 1, ``torch.cuda.empty_cache()`` every 10 samples, stop at the
  first OOM (what is left is lost); the ratios are against this loop. A second naive row adds
  ``gc.collect()`` every 10 samples, as many guides do (0.1-0.3 s each once transformers is imported);
- fixed 8: batches of 8 in dataset order (no length sorting), a batch that runs out of memory is
  skipped (its samples are lost);
- safe_generate: ``batch_size="auto"``, length-sorted, adaptive, results streamed to a JSONL file;
- oracle: told the budget in advance, longest first, every batch exactly as large as fits, no OOM
  and no search: the ceiling for any loop that has to discover the budget, so "safe_generate / oracle"
  says how much the adaptation costs.

Outputs of samples finished by several contenders are checked equal. On CUDA (when available) the
same comparison runs again without a simulated budget, on the real GPU.

Each loop runs ``--repeats`` times, interleaved, and its fastest run counts (the machine is shared).

Run: ``python bench/eval_throughput.py [--prompts 200] [--new 32] [--budget 2048] [--repeats 2]``.
Writes ``bench/results/eval_throughput.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _common import format_table, write_results  # noqa: E402

from helpers import batch_size as bs  # noqa: E402
from helpers.evaluate import load_prompts, safe_generate  # noqa: E402
from helpers.generation import count_new_tokens, stop_token_ids  # noqa: E402
from helpers.loading import load  # noqa: E402
from helpers.oom import is_oom  # noqa: E402
from helpers.testing import simulated_budget  # noqa: E402


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` prompts: the shipped questions, each with 0 to 48 words of corpus context before it."""
    rng = random.Random(seed)
    questions = load_prompts(ROOT / "data" / "eval" / "prompts.jsonl")
    words = (ROOT / "data" / "corpus" / "memory_notes.txt").read_text().split()
    out = []
    for k in range(n):
        q = questions[k % len(questions)]
        context_words = int(rng.random() ** 2 * 48)  # mostly short, a long tail (like real eval sets)
        start = rng.randrange(len(words))
        context = " ".join((words * 2)[start : start + context_words])
        out.append({"id": f"b{k:03d}", "prompt": (context + "\n" if context else "") + q["prompt"]})
    return out


def run_batch(model, tok, batch: list[dict], new: int, outputs: dict, stop) -> int:
    """Greedy-generate ``batch`` in one padded call, decode into ``outputs``; the new-token count (OOMs propagate)."""
    enc = tok([p["prompt"] for p in batch], return_tensors="pt", padding=True).to(next(model.parameters()).device)
    with torch.inference_mode():
        ids = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    tokens = 0
    for p, g in zip(batch, ids[:, enc["input_ids"].shape[1] :].cpu(), strict=True):
        outputs[p["id"]] = tok.decode(g, skip_special_tokens=True)
        tokens += count_new_tokens(g, stop)
    return tokens


def naive(model, tok, prompts, new, collect: bool = False) -> dict:
    """Batch 1, ``empty_cache()`` (and with ``collect``, ``gc.collect()``) every 10 samples, stop at the first OOM."""
    stop = stop_token_ids(model, tok)
    outputs, tokens, ooms = {}, 0, 0
    started = time.perf_counter()
    for k, p in enumerate(prompts):
        try:
            tokens += run_batch(model, tok, [p], new, outputs, stop)
        except Exception as e:
            if not is_oom(e):
                raise
            ooms += 1
            break  # "stop at the first OOM"
        if (k + 1) % 10 == 0:
            if collect:
                gc.collect()
            torch.cuda.empty_cache()
    return {
        "seconds": time.perf_counter() - started,
        "tokens": tokens,
        "outputs": outputs,
        "ooms": ooms,
        "batch_sizes": [1],
    }


def fixed(model, tok, prompts, new, size=8) -> dict:
    """Batches of ``size`` in dataset order; a batch that runs out of memory is skipped."""
    stop = stop_token_ids(model, tok)
    outputs, tokens, ooms = {}, 0, 0
    started = time.perf_counter()
    for i in range(0, len(prompts), size):
        try:
            tokens += run_batch(model, tok, prompts[i : i + size], new, outputs, stop)
        except Exception as e:
            if not is_oom(e):
                raise
            ooms += 1
            del e
            gc.collect()  # what such loops do; a lost batch is lost either way
            torch.cuda.empty_cache()
    return {
        "seconds": time.perf_counter() - started,
        "tokens": tokens,
        "outputs": outputs,
        "ooms": ooms,
        "batch_sizes": [size],
    }


def oracle(model, tok, prompts, new, budget: int, cap: int = 64) -> dict:
    """The upper bound under a known budget: longest first, each batch exactly as large as fits; no OOM, no search."""
    stop = stop_token_ids(model, tok)
    lengths = [len(x) for x in tok([p["prompt"] for p in prompts])["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda k: -lengths[k])
    outputs, tokens, sizes = {}, 0, set()
    tok.padding_side = "left"
    started = time.perf_counter()
    i = 0
    while i < len(order):
        size = max(1, min(cap, budget // (lengths[order[i]] + new)))
        batch = [prompts[k] for k in order[i : i + size]]
        tokens += run_batch(model, tok, batch, new, outputs, stop)
        sizes.add(len(batch))
        i += len(batch)
    return {
        "seconds": time.perf_counter() - started,
        "tokens": tokens,
        "outputs": outputs,
        "ooms": 0,
        "batch_sizes": sorted(sizes),
    }


def ours(model, tok, prompts, new, folder: Path) -> dict:
    bs.clear_cache()
    report = safe_generate(
        model, tok, prompts, max_new_tokens=new, results=folder / "ours.jsonl", resume=False, progress=False
    )
    return {
        "seconds": report.seconds,
        "tokens": report.new_tokens,
        "ooms": report.oom_retries,
        "outputs": {r["id"]: r["output"] for r in report.records},
        "batch_sizes": sorted(set(report.batch_sizes)),
        "truncated": report.truncated,
        "cache_empties": report.cache_empties,
    }


ORACLE = "oracle (told the budget; upper bound)"


def compare(model, tok, prompts, new, budget: int | None, label: str, repeats: int) -> tuple[list[list], dict]:
    """Each loop ``repeats`` times, interleaved; the fastest run of each counts (the machine is shared)."""
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        loops = [
            ("naive (batch 1, empty_cache every 10)", lambda: naive(model, tok, prompts, new)),
            ("naive + gc.collect every 10", lambda: naive(model, tok, prompts, new, True)),
            ("fixed batch 8, unsorted", lambda: fixed(model, tok, prompts, new)),
            ('safe_generate(batch_size="auto")', lambda: ours(model, tok, prompts, new, Path(tmp))),
        ]
        if budget:  # what a loop told the budget in advance could do: the ceiling for any adaptive one
            loops.append((ORACLE, lambda: oracle(model, tok, prompts, new, budget)))
        for _ in range(repeats):
            for name, fn in loops:
                with simulated_budget(model, tokens=budget) if budget else contextlib.nullcontext():
                    run = fn()
                if name not in runs or run["seconds"] < runs[name]["seconds"]:
                    runs[name] = run
    base = runs["naive (batch 1, empty_cache every 10)"]
    base_tps = base["tokens"] / base["seconds"]
    ceiling = runs[ORACLE]["tokens"] / runs[ORACLE]["seconds"] if ORACLE in runs else None
    ref = runs['safe_generate(batch_size="auto")']["outputs"]
    rows, payload = [], {}
    for name, r in runs.items():
        shared = set(r["outputs"]) & set(ref)
        same = all(r["outputs"][i] == ref[i] for i in shared)
        tps = r["tokens"] / r["seconds"]
        lost = len(prompts) - len(r["outputs"])
        rows.append(
            [
                label,
                name,
                f"{len(r['outputs'])}/{len(prompts)}",
                lost,
                r["ooms"],
                ",".join(map(str, r["batch_sizes"]))
                if len(r["batch_sizes"]) < 6
                else f"{r['batch_sizes'][0]}..{r['batch_sizes'][-1]}",
                f"{tps:.0f}",
                f"{tps / base_tps:.2f}x",
                "yes" if same else "NO",
            ]
        )
        payload[name] = {
            "samples_done": len(r["outputs"]),
            "samples_lost": lost,
            "oom_retries_or_errors": r["ooms"],
            "seconds": round(r["seconds"], 3),
            "new_tokens": r["tokens"],
            "tokens_per_s": round(tps, 1),
            "vs_naive": round(tps / base_tps, 2),
            "outputs_equal_where_shared": same,
            **({"of_oracle": round(tps / ceiling, 2)} if ceiling else {}),
            "batch_sizes": r["batch_sizes"],
            **{k: r[k] for k in ("truncated", "cache_empties") if k in r},
        }
    return rows, payload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each loop, interleaved; the fastest counts")
    ap.add_argument(
        "--budget", type=int, default=2048, help="simulated memory: batch x tokens per generate call (also run at half)"
    )
    args = ap.parse_args(argv)

    model_dir = ROOT / "data" / "tiny" / "llama"
    if not model_dir.exists():
        print("build the tiny models first: python data/build_tiny_models.py")
        return 1
    prompts = make_prompts(args.prompts)
    header = ["device", "loop", "samples done", "lost", "OOMs", "batch sizes", "tokens/s", "vs naive", "same outputs"]
    # device_map=None: the CPU rows stay on the CPU on a machine with a GPU too (the default "auto" would place it there)
    model, tok, _ = load(str(model_dir), load="fp32", check=False, device_map=None)
    lengths = [len(x) for x in tok([p["prompt"] for p in prompts])["input_ids"]]
    results = {
        "settings": {
            **vars(args),
            "prompt_tokens_min": min(lengths),
            "prompt_tokens_max": max(lengths),
            "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1),
            "torch_threads": torch.get_num_threads(),
        }
    }
    rows = []
    for budget in (args.budget, args.budget // 2):  # roomy enough for batches of 8, and tight
        more, payload = compare(model, tok, prompts, args.new, budget, f"cpu, budget {budget}", args.repeats)
        rows += more
        results[f"cpu_budget_{budget}"] = payload
    if torch.cuda.is_available():
        model, tok, _ = load(str(model_dir), load="fp16", check=False)
        cuda_rows, cuda_payload = compare(
            model, tok, prompts, args.new, None, torch.cuda.get_device_name(0), args.repeats
        )
        rows += cuda_rows
        results["cuda"] = cuda_payload
    print(format_table(header, rows))
    path = write_results("eval_throughput", results)
    print(f"\nwrote {path.relative_to(ROOT)}")
    print(json.dumps(results["settings"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
