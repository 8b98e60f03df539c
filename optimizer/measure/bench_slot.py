"""The host's one bench slot: whatever times holds it, so no two timings on a host overlap (several compiles at
once, `optimizer compile --workers N`, Ray tasks on one node), and each records the window it held it for.

An fcntl lock on a per-host file in the system temp dir: the kernel releases it when its process dies, so a killed
compile never leaves the slot taken. Re-entrant per process: an acquisition inside one already held (ctx.time
called while a stage is measured) is a no-op and records no window of its own.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from optimizer.core.errors import OptimizerError
from optimizer.core.metrics import TimedWindow

_lock = threading.RLock()  # threads of one process take turns too; the file lock is per process
_depth = 0
_collectors: list[list[TimedWindow]] = []


def hostname() -> str:
    """This host's name, as every window records it (tests monkeypatch it to simulate another host)."""
    return socket.gethostname()


def slot_path() -> Path:
    """The lock file: one per host (and user: another user's compiles cannot open this user's file).
    OPTIMIZER_BENCH_SLOT names another (e.g. one per GPU, when each GPU times its own stages)."""
    if os.environ.get("OPTIMIZER_BENCH_SLOT"):
        path = Path(os.environ["OPTIMIZER_BENCH_SLOT"])
        if path.is_dir() or not path.parent.is_dir():
            what = "is a folder" if path.is_dir() else f"is in {path.parent}, which is not a folder"
            raise OptimizerError(f"OPTIMIZER_BENCH_SLOT: {path} {what}; name a lock file in an existing folder "
                                 "(it is created), or unset it for the host's own")
        return path
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    return Path(tempfile.gettempdir()) / f"optimizer-bench-{host}-{os.getuid()}.lock"


@contextmanager
def bench_slot(what: str) -> Iterator[TimedWindow | None]:
    """Hold the host's bench slot while timing `what` (e.g. "fused measure"). Yields the window (end filled in on
    exit, also added to every open `collect_windows`), or None when this process already holds the slot."""
    global _depth
    with _lock:
        if _depth > 0:
            _depth += 1
            try:
                yield None
            finally:
                _depth -= 1
            return
        path = slot_path()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise OptimizerError(f"bench slot: cannot open {path} ({e.strerror or e})") from None
        try:
            _take(fd, path, what)
            _depth = 1
            window = TimedWindow(host=hostname(), start=time.time(), end=0.0, pid=os.getpid(), what=what)
            try:
                yield window
            finally:
                window.end = time.time()
                _depth = 0
                for sink in _collectors:
                    sink.append(window)
        finally:
            os.close(fd)  # closing the descriptor releases the lock


def _take(fd: int, path: Path, what: str) -> None:
    """The slot's lock; while another process holds it, one line on stderr says this one waits, and for whom (the
    holder's pid, which each holder writes into the file: a number read back, never the file's text)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        by = f" by pid {int(holder)}" if holder.isdigit() else ""
        sys.stderr.write(f"waiting for the bench slot ({what}): it is held{by} (lock {path}); timings on one host "
                         "never overlap, this one starts when it is free\n")
        sys.stderr.flush()
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process times
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)


def holding() -> bool:
    """Whether this process holds the slot now."""
    return _depth > 0


@contextmanager
def collect_windows() -> Iterator[list[TimedWindow]]:
    """The windows closed in this process while the block runs (e.g. ctx.time during a pass's build)."""
    sink: list[TimedWindow] = []
    _collectors.append(sink)
    try:
        yield sink
    finally:
        _collectors.remove(sink)
