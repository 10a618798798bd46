"""``make gpu-check``: prove every CUDA path on a real GPU capped to a T4, and measure the estimator.

Stages (each resumable from a state folder, since one command on a lent GPU machine may run at most
10 minutes): env, weights, generate, qlora, context, recovery, pytest_cuda, notebooks. A real run
writes ``bench/results/gpu/<stage>.json`` and ``bench/results/gpu/summary.md``. ``--dry-run`` runs
every stage on the CPU with the tiny model and a simulated cap, writing only under
``<state>/dry/``: no CPU figure can be mistaken for a GPU one.

    python scripts/gpu_check.py                         # every stage not done yet, capped to a T4
    python scripts/gpu_check.py --stages weights,generate --fresh
    python scripts/gpu_check.py --dry-run               # the CPU rehearsal CI runs

See docs/gpu_check.md for running it on a lent GPU machine (wheels, carry, one stage per call).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import gpu_stages  # noqa: E402
import torch  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gpu"
STAGES = ("env", "weights", "generate", "qlora", "context", "recovery", "pytest_cuda", "notebooks")
STAGE_BUDGET_S = 8 * 60  # a lent machine runs one command for at most 10 minutes: leave room to write


@dataclass
class Run:
    """What every stage needs: where to write, whether this is a rehearsal, and how long is left."""

    dry: bool
    state: Path
    out: Path
    capped: bool = True
    started: float = field(default_factory=time.perf_counter)
    budget_s: float = STAGE_BUDGET_S

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def time_left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def partial(self, stage: str) -> Path:
        return self.state / f"{stage}.partial.json"


def _machine(run: Run) -> dict:
    import platform

    info = {"python": platform.python_version(), "torch": torch.__version__, "dry_run": run.dry, "cuda": None}
    if not run.dry:
        props = torch.cuda.get_device_properties(0)
        info.update(cuda=torch.version.cuda, gpu=props.name, capability=f"{props.major}.{props.minor}",
                    total_memory=props.total_memory, cap_fraction=torch.cuda.get_per_process_memory_fraction(0))  # fmt: skip
    return info


def act_as_t4(run: Run) -> None:
    """Cap this process at the T4 preset's capacity: every allocation past it is a real CUDA OOM."""
    if run.dry or not run.capped:
        return
    from helpers.devices import DEVICES

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, DEVICES["t4"]["capacity"] / total), 0)


def run_stage(run: Run, stage: str, fresh: bool) -> dict | None:
    target = run.out / f"{stage}.json"
    if target.exists() and not fresh:
        print(f"== {stage}: done before ({target.relative_to(REPO) if target.is_relative_to(REPO) else target})")
        return json.loads(target.read_text())
    if run.time_left() < 60:
        print(f"== {stage}: no time left in this call; run it again to continue")
        return None
    print(f"== {stage}")
    started = time.perf_counter()
    result = getattr(gpu_stages, f"stage_{stage}")(run)
    result.update(stage=stage, machine=_machine(run), seconds=round(time.perf_counter() - started, 1))
    if not result.get("incomplete"):
        target.write_text(json.dumps(result, indent=2, default=str) + "\n")
        run.partial(stage).unlink(missing_ok=True)
    print(gpu_stages.format_rows(result.get("rows", [])))
    for note in result.get("notes", []):
        print(f"  note: {note}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    parser.add_argument("--state", type=Path, default=RESULTS / "state", help="where progress is kept between calls")
    parser.add_argument("--dry-run", action="store_true", help="rehearse every stage on the CPU with the tiny model")
    parser.add_argument("--fresh", action="store_true", help="redo stages that are done already")
    parser.add_argument("--uncapped", action="store_true", help="measure the card as it is, not as a T4")
    args = parser.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry-run to rehearse on the CPU (GPU figures come only from a GPU)")
    out = args.state / "dry" if args.dry_run else (RESULTS if not args.uncapped else RESULTS / "uncapped")
    run = Run(dry=args.dry_run, state=args.state, out=out, capped=not args.uncapped)
    run.state.mkdir(parents=True, exist_ok=True)
    run.out.mkdir(parents=True, exist_ok=True)
    act_as_t4(run)
    results = {s: run_stage(run, s, args.fresh) for s in stages}
    summary = gpu_stages.summarize({s: r for s, r in results.items() if r}, dry=run.dry)
    (run.out / "summary.md").write_text(summary + "\n")
    print(summary)
    return 0 if all(results.values()) else 3  # 3: some stage still to run (time ran out in this call)


if __name__ == "__main__":
    sys.exit(main())
