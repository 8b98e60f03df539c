"""Writing a bundle folder: one export at a time per --out, built in a staging folder of its own and moved into place
only when complete, so an export that fails, is interrupted or loses a race leaves nothing of its own behind and
removes nothing of the user's."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from optimizer.core.errors import OptimizerError


def _check_out(out: Path) -> None:
    if out.is_symlink():
        raise OptimizerError(f"--out: {out} is a symbolic link; give a new or empty folder")
    if out.exists() and not out.is_dir():
        raise OptimizerError(f"--out: {out} exists and is a file; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise OptimizerError(f"--out: {out} exists and is not empty")


@contextmanager
def out_lock(out: Path) -> Iterator[bool]:
    """Hold --out for one export: the folder (made empty when it is new) is locked (flock on the folder itself, so
    nothing beside it is written); another export into it is refused with one line. Yields whether this export made
    the folder (it is removed again unless the export filled it)."""
    _check_out(out)
    made = False
    try:
        out.mkdir(parents=True)
        made = True
    except FileExistsError:
        pass
    except OSError as e:
        raise OptimizerError(f"--out: cannot make {out} ({e.strerror or e})") from None
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            made = False  # the other export's folder now
            raise OptimizerError(f"--out: another export is writing to {out}; wait for it, or give another --out") \
                from None
        _check_out(out)  # a racing export may have filled it between our check and our lock
        yield made
    finally:
        os.close(fd)  # releases the lock
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


@contextmanager
def _no_interrupts(reraise: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM held off while a few filesystem calls finish (cleanup, or the final rename), so that a
    second Ctrl-C cannot leave half of them done; raised after them when `reraise` (not once the bundle is in
    place: the export is then done)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda n, _f: pending.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending and reraise:
            raise KeyboardInterrupt


class Interrupts:
    """The command line's Ctrl-C and SIGTERM during an export: until the bundle is in place each aborts it (its
    staging folder is removed); a signal is remembered even where a library swallowed the KeyboardInterrupt (a bare
    `except:`) or turned it into another error (an interrupted import is an ImportError), so the export is never
    published after one and the CLI can say "interrupted". Once the bundle is in place, signals are ignored: the
    export is done."""

    def __init__(self) -> None:
        self.fired = False
        self.published = False

    def install(self) -> Interrupts:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, *_: object) -> None:
        if not self.published:
            self.fired = True
            raise KeyboardInterrupt

    def ignore(self) -> None:
        """To the process's end, its teardown included (where Python would put the default handler back)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _clear_leftovers(out: Path) -> None:
    """The staging folders of earlier exports into `out` that were killed (kill -9: no cleanup ran). `out` is held
    (out_lock), so no live export owns one; another --out's (a different name) is not touched, nor a link."""
    prefix = f".{out.name}.partial-"
    for p in out.parent.iterdir():
        if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink():
            with _no_interrupts():
                shutil.rmtree(p, ignore_errors=True)


@contextmanager
def staged(out: Path, interrupts: Interrupts | None = None) -> Iterator[Path]:
    """A new staging folder beside `out` (a unique name: tempfile.mkdtemp), renamed onto `out` when the body
    finishes and removed when it raises (Ctrl-C included). `out` must be held with out_lock."""
    _clear_leftovers(out)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise OptimizerError(f"--out: cannot write beside {out} ({e.strerror or e})") from None
    try:
        yield staging
        with _no_interrupts(reraise=False):
            if interrupts is not None and interrupts.fired:  # a signal a library swallowed: never published
                raise KeyboardInterrupt
            os.chmod(staging, 0o755)  # mkdtemp makes it private; a bundle is a plain folder
            os.rename(staging, out)  # out is locked and empty: rename replaces it in one step
            if interrupts is not None:
                interrupts.published = True
    except BaseException:
        with _no_interrupts():
            shutil.rmtree(staging, ignore_errors=True)
        raise
