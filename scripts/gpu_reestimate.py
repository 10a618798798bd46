"""What today's estimator says for every cell a GPU measured: ``bench/results/gpu/estimates_now.json``.

A GPU run stores the estimate of its day beside each measurement. The estimator improves between
lent GPUs (the no-checkpointing QLoRA rows were fixed from a GPU census), so the GPU table shows
both: the estimate then, and the current one against the same measurement. No GPU is needed: the
estimates come from the shipped configs (cut to the layers the run built), on the preset of the
card that measured, without the CUDA-context row (as the stages compare). A test keeps the file
current (tests/test_docs.py), so an estimator change that moves a GPU verdict shows in review.

    python scripts/gpu_reestimate.py          # rewrite the file
    python scripts/gpu_reestimate.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from helpers.core.sources import read_json, shipped_config  # noqa: E402
from helpers.estimator.configs import config_from_dict  # noqa: E402
from helpers.estimator.core import estimate  # noqa: E402
from helpers.training.plan import TrainPlan  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gpu"
OUT = RESULTS / "estimates_now.json"
HUB = {"tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "codellama": "codellama/CodeLlama-7b-hf",
       "mistral": "mistralai/Mistral-7B-v0.1", "qwen": "Qwen/Qwen2.5-7B"}  # fmt: skip
PRESETS = {"H100": "h100", "A100": "a100-80", "L4": "l4", "T4": "t4"}  # card name -> the preset of its kind


def _config(hub_id: str, layers: int | None):
    config = config_from_dict(read_json(shipped_config(hub_id)), hub_id)
    if layers:
        config.num_hidden_layers = min(layers, config.num_hidden_layers)
    return config


def _preset(gpu: str) -> str:
    return next((p for k, p in PRESETS.items() if k in gpu), "t4")


def _without_context(est) -> int:
    return est.total - sum(r.bytes for r in est.rows if r.key == "overhead.cuda_context")


def _layers(result: dict) -> int | None:
    """The decoder layers the run built (its model note), None for all."""
    for note in result.get("notes", []):
        if "all 32 layers" in note:
            return None
        if "the first 8 of" in note:
            return 8
    return None


def _generate(result: dict) -> dict:
    config = _config(HUB["codellama"], _layers(result))
    out = {}
    for r in result.get("rows", []):
        est = estimate(config, load="nf4", batch_size=r["batch"], prompt_tokens=r["prompt"],
                       max_new_tokens=r["new"], compute_dtype="fp16", device=_preset(r.get("gpu", "")))  # fmt: skip
        out[f"{r['batch']}/{r['prompt']}/{r['new']}"] = _without_context(est)
    return out


def _qlora(result: dict) -> dict:
    """As the stage plans it: a TrainPlan on a folder holding the (cut) config, estimated on the card's preset."""
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        _config(HUB["codellama"], _layers(result)).save_pretrained(folder)
        for r in result.get("rows", []):
            plan = TrainPlan(folder, load="nf4", micro_batch=r["micro_batch"], batch_size=r["micro_batch"],
                             gradient_checkpointing=r["checkpointing"], optimizer=r["optimizer"], seq_len=512,
                             max_steps=2, save_steps=1000, output_dir=folder, precision="fp16")  # fmt: skip
            est = plan.estimate(_preset(r.get("gpu", "")))
            out[f"{r['micro_batch']}/{r['checkpointing']}/{r['optimizer']}"] = _without_context(est)
    return out


def _weights(result: dict) -> dict:
    out = {}
    for r in result.get("rows", []):
        layers = 8 if str(r.get("model", "")).endswith("-L8") else None
        mode, dq = r["mode"].split(" ")[0], "no dq" not in r["mode"]
        est = estimate(_config(HUB[r["name"]], layers), load=mode, double_quant=dq, compute_dtype="fp16",
                       device=_preset(r.get("gpu", "")))  # fmt: skip
        out[f"{r['name']}/{r['mode']}"] = est.weights
    return out


def estimates_now(folder: Path = RESULTS) -> dict:
    """Today's estimate of every GPU cell, keyed by stage and cell."""
    found = {}
    for stage, fn in (("generate", _generate), ("qlora", _qlora), ("weights", _weights)):
        path = folder / f"{stage}.json"
        if path.exists():
            found[stage] = fn(json.loads(path.read_text()))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale, write nothing")
    args = parser.parse_args(argv)
    now = estimates_now()
    if args.check:
        stale = not OUT.exists() or json.loads(OUT.read_text()) != now
        if stale:
            print(f"{OUT.relative_to(REPO)} is stale: run python scripts/gpu_reestimate.py, then make docs")
        return int(stale)
    OUT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
