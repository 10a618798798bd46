"""A kill at every file operation of a checkpoint save and its rotation leaves a run that resumes.

The run (fp32 LoRA on the tiny Llama, 7 steps, a checkpoint every 2, keep 1) is killed while it saves
checkpoint-6 and deletes checkpoint-4: once before each file operation (open for writing, write of a
tensor file, rename, delete, fsync, mkdir), and once with each tensor file cut in half as it was
written. A kill (``os._exit`` in a forked copy of the test process: no cleanup runs, as when Colab's
runtime dies) leaves the folder as it is on disk at that moment, so one run copies its folder at every
operation instead of being killed once per operation (the copies are checked against real kills, file
by file); each copy is put back in the run's folder and a fork resumes it and trains to the end. Its
losses must be the uninterrupted run's, step for step.
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
    before it, or (``torn``) right after a tensor file was written, with the file cut in half. With
    ``copies``, it copies the run's folder ``out`` instead, as a kill before each operation (but an fsync)
    and after each tensor file write, cut, would leave it: ``copies/kill-<n>[-torn]``."""

    def __init__(self, kill_at: int | None = None, torn: bool = False, out=None, copies=None):
        self.kill_at, self.torn, self.armed, self.count, self.log = kill_at, torn, False, 0, []
        self.out, self.copies = out, copies

    def before(self, what: str) -> bool:
        if not self.armed:
            return False
        self.count += 1
        self.log.append(what)
        if self.copies is not None and what != "fsync":  # a kill before an fsync is the kill after the op before
            self.copy(f"kill-{self.count}")
        if self.count == self.kill_at and not self.torn:
            os._exit(KILLED)
        return self.count == self.kill_at  # torn: the caller writes, cuts, then exits

    def after_write(self, path: str, cut: bool) -> None:
        """A tensor file was written: cut it and exit (``cut``), or copy the folder with it cut."""
        if cut:
            with self.real_open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            os._exit(KILLED)
        if self.copies is not None and self.armed:
            copy = self.copy(f"kill-{self.count}-torn")
            with self.real_open(copy / os.path.relpath(path, self.out), "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)

    def copy(self, name: str):
        armed, self.armed = self.armed, False  # the copy's own file operations are not the save's
        try:
            return shutil.copytree(self.out, self.copies / name)
        finally:
            self.armed = armed

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
                self.after_write(path, cut)
                return out

            return write

        self.real_open = real_open
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


def _killed_run(model_path, out, kill_at=None, torn=False, copies=None):
    ops = Ops(kill_at, torn, out, copies)
    ops.install()
    result = _train(model_path, out, callbacks=[Arm(ops)])
    return {"count": ops.count, "log": ops.log, "step": result.global_step}


def _resumed(model_path, out):
    result = _train(model_path, out)
    return {"losses": result.losses, "from": result.resumed_from, "skipped": [str(s) for s in result.skipped]}


def _put_back(folder, out):
    """``out`` as ``folder`` is: the copies resume where the run that left them was killed (same paths)."""
    shutil.rmtree(out, ignore_errors=True)
    return shutil.copytree(folder, out)


def _files(folder) -> dict[str, object]:
    """Each file's bytes; Trainer's state without the wall-clock figures it logs (runtime, per second)."""

    def content(f):
        if f.name != "trainer_state.json":
            return f.read_bytes()
        state = json.loads(f.read_bytes())
        for entry in state.get("log_history", []):
            for key in [k for k in entry if k.endswith(("_runtime", "_per_second"))]:
                del entry[key]
        return state

    return {str(f.relative_to(folder)): content(f) for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """The uninterrupted run's losses, the folder as of checkpoint-4, the save's operations, and the
    folder as a kill at each of them leaves it."""
    root = tmp_path_factory.mktemp("kills")
    _load(tiny_llama)  # here, once: every fork starts from this copy of the prepared model
    code, reference = _in_fork(lambda: _resumed(tiny_llama, root / "reference"))
    assert code == 0, reference
    before = root / "before"
    code, got = _in_fork(lambda: _train(tiny_llama, before, callbacks=[StopAfter(4)]) and None)
    assert code == 1 and "KeyboardInterrupt" in got["error"]
    assert [f.name for f in checkpoint_folders(before)] == ["checkpoint-4"]  # checkpoint-2 rotated out
    out, copies = root / "run", root / "copies"
    copies.mkdir()
    code, counted = _in_fork(lambda: _killed_run(tiny_llama, _put_back(before, out), copies=copies))
    assert code == 0 and counted["step"] == LAST, counted
    return dict(reference["losses"]), before, counted, out, copies


def test_the_save_and_rotation_are_counted_operation_by_operation(runs):
    _, _, counted, _, copies = runs
    log = counted["log"]
    # the tensor files, then the marker (written last), then checkpoint-4's deletion, renamed away first
    assert {"write adapter_model.safetensors", "write optimizer.pt", "write rng_state.pth"} <= set(log)
    marker = log.index(f"open .{COMPLETE}.tmp")
    assert max(i for i, op in enumerate(log) if op.startswith("write ")) < marker
    deletes = [i for i, op in enumerate(log) if op in ("unlink", "rmdir")]
    assert deletes and min(deletes) > log.index("replace", marker + 1) > marker, log
    assert counted["count"] >= 15
    # one copy of the folder per kill: before each operation but the fsyncs, and each tensor file cut
    kills = {f"kill-{k}" for k, op in enumerate(log, start=1) if op != "fsync"}
    kills |= {f"kill-{k}-torn" for k, op in enumerate(log, start=1) if op.startswith("write ")}
    assert {c.name for c in copies.iterdir()} == kills


@pytest.mark.parametrize("which", ["marker", "torn"])
def test_a_copy_is_what_a_real_kill_there_leaves(runs, tiny_llama, which):
    """The copies stand for kills: a forked run killed for real (``os._exit``) before the marker is
    written, and right after the first tensor file is written and cut, leaves the same files, byte for byte
    (but the timings Trainer logs)."""
    _, before, counted, out, copies = runs
    log = counted["log"]
    k = log.index(f"open .{COMPLETE}.tmp") + 1 if which == "marker" else next(
        i for i, op in enumerate(log, start=1) if op.startswith("write "))  # fmt: skip
    torn = which == "torn"
    code, _ = _in_fork(lambda: _killed_run(tiny_llama, _put_back(before, out), k, torn))
    assert code == KILLED, (k, torn, log[k - 1])
    killed, copied = _files(out), _files(copies / f"kill-{k}{'-torn' if torn else ''}")
    assert killed.keys() == copied.keys()
    assert [name for name in killed if killed[name] != copied[name]] == []


def test_a_kill_at_every_file_operation_of_a_save_and_rotation_resumes_with_the_reference_losses(runs, tiny_llama):
    """Before: killed while Trainer deleted checkpoint-4 (after writing checkpoint-6, before its marker),
    resume found neither complete and stopped with CheckpointError; steps 7 on never ran."""
    reference, _, counted, out, copies = runs
    assert sorted(reference) == list(range(1, LAST + 1))
    outcomes = {}
    for copy in sorted(copies.iterdir(), key=lambda c: (int(c.name.split("-")[1]), c.name)):
        k, torn = int(copy.name.split("-")[1]), copy.name.endswith("-torn")
        _put_back(copy, out)
        point = find_resume(out)  # the newest complete one: checkpoint-6 once its marker is in place, else 4
        assert point.checkpoint is not None, (k, counted["log"][k - 1])
        code, resumed = _in_fork(lambda: _resumed(tiny_llama, out))
        assert code == 0, (k, torn, counted["log"][k - 1], resumed)
        losses = dict(resumed["losses"])
        assert sorted(losses) == sorted(reference), (k, losses)
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-4, abs=1e-4), (k, torn, step, losses, reference)
        outcomes[(k, torn)] = resumed["from"]
    assert set(outcomes.values()) == {4, SAVED_AT}  # the kills before the marker resume from 4, after it from 6
