"""The one check before we open a file a user named (a model, a data_file): it must be a regular file. A FIFO, a
device or a socket would block the open forever (or stream without end); it is refused in one line instead."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def not_regular(path: Path) -> str | None:
    """What `path` is when it exists and is not a regular file or folder (stat only, nothing opened), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # missing: the reader says so in its own words
    return next((what for test, what in _KINDS if test(mode)), None)

