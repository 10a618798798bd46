"""The crash-safe results file of an evaluation: an append-only JSONL file, one finished sample a line.

``ResultsFile`` locks the file for one run (a second writer gets an error naming the first), reads
what earlier runs finished, repairs a last line torn by a crash (kept in ``<path>.torn``), and
appends each record flushed at once and fsynced per batch. ``ResultsWriteError`` is what a failed
write raises: it carries the records that did not reach the disk.

What made the records (the generation settings and the model's identity) is written once, as a
header line ``{"oomkit_made": <hash>, "settings": ..., "model": ...}`` before the first record made
so; each record names it (``"made": <hash>``) and gets both back, shared, when read. Files written
before headers existed (settings and model in every record) are read as they are. The file is read
once per run, streaming, in chunks parsed together (their keys shared): a resume costs time and
memory in proportion to the records, not to the settings.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs unlocked
    fcntl = None

from ..core.arguments import regular_file
from ..core.errors import EvalError, OomkitError

__all__ = ["ResultsFile", "ResultsWriteError", "MADE", "made_hash", "is_record"]

MADE = "oomkit_made"  # a header line's key: what made the records that name its hash
_SHARED = ("settings", "model")  # stored once in the header, not in each record
_REPEATED = ("made", "time", "truncated_reason", "scored_by")  # values shared by many records (a header's, a batch's)
_KNOWN = ("id", "prompt", "reference")  # texts the prompts hold too (see ResultsFile.share)
_CHUNK = 2048  # lines parsed by one json.loads (one call shares its keys' strings: less memory, less time)


def made_hash(settings: dict, model: dict) -> str:
    """The hash a header and its records share: of the settings and the model identity, canonical JSON."""
    text = json.dumps({"settings": settings, "model": model}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_record(line: object) -> bool:
    """Whether a parsed line is a result record (a header, or anything else, is not)."""
    return isinstance(line, dict) and "id" in line


class ResultsWriteError(OomkitError, OSError):
    """A finished result could not be written (disk full, file too large, permissions).

    ``unsaved`` holds the finished records that did not reach the disk, so even then nothing is lost.
    """

    def __init__(self, message: str, unsaved: list[dict]):
        super().__init__(message)
        self.unsaved = unsaved

    def __reduce__(self):
        # pickled with its records (a worker process handing the error back must not lose them)
        return type(self), (self.args[0], self.unsaved)


class ResultsFile:
    """An append-only JSONL file of finished samples, flushed per sample and fsynced per batch.

    ``open()`` takes an exclusive lock for the run (``fcntl.flock`` on ``<real path>.lock``, which
    holds the owner's pid, and on the results file itself), so two writers (a notebook re-run while
    an old kernel still runs, two tabs, one path reached through a symlink or a hard link) cannot
    both append: the second gets an error naming the first. It reads what a previous run
    finished; a last line torn by a crash (no newline, or not valid JSON) is cut off and kept in
    ``<path>.torn`` for inspection, so it is neither lost nor duplicated. The repair only touches a
    file no other process holds.
    """

    def __init__(self, path: str | os.PathLike):
        # "~/x.jsonl" is the home folder's, not a folder named "~"; a FIFO or a device is refused
        self.path = regular_file(path, "results file", EvalError)
        self.repaired = False
        self.backup: Path | None = None  # where resume=False moved an earlier run's results
        self._fh = None
        self._lock: int | None = None
        self._inode_lock: int | None = None  # the results file itself: one lock whatever name reaches it
        self.records: dict[str, dict] = {}  # by id: read at open(), then each one appended
        self.made: dict[str, dict] = {}  # header hash -> {"settings", "model"}
        self._created = False  # open() created the file: an empty one is removed again at close()
        self._strings: dict[str, str] = {}  # see _REPEATED
        self._known: dict[str, str] = {}  # see share()
        self._pairs: list[tuple] = []  # see _share_inline

    @property
    def lock_path(self) -> Path:
        """``<path>.lock`` beside the real file (a symlink's target), so every name of it shares one lock."""
        real = Path(os.path.realpath(self.path))
        return real.with_name(real.name + ".lock")

    def lock(self) -> bool:
        """Take the run's exclusive lock (without waiting); False where the file system has no locks.

        Raises:
            EvalError: another process holds it (the message names its pid).
        """
        if fcntl is None or self._lock is not None:
            return self._lock is not None
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise EvalError(
                    f"{self.path} is being written by another run (process {holder}; this is {os.getpid()}): "
                    "two writers would duplicate every result. Wait for it to finish or stop it (an old "
                    "notebook kernel, another tab), or pass results= another path"
                ) from None
            return False  # no locks on this file system (some network mounts): run unlocked
        self._lock = fd
        try:
            self._lock_file()
        except BaseException:
            self.unlock()
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return True

    def _lock_file(self) -> None:
        """Lock the results file's own inode too: a hard link is another name with another ``.lock``.

        Taken again after the file is (re)created (``open``), so the lock follows the file written to.
        """
        try:
            st = os.stat(self.path)
            if self._inode_lock is not None:
                held = os.fstat(self._inode_lock)
                if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
                    return
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # not there yet (nothing to share), or unreadable: the name's lock alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise EvalError(
                    f"{self.path} is being written by another run under another name (a hard link to the same "
                    f"file, inode {st.st_ino}; this is process {os.getpid()}): two writers would duplicate every "
                    "result. Wait for it to finish or stop it, or pass results= a separate file (not a link)"
                ) from None
            return  # no locks on this file system
        if self._inode_lock is not None:
            os.close(self._inode_lock)
        self._inode_lock = fd

    def unlock(self) -> None:
        if self._inode_lock is not None:
            os.close(self._inode_lock)  # closing releases its flock
            self._inode_lock = None
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock, 0)
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            os.close(self._lock)
            self._lock = None

    def share(self, texts) -> None:
        """Texts the caller holds (prompt ids, prompts, references): a record read with the same text keeps
        the caller's string instead of a copy (bench/resume_scale.py's 100,000 rows: 108 -> 91 MiB peak)."""
        self._known = {t: t for t in texts if isinstance(t, str)}

    def read(self) -> dict[str, dict]:
        """Finished records by id (repairing a torn last line first, unless another process holds the file)."""
        if not self.path.exists():
            return {}
        if self._lock is None:
            try:
                self.lock()
            except EvalError:
                return self._parse(repair=False)  # someone is writing: read only
            try:
                return self._parse(repair=True)
            finally:
                self.unlock()
        return self._parse(repair=True)

    def _parse(self, *, repair: bool) -> dict[str, dict]:
        """One streaming pass: records by id (the last line of an id wins), headers into ``self.made``.

        A line that is no record is a crash's torn last line when only blank lines follow it (cut off,
        kept in ``<path>.torn``); anywhere else the file is refused.
        """
        records: dict[str, dict] = {}
        pos = number = 0
        bad = torn = None  # the first line that is no record; a last piece without its newline
        chunk: list[bytes] = []
        numbers: list[int] = []  # each chunk line's number in the file (blank lines are skipped)
        with open(self.path, "rb") as f:
            for line in f:  # binary: lines end at b"\n" only (U+2028 inside a string is text)
                number += 1
                pos += len(line)
                if not line.endswith(b"\n"):  # the last piece: torn by a crash (cut off, blank or not)
                    torn = number
                    break
                if not line.strip():
                    continue
                if bad is not None:
                    raise self._bad_line(bad)
                chunk.append(line)
                numbers.append(number)
                if len(chunk) >= _CHUNK:
                    bad, chunk, numbers = self._take(chunk, records, numbers), [], []
        if chunk:
            bad = self._take(chunk, records, numbers)
        if bad is not None and torn is not None and line.strip():
            raise self._bad_line(bad)  # a bad line, then more text: not a crash's torn end
        cut = bad or torn
        good_end = self._end_of_line(cut - 1) if cut else pos
        if repair and good_end < pos:
            self._set_torn_aside(good_end)
        return records

    def _take(self, chunk: list[bytes], records: dict, numbers: list[int]) -> int | None:
        """Parse ``chunk`` (lines numbered ``numbers``) into ``records``: the number of a bad line when
        it is the chunk's last (maybe torn), None when all are records; raises for one before the last."""
        try:
            rows = json.loads(b"[" + b",".join(chunk) + b"]")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # too deep: no record of ours
            rows = None
        if rows is None or len(rows) != len(chunk):  # one line in error, or one holding two values
            rows = []
            for line in chunk:
                try:
                    value = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    value = None
                rows.append(value)
        for k, rec in enumerate(rows):
            if isinstance(rec, dict) and MADE in rec and "id" not in rec:
                self.made[str(rec[MADE])] = {key: rec.get(key) for key in _SHARED}
                continue
            if not is_record(rec):
                if k < len(rows) - 1:
                    raise self._bad_line(numbers[k])
                return numbers[k]
            for key in _REPEATED:  # one string object for each value many records repeat
                if isinstance(rec.get(key), str):
                    rec[key] = self._strings.setdefault(rec[key], rec[key])
            for key in _KNOWN:  # the caller's own string when it is the same text (see share)
                if isinstance(rec.get(key), str):
                    rec[key] = self._known.get(rec[key], rec[key])
            shared = self.made.get(rec["made"]) if "made" in rec else None
            if shared is not None:
                rec.update(shared)  # the same two objects in every record made so
            elif "made" not in rec:
                self._share_inline(rec)
            records[str(rec["id"])] = rec
        return None

    def _share_inline(self, rec: dict) -> None:
        """A record of the format before headers holds its own copy of the settings and model: an equal
        pair seen before replaces it (one object kept, and compared once on resume, not per record)."""
        pair = (rec.get("settings"), rec.get("model"))
        for seen in self._pairs:
            if seen == pair:
                rec["settings"], rec["model"] = seen
                return
        if len(self._pairs) < 16:  # a handful of runs made a file; past that, each keeps its own
            self._pairs.append(pair)

    def _end_of_line(self, number: int) -> int:
        """The byte offset just past line ``number`` (1-based; 0 for none): where a repair cuts."""
        if number <= 0:
            return 0
        pos = 0
        with open(self.path, "rb") as f:
            for _, line in zip(range(number), f, strict=False):
                pos += len(line)
        return pos

    def _bad_line(self, number: int) -> EvalError:
        return EvalError(
            f"{self.path} line {number} is not a valid result record: fix or move the file "
            "(only a torn last line is repaired automatically)"
        )

    def _set_torn_aside(self, good_end: int) -> None:
        """Move a torn last line to ``<path>.torn`` and cut it off; on a full or read-only disk change
        nothing and say so (appending after a torn line would corrupt the next record)."""
        with open(self.path, "rb") as f:
            f.seek(good_end)
            torn = f.read()
        torn_path = self.path.with_name(self.path.name + ".torn")
        try:
            if torn.strip():
                with open(torn_path, "ab") as f:
                    f.write(torn + b"\n")
                self.repaired = True
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
        except OSError as e:
            raise EvalError(
                f"{self.path} ends in a torn line that could not be set aside in {torn_path.name} "
                f"({e.strerror or e}); nothing was changed and every finished record is still in the file. "
                "Free disk space (or make the folder writable) and run again"
            ) from None

    def open(self, *, fresh: bool = False) -> dict[str, dict]:
        """Lock the file, check it can be written (before any generation), return what is already finished.

        ``fresh``: start the file over (only a results file: anything else is refused). The earlier
        results are moved to ``<path>.<time>.bak`` (``self.backup``), never deleted: a notebook cell
        re-run after a runtime reset must not wipe an evaluation.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.lock()
            if fresh:
                self._start_over()
            self.made = {}
            done = self.read()
            self._created = not self.path.exists()
            self._fh = open(self.path, "a", encoding="utf-8")
            self.records = done
            if self._lock is not None:
                self._lock_file()  # a file created just now (or anew by fresh=True) is locked as well
        except OSError as e:
            self.close()
            raise EvalError(
                f"cannot write results to {self.path}: {e.strerror or e}. Pass results= a path in a "
                "writable folder (in Colab, /content/... or a mounted Drive folder)"
            ) from None
        except BaseException:
            self.close()
            raise
        return done

    def _start_over(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb") as f:
            first = f.readline(1 << 20)
        try:
            rec = json.loads(first)
            ours = isinstance(rec, dict) and (MADE in rec or ("id" in rec and ("output" in rec or "error" in rec)))
        except (json.JSONDecodeError, UnicodeDecodeError):
            ours = False
        if not ours:
            raise EvalError(
                f"{self.path} is not a safe_generate results file (its first line is no result record), "
                "so resume=False will not delete it: pass results= another path"
            )
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = self.path.with_name(f"{self.path.name}.{stamp}.bak")
        n = 1
        while backup.exists():
            n += 1
            backup = self.path.with_name(f"{self.path.name}.{stamp}-{n}.bak")
        os.replace(self.path, backup)
        self.backup = backup

    def append(self, record: dict, *, sync: bool = True) -> None:
        """Write one record and flush it; ``sync`` also pushes it to the disk (a crash right after keeps it).

        A record with ``"made"`` is written without its settings and model: they go once into a header
        line, written (and synced) before the first record that names it.
        """
        made = record.get("made")
        if made is not None and made not in self.made:
            shared = {key: record.get(key) for key in _SHARED}
            self._fh.write(json.dumps({MADE: made, **shared}, ensure_ascii=False) + "\n")
            self._fh.flush()
            self.sync()
            self.made[made] = shared
        line = {k: v for k, v in record.items() if k not in _SHARED} if made is not None else record
        self._fh.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._fh.flush()
        self.records[str(record["id"])] = record
        if sync:
            self.sync()

    def sync(self) -> None:
        """fsync: what was flushed survives a crash of the machine, not only of the process."""
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
                if self._created and self.path.stat().st_size == 0:
                    self.path.unlink()  # nothing was written: no empty file left behind (an input error)
            self._fh = None
        self.unlock()
