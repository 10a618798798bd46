"""Training checkpoints a kill cannot fake: validate them, resume from the newest complete one, mark them.

A ``checkpoint-N`` folder holds the adapter (``adapter_config.json`` + ``adapter_model.safetensors``),
``trainer_state.json``, ``optimizer.pt``, ``scheduler.pt`` and the RNG state (``rng_state.pth``).
A Colab runtime killed while Trainer writes them (slow on Drive) leaves a folder that is empty or
half written. :func:`complete_marker` (a ``TrainerCallback``) fsyncs every file of a saved
checkpoint, then writes :data:`COMPLETE` last, listing each file's size (and a hash of each safetensors file, which has no checksum of its own): a folder without it was
not finished. :func:`find_resume` walks the folders newest first and returns the first complete one
with the newer ones it skipped and why; :func:`problem` says what is wrong with one folder.
Checkpoints written before the marker existed are accepted when every file validates. Given a
stamp (what the run trains on), the marker callback also writes it as :data:`RUN` in each
checkpoint, before the marker: :func:`read_stamp` gives it back to a run about to resume.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import OomkitError

__all__ = [
    "COMPLETE", "CheckpointError", "CheckpointWarning", "Skipped", "ResumePoint", "checkpoint_folders",
    "problem", "find_resume", "newest_complete", "set_aside", "set_aside_all", "mark_complete", "complete_marker",
    "RUN", "WHY", "read_stamp", "checkpoint_step", "rotate", "CheckpointWriteError", "write_failure",
]  # fmt: skip

COMPLETE = "COMPLETE"
RUN = "oomkit_run.json"  # the settings and data a checkpoint was trained with (see complete_marker)
STATE = "trainer_state.json"
TORCH_FILES = ("optimizer.pt", "scheduler.pt")  # a missing one would resume with a fresh state
FOLDER = re.compile(r"^checkpoint-(\d+)$")
WHY = "SET_ASIDE.txt"  # written into a folder set_aside moved: why it was not resumed from
HASHED = 1 << 30  # safetensors files up to this size get a content hash in the marker (they have no checksum)


class CheckpointError(OomkitError, ValueError):
    """No checkpoint in the output folder can be resumed; the message names the file and what to do."""


class CheckpointWriteError(OomkitError, OSError):
    """A checkpoint could not be written (a full disk, a quota): the message says so and which checkpoint
    the next run resumes from; nothing saved before is lost."""


class CheckpointWarning(UserWarning):
    """A newer checkpoint was incomplete or corrupted and an earlier one is used instead, or the one
    resumed from was written with other settings or data than the run resuming from it."""


@dataclass
class Skipped:
    """A checkpoint :func:`find_resume` passed over, why, and where it was moved (see :func:`set_aside`)."""

    path: Path
    problem: str
    moved_to: Path | None = None

    def __str__(self) -> str:
        moved = f" (moved to {self.moved_to.name})" if self.moved_to else ""
        return f"{self.path.name}{moved}: {self.problem}"


@dataclass
class ResumePoint:
    """The newest complete checkpoint (None: start from scratch) and the newer ones skipped."""

    checkpoint: Path | None
    step: int | None
    skipped: list[Skipped] = field(default_factory=list)


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-N`` folders in ``output_dir``, newest (highest N) first."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if FOLDER.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(FOLDER.match(p.name)[1]), reverse=True)


def _torch_file(path: Path) -> str | None:
    """What is wrong with a ``torch.save`` file (a zip archive), None when it is whole.

    Reads it once to check each entry's CRC: ``torch.load`` does not, and would resume from garbled
    optimizer moments without a word.
    """
    try:
        with zipfile.ZipFile(path) as z:
            size = path.stat().st_size
            if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                return f"{path.name} is truncated"
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError):
        return f"{path.name} is truncated or corrupted (not a whole torch file)"
    return f"{path.name} is corrupted ({bad} fails its checksum)" if bad else None


def _safetensors_file(path: Path) -> str | None:
    """What is wrong with a safetensors file: its header must parse and its data end where the file does."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:
                raise ValueError
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return f"{path.name} is truncated or corrupted (its header does not parse)"
    if size < 8 + n + end:
        return f"{path.name} is truncated ({size} of {8 + n + end} bytes)"
    return None


def _json_file(path: Path, key: str | None = None) -> str | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return f"{path.name} is {'empty' if path.stat().st_size == 0 else 'not valid JSON'}"
    if not isinstance(data, dict):
        return f"{path.name} holds a JSON {type(data).__name__}, not an object"
    if key and (isinstance(data.get(key), bool) or not isinstance(data.get(key), int)):
        return f"{path.name} has no {key}"
    return None


def _weights(folder: Path) -> str | None:
    """The adapter (or, for a full fine-tune, the model) weights and config."""
    full = (folder / "config.json").exists() and not (folder / "adapter_config.json").exists()
    config = folder / ("config.json" if full else "adapter_config.json")
    if not config.exists():
        return f"{config.name} is missing"
    found = _json_file(config)
    if found:
        return found
    stem = "model" if full else "adapter_model"
    files = sorted(folder.glob(f"{stem}*.safetensors")) or sorted(
        folder.glob(f"{'pytorch_model' if full else stem}*.bin")
    )
    if not files:
        return f"{stem}.safetensors is missing"
    for f in files:
        found = _safetensors_file(f) if f.suffix == ".safetensors" else _torch_file(f)
        if found:
            return found
    return None


def _marker(folder: Path) -> str | None:
    """What the :data:`COMPLETE` marker says is wrong: a file missing or of another size than saved."""
    try:
        files = json.loads((folder / COMPLETE).read_text(encoding="utf-8"))["files"]
        sizes = {str(k): int(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return f"{COMPLETE} is not valid JSON"
    hashes = json.loads((folder / COMPLETE).read_text(encoding="utf-8")).get("sha256") or {}
    hashes = {str(k): v for k, v in hashes.items()} if isinstance(hashes, dict) else {}
    for name in [*sizes, *hashes]:
        outside = _not_a_file_of(folder, name)
        if outside:  # never opened, never measured: a FIFO or /dev/zero would hang the read
            return f"{COMPLETE} names {name[:80]!r}, {outside}: the marker was not written by oomkit's save"
    for name, size in sizes.items():
        path = folder / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, the save wrote {size} (truncated or changed since)"
    for name, digest in hashes.items():
        if (folder / name).exists() and _sha256(folder / name) != digest:
            return f"{name} changed since the save (same size, other bytes: damaged on disk or in a sync)"
    return None


def _not_a_file_of(folder: Path, name: str) -> str | None:
    """Why ``name`` (from a marker) is not a plain file directly inside ``folder``; None when it is one
    (or is missing: that is said with the sizes). Looks only at the name and ``lstat``, never the content."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or Path(name).is_absolute():
        return "which is not a file name inside the checkpoint folder"
    try:
        mode = (folder / name).lstat().st_mode
    except OSError:
        return None
    if not stat.S_ISREG(mode):
        return "which is not a regular file (a link, a device or a pipe)"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def problem(folder: str | Path, *, marker_required: bool = False) -> str | None:
    """Why ``folder`` cannot be resumed from (one sentence naming the file), None when it is complete.

    Args:
        marker_required: a folder without the :data:`COMPLETE` marker is incomplete even when its
            files validate (set for folders newer than a marked one: the save was cut short).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return "it is not a folder"
    if not any(folder.iterdir()):
        return "the folder is empty (the run was stopped while saving it)"
    found = next((p for p in _file_problems(folder) if p), None)
    if found:
        return found
    if (folder / COMPLETE).exists():
        return _marker(folder)
    if marker_required:
        return f"it has no {COMPLETE} marker (the save was cut short before it finished)"
    return None


def _file_problems(folder: Path):
    """What is wrong with each file a resume needs, in the order Trainer writes them (None: fine)."""
    yield _weights(folder)
    for name in TORCH_FILES:
        path = folder / name
        yield _torch_file(path) if path.exists() else f"{name} is missing (resuming would start it afresh)"
    rng = sorted(folder.glob("rng_state*.pth"))
    if not rng:
        yield "rng_state.pth is missing"
    for path in [*rng, *folder.glob("scaler.pt")]:
        yield _torch_file(path)
    state = folder / STATE
    yield _json_file(state, "global_step") if state.exists() else f"{STATE} is missing"


def checkpoint_step(folder: str | Path) -> int | None:
    """The step a ``checkpoint-N`` folder is named after (None for another name)."""
    found = FOLDER.match(Path(folder).name)
    return int(found[1]) if found else None


def _step(folder: Path) -> int:
    return int(FOLDER.match(folder.name)[1])


def find_resume(output_dir: str | Path) -> ResumePoint:
    """The newest complete checkpoint in ``output_dir`` and the newer ones skipped (with the reason).

    A folder without the :data:`COMPLETE` marker that is newer than the oldest marked one is
    incomplete; older unmarked ones (saved before the marker existed) count when their files validate.
    A lone checkpoint that is not complete (the run was stopped while saving its first one) is
    skipped, and training starts from scratch: resuming could not save any step of it.
    Raises :class:`CheckpointError` when there are several checkpoints and none is complete.
    """
    folders = checkpoint_folders(output_dir)
    marked = [_step(f) for f in folders if (f / COMPLETE).exists()]
    skipped = []
    for folder in folders:
        found = problem(folder, marker_required=bool(marked) and _step(folder) > min(marked))
        if found is None:
            step = json.loads((folder / STATE).read_text(encoding="utf-8"))["global_step"]
            return ResumePoint(folder, step, skipped)
        skipped.append(Skipped(folder, found))
    if len(skipped) == 1:
        # the first save was cut short: no step can be recovered, so starting over loses nothing (the
        # caller sets the folder aside). Several broken ones are a bad sync or a changed folder: look first
        return ResumePoint(None, None, skipped)
    if skipped:
        newest, older = skipped[0], len(skipped) - 1
        more = " (and the older one is not complete either)" if older == 1 else ""
        more = more or f" (and the {older} older ones are not complete either)"
        raise CheckpointError(
            f"cannot resume from {Path(output_dir)}: {newest.path.name}: {newest.problem}{more}, and there is "
            f"no earlier complete checkpoint; look at {newest.path}, or pass resume=False to start over (the "
            "checkpoints are kept, renamed previous-checkpoint-N)"
        )
    return ResumePoint(None, None, [])


def newest_complete(output_dir: str | Path) -> Path | None:
    """The newest complete ``checkpoint-N`` folder (None when there is none); changes nothing."""
    try:
        return find_resume(output_dir).checkpoint
    except CheckpointError:
        return None


def set_aside(skipped: Skipped, prefix: str = "incomplete") -> Skipped:
    """Rename a skipped folder to ``<prefix>-checkpoint-N`` so Trainer neither rotates nor reuses it.

    Training writes ``checkpoint-N`` afresh when it gets there; the old files are kept, never deleted.
    A name already taken gets ``-2``, ``-3``... appended.
    """
    target = skipped.path.with_name(f"{prefix}-{skipped.path.name}")
    n = 1
    while target.exists():
        n += 1
        target = skipped.path.with_name(f"{prefix}-{skipped.path.name}-{n}")
    try:
        skipped.path.rename(target)
    except OSError:  # a read-only or odd file system: leave it; its missing marker keeps it skipped
        return skipped
    skipped.moved_to = target
    try:  # the folder says itself why it was set aside (a later look, or another notebook, sees it)
        (target / WHY).write_text(f"set aside by oomkit: {skipped.problem}\n", encoding="utf-8")
    except OSError:
        pass  # the rename is what matters; the reason was also warned about
    return skipped


def set_aside_all(output_dir: str | Path, reason: str, prefix: str = "previous") -> list[Skipped]:
    """Rename every ``checkpoint-N`` in ``output_dir`` to ``<prefix>-checkpoint-N`` (kept, never deleted).

    For a run that starts over in a folder an earlier run used: Trainer rotates checkpoints by
    modification time, so an old high-numbered one would survive the new run's saves and a later
    resume would continue the old run. Raises :class:`CheckpointError` when one cannot be moved.
    """
    moved = []
    for folder in checkpoint_folders(output_dir):
        done = set_aside(Skipped(folder, reason), prefix)
        if done.moved_to is None:
            raise CheckpointError(
                f"cannot move {folder} out of the way before starting over (the file system refused the "
                "rename); move or delete it yourself, or train into another output_dir"
            )
        moved.append(done)
    return moved


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems (and folders on some platforms) do not sync; nothing to do
        pass
    finally:
        os.close(fd)


def mark_complete(folder: str | Path, step: int) -> Path:
    """fsync every file of a saved checkpoint, then write :data:`COMPLETE` (atomically) listing their sizes."""
    folder = Path(folder)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != COMPLETE}
    for name in files:
        _fsync(folder / name)
    # torch files carry CRCs (checked on resume); safetensors have none, so a flipped byte needs a hash
    hashes = {n: _sha256(folder / n) for n, size in files.items() if n.endswith(".safetensors") and size <= HASHED}
    _write_json(folder / COMPLETE, {"global_step": step, "files": files, "sha256": hashes})
    _fsync(folder)
    return folder / COMPLETE


def read_stamp(folder: str | Path) -> dict | None:
    """The stamp :func:`complete_marker` wrote into a checkpoint (None: none, or not readable)."""
    try:
        data = json.loads((Path(folder) / RUN).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically and durably (a kill leaves the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


REMOVING = ".removing-"  # a folder renamed so while rotation deletes it: no longer a checkpoint to anyone


def rotate(output_dir: str | Path, keep: int | None, newest: int) -> list[Path]:
    """Delete the checkpoints older than the ``keep`` newest complete ones, once ``checkpoint-<newest>`` is.

    Trainer deletes the oldest checkpoint before the newest one is marked complete, so a kill in
    between leaves neither usable. Here nothing is deleted unless ``checkpoint-<newest>`` has its
    :data:`COMPLETE` marker, and each folder is first renamed ``.removing-checkpoint-N`` (one atomic
    step: a kill mid-delete leaves a folder no resume looks at, removed by the next rotation).
    Folders newer than ``newest`` are never touched. Returns the folders deleted.
    """
    out = Path(output_dir)
    for leftover in out.glob(f"{REMOVING}checkpoint-*"):  # a rotation killed mid-delete
        shutil.rmtree(leftover, ignore_errors=True)
    if not keep or keep <= 0 or not (out / f"checkpoint-{newest}" / COMPLETE).exists():
        return []
    older = [f for f in checkpoint_folders(out) if _step(f) <= newest]
    kept = [f for f in older if (f / COMPLETE).exists()][:keep]
    if len(kept) < keep:
        return []  # fewer complete ones than asked to keep: an unmarked older one may be all a resume has
    oldest_kept = _step(kept[-1])
    gone = []
    for folder in [f for f in older if _step(f) < oldest_kept]:
        doomed = folder.with_name(REMOVING + folder.name)
        try:
            os.replace(folder, doomed)
        except OSError:  # a file system that refuses the rename: the folder stays (more disk used, nothing lost)
            continue
        _fsync(out)
        shutil.rmtree(doomed, ignore_errors=True)
        gone.append(folder)
    return gone


def write_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a write that failed for want of space: ``OSError``
    ENOSPC/EDQUOT, or torch's raw "unexpected pos" / "file write failed" of a zip writer on a full disk."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        text = str(error)
        if isinstance(error, RuntimeError) and ("unexpected pos" in text or "file write failed" in text):
            return True
        error = error.__cause__ or error.__context__
    return False


def complete_marker(stamp: dict | None = None, keep: int | None = None):
    """A ``TrainerCallback`` that writes :data:`COMPLETE` after Trainer saved a checkpoint, and removes a
    stale marker before a checkpoint is saved over an old folder of the same step.

    Args:
        stamp: JSON-able facts about the run (settings, a hash of the data), written into each
            checkpoint as :data:`RUN` before the marker, so the marker vouches for it too.
        keep: the checkpoints to keep (the plan's ``save_total_limit``): older ones are deleted by
            :func:`rotate` after the marker is written. Trainer's own rotation must be off
            (``save_total_limit=None``): it deletes before the marker.
    """
    return _marker_class()(stamp, keep)


@functools.cache
def _marker_class():
    from transformers import TrainerCallback  # here, so importing oomkit does not import transformers

    class CompleteMarker(TrainerCallback):
        def __init__(self, stamp: dict | None = None, keep: int | None = None):
            self.stamp = stamp
            self.keep = keep

        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save and args.should_save:  # about to write checkpoint-<step>, maybe over an old one
                stale = Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETE
                if stale.exists():
                    stale.unlink()
                    _fsync(stale.parent)

        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if args.should_save and folder.is_dir():
                if self.stamp is not None:
                    _write_json(folder / RUN, self.stamp)
                mark_complete(folder, state.global_step)
                rotate(args.output_dir, self.keep, state.global_step)

    return CompleteMarker
