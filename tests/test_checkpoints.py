"""Checkpoints a kill or a corruption cannot turn into a crash loop or a silent fresh state.

One real tiny run (fp32 LoRA on the tiny Llama, 5 steps, a checkpoint at each) is the reference;
each test copies its folder, breaks the newest checkpoints the way a killed Colab runtime or a bad
Drive sync does, and resumes.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import transformers
from peft import get_peft_model_state_dict, load_peft_weights

from helpers.loading.loader import load
from helpers.training.adapters import prepare_qlora  # fmt: skip
from helpers.training.checkpoints import (
    COMPLETE,
    RUN,
    CheckpointError,
    CheckpointWarning,
    checkpoint_folders,
    find_resume,
    problem,
)
from helpers.training.data import build_dataset, load_instructions
from helpers.training.finetune import last_checkpoint, make_trainer, train
from helpers.training.plan import TrainPlan

ROWS = load_instructions()[:24]


def _plan(model, out, **kw):
    base = dict(load="fp32", seq_len=64, batch_size=2, micro_batch=2, max_steps=5, save_steps=1,
                save_total_limit=10, logging_steps=1, output_dir=str(out), learning_rate=1e-3, warmup_steps=0,
                r=4, alpha=8)  # fmt: skip
    return TrainPlan(str(model), **{**base, **kw})


def _run(plan, **kw):
    model, tok, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    return train(model, tok, plan, build_dataset(tok, ROWS, plan.seq_len), **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    """The uninterrupted run: its folder (checkpoint-1 .. checkpoint-5) and its losses."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = _run(_plan(tiny_llama, out))
    assert [s for s, _ in result.losses] == [1, 2, 3, 4, 5]
    return out, dict(result.losses)


def _cut_at_3(reference, tmp_path):
    """A copy of the run as if killed after saving checkpoint-3: checkpoints 1, 2, 3."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    shutil.rmtree(out / "checkpoint-4")
    shutil.rmtree(out / "checkpoint-5")
    return out


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_a_byte(path):
    """Garble one byte of a tensor's data: same size, and torch.load would not notice."""
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_state(folder, change):
    state = json.loads((folder / "trainer_state.json").read_text())
    change(state)
    (folder / "trainer_state.json").write_text(json.dumps(state))


def _empty(folder):
    shutil.rmtree(folder)
    folder.mkdir()


CORRUPTIONS = {  # kind -> (what it does to checkpoint-3, what the message must say)
    "empty folder": (_empty, "the folder is empty"),
    "empty trainer_state.json": (lambda f: (f / "trainer_state.json").write_text(""), "trainer_state.json is empty"),
    "garbled trainer_state.json": (
        lambda f: (f / "trainer_state.json").write_text('{"global_st'),
        "trainer_state.json is not valid JSON",
    ),
    "no global_step": (lambda f: _rewrite_state(f, lambda s: s.pop("global_step")), "trainer_state.json has no global_step"),
    "truncated optimizer.pt": (lambda f: _truncate(f / "optimizer.pt"), "optimizer.pt is truncated"),
    "garbled optimizer.pt": (lambda f: _flip_a_byte(f / "optimizer.pt"), "optimizer.pt is corrupted"),
    "truncated adapter": (
        lambda f: _truncate(f / "adapter_model.safetensors", 0.9),
        "adapter_model.safetensors is truncated",
    ),
    "missing optimizer.pt": (lambda f: (f / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    "missing scheduler.pt": (lambda f: (f / "scheduler.pt").unlink(), "scheduler.pt is missing"),
    "missing rng_state.pth": (lambda f: (f / "rng_state.pth").unlink(), "rng_state.pth is missing"),
    "missing adapter_config.json": (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json is missing"),
    "garbled adapter_config.json": (
        lambda f: (f / "adapter_config.json").write_bytes(b"\xff\xfe{"),
        "adapter_config.json is not valid JSON",
    ),
    "killed before the marker": (lambda f: (f / COMPLETE).unlink(), f"no {COMPLETE} marker"),
}  # fmt: skip


def test_every_saved_checkpoint_is_marked_complete(reference):
    out, _ = reference
    assert [f.name for f in checkpoint_folders(out)] == [f"checkpoint-{n}" for n in (5, 4, 3, 2, 1)]
    for folder in checkpoint_folders(out):
        marker = json.loads((folder / COMPLETE).read_text())
        assert marker["global_step"] == int(folder.name.split("-")[1])
        assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "adapter_model.safetensors"} <= set(marker["files"])
        assert RUN in marker["files"]  # the run's stamp is written before the marker, which vouches for it
        stamp = json.loads((folder / RUN).read_text())
        assert stamp["plan"]["learning_rate"] == 1e-3 and stamp["dataset"]["examples"] == len(ROWS)
        assert problem(folder) is None
    assert last_checkpoint(out).name == "checkpoint-5"


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_broken_newest_checkpoint_is_skipped_with_the_file_named(reference, tmp_path, kind):
    out = _cut_at_3(reference, tmp_path)
    corrupt, says = CORRUPTIONS[kind]
    corrupt(out / "checkpoint-3")
    point = find_resume(out)
    assert point.checkpoint.name == "checkpoint-2" and point.step == 2
    assert [s.path.name for s in point.skipped] == ["checkpoint-3"]
    assert says in point.skipped[0].problem
    assert last_checkpoint(out).name == "checkpoint-2"


@pytest.mark.parametrize("kind", [k for k in CORRUPTIONS if k != "killed before the marker"])
def test_checkpoints_saved_before_the_marker_existed_are_validated_file_by_file(reference, tmp_path, kind):
    out = _cut_at_3(reference, tmp_path)
    for marker in out.glob(f"checkpoint-*/{COMPLETE}"):
        marker.unlink()
    assert find_resume(out).checkpoint.name == "checkpoint-3"  # whole files: an older run's checkpoints count
    corrupt, says = CORRUPTIONS[kind]
    corrupt(out / "checkpoint-3")
    point = find_resume(out)
    assert point.checkpoint.name == "checkpoint-2" and says in point.skipped[0].problem


def test_a_file_changed_after_the_save_is_caught_by_the_marker(reference, tmp_path):
    out = _cut_at_3(reference, tmp_path)
    with (out / "checkpoint-3" / "trainer_state.json").open("a") as f:
        f.write("\n")  # still valid JSON, but not what the save wrote
    point = find_resume(out)
    assert point.step == 2 and "trainer_state.json is" in point.skipped[0].problem
    assert "the save wrote" in point.skipped[0].problem


@pytest.mark.parametrize(
    "kind",
    [
        "empty folder",
        "garbled trainer_state.json",
        "no global_step",
        "truncated optimizer.pt",
        "garbled optimizer.pt",
        "truncated adapter",
        "missing optimizer.pt",
        "missing scheduler.pt",
        "killed before the marker",
    ],
)
def test_train_resumes_from_the_previous_complete_checkpoint(reference, tiny_llama, tmp_path, kind):
    """Before: a raw traceback on every rerun, or a silent fresh optimizer/scheduler (another loss curve)."""
    out = _cut_at_3(reference, tmp_path)
    corrupt, says = CORRUPTIONS[kind]
    corrupt(out / "checkpoint-3")
    with pytest.warns(CheckpointWarning, match=f"skipped checkpoint-3 in .*{says}.*resuming from checkpoint-2"):
        result = _run(_plan(tiny_llama, out))
    assert result.resumed_from == 2 and result.global_step == 5
    assert [s.path.name for s in result.skipped] == ["checkpoint-3"] and says in result.skipped[0].problem
    assert "skipped checkpoint-3 (moved to incomplete-checkpoint-3)" in str(result)
    losses = dict(result.losses)
    assert list(losses) == [1, 2, 3, 4, 5]
    # the optimizer and scheduler states came back: the same curve as the uncut run (a fresh optimizer at
    # step 3, as resuming from checkpoint-3 without optimizer.pt gives, changes the loss from step 5 on)
    for step in (3, 4, 5):
        assert losses[step] == pytest.approx(reference[1][step], rel=1e-4, abs=1e-4), (step, losses, reference[1])
    assert (out / "incomplete-checkpoint-3").is_dir()  # kept, not deleted, out of Trainer's way
    assert all(problem(out / f"checkpoint-{n}") is None for n in (3, 4, 5))


class Killed(BaseException):
    """The runtime dying: nothing in Trainer catches it."""


def _kill_while_saving(monkeypatch, step):
    """Die after the adapter of checkpoint-<step> is written, before its optimizer state."""
    save = transformers.Trainer._save_optimizer_and_scheduler

    def dying(self, output_dir):
        if self.state.global_step == step:
            raise Killed
        return save(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, "_save_optimizer_and_scheduler", dying)


def test_a_kill_during_the_save_resumes_from_the_checkpoint_before(tiny_llama, tmp_path, monkeypatch):
    plan = _plan(tiny_llama, tmp_path / "run")
    _kill_while_saving(monkeypatch, 3)
    with pytest.raises(Killed):
        _run(plan)
    half = tmp_path / "run" / "checkpoint-3"
    assert (half / "adapter_model.safetensors").exists() and not (half / COMPLETE).exists()
    monkeypatch.undo()
    with pytest.warns(CheckpointWarning, match="checkpoint-3 .*optimizer.pt is missing.*resuming from checkpoint-2"):
        again = _run(plan)
    assert again.resumed_from == 2 and again.global_step == 5


def test_saving_over_an_old_checkpoint_drops_its_marker_first(reference, tiny_llama, tmp_path, monkeypatch):
    """A new run in an old run's folder through a bare Trainer (train(resume=False) moves the old ones aside
    first), killed while overwriting checkpoint-3: the old marker must not make the mix of new adapter and
    old optimizer look whole."""
    out = _cut_at_3(reference, tmp_path)
    _kill_while_saving(monkeypatch, 3)
    plan = _plan(tiny_llama, out, learning_rate=5e-4)
    model, tok, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    with pytest.raises(Killed):
        make_trainer(model, tok, plan, build_dataset(tok, ROWS, plan.seq_len)).train()
    assert not (out / "checkpoint-3" / COMPLETE).exists()
    point = find_resume(out)
    assert point.checkpoint.name == "checkpoint-2" and f"no {COMPLETE} marker" in point.skipped[0].problem


def test_a_cut_short_first_checkpoint_is_set_aside_and_training_starts_over(reference, tiny_llama, tmp_path):
    """The runtime died while Drive was writing the first checkpoint: no step can be resumed, so starting
    over loses nothing (it raised CheckpointError, asking the user to pass resume=False or delete it)."""
    out = tmp_path / "run"
    shutil.copytree(reference[0] / "checkpoint-1", out / "checkpoint-1")
    (out / "checkpoint-1" / "optimizer.pt").unlink()
    point = find_resume(out)
    assert point.checkpoint is None and [s.path.name for s in point.skipped] == ["checkpoint-1"]
    with pytest.warns(CheckpointWarning, match="skipped checkpoint-1 .*optimizer.pt is missing.*starting from scratch"):
        result = _run(_plan(tiny_llama, out, max_steps=2))
    assert result.resumed_from is None and result.global_step == 2
    assert (out / "incomplete-checkpoint-1" / "adapter_model.safetensors").exists()  # kept, not deleted
    assert problem(out / "checkpoint-1") is None  # written afresh by the new run


def test_starting_over_sets_the_earlier_runs_checkpoints_aside(reference, tiny_llama, tmp_path):
    """resume=False in a folder an earlier run used: its checkpoints are renamed, not left for Trainer's
    rotation (by age, so an old high-numbered one survived) and the next resume (it continued the old run
    at step 5 instead of the new one at step 2)."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)  # the earlier run: checkpoint-1 .. checkpoint-5
    result = _run(_plan(tiny_llama, out, max_steps=2, learning_rate=5e-4), resume=False)
    assert result.global_step == 2 and result.resumed_from is None
    assert [f.name for f in checkpoint_folders(out)] == ["checkpoint-2", "checkpoint-1"]  # the new run's only
    assert find_resume(out).step == 2
    moved = [f"previous-checkpoint-{n}" for n in (5, 4, 3, 2, 1)]
    assert [s.moved_to.name for s in result.set_aside] == moved
    assert all(problem(out / name) is None for name in moved)  # kept whole, never deleted
    assert "set aside the 5 checkpoints of an earlier run (kept as previous-checkpoint-5, " in str(result)
    again = _run(_plan(tiny_llama, out, max_steps=2, learning_rate=5e-4), resume=False)  # and once more
    assert [s.moved_to.name for s in again.set_aside] == ["previous-checkpoint-2-2", "previous-checkpoint-1-2"]


def _adapter(model) -> dict:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_a_finished_run_run_again_loads_its_adapter_and_trains_nothing(reference, tiny_llama, tmp_path):
    """Resuming from checkpoint-5 of a 5-step run ran a sixth step (and could rotate an older checkpoint
    out); now the trained adapter is loaded into the model and nothing trains."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    plan = _plan(tiny_llama, out)
    model, tok, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    untrained = _adapter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # same settings and data: nothing to warn about
        result = train(model, tok, plan, build_dataset(tok, ROWS, plan.seq_len))
    assert (result.resumed_from, result.global_step, result.max_steps) == (5, 5, 5) and result.finished_before
    assert "already finished" in str(result) and "nothing trained" in str(result)
    assert dict(result.losses) == reference[1]  # the finished run's curve, from its checkpoint
    assert [f.name for f in checkpoint_folders(out)] == [f"checkpoint-{n}" for n in (5, 4, 3, 2, 1)]
    saved = load_peft_weights(str(out / "checkpoint-5"), device="cpu")
    loaded = _adapter(model)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert any(not torch.equal(loaded[k], untrained[k]) for k in saved)


def test_an_epoch_based_run_run_again_is_finished_too(tiny_llama, tmp_path):
    plan = _plan(tiny_llama, tmp_path / "run", max_steps=0, epochs=0.25, save_steps=2)  # 12 batches: 3 steps
    first = _run(plan)
    assert first.global_step == 3
    again = _run(plan)
    assert again.global_step == 3 and again.max_steps == 3 and again.finished_before


def test_resuming_with_other_settings_or_data_says_what_changed(reference, tiny_llama, tmp_path):
    """A checkpoint holds the settings and a hash of the data it was trained on; resuming with others
    continued silently (and a finished run ignored new data without a word)."""
    out = _cut_at_3(reference, tmp_path)
    plan = _plan(tiny_llama, out, learning_rate=5e-4)
    model, tok, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    data = build_dataset(tok, load_instructions()[24:48], plan.seq_len)
    with pytest.warns(CheckpointWarning, match=r"checkpoint-3 .*learning_rate 0\.001 -> 0\.0005; the data \(24 ex"):
        result = train(model, tok, plan, data)
    assert result.resumed_from == 3 and result.global_step == 5 and not result.finished_before
    assert result.changed[0] == "learning_rate 0.001 -> 0.0005" and result.changed[1].startswith("the data (24")
    assert "written with other settings or data: learning_rate 0.001 -> 0.0005" in str(result)


def test_no_complete_checkpoint_is_one_clear_error(reference, tiny_llama, tmp_path):
    out = _cut_at_3(reference, tmp_path)
    (out / "checkpoint-3" / "optimizer.pt").unlink()
    (out / "checkpoint-2" / "trainer_state.json").write_text("")
    _empty(out / "checkpoint-1")
    with pytest.raises(CheckpointError) as e:
        _run(_plan(tiny_llama, out))
    msg = str(e.value)
    assert "\n" not in msg and "checkpoint-3: optimizer.pt is missing" in msg
    assert "the 2 older ones are not complete either" in msg
    assert "pass resume=False to start over (the checkpoints are kept" in msg and str(out / "checkpoint-3") in msg
    assert (out / "checkpoint-3").is_dir()  # nothing moved or deleted when nothing can be resumed
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        fresh = _run(_plan(tiny_llama, out, max_steps=1), resume=False)
    assert fresh.resumed_from is None and fresh.global_step == 1
    assert (out / "previous-checkpoint-3" / "scheduler.pt").exists()  # started over; the broken ones are kept
    assert problem(out / "checkpoint-1") is None


# ---------------------------------------------------------------------------------------------
# issue 31 item 2: whole files that do not load (or load wrong) are proven bad before a resume


def _remark(folder):
    """The marker rewritten over the damaged files: whole, sized as listed; only loading them tells."""
    from helpers.training.checkpoints import mark_complete

    (folder / COMPLETE).unlink()
    mark_complete(folder, int(folder.name.split("-")[1]))


def _rewrite_adapter(folder, change):
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({k: change(v) for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})


def _other_models_optimizer(folder):
    opt = torch.load(folder / "optimizer.pt", weights_only=True)
    for entry in opt["state"].values():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim():
                entry[k] = torch.zeros((v.shape[0] * 2, *v.shape[1:]), dtype=v.dtype)  # another width
    torch.save(opt, folder / "optimizer.pt")


def _swap(folder):
    a, b = folder / "optimizer.pt", folder / "scheduler.pt"
    tmp = folder / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


class _RunsCode:
    """A pickle that runs a shell command when loaded (what a hostile checkpoint would hold)."""

    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.flag}",)


UNLOADABLE = {  # kind -> (what it does to checkpoint-3, what the reason must say)
    "another model's optimizer.pt": (_other_models_optimizer, "optimizer.pt holds state shaped"),
    "swapped optimizer/scheduler": (_swap, "optimizer.pt holds a learning-rate scheduler's state"),
    "code-running pickle": (
        lambda f: torch.save(_RunsCode(f.parent / "RAN"), f / "optimizer.pt"),
        "optimizer.pt is not plain tensor data",
    ),
    "all-NaN adapter": (
        lambda f: _rewrite_adapter(f, lambda t: torch.full_like(t, float("nan"))),
        "values in .* are NaN or infinite",
    ),
    "adapter shaped for another model": (
        lambda f: _rewrite_adapter(f, lambda t: torch.zeros((t.shape[0] + 1, *t.shape[1:]))),
        "adapter_model.safetensors is shaped for another model",
    ),
}


@pytest.mark.parametrize("kind", UNLOADABLE)
def test_a_checkpoint_that_does_not_load_is_set_aside_and_the_one_before_resumed(reference, tiny_llama, tmp_path, kind):
    """Before: the same raw error on every rerun, a code-running pickle loaded, or a silent wrong resume."""
    out = _cut_at_3(reference, tmp_path)
    corrupt, says = UNLOADABLE[kind]
    corrupt(out / "checkpoint-3")
    _remark(out / "checkpoint-3")
    assert find_resume(out).checkpoint.name == "checkpoint-3"  # whole files: only loading them tells
    with pytest.warns(
        CheckpointWarning, match=f"checkpoint-3 in .*cannot be resumed from: .*{says}.*resuming from checkpoint-2"
    ):
        result = _run(_plan(tiny_llama, out))
    assert not (out / "RAN").exists(), "the pickle's code ran"
    assert result.resumed_from == 2 and result.global_step == 5
    assert result.skipped[0].moved_to.name == "unusable-checkpoint-3"
    import re

    assert re.search(says, (out / "unusable-checkpoint-3" / "SET_ASIDE.txt").read_text())
    losses = dict(result.losses)
    for step in (3, 4, 5):
        assert losses[step] == pytest.approx(reference[1][step], rel=1e-4, abs=1e-4), (step, losses, reference[1])


def _rewrite_torch(path, change):
    data = torch.load(path, weights_only=True)
    change(data)
    torch.save(data, path)


def _rewrite_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _nan_moments(opt):
    for entry in opt["state"].values():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim():
                entry[k] = torch.full_like(v, float("nan"))


def _broken_rng(f):
    torch.save({"python": (3, (1, 2), None), "numpy": ("MT19937",), "cpu": torch.zeros(3, dtype=torch.uint8)},
               f / "rng_state.pth")  # fmt: skip


WHOLE_BUT_WRONG = {  # kind -> (what it does to checkpoint-3 before the marker is rewritten, what the reason says)
    "truncated scheduler.pt": (lambda f: _truncate(f / "scheduler.pt"), "scheduler.pt is truncated"),
    "empty optimizer.pt": (lambda f: (f / "optimizer.pt").write_bytes(b""), "optimizer.pt is truncated or corrupted"),
    "empty adapter": (
        lambda f: (f / "adapter_model.safetensors").write_bytes(b""),
        "adapter_model.safetensors is truncated or corrupted",
    ),
    "trainer_state.json not JSON": (
        lambda f: (f / "trainer_state.json").write_text("{not json"), "trainer_state.json is not valid JSON"
    ),
    "trainer_state.json of another step": (
        lambda f: _rewrite_json(f / "trainer_state.json", lambda s: s.update(global_step=99)),
        "trainer_state.json says global step 99, the folder is checkpoint-3",
    ),
    "scheduler.pt ahead of the checkpoint": (
        lambda f: _rewrite_torch(f / "scheduler.pt", lambda s: s.update(last_epoch=40)),
        "scheduler.pt is at step 40, ahead of this checkpoint's 3",
    ),
    "scheduler.pt of another run": (
        lambda f: _rewrite_torch(f / "scheduler.pt", lambda s: s.update(base_lrs=[5e-4] * len(s["base_lrs"]))),
        "scheduler.pt starts from learning rate 0.0005, optimizer.pt from 0.001",
    ),
    "rng_state.pth of no random states": (
        lambda f: torch.save({"python": 1}, f / "rng_state.pth"),
        "rng_state.pth holds no random-number states",
    ),
    "broken rng_state.pth": (_broken_rng, "rng_state.pth holds a broken random-number state"),
    "code-running rng_state.pth": (
        lambda f: torch.save(_RunsCode(f.parent / "RAN"), f / "rng_state.pth"),
        "rng_state.pth is not plain tensor data",
    ),
    "missing adapter_config.json": (
        lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json is missing"
    ),
    "adapter_config.json of no adapter": (
        lambda f: (f / "adapter_config.json").write_text("{}"), "adapter_config.json is no PEFT adapter config"
    ),
    "adapter_config.json of another rank": (
        lambda f: _rewrite_json(f / "adapter_config.json", lambda c: c.update(r=8)),
        "adapter_config.json is for another adapter: r 8, this model's is 4",
    ),
    "NaN optimizer moments": (
        lambda f: _rewrite_torch(f / "optimizer.pt", _nan_moments), "optimizer.pt holds NaN or infinite optimizer moments"
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", WHOLE_BUT_WRONG)
def test_whole_files_of_the_wrong_content_are_set_aside_and_the_one_before_resumed(
    reference, tiny_llama, tmp_path, kind
):
    """Each ends in a set-aside naming the file: before, a raw error on every rerun or a silent wrong resume."""
    out = _cut_at_3(reference, tmp_path)
    corrupt, says = WHOLE_BUT_WRONG[kind]
    corrupt(out / "checkpoint-3")
    _remark(out / "checkpoint-3")  # whole by its marker: sizes and hashes as they are now
    with pytest.warns(CheckpointWarning, match=f"checkpoint-3 in .*{says}.*resuming from checkpoint-2"):
        result = _run(_plan(tiny_llama, out))
    assert not (out / "RAN").exists(), "the pickle's code ran"
    assert result.resumed_from == 2 and result.global_step == 5
    assert [s.path.name for s in result.skipped] == ["checkpoint-3"] and says in result.skipped[0].problem
    assert result.skipped[0].moved_to.name in ("unusable-checkpoint-3", "incomplete-checkpoint-3")
    losses = dict(result.losses)
    for step in (3, 4, 5):
        assert losses[step] == pytest.approx(reference[1][step], rel=1e-4, abs=1e-4), (step, losses, reference[1])


# the issue's 13 kinds of whole-but-wrong checkpoint, each with the case that shows how it ends
ISSUE_KINDS = {
    "another model's optimizer.pt": UNLOADABLE,
    "swapped optimizer/scheduler": UNLOADABLE,
    "code-running pickle": UNLOADABLE,
    "all-NaN adapter": UNLOADABLE,
    "adapter shaped for another model": UNLOADABLE,
    "flipped bytes in the adapter": None,  # test_flipped_bytes_in_the_adapter_are_caught_by_the_markers_hash
    "truncated scheduler.pt": WHOLE_BUT_WRONG,
    "empty optimizer.pt": WHOLE_BUT_WRONG,
    "trainer_state.json not JSON": WHOLE_BUT_WRONG,
    "trainer_state.json of another step": WHOLE_BUT_WRONG,
    "scheduler.pt of another run": WHOLE_BUT_WRONG,
    "broken rng_state.pth": WHOLE_BUT_WRONG,
    "missing adapter_config.json": WHOLE_BUT_WRONG,
}


def test_the_issues_thirteen_kinds_are_each_a_case():
    assert len(ISSUE_KINDS) == 13
    assert all(cases is None or kind in cases for kind, cases in ISSUE_KINDS.items())


def test_flipped_bytes_in_the_adapter_are_caught_by_the_markers_hash(reference, tmp_path):
    out = _cut_at_3(reference, tmp_path)
    path = out / "checkpoint-3" / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # the last bit of a value: finite, right shape, right size
    path.write_bytes(bytes(data))
    point = find_resume(out)
    assert point.checkpoint.name == "checkpoint-2"
    assert "adapter_model.safetensors changed since the save" in point.skipped[0].problem


def test_when_no_checkpoint_loads_one_clear_error_then_a_fresh_start(reference, tiny_llama, tmp_path):
    out = _cut_at_3(reference, tmp_path)
    for n in (1, 2, 3):
        _rewrite_adapter(out / f"checkpoint-{n}", lambda t: torch.full_like(t, float("nan")))
        _remark(out / f"checkpoint-{n}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(
            CheckpointError, match=r"no checkpoint in .* can be resumed from.*NaN.*Run again to train from scratch"
        ):
            _run(_plan(tiny_llama, out, max_steps=1))
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == [
        f"unusable-checkpoint-{n}" for n in (1, 2, 3)
    ]
    fresh = _run(_plan(tiny_llama, out, max_steps=1))  # the rerun does not meet the same error again
    assert fresh.resumed_from is None and fresh.global_step == 1


def test_a_good_checkpoint_is_proven(reference, tiny_llama):
    from helpers.training.checkpoint_proof import prove

    out, _ = reference
    model, _tok, _ = load(_plan(tiny_llama, out).load_plan())
    model, _ = prepare_qlora(model, _plan(tiny_llama, out))
    assert all(prove(folder, model) is None for folder in checkpoint_folders(out))


def test_a_checkpoint_of_another_rank_is_a_settings_error_not_set_aside(reference, tiny_llama, tmp_path):
    from helpers.training.plan import FinetuneError

    out = _cut_at_3(reference, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(
            FinetuneError, match=r"checkpoint-3 does not fit this run: .*other settings \(r 4 -> 8\).*resume=False"
        ):
            _run(_plan(tiny_llama, out, r=8, alpha=16))
    assert (out / "checkpoint-3").is_dir() and not list(out.glob("unusable-*"))
