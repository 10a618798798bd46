"""QLoRA fine-tuning that fits the GPU: plan, prepare, pick the micro-batch, train, resume, save.

A :class:`TrainPlan` holds every choice that decides memory and resumability (load mode, LoRA
rank, sequence length, effective batch = micro-batch x gradient accumulation, optimizer, precision,
checkpoints). ``plan.estimate()`` is the estimator's training budget for it; :func:`find_micro_batch`
measures the largest micro-batch that runs a real training step and keeps the effective batch by
accumulating gradients. :func:`train` runs transformers' ``Trainer`` and continues from the newest
complete checkpoint in ``plan.output_dir`` when there is one (a Colab disconnect costs at most
``save_steps`` steps; one that cut a save short costs one checkpoint more, see
:mod:`helpers.training.checkpoints`). :func:`save_adapter` writes only the LoRA weights.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import math
import shutil
import time
import warnings
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import torch

from ..core.arguments import number
from ..core.reducers import chunked_lm_loss, offload_activations
from ..core.vocab import BF16, FP16, TIGHT_FRACTION
from ..estimator.rows import EstimateError
from ..estimator.timing import time_basis, view_time
from ..loading.fingerprint import weights_fingerprint
from ..loading.generation import token_ids_problem
from ..loading.loader import keep_4bit_layout
from ..oom.batch_size import find_max_batch_size
from .checkpoint_proof import prove
from .checkpoints import (
    WHY,
    CheckpointError,
    CheckpointWarning,
    CheckpointWriteError,
    ResumePoint,
    Skipped,
    complete_marker,
    find_resume,
    newest_complete,
    read_stamp,
    set_aside,
    set_aside_all,
    write_failure,
)
from .data import (
    collate,
)
from .family_data import probe_batch
from .plan import FinetuneError, TrainPlan, need_model, need_plan, need_tokenizer
from .view import TrainProgress

# the plan (train_plan), the data (training_data) and the adapters (adapters) are re-exported: one import for a run
__all__ = [
    "MicroBatch",
    "TrainResult",
    "find_micro_batch",
    "make_trainer",
    "train",
    "last_checkpoint",
    "run_stamp",
    "stamp_changes",
    "dataset_hash",
    "predicted_step_seconds",
]  # fmt: skip


@dataclass
class MicroBatch:
    """The measured micro-batch and the accumulation that keeps the effective batch."""

    micro_batch: int
    gradient_accumulation: int
    batch_size: int
    search: Any

    @property
    def why(self) -> str:
        """How the micro-batch follows from the search, in a few words."""
        s = self.search
        if s.limit and s.max_ok >= s.limit:
            how, usable = f"the cap {s.limit} ran: no margin, that is for after an out-of-memory try", s.max_ok
        else:
            how, usable = f"{s.margin:.0%} of the largest that ran, {s.max_ok}: {s.batch_size}", s.batch_size
        if self.micro_batch == usable:
            return how
        return f"{how}; the largest divisor of {self.batch_size} up to {usable} is {self.micro_batch}"

    def headline(self) -> str:
        """The answer: micro-batch x accumulation = effective batch, and why."""
        return (
            f"micro-batch {self.micro_batch} x gradient accumulation {self.gradient_accumulation} = "
            f"effective batch {self.batch_size} ({self.why})"
        )

    def __str__(self) -> str:
        # the search's tries, not its own "batch size N" (its margin's answer): one number for one question
        return f"{self.headline()}\nsearch: {self.search.tries_text()}"

    def _repr_html_(self) -> str:
        return f"<p><b>{escape(self.headline())}</b></p>{self.search._repr_html_(title='search: ' + self.search.tries_text())}"


def find_micro_batch(model: torch.nn.Module, plan: TrainPlan, *, margin: float = TIGHT_FRACTION) -> MicroBatch:
    """Measure the largest micro-batch a real training step (forward + backward at ``seq_len``) fits.

    The search is capped at ``plan.micro_batch`` when the plan has one (a choice made in
    :class:`~helpers.TrainPanel`: the most to try), else at ``plan.batch_size``. When
    that cap runs it is kept whole; after an out-of-memory try, ``margin`` of the largest size that
    ran (the margin guards the edge a search found; a cap that ran found none). Either is rounded
    down to a divisor of the effective batch, so micro-batch x accumulation is exactly the batch
    asked for. Set it on the plan with ``plan = plan.replace(micro_batch=mb.micro_batch)``.
    """
    need_model(model, "find_micro_batch")
    need_plan(plan, "find_micro_batch")
    number("margin", margin, low=0, high=1, low_open=True, error=FinetuneError)

    device = next(p for p in model.parameters()).device
    was_training = model.training
    model.train()

    precision = plan.resolved_precision()
    # Trainer runs fp16/bf16 under autocast; without it the activations of prepare_model_for_kbit_training's
    # fp32 layers stay fp32 and the search would settle for a smaller micro-batch than training needs
    autocast = (
        torch.autocast(device.type, dtype=torch.float16 if precision == FP16 else torch.bfloat16)
        if device.type == "cuda" and precision in (FP16, BF16)
        else contextlib.nullcontext()
    )

    def step(b: int) -> None:
        inputs = probe_batch(model, b, plan.seq_len, device)  # the family's inputs: mel frames, an image
        try:
            with autocast:
                loss = training_loss(model, inputs, plan)
            loss.backward()
        finally:
            model.zero_grad(set_to_none=True)

    limit = plan.micro_batch or plan.batch_size
    try:
        search = find_max_batch_size(step, limit=limit, margin=margin, key=_micro_batch_key(plan, precision, device),
                                     progress=True)  # fmt: skip
    finally:
        model.train(was_training)
    # the margin is headroom below a size that ran out of memory; when the limit itself ran there was none
    usable = search.max_ok if search.max_ok >= limit else search.batch_size
    micro = max(d for d in range(1, usable + 1) if plan.batch_size % d == 0)
    return MicroBatch(micro, plan.batch_size // micro, plan.batch_size, search)


def _micro_batch_key(plan: TrainPlan, precision: str, device: torch.device) -> tuple:
    """The search cache key: everything that changes a training step's memory (LoRA targets and
    dropout change what is adapted and saved for backward; precision the activations' size), and the
    limit, so a search stopped by a smaller one is not taken for the answer to a larger one."""
    targets = plan.targets if isinstance(plan.targets, str) else tuple(plan.targets)
    return ("qlora", plan.model, plan.load, plan.double_quant, plan.r, targets, plan.dropout, precision,
            plan.seq_len, plan.gradient_checkpointing, plan.micro_batch or plan.batch_size, str(device), plan.loss,
            plan.offload_activations)  # fmt: skip


# -- training ------------------------------------------------------------------------------------


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest *complete* ``checkpoint-N`` folder in ``output_dir`` (None when there is none).

    Incomplete or corrupted ones (a kill during the save) are passed over; see :mod:`helpers.training.checkpoints`.
    """
    return newest_complete(output_dir)


def make_trainer(model, tokenizer, plan: TrainPlan, dataset: list[dict], *, callbacks=(), **argument_overrides):
    """A ``Trainer`` for ``plan`` (needs ``plan.micro_batch``; see :func:`find_micro_batch`).

    Each checkpoint it saves is marked complete and stamped with the run's settings and a hash of
    ``dataset`` (see :func:`run_stamp`), which :func:`train` compares when it resumes.
    """
    return _trainer_and_stamp(model, tokenizer, plan, dataset, callbacks, argument_overrides)[0]


def training_loss(model, inputs: dict, plan: TrainPlan, num_items=None) -> torch.Tensor:
    """One forward pass's loss with the plan's reducers: the chunked loss (``plan.loss="chunked"``) and
    activation offload (``plan.offload_activations``); the model's own loss otherwise (Liger's fused one
    when ``"fused"``: TrainingArguments patches the model)."""
    with offload_activations(plan.offload_activations):
        if plan.loss == "chunked":
            rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "labels")}
            return chunked_lm_loss(model, inputs["input_ids"], inputs["labels"], num_items, **rest)
        kw = {} if num_items is None else {"num_items_in_batch": num_items}
        return model(**inputs, **kw).loss


def _reducing_trainer(base):
    """``Trainer`` whose loss runs through :func:`training_loss` (the plan's reducers)."""

    class ReducingTrainer(base):
        def __init__(self, *args, plan: TrainPlan, **kwargs):
            super().__init__(*args, **kwargs)
            self.plan = plan

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs or (self.plan.loss != "chunked" and not self.plan.offload_activations):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            items = num_items_in_batch if self.model_accepts_loss_kwargs else None
            return training_loss(model, inputs, self.plan, items)

    return ReducingTrainer


def _trainer_and_stamp(model, tokenizer, plan: TrainPlan, dataset, callbacks, overrides: dict) -> tuple[Any, dict]:
    from transformers import Trainer

    if plan.micro_batch is None:
        raise FinetuneError(
            "plan.micro_batch is not set: run find_micro_batch(model, plan) and "
            "plan = plan.replace(micro_batch=...) first (or set it by hand)"
        )
    if len(dataset) == 0:
        raise FinetuneError(
            "the dataset is empty: nothing to train on (check the data file and build_dataset's seq_len)"
        )
    first = dataset[0]
    if not isinstance(first, dict) or "labels" not in first or not {"input_ids", "input_features"} & set(first):
        raise FinetuneError(
            "the dataset holds raw rows, not tokenized examples: pass "
            "build_dataset(tokenizer, rows, plan.seq_len) (it adds input_ids and labels)"
        )
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a Whisper or VLM processor: its tokenizer pads
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    args = plan.training_arguments(**overrides)
    # Trainer's rotation deletes the oldest checkpoint before the newest is marked complete (a kill in
    # between left no usable one): the marker callback rotates instead, after the marker
    keep, args.save_total_limit = args.save_total_limit, None
    stamp = run_stamp(plan, args, dataset)
    stamp["base"] = weights_fingerprint(model)  # a resume onto other base weights at the same path is told
    trainer = _reducing_trainer(Trainer)(
        plan=plan,
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=lambda ex: collate(ex, pad),
        # the COMPLETE marker goes last, after everything is saved; it rotates the old ones after it
        callbacks=[*callbacks, complete_marker(stamp, keep)],
    )
    return trainer, stamp


def dataset_hash(dataset) -> str:
    """sha256 of every example's token ids and labels, in order: what training sees of the data."""
    h = hashlib.sha256()
    for example in dataset:
        for key in ("input_ids", "labels"):
            if key not in example:  # Whisper's examples are audio features (hashed below) and labels
                continue
            values = list(example[key])
            h.update(len(values).to_bytes(8, "little"))  # so [1, 2] + [3] differs from [1] + [2, 3]
            try:
                h.update(array.array("q", values).tobytes())
            except (TypeError, OverflowError):  # tensors, numpy ints: their text is still the same each time
                h.update(repr([int(v) for v in values]).encode())
        for key in ("input_features", "pixel_values"):  # what the encoder of Whisper or a VLM sees
            if key in example:
                h.update(torch.as_tensor(example[key]).float().numpy().tobytes())
    return h.hexdigest()


# what decides the adapter a run trains: a checkpoint written with other values is another run's
_STAMPED_PLAN = ("model", "load", "double_quant", "r", "alpha", "dropout", "targets", "seq_len", "packing")


def run_stamp(plan: TrainPlan, args, dataset) -> dict:
    """The settings and data a run trains with, as stored in each of its checkpoints (JSON-able).

    The micro-batch (measured; the effective batch is stamped), the output folder, save and log
    intervals and gradient checkpointing are left out: they change memory or bookkeeping, not the result.
    """
    stamped = {name: getattr(plan, name) for name in _STAMPED_PLAN}
    stamped["targets"] = stamped["targets"] if isinstance(stamped["targets"], str) else list(stamped["targets"])
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    steps = {"max_steps": args.max_steps} if args.max_steps > 0 else {"epochs": args.num_train_epochs}
    stamped.update(batch_size=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                   optimizer=str(getattr(args.optim, "value", args.optim)), precision=precision,
                   learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed, **steps)  # fmt: skip
    return {"plan": stamped, "dataset": {"examples": len(dataset), "sha256": dataset_hash(dataset)}}


def stamp_changes(old: dict | None, new: dict) -> list[str]:
    """What differs between the stamp a checkpoint holds and this run's, one phrase each ([] when none
    differs, or the checkpoint has no stamp: written before stamps existed)."""
    if not old:
        return []
    before, now = old.get("plan", {}), new["plan"]
    changes = [f"{k} {before[k]!r} -> {v!r}" for k, v in now.items() if k in before and before[k] != v]
    if old.get("base") not in (None, new.get("base")):
        changes.append(
            f"the base weights (fingerprint {old['base']} -> {new.get('base')}: other weights at the same path, "
            "replaced, re-downloaded or edited; the adapter was trained on the old ones)"
        )
    was, data = old.get("dataset", {}), new["dataset"]
    if was.get("sha256") not in (None, data["sha256"]):
        changes.append(
            f"the data ({was.get('examples')} examples, sha256 {str(was['sha256'])[:12]}) -> "
            f"({data['examples']} examples, sha256 {data['sha256'][:12]})"
        )
    return changes


@dataclass
class TrainResult:
    """What a (possibly resumed) run did."""

    output_dir: Path
    resumed_from: int | None
    global_step: int
    max_steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    log_history: list[dict] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # newer checkpoints passed over, and why
    set_aside: list[Skipped] = field(default_factory=list)  # an earlier run's checkpoints, moved (resume=False)
    changed: list[str] = field(default_factory=list)  # how the resumed checkpoint's settings or data differ
    finished_before: bool = False  # the checkpoint had reached max_steps: its adapter loaded, nothing trained
    progress: TrainProgress | None = None  # the live view's last update: peak reserved, share of the card, time

    @property
    def first_loss(self) -> float | None:
        return self.losses[0][1] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None

    def __str__(self) -> str:
        start = f"resumed at step {self.resumed_from}" if self.resumed_from else "started from scratch"
        done = f"trained to step {self.global_step} of {self.max_steps} ({start}) in {self.seconds:.1f} s"
        if self.finished_before:
            done = (
                f"already finished: the checkpoint of step {self.resumed_from} is the run's last (of {self.max_steps}), "
                "so its adapter is loaded into the model and nothing trained (raise max_steps or epochs to train "
                "on, or pass resume=False to start over)"
            )
        loss = (
            f"; loss {self.first_loss:.3f} (step {self.losses[0][0]}) -> {self.last_loss:.3f} "
            f"(step {self.losses[-1][0]})"
            if self.losses
            else ""
        )
        skipped = "".join(f"; skipped {s}" for s in self.skipped)
        if self.set_aside:
            n, names = len(self.set_aside), ", ".join(s.moved_to.name for s in self.set_aside if s.moved_to)
            skipped += f"; set aside the {n} checkpoint{'s' if n > 1 else ''} of an earlier run (kept as {names})"
        if self.changed:
            skipped += f"; the checkpoint was written with other settings or data: {', '.join(self.changed)}"
        # the live view ended with its summary (peak reserved, wall time; kept in .progress): not said twice
        return f"{done}{loss}; checkpoints in {self.output_dir}{skipped}"


def train(
    model, tokenizer, plan: TrainPlan, dataset: list[dict], *, callbacks=(), resume: bool = True,
    view: str | bool = "auto", **argument_overrides,
) -> TrainResult:  # fmt: skip
    """Train with ``Trainer``; continue from the newest complete checkpoint in the output folder when ``resume``.

    A checkpoint holds the adapter, optimizer, scheduler and RNG states, so a rerun after a
    disconnect continues at the step where it saved, with the same data order. A newer checkpoint
    that a kill left half written, or that is corrupted, is skipped with a :class:`CheckpointWarning`
    naming the file, and renamed ``incomplete-checkpoint-N`` (kept, not deleted); the skips are in
    ``TrainResult.skipped``. A lone checkpoint cut short is set aside the same way and training starts over;
    when several are there and none is complete, :class:`CheckpointError` says what to do.
    A complete checkpoint is then proven (:func:`helpers.training.checkpoint_proof.prove`): its adapter and
    optimizer/scheduler states must load as plain tensors, be finite and fit this model; one that does
    not is renamed ``unusable-checkpoint-N`` (its ``SET_ASIDE.txt`` says why) and the one before is
    used; when none is left, one :class:`CheckpointError` says so and the next run starts from scratch.

    A checkpoint that already reached ``max_steps`` (the run finished; the cell run again) is not
    trained further: its adapter is loaded into ``model`` and ``TrainResult.finished_before`` is set.
    Each checkpoint holds the run's settings and a hash of its data (:func:`run_stamp`); resuming
    from one written with others warns (:class:`CheckpointWarning`) and lists them in ``TrainResult.changed``.

    ``resume=False`` starts over: the folder's ``checkpoint-N`` are renamed ``previous-checkpoint-N``
    first (kept; listed in ``TrainResult.set_aside``), so a later resume continues this run, not theirs.

    ``view`` shows the run live (:class:`~helpers.TrainView`: step/total, ETA, loss, tokens/s,
    GPU memory against the card; an updating output in a notebook, text lines without one; ``"html"``,
    ``"text"``, or ``False`` for none; a ``TrainView`` among ``callbacks`` is used instead), and its last
    figures are ``TrainResult.progress``: peak reserved, share of the card, wall time.
    """
    from .view import TrainView

    need_model(model, "train")
    need_plan(plan, "train")
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a Whisper or VLM processor: its tokenizer pads
    need_tokenizer(tokenizer, "train")
    missing_row = token_ids_problem(model, tokenizer)
    if missing_row:  # else a raw IndexError from the embedding at the first padded batch
        raise FinetuneError(missing_row)
    if not isinstance(dataset, list | tuple) or not dataset or not all(isinstance(e, dict) for e in dataset):
        raise FinetuneError(f"dataset must be build_dataset()'s non-empty list of examples, got {dataset!r:.60}")
    keep_4bit_layout(model)
    shown = next((c for c in callbacks if isinstance(c, TrainView)), None)
    if shown is None and view:
        shown = TrainView("auto" if view is True else view)
        callbacks = [*callbacks, shown]
    trainer, stamp = _trainer_and_stamp(model, tokenizer, plan, dataset, callbacks, argument_overrides)
    if shown is not None:  # the view replaces Trainer's raw log dicts (disable_tqdm) or its bar
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        if shown.predicted_step is None:  # the plan's time beside the measured one
            shown.predicted_step = predicted_step_seconds(model, plan, trainer.args)

        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    out = Path(trainer.args.output_dir)
    point = _proven_resume(trainer.model, out, stamp) if resume else ResumePoint(None, None)
    # starting over: the earlier run's checkpoints must go out of Trainer's way (renamed, kept), or its
    # rotation by age keeps an old high-numbered one and the next resume continues the old run
    aside = [] if resume else set_aside_all(out, "an earlier run's checkpoint (resume=False starts over)")
    total = _total_steps(trainer.args, len(dataset))
    finished = point.checkpoint is not None and point.step >= total
    changed = stamp_changes(read_stamp(point.checkpoint), stamp) if point.checkpoint else []
    if changed:
        _warn_changed(point.checkpoint, out, changed, finished)
    if finished:  # Trainer would run one step past max_steps and rotate an older checkpoint out
        _load_checkpoint_weights(trainer, point.checkpoint)
        history = json.loads((point.checkpoint / "trainer_state.json").read_text(encoding="utf-8")).get(
            "log_history", []
        )
        losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
        return TrainResult(out, point.step, point.step, total, losses, 0.0, history, point.skipped, aside, changed,
                           finished_before=True)  # fmt: skip
    started = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=str(point.checkpoint) if point.checkpoint else None)
    except (OSError, RuntimeError) as e:
        if not write_failure(e):
            raise
        raise _disk_full(out, trainer.state.global_step, e) from e
    history = trainer.state.log_history
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    return TrainResult(out, point.step, trainer.state.global_step, trainer.state.max_steps, losses,
                       time.perf_counter() - started, history, point.skipped, aside, changed,
                       progress=shown.last if shown is not None else None)  # fmt: skip


def predicted_step_seconds(model, plan: TrainPlan, args) -> float | None:
    """Seconds per optimizer step the plan predicts here, at the micro-batch and accumulation Trainer runs
    (:func:`~helpers.estimator.timing.view_time`: this process's calibration, or the GPU's card figures); None
    where nothing can time it (an uncalibrated CPU, an unlisted GPU, a family the formulas lack)."""
    micro, accumulation = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    if time_basis("current") is None:  # nothing to time with: no estimate to make
        return None
    try:
        est = plan.replace(micro_batch=micro).estimate("current", model=getattr(model, "config", model))
    except (EstimateError, ValueError, TypeError, AttributeError, KeyError):
        return None
    t = view_time(est, batches=(1,), steps=accumulation, cached=True)
    return None if t is None or t.step_seconds is None else t.step_seconds * accumulation


def _disk_full(out: Path, step: int, error: BaseException) -> CheckpointWriteError:
    """A save that failed for want of space, in words: where, how much is free, what a rerun resumes from."""
    try:
        free = f"{shutil.disk_usage(out).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    last = newest_complete(out)
    then = f"a rerun resumes from {last.name}" if last else "no checkpoint is complete yet, so a rerun starts over"
    return CheckpointWriteError(
        f"the disk is full: saving the checkpoint of step {step} in {out} failed ({free}; "
        f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120] if str(error).strip() else error!r}). "
        f"Nothing saved before is lost: {then}. Free space (delete old checkpoints or files, empty the Drive "
        "trash), lower save_total_limit, or point output_dir at a disk with room, then run again"
    )


def _warn_changed(checkpoint: Path, out: Path, changed: list[str], finished: bool) -> None:
    """Resuming from a checkpoint written with other settings or data: say which, and what happens now."""
    then = (
        "it had finished, so nothing trains on the new ones: its adapter is loaded as it is"
        if finished
        else "training continues from it with the new ones"
    )
    warnings.warn(
        f"{checkpoint.name} in {out} was written with other settings or data: {'; '.join(changed)}. "
        f"{then.capitalize()}; pass resume=False to train from scratch (the old checkpoints are kept, renamed)",
        CheckpointWarning,
        stacklevel=3,  # the caller of train()
    )


_SHAPE_KEYS = ("model", "r", "targets")  # stamped settings that decide the adapter's and optimizer's shapes


def _proven_resume(model, out: Path, stamp: dict) -> ResumePoint:
    """The newest checkpoint whose files are whole *and* load into ``model`` (:func:`prove`).

    One that fails is renamed ``unusable-checkpoint-N`` with a file saying why, and the one before is
    tried; the next rerun therefore never meets the same broken checkpoint again. A checkpoint
    trained with other settings (its stamp differs) is not set aside: the plan is what changed.
    """
    point = find_resume(out)
    _set_aside_skipped(point, out)
    unusable: list[Skipped] = []
    while point.checkpoint is not None:
        why = prove(point.checkpoint, model)
        if why is None:
            break
        # another rank, targets or base explains a misfit: the plan changed, the checkpoint is fine
        changed = [c for c in stamp_changes(read_stamp(point.checkpoint), stamp) if c.split(" ")[0] in _SHAPE_KEYS]
        if changed:
            raise FinetuneError(
                f"{point.checkpoint} does not fit this run: {why}; it was trained with other settings "
                f"({'; '.join(changed)}). Pass resume=False to start over (it is kept, renamed), or train "
                "with the settings it was made with"
            )
        unusable.append(set_aside(Skipped(point.checkpoint, why), "unusable"))
        point = find_resume(out)
        _set_aside_skipped(point, out)
    for skip in unusable:
        instead = f"resuming from {point.checkpoint.name} instead" if point.checkpoint else "no earlier one is good"
        warnings.warn(
            f"{skip.path.name} in {out} cannot be resumed from: {skip}; {instead}", CheckpointWarning, stacklevel=3
        )
    if unusable and point.checkpoint is None:
        names = ", ".join(s.moved_to.name if s.moved_to else s.path.name for s in unusable)
        raise CheckpointError(
            f"no checkpoint in {out} can be resumed from: {unusable[0]}. Set aside as {names} (each holds "
            f"{WHY} saying why). Run again to train from scratch (or pass resume=False)"
        )
    point.skipped = unusable + point.skipped
    return point


def _set_aside_skipped(point: ResumePoint, out: Path) -> None:
    """Rename the checkpoints :func:`find_resume` passed over (kept) and warn about each."""
    for skip in point.skipped:
        set_aside(skip)
        kept = f" (the folder is kept as {skip.moved_to.name})" if skip.moved_to else ""
        instead = f"resuming from {point.checkpoint.name}" if point.checkpoint else "starting from scratch"
        warnings.warn(
            f"skipped {skip.path.name} in {out}: {skip.problem}; {instead} instead{kept}",
            CheckpointWarning,
            stacklevel=3,
        )


def _total_steps(args, examples: int) -> int:
    """The optimizer steps the run makes in all, as Trainer counts them (one process)."""
    if args.max_steps > 0:
        return args.max_steps
    per = args.per_device_train_batch_size
    batches = examples // per if args.dataloader_drop_last else math.ceil(examples / per)
    accumulation = args.gradient_accumulation_steps
    per_epoch = max(batches // accumulation + int(batches % accumulation > 0), 1)
    return math.ceil(args.num_train_epochs * per_epoch)


def _load_checkpoint_weights(trainer, folder: Path) -> None:
    """Put the trained weights of ``folder`` into the trainer's model (the adapter for a PEFT model)."""
    model = trainer.model
    if not hasattr(model, "peft_config"):
        trainer._load_from_checkpoint(str(folder))  # what Trainer runs on resume, for any other model
        return
    from peft import load_peft_weights, set_peft_model_state_dict

    try:
        loaded = set_peft_model_state_dict(model, load_peft_weights(str(folder)), adapter_name=model.active_adapter)
    except RuntimeError as e:  # a size mismatch: another rank
        raise FinetuneError(
            f"the adapter in {folder} does not fit this model's LoRA adapters ({str(e).splitlines()[-1].strip()}); "
            "its LoRA settings differ from the plan's: pass resume=False to start over (it is kept)"
        ) from None
    unexpected = list(getattr(loaded, "unexpected_keys", None) or [])
    if unexpected:
        raise FinetuneError(
            f"the adapter in {folder} has {len(unexpected)} weights this model has no place for (e.g. "
            f"{unexpected[0]}): its LoRA targets differ from the plan's; pass resume=False to start over (it is kept)"
        )
