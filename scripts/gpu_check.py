"""``make gpu-check``: prove every CUDA path on a real GPU capped to a T4, and measure the estimator.

Stages (each resumable from a state folder, since one command on a lent GPU machine may run at most
10 minutes): env, weights, generate, qlora, context, recovery, attention, reducers (scripts/gpu_reducers.py),
pytest_cuda, notebooks. A real run
writes ``bench/results/gpu/<stage>.json`` (``<stage>.error.json`` when a stage fails: the others go
on) and ``bench/results/gpu/summary.md``, built from every result present. ``--out DIR`` (default
``$OUT/gpu`` when ``$OUT`` is set) gets a copy of the small result files after every row, so a call
cut off keeps what it measured. ``--dry-run`` runs every stage on the CPU with the tiny model and a
simulated cap, writing only under ``<state>/dry/``: no CPU figure can be mistaken for a GPU one.

    python scripts/gpu_check.py --stages env,context    # the preflight call
    timeout -s INT 540 python scripts/gpu_check.py --stages generate
    python scripts/gpu_check.py --dry-run               # the CPU rehearsal CI runs

Exit codes: 0 every stage asked for is done; 3 some stage is incomplete (time ran out), skipped or
failed; 130 interrupted (results flushed first). See docs/gpu_check.md for a lent GPU machine.
"""

from __future__ import annotations

import time

_IMPORTED = time.time()  # before torch: the budget counts the imports too

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import gpu_reducers  # noqa: E402
import gpu_stages  # noqa: E402
import torch  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gpu"
PREDICTED = RESULTS / "time_predicted.json"  # make gpu-predict: the times predicted before a GPU measures them
# most valuable first (issue 29): one lent call of at most 9 minutes measures them in this order and
# writes each row as it is measured, so a call cut off keeps what it got
STAGES = (
    "env",
    "context",
    "generate",
    "qlora",
    "recovery",
    "attention",
    "reducers",
    "weights",
    "pytest_cuda",
    "notebooks",
)
# a lent machine gives 15 minutes in all and 10 a command: `timeout -s INT 540` around the one call,
# and stages stop starting new rows after this many seconds from process start (imports included)
STAGE_BUDGET_S = float(os.environ.get("OOMKIT_GPU_BUDGET_S", 480))
LAYERS = 8  # the 7B is built with its first 8 of 32 decoder layers: build + 3 loads fit the call


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing: the module's import time is the next best
        return _IMPORTED


@dataclass
class Run:
    """What every stage needs: where to write, whether this is a rehearsal, and how long is left.

    ``out`` holds the stage results, ``state`` the progress of this run kind (dry, capped and
    uncapped never share it), ``export`` the folder that receives a copy after every row.
    """

    dry: bool
    state: Path
    out: Path
    capped: bool = True
    export: Path | None = None
    models: tuple[str, ...] = gpu_stages.DEFAULT_MODELS
    models_dir: Path | None = None
    prompts: int = 48
    layers: int | None = LAYERS
    full: bool = False
    started: float = field(default_factory=time.time)  # the script passes its process start
    budget_s: float = STAGE_BUDGET_S
    cap: dict = field(default_factory=dict)
    _bnb: tuple[bool, str] | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def kind(self) -> str:
        return "dry" if self.dry else ("capped" if self.capped else "uncapped")

    def time_left(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def partial(self, stage: str) -> Path:
        return self.state / f"{stage}.partial.json"

    def stamp(self) -> dict:
        """What every row carries, so rows of another card or another cap are never merged."""
        gpu = "cpu (dry run)" if self.dry else torch.cuda.get_device_name(0)
        return {"gpu": gpu, "cap_bytes": self.cap.get("cap_bytes")}

    def bnb(self) -> tuple[bool, str]:
        """bitsandbytes_status on this run's device, once: modes that need it are skipped when it fails."""
        if self._bnb is None:
            from helpers.core.devices import bitsandbytes_status

            self._bnb = bitsandbytes_status(self.device)
        return self._bnb

    def flush(self) -> None:
        """Copy the small result files (never models) to the export folder, if any."""
        if self.export is None:
            return
        rel = {"dry": "dry", "capped": "", "uncapped": "uncapped"}[self.kind]
        results, progress = self.export / rel, self.export / "state" / rel
        files = [*self.out.glob("*.json"), self.out / "summary.md"]
        copies = [(p, results) for p in files if p.is_file() and not p.name.endswith(".partial.json")]
        copies += [(p, progress) for p in self.state.glob("*.partial.json")]
        for gone in progress.glob("*.partial.json"):  # a stage that finished since: its progress is void
            if not (self.state / gone.name).exists():
                gone.unlink(missing_ok=True)
        for src, dest in copies:
            dest.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(src, dest / src.name)
            except OSError as e:  # a full or vanished export folder must not stop the measuring
                print(f"  note: could not copy {src.name} to {dest}: {e}")


def _cap_fraction() -> float | None:
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    return get(0) if get is not None else None


def _machine(run: Run) -> dict:
    import platform

    info = {"python": platform.python_version(), "torch": torch.__version__, "dry_run": run.dry, "cuda": None,
            "kind": run.kind, "cap": run.cap}  # fmt: skip
    if not run.dry:
        props = torch.cuda.get_device_properties(0)
        info.update(cuda=torch.version.cuda, gpu=props.name, capability=f"{props.major}.{props.minor}",
                    total_memory=props.total_memory, cap_fraction=_cap_fraction())  # fmt: skip
    return info


def act_as_t4(run: Run) -> None:
    """Cap this process so that what PyTorch may allocate is what a T4 leaves it: the T4's capacity
    minus the CUDA context (on a T4 the context comes out of those bytes; on a big card it lives
    outside the fraction). The context is the one the context stage measured, else the rule of thumb."""
    from helpers.core.devices import CUDA_CONTEXT, DEVICES

    t4 = DEVICES["t4"]["capacity"]
    context, source = CUDA_CONTEXT, "rule of thumb (helpers.core.devices.CUDA_CONTEXT)"
    measured = RESULTS / "context.json"
    if measured.exists() and not run.dry:
        rows = json.loads(measured.read_text()).get("rows", [])
        if rows and rows[0].get("measured"):  # what lives outside the allocator once cuBLAS is up
            context, source = int(rows[0]["measured"]), f"measured by the context stage on {rows[0].get('gpu')}"
    run.cap = {"t4_capacity": t4, "context": context, "context_source": source}
    if run.dry or not run.capped:
        return
    # a T4 (sm75) has neither flash nor cuDNN attention: without them a bigger card picks the T4's
    # kernels (memory-efficient or math), so prefill memory and helpers.core.attention's fix are the T4's
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    run.cap["attention"] = "flash and cuDNN SDPA off (as on a T4)"
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, (t4 - context) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    run.cap.update(fraction=round(fraction, 6), cap_bytes=int(fraction * total), total=total)


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def _free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_stage(run: Run, stage: str, fresh: bool) -> dict | None:
    """One stage: its result, or ``None`` when it still has to run (time ran out, skipped, or failed)."""
    target, failed = run.out / f"{stage}.json", run.out / f"{stage}.error.json"
    if target.exists() and not fresh:
        done = json.loads(target.read_text())
        if not done.get("skipped"):
            shown = target.relative_to(REPO) if target.is_relative_to(REPO) else target
            print(f"== {stage}: done before ({shown})")
            return done
    if run.time_left() < 60:
        print(f"== {stage}: no time left in this call; run it again to continue")
        return None
    print(f"== {stage}")
    started = time.perf_counter()
    try:
        module = gpu_reducers if stage == "reducers" else gpu_stages
        result = getattr(module, f"stage_{stage}")(run)
    except Exception as e:  # one stage's failure must not cost the others (KeyboardInterrupt goes up)
        from helpers.environment import versions

        _free_gpu()
        error = {"stage": stage, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                 "machine": _machine(run), "versions": versions(), "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
        _write(failed, error)
        print(f"  FAILED: {error['error'][:300]}\n  (traceback in {failed.name}; the next stages go on)")
        return None
    result.update(stage=stage, machine=_machine(run), seconds=round(time.perf_counter() - started, 1))
    if left := _left_allocated(run):  # what a stage keeps skews every stage after it: say so
        result.setdefault("notes", []).append(f"the stage left {left / 2**30:.2f} GiB allocated on the card")
    if stage == "context" and not result.get("incomplete"):
        _write(target, result)
        act_as_t4(run)  # the cap from the context just measured, for every stage after it
        result["machine"] = _machine(run)
    if not result.get("incomplete"):
        _write(target, result)
        run.partial(stage).unlink(missing_ok=True)
        failed.unlink(missing_ok=True)
    print(gpu_stages.format_rows(result.get("rows", [])))
    for note in result.get("notes", []):
        print(f"  note: {note}")
    return None if result.get("incomplete") or result.get("skipped") else result


def _left_allocated(run: Run) -> int:
    """Bytes still allocated after a stage, past a 256 MiB allowance (cuBLAS workspaces, caches)."""
    if run.dry:
        return 0
    gc.collect()
    left = torch.cuda.memory_allocated()
    return left if left > 256 << 20 else 0


def write_summary(run: Run) -> str:
    """summary.md from every result JSON in the run's folder, not just this call's stages."""
    results = {s: json.loads(p.read_text()) for s in STAGES if (p := run.out / f"{s}.json").exists()}
    errors = {s: json.loads(p.read_text()) for s in STAGES if (p := run.out / f"{s}.error.json").exists()}
    summary = gpu_stages.summarize(results, dry=run.dry, errors=errors)
    if not run.dry and results:
        import render_gpu

        summary += "\n\n" + render_gpu.machine_line(results)
    (run.out / "summary.md").write_text(summary + "\n")
    run.flush()
    return summary


def _interrupt(signum, frame):  # SIGTERM as SIGINT: both flush the results before exiting
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The harness; ``started`` is when its time budget began (default: now; the script passes its
    process start, so the imports count on a lent machine, and no caller's age ever does)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    parser.add_argument("--state", type=Path, default=RESULTS / "state", help="where progress is kept between calls")
    parser.add_argument("--dry-run", action="store_true", help="rehearse every stage on the CPU with the tiny model")
    parser.add_argument("--fresh", action="store_true", help="redo stages that are done already")
    parser.add_argument("--uncapped", action="store_true", help="measure the card as it is, not as a T4")
    parser.add_argument("--out", type=Path, default=None,
                        help="copy the small result files here after every row (default: $OUT/gpu when $OUT is set)")  # fmt: skip
    parser.add_argument("--models", default=",".join(gpu_stages.DEFAULT_MODELS),
                        help=f"models of the weights stage, from {', '.join(gpu_stages.GPU_MODELS)}")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=48, help="prompts of the recovery stage's safe_generate check")
    parser.add_argument("--layers", type=int, default=LAYERS,
                        help="decoder layers of the 7B built for generate/qlora/recovery (0: all 32)")  # fmt: skip
    parser.add_argument("--full", action="store_true",
                        help="the full grids (batch 1/4/8 x prompt x new 256/1024; QLoRA mb 1/2/4 x checkpointing x "
                             "optimizer) instead of issue 29's cells: several lent sessions' worth")  # fmt: skip
    parser.add_argument("--predict", action="store_true",
                        help=f"write oomkit's time predictions for the generate and qlora cells to "
                             f"{PREDICTED.relative_to(REPO)} (no GPU needed) and exit")  # fmt: skip
    args = parser.parse_args(argv)
    if args.predict:
        _write(PREDICTED, gpu_stages.time_predictions(args.layers or None))
        print(f"wrote {PREDICTED.relative_to(REPO)}")
        return 0
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if bad := [m for m in models if m not in gpu_stages.GPU_MODELS]:
        parser.error(f"unknown model(s) {', '.join(bad)}; choose from {', '.join(gpu_stages.GPU_MODELS)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry-run to rehearse on the CPU (GPU figures come only from a GPU)")
    kind = "dry" if args.dry_run else ("uncapped" if args.uncapped else "capped")
    out = {"dry": args.state / "dry", "capped": RESULTS, "uncapped": RESULTS / "uncapped"}[kind]
    state = {"dry": args.state / "dry", "capped": args.state, "uncapped": args.state / "uncapped"}[kind]
    export = args.out or (Path(os.environ["OUT"]) / "gpu" if os.environ.get("OUT") else None)
    models_dir = Path(os.environ.get("OOMKIT_GPU_MODELS") or "/tmp/oomkit-gpu-models")
    run = Run(dry=args.dry_run, state=state, out=out, capped=not args.uncapped, export=export, models=("tiny",) if args.dry_run else models,
              models_dir=args.state / "dry" / "models" if args.dry_run else models_dir, prompts=args.prompts,
              layers=args.layers or None, full=args.full, started=started or time.time())  # fmt: skip
    for folder in (run.state, run.out):
        folder.mkdir(parents=True, exist_ok=True)
    act_as_t4(run)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    pending = []
    try:
        for stage in stages:
            if run_stage(run, stage, args.fresh) is None:
                pending.append(stage)
            write_summary(run)
    except KeyboardInterrupt:
        print("== interrupted: results so far are saved; run the same command again to continue")
        print(write_summary(run))
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(write_summary(run))
    if pending:
        print(f"== not done: {', '.join(pending)} (time ran out, skipped or failed: see above; exit 3)")
    return 3 if pending else 0


if __name__ == "__main__":
    sys.exit(main(started=_process_start()))
