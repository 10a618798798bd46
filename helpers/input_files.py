"""Files a user names, checked before they are read: a FIFO blocks a read forever, a device such as
/dev/zero never ends (or, as /dev/full, swallows every write), so only regular files are read or written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["regular_file"]

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


def regular_file(path: str | os.PathLike, what: str, error: type[Exception]) -> Path:
    """``path`` with ``~`` expanded, when it is a regular file, a folder or not there yet (the caller
    handles those); ``error`` naming what it is instead (a FIFO, a device, a socket)."""
    p = Path(os.path.expanduser(os.fspath(path)))
    try:
        mode = os.stat(p).st_mode
    except OSError:  # missing or unreadable: the caller's own open says so
        return p
    for test, kind in _KINDS:
        if test(mode):
            raise error(
                f"{what} {p} is {kind}, not a regular file: reading it would block or never end, and writing "
                "to it loses what is written. Pass the path of an ordinary file"
            )
    return p
