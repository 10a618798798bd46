"""A kill at every file operation of a checkpoint save and its rotation leaves a run that resumes.

The run (fp32 LoRA on the tiny Llama, 7 steps, a checkpoint every 2, keep 1) is killed while it saves
checkpoint-6 and deletes checkpoint-4: once before each file operation (open for writing, write of a
tensor file, rename, delete, fsync, mkdir), and once with each tensor file cut in half as it was
written. Each kill happens in a forked copy of the test process (``os._exit``: no cleanup runs, as
when Colab's runtime dies); a second fork resumes and trains to the end. Its losses must be the
uninterrupted run's, step for step.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import sys
import traceback

import pytest
import torch
from transformers import TrainerCallback

from helpers.loading.loader import load
from helpers.training.adapters import prepare_qlora
from helpers.training.checkpoints import COMPLETE, checkpoint_folders, find_resume
from helpers.training.data import build_dataset, load_instructions
from helpers.training.finetune import train
from helpers.training.plan import TrainPlan

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="the kills run in forked processes"), pytest.mark.slow]

ROWS = load_instructions()[:24]
KILLED = 77  # the exit status of a child killed on purpose
SAVED_AT, LAST = 6, 7


def _plan(model, out):
    return TrainPlan(str(model), load="fp32", seq_len=64, batch_size=2, micro_batch=2, max_steps=LAST, save_steps=2,
                     save_total_limit=1, logging_steps=1, output_dir=str(out), learning_rate=1e-3, warmup_steps=0,
                     r=4, alpha=8)  # fmt: skip


class Ops:
    """Counts the file operations of a save (once armed) and kills the process at the ``kill_at``-th:
    before it, or (``torn``) right after a tensor file was written, with the file cut in half."""

    def __init__(self, kill_at: int | None = None, torn: bool = False):
        self.kill_at, self.torn, self.armed, self.count, self.log = kill_at, torn, False, 0, []

    def before(self, what: str) -> bool:
        if not self.armed:
            return False
        self.count += 1
        self.log.append(what)
        if self.count == self.kill_at and not self.torn:
            os._exit(KILLED)
        return self.count == self.kill_at  # torn: the caller writes, cuts, then exits

    def install(self) -> None:
        real_open, real_os_open, real_save = builtins.open, os.open, torch.save
        import peft.peft_model as peft_model

        real_safe = peft_model.safe_save_file

        def opened(file, mode="r", *a, **kw):
            if isinstance(mode, str) and set(mode) & set("wax+"):
                self.before(f"open {os.path.basename(str(file))}")
            return real_open(file, mode, *a, **kw)

        def os_opened(path, flags, *a, **kw):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                self.before(f"os.open {os.path.basename(str(path))}")
            return real_os_open(path, flags, *a, **kw)

        def tensor_file(real, name_at):
            def write(*a, **kw):
                path = str(a[name_at])
                cut = self.before(f"write {os.path.basename(path)}")
                out = real(*a, **kw)
                if cut:
                    with real_open(path, "r+b") as f:
                        f.truncate(os.path.getsize(path) // 2)
                    os._exit(KILLED)
                return out

            return write

        builtins.open = io.open = opened
        os.open = os_opened
        torch.save = tensor_file(real_save, 1)
        peft_model.safe_save_file = tensor_file(real_safe, 1)
        for name in ("replace", "rename", "unlink", "remove", "rmdir", "mkdir", "fsync"):
            setattr(os, name, self._counted(getattr(os, name), name))

    def _counted(self, real, name: str):
        def call(*a, **kw):
            self.before(name)
            return real(*a, **kw)

        return call


class Arm(TrainerCallback):
    """Arms the counter when step 6's save begins, disarms it when step 7 begins (its save is not counted)."""

    def __init__(self, ops: Ops):
        self.ops = ops

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == SAVED_AT:
            self.ops.armed = True

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == SAVED_AT:
            self.ops.armed = False


class StopAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt  # the pre-state: checkpoint-4 saved, step 5 never ran


_LOADED = {}


def _load(model_path) -> None:
    plan = _plan(model_path, "unused")
    model, tok, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    _LOADED[model_path] = model, tok, build_dataset(tok, ROWS, plan.seq_len)


def _train(model_path, out, **kw):
    """Train in ``out`` (in a forked child: it trains its own copy of the model the parent prepared)."""
    model, tok, data = _LOADED[model_path]
    return train(model, tok, _plan(model_path, out), data, view=False, **kw)


def _in_fork(fn) -> tuple[int, object]:
    """Run ``fn()`` in a forked child; (its exit status, what it returned, through a JSON file)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        status = 0
        try:
            torch.set_num_threads(1)
            data = json.dumps(fn()).encode()
        except BaseException:
            data = json.dumps({"error": traceback.format_exc()}).encode()
            status = 1
        with os.fdopen(w, "wb") as f:
            f.write(data)
        sys.stdout.flush()
        os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code, (json.loads(data) if data else None)


def _killed_run(model_path, out, kill_at, torn):
    ops = Ops(kill_at, torn)
    ops.install()
    result = _train(model_path, out, callbacks=[Arm(ops)])
    return {"count": ops.count, "log": ops.log, "step": result.global_step}


def _resumed(model_path, out):
    result = _train(model_path, out)
    return {"losses": result.losses, "from": result.resumed_from, "skipped": [str(s) for s in result.skipped]}


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """The uninterrupted run's losses, the folder as of checkpoint-4, and the save's operations."""
    root = tmp_path_factory.mktemp("kills")
    _load(tiny_llama)  # here, once: every fork starts from this copy of the prepared model
    code, reference = _in_fork(lambda: _resumed(tiny_llama, root / "reference"))
    assert code == 0, reference
    before = root / "before"
    code, got = _in_fork(lambda: _train(tiny_llama, before, callbacks=[StopAfter(4)]) and None)
    assert code == 1 and "KeyboardInterrupt" in got["error"]
    assert [f.name for f in checkpoint_folders(before)] == ["checkpoint-4"]  # checkpoint-2 rotated out
    code, counted = _in_fork(lambda: _killed_run(tiny_llama, shutil.copytree(before, root / "count"), None, False))
    assert code == 0 and counted["step"] == LAST, counted
    return dict(reference["losses"]), before, counted


def test_the_save_and_rotation_are_counted_operation_by_operation(runs):
    _, _, counted = runs
    log = counted["log"]
    # the tensor files, then the marker (written last), then checkpoint-4's deletion, renamed away first
    assert {"write adapter_model.safetensors", "write optimizer.pt", "write rng_state.pth"} <= set(log)
    marker = log.index(f"open .{COMPLETE}.tmp")
    assert max(i for i, op in enumerate(log) if op.startswith("write ")) < marker
    deletes = [i for i, op in enumerate(log) if op in ("unlink", "rmdir")]
    assert deletes and min(deletes) > log.index("replace", marker + 1) > marker, log
    assert counted["count"] >= 15


def test_a_kill_at_every_file_operation_of_a_save_and_rotation_resumes_with_the_reference_losses(
    runs, tiny_llama, tmp_path
):
    """Before: killed while Trainer deleted checkpoint-4 (after writing checkpoint-6, before its marker),
    resume found neither complete and stopped with CheckpointError; steps 7 on never ran."""
    reference, before, counted = runs
    assert sorted(reference) == list(range(1, LAST + 1))
    # an fsync changes nothing a killed process leaves behind (only what a power cut would): a kill before
    # one is the kill after the operation before it
    kills = [(k, False) for k, op in enumerate(counted["log"], start=1) if op != "fsync"]
    kills += [(k, True) for k, op in enumerate(counted["log"], start=1) if op.startswith("write ")]
    outcomes = {}
    for k, torn in kills:
        out = shutil.copytree(before, tmp_path / f"kill-{k}{'-torn' if torn else ''}")
        code, _ = _in_fork(lambda out=out, k=k, torn=torn: _killed_run(tiny_llama, out, k, torn))
        assert code == KILLED, (k, torn, counted["log"][k - 1])
        point = find_resume(out)  # the newest complete one: checkpoint-6 once its marker is in place, else 4
        assert point.checkpoint is not None, (k, counted["log"][k - 1])
        code, resumed = _in_fork(lambda out=out: _resumed(tiny_llama, out))
        assert code == 0, (k, torn, counted["log"][k - 1], resumed)
        losses = dict(resumed["losses"])
        assert sorted(losses) == sorted(reference), (k, losses)
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-4, abs=1e-4), (k, torn, step, losses, reference)
        outcomes[(k, torn)] = resumed["from"]
    assert set(outcomes.values()) == {4, SAVED_AT}  # the kills before the marker resume from 4, after it from 6
