"""Checkpoint markers that name files outside their folder, a disk that fills up during a save, and a pad
token the model has no row for (issue 48 item 5): each one clear error, never a hang or a raw traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
import transformers

from helpers.core.errors import EvalError
from helpers.evaluation.evaluate import safe_generate
from helpers.loading.loader import load
from helpers.training.adapters import prepare_qlora
from helpers.training.checkpoints import COMPLETE, CheckpointWriteError, find_resume, problem, rotate, write_failure
from helpers.training.data import build_dataset, load_instructions
from helpers.training.finetune import train
from helpers.training.plan import FinetuneError, TrainPlan

ROWS = load_instructions()[:8]


def _plan(model, out, **kw):
    base = dict(load="fp32", seq_len=64, batch_size=2, micro_batch=2, max_steps=2, save_steps=1, logging_steps=1,
                output_dir=str(out), r=4, alpha=8)  # fmt: skip
    return TrainPlan(str(model), **{**base, **kw})


def _prepared(plan):
    torch.set_num_threads(1)
    model, tok, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    return model, tok


@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory):
    """A run of 2 steps: checkpoint-1 and checkpoint-2, both complete."""
    out = tmp_path_factory.mktemp("saved") / "run"
    plan = _plan(tiny_llama, out)
    model, tok = _prepared(plan)
    train(model, tok, plan, build_dataset(tok, ROWS, plan.seq_len), view=False)
    return out


def _mark(folder, files):
    marker = json.loads((folder / COMPLETE).read_text())
    marker["files"].update(files)
    (folder / COMPLETE).write_text(json.dumps(marker))


@pytest.mark.parametrize(
    "name", ["../../../../dev/zero", "/dev/zero", "..", "sub/../../x", "link-to-zero", "fifo"]
)  # fmt: skip
def test_a_marker_naming_a_file_outside_its_folder_is_refused_unread(saved, tmp_path, name):
    """Before: a marker naming ../../dev/zero hung resume (hashing an endless file), and the sizes of files
    outside the folder appeared in the warning."""
    out = shutil.copytree(saved, tmp_path / "run")
    newest = out / "checkpoint-2"
    if name == "link-to-zero":
        (newest / name).symlink_to("/dev/zero")
    if name == "fifo":
        os.mkfifo(newest / name)
    _mark(newest, {name: 123})
    found = problem(newest)
    assert found and f"{COMPLETE} names" in found and "123" not in found.replace(f"{COMPLETE} names", "")
    assert "not a file name inside" in found or "not a regular file" in found
    point = find_resume(out)  # returns at once: nothing outside was opened
    assert point.checkpoint.name == "checkpoint-1" and point.skipped[0].path.name == "checkpoint-2"


def test_a_full_disk_during_a_save_is_one_clear_error(tiny_llama, tmp_path, monkeypatch):
    """Before: a raw torch "enforce fail ... unexpected pos" that never said the disk was full."""
    plan = _plan(tiny_llama, tmp_path / "run", max_steps=3)
    model, tok = _prepared(plan)
    data = build_dataset(tok, ROWS, plan.seq_len)
    save = transformers.Trainer._save_optimizer_and_scheduler
    kinds = {
        "OSError ENOSPC": OSError(errno.ENOSPC, "No space left on device"),
        "torch's zip writer": RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 7424 vs 7312"),
    }
    for kind, error in kinds.items():

        def full(self, output_dir, error=error):
            if self.state.global_step == 2:
                raise error
            return save(self, output_dir)

        monkeypatch.setattr(transformers.Trainer, "_save_optimizer_and_scheduler", full)
        with pytest.raises(CheckpointWriteError, match=r"the disk is full: saving the checkpoint of step 2") as caught:
            train(model, tok, plan, data, view=False, resume=False)
        message = str(caught.value)
        assert "MiB free" in message and "a rerun resumes from checkpoint-1" in message, kind
        assert "Free space" in message and isinstance(caught.value, OSError)
    assert write_failure(kinds["OSError ENOSPC"]) and not write_failure(RuntimeError("shape mismatch"))
    monkeypatch.undo()
    again = train(model, tok, plan, data, view=False)  # nothing lost: it resumes
    assert again.resumed_from == 1 and again.global_step == 3


def test_a_pad_token_added_without_resizing_is_a_clear_error(tiny_llama, tmp_path):
    """Before: a raw IndexError (index out of range in self) from the embedding, in generate and in training."""
    plan = _plan(tiny_llama, tmp_path / "run")
    model, tok, _ = load(plan.load_plan())
    rows = model.get_input_embeddings().num_embeddings
    tok.add_special_tokens({"pad_token": "[PAD]"})
    assert tok.pad_token_id >= rows
    with pytest.raises(EvalError, match=r"pad token '\[PAD\]' is id \d+, but the model's embedding has \d+ rows.*"
                                        r"resize_token_embeddings"):  # fmt: skip
        safe_generate(model, tok, ["hello"], max_new_tokens=2, results=tmp_path / "r.jsonl", progress=False)
    assert not (tmp_path / "r.jsonl").exists()
    model, _ = prepare_qlora(model, plan)
    with pytest.raises(FinetuneError, match=r"pad token '\[PAD\]'.*tokenizer.pad_token = tokenizer.eos_token"):
        train(model, tok, plan, build_dataset(tok, ROWS, plan.seq_len), view=False)


def test_rotation_keeps_a_folder_it_cannot_rename_and_never_deletes_before_the_marker(saved, tmp_path, monkeypatch):
    out = shutil.copytree(saved, tmp_path / "run")
    (out / "checkpoint-2" / COMPLETE).unlink()  # the newest is not marked: nothing may go
    assert rotate(out, 1, 2) == [] and (out / "checkpoint-1").is_dir()
    shutil.copy(saved / "checkpoint-2" / COMPLETE, out / "checkpoint-2" / COMPLETE)

    def refuse(*a, **kw):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", refuse)
        assert rotate(out, 1, 2) == [] and (out / "checkpoint-1").is_dir()  # kept; training goes on
    assert rotate(out, 1, 2) == [out / "checkpoint-1"] and not (out / "checkpoint-1").exists()
    assert not list(out.glob(".removing-*")) and find_resume(out).checkpoint.name == "checkpoint-2"
