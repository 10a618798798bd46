"""Evaluation throughput: safe_generate vs the seeds' naive loop vs a fixed batch of 8, same memory budget.

``--prompts`` prompts of varied length (built from helpers/data/eval_prompts.jsonl and the corpus),
greedy decoding, ``--new`` new tokens each, on the tiny Llama. All three run side by side in one
process under the same simulated memory budget (``helpers.testing.simulated_budget``: a generate
call with batch x (prompt + new tokens) above ``--budget`` tokens raises a real OOM; run at the
budget and at half of it). An OOM is not free: before raising, the bench runs the failed batch's
prefill forward (what a GPU spends at least before it runs out of memory in ``generate``):

- naive: the seeds' advice, batch 1, ``torch.cuda.empty_cache()`` every 10 samples, stop at the
  first OOM (what is left is lost); the ratios are against this loop. A second naive row adds
  ``gc.collect()`` every 10 samples, as many guides do (0.1-0.3 s each once transformers is imported);
- fixed 8: batches of 8 in dataset order (no length sorting), a batch that runs out of memory is
  skipped (its samples are lost; no ``gc.collect()`` after it); and the same sorted by length
  (tokenized once, the tokenization timed), which pads far less; and a fixed 4 sorted by length, what
  a careful user picks under a tight budget (fewer of its batches run out of memory);
- safe_generate: ``batch_size="auto"``, length-sorted, adaptive, results streamed to a JSONL file;
  timed end to end around the call (tokenization, the JSONL writes and reading the records back);
- oracle: told the budget in advance, longest first, every batch exactly as large as fits, no OOM
  and no search: the ceiling for any loop that has to discover the budget, so "safe_generate / oracle"
  says how much the adaptation costs.

Outputs of samples finished by several contenders are checked equal. On CUDA (when available) the
same comparison runs again without a simulated budget, on the real GPU.

Every loop is timed from outside the call, wall clock. Each runs ``--repeats`` times, interleaved
(one round = every loop once, in a rotated order); the ratio to the naive loop is taken within each
round, and the median and range over rounds are reported (the machine is shared).

Run: ``python bench/eval_throughput.py [--prompts 120] [--new 32] [--budget 2048] [--repeats 5] [--threads 1]``.
Writes ``bench/results/eval_throughput.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _common import format_table, write_results  # noqa: E402

from helpers.core.sources import data_path  # noqa: E402
from helpers.evaluation.evaluate import safe_generate  # noqa: E402
from helpers.evaluation.prompts import load_prompts  # noqa: E402
from helpers.loading.generation import count_new_tokens, stop_token_ids  # noqa: E402
from helpers.loading.loader import load  # noqa: E402
from helpers.oom import batch_size as bs  # noqa: E402
from helpers.oom.messages import is_oom  # noqa: E402
from helpers.testing import simulated_budget  # noqa: E402


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` prompts: the shipped questions, each with 0 to 48 words of corpus context before it."""
    rng = random.Random(seed)
    questions = load_prompts(data_path("eval_prompts.jsonl"))
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
    return {"tokens": tokens, "outputs": outputs, "ooms": ooms, "batch_sizes": [1]}


def fixed(model, tok, prompts, new, size=8, by_length: bool = False) -> dict:
    """Batches of ``size`` (in dataset order, or sorted by token length); a batch that runs out of memory is skipped."""
    stop = stop_token_ids(model, tok)
    if by_length:
        lengths = [len(x) for x in tok([p["prompt"] for p in prompts])["input_ids"]]
        prompts = [prompts[k] for k in sorted(range(len(prompts)), key=lambda k: lengths[k])]
    outputs, tokens, ooms = {}, 0, 0
    for i in range(0, len(prompts), size):
        try:
            tokens += run_batch(model, tok, prompts[i : i + size], new, outputs, stop)
        except Exception as e:
            if not is_oom(e):
                raise
            ooms += 1
            torch.cuda.empty_cache()  # a lost batch is lost; no gc.collect(): refcounting freed it
    return {"tokens": tokens, "outputs": outputs, "ooms": ooms, "batch_sizes": [size]}


def padding_share(tok, prompts, size: int, by_length: bool) -> float:
    """Share of the prompt tokens in batches of ``size`` that are padding."""
    lengths = [len(x) for x in tok([p["prompt"] for p in prompts])["input_ids"]]
    if by_length:
        lengths.sort()
    padded = sum(max(lengths[i : i + size]) * len(lengths[i : i + size]) for i in range(0, len(lengths), size))
    return 1 - sum(lengths) / padded


def oracle(model, tok, prompts, new, budget: int, cap: int = 64) -> dict:
    """The upper bound under a known budget: longest first, each batch exactly as large as fits; no OOM, no search."""
    stop = stop_token_ids(model, tok)
    lengths = [len(x) for x in tok([p["prompt"] for p in prompts])["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda k: -lengths[k])
    outputs, tokens, sizes = {}, 0, set()
    tok.padding_side = "left"
    i = 0
    while i < len(order):
        size = max(1, min(cap, budget // (lengths[order[i]] + new)))
        batch = [prompts[k] for k in order[i : i + size]]
        tokens += run_batch(model, tok, batch, new, outputs, stop)
        sizes.add(len(batch))
        i += len(batch)
    return {"tokens": tokens, "outputs": outputs, "ooms": 0, "batch_sizes": sorted(sizes)}


def ours(model, tok, prompts, new, folder: Path) -> dict:
    bs.clear_cache()
    report = safe_generate(
        model, tok, prompts, max_new_tokens=new, results=folder / "ours.jsonl", resume=False, progress=False
    )
    return {
        "tokens": report.new_tokens,
        "ooms": report.oom_retries,
        "outputs": {r["id"]: r["output"] for r in report.records},
        "batch_sizes": sorted(set(report.batch_sizes)),
        "truncated": report.truncated,
        "cache_empties": report.cache_empties,
        "internal_seconds": report.seconds,
    }


@contextlib.contextmanager
def charged_budget(model, tokens: int):
    """``simulated_budget``, but a generate call over the budget first runs its prefill forward, then fails."""
    with simulated_budget(model, tokens=tokens) as sim:
        inner = model.generate  # the simulated one

        def generate(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and ids.shape[0] * (ids.shape[1] + int(kwargs.get("max_new_tokens", 0))) > tokens:
                with torch.inference_mode():  # what the GPU spends before it runs out of memory
                    model(input_ids=ids, attention_mask=kwargs.get("attention_mask"))
            return inner(*args, **kwargs)

        model.generate = generate  # removed with the simulated one when the block ends
        yield sim


ORACLE = "oracle (told the budget; upper bound)"


NAIVE = "naive (batch 1, empty_cache every 10)"
SAFE = 'safe_generate(batch_size="auto")'


def compare(model, tok, prompts, new, budget: int | None, label: str, repeats: int) -> tuple[list[list], dict]:
    """Each loop ``repeats`` times, interleaved (rotated order per round); per-round ratios to the naive loop."""
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        loops = [
            (NAIVE, lambda: naive(model, tok, prompts, new)),
            ("naive + gc.collect every 10", lambda: naive(model, tok, prompts, new, True)),
            ("fixed batch 8, unsorted", lambda: fixed(model, tok, prompts, new)),
            ("fixed batch 8, sorted by length", lambda: fixed(model, tok, prompts, new, by_length=True)),
            ("fixed batch 4, sorted by length", lambda: fixed(model, tok, prompts, new, 4, by_length=True)),
            (SAFE, lambda: ours(model, tok, prompts, new, Path(tmp))),
        ]
        if budget:  # what a loop told the budget in advance could do: the ceiling for any adaptive one
            loops.append((ORACLE, lambda: oracle(model, tok, prompts, new, budget)))
        for r in range(repeats):
            for name, fn in loops[r % len(loops) :] + loops[: r % len(loops)]:
                with charged_budget(model, budget) if budget else contextlib.nullcontext():
                    started = time.perf_counter()
                    run = fn()
                    run["seconds"] = time.perf_counter() - started
                print(f"  {label} round {r + 1}: {name} {run['seconds']:.1f} s", file=sys.stderr, flush=True)
                runs.setdefault(name, []).append(run)
    per_round_naive = [x["tokens"] / x["seconds"] for x in runs[NAIVE]]
    ref = runs[SAFE][0]["outputs"]
    rows, payload = [], {}
    for name, rs in runs.items():
        r = rs[0]
        tps = [x["tokens"] / x["seconds"] for x in rs]
        ratios = [t / b for t, b in zip(tps, per_round_naive)]
        of_oracle = [t / (o["tokens"] / o["seconds"]) for t, o in zip(tps, runs[ORACLE])] if ORACLE in runs else None
        shared = set(r["outputs"]) & set(ref)
        same = all(r["outputs"][i] == ref[i] for i in shared)
        lost = len(prompts) - len(r["outputs"])
        med = statistics.median(ratios)
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
                f"{statistics.median(tps):.0f}",
                f"{med:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                "yes" if same else "NO",
            ]
        )
        payload[name] = {
            "samples_done": len(r["outputs"]),
            "samples_lost": lost,
            "oom_retries_or_errors": r["ooms"],
            "seconds": [round(x["seconds"], 3) for x in rs],
            "new_tokens": r["tokens"],
            "tokens_per_s": round(statistics.median(tps), 1),
            "vs_naive": round(med, 3),
            "vs_naive_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "outputs_equal_where_shared": same,
            **({"of_oracle": round(statistics.median(of_oracle), 3)} if of_oracle else {}),
            "batch_sizes": r["batch_sizes"],
            **{k: r[k] for k in ("truncated", "cache_empties") if k in r},
            **({"internal_seconds": [round(x["internal_seconds"], 3) for x in rs]} if "internal_seconds" in r else {}),
        }
    return rows, payload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (2 threads on 2 shared cores ran up to 18x slower here)"
    )
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="rounds, each running every loop once (interleaved)")
    ap.add_argument(
        "--budget", type=int, default=2048, help="simulated memory: batch x tokens per generate call (also run at half)"
    )
    args = ap.parse_args(argv)

    model_dir = ROOT / "data" / "tiny" / "llama"
    if not model_dir.exists():
        print("build the tiny models first: python data/build_tiny_models.py")
        return 1
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.prompts)
    header = ["device", "loop", "samples done", "lost", "OOMs", "batch sizes", "tokens/s (median)",
              "vs naive: median (range)", "same outputs"]  # fmt: skip
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
            "padding_unsorted_8": round(padding_share(tok, prompts, 8, False), 3),
            "padding_sorted_8": round(padding_share(tok, prompts, 8, True), 3),
            "oom_charge": "prefill forward of the failed batch",
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
