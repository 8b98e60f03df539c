"""The run folder: one sub-folder per stage, named `NN-name`, plus report files.

Writes are atomic (temp name, then rename), so a run killed at any point never leaves a half-written
artifact or report that a later run would trust. A stage is built in `.building-NN-name/` and renamed
into place only when its pass succeeded and stage.json is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

STAGE_FILE = "stage.json"
METRICS_FILE = "metrics.json"


def content_hash(*parts: Any) -> str:
    """A stable hash of JSON-able parts (dict keys sorted), for cache keys."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=str))


def write_text(path: Path, text: str) -> None:
    """Atomic: a temp file renamed into place. A failed write (disk full, read-only) removes the temp file and is
    one OptimizerError naming the file; what was at `path` before stays as it was."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        from optimizer.core.errors import OptimizerError

        raise OptimizerError(f"{path}: cannot write ({e.strerror or e})") from None


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class RunDir:
    def __init__(self, root: Path) -> None:
        self.root = root

    def prepare(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            from optimizer.core.errors import OptimizerError

            raise OptimizerError(f"{self.root}: cannot write the run folder ({e.strerror or e})") from None
        self._lock()
        for leftover in self.root.glob(".building-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _lock(self) -> None:
        """One writer per run folder: a second compile into it is refused, not interleaved."""
        import fcntl

        from optimizer.core.errors import OptimizerError

        path = self.root / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OptimizerError(
                f"{self.root}: another optimizer run (pid {holder}) is writing to this run folder; "
                "wait for it to finish or give another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd  # held until release() or the process ends

    def writer_pid(self) -> int | None:
        """The pid of the compile writing this run folder now, or None when no process holds it."""
        import fcntl

        path = self.root / ".lock"
        if not path.is_file():
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(holder) if holder.isdigit() else -1
        finally:
            os.close(fd)  # closing drops a lock we took
        return None

    def release(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)
            self._lock_fd = None

    @staticmethod
    def folder_name(index: int, name: str) -> str:
        return f"{index:02d}-{name}"

    def stage_dir(self, index: int, name: str) -> Path:
        """The stage's folder, which must be a direct child of the run folder (names are checked at load too)."""
        path = self.root / self.folder_name(index, name)
        if path.resolve().parent != self.root.resolve():
            from optimizer.core.errors import OptimizerError

            raise OptimizerError(f"stage name {name!r} would place its folder outside the run folder {self.root}")
        return path

    def building_dir(self, index: int, name: str) -> Path:
        d = self.root / f".building-{self.folder_name(index, name)}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    def find_cached(self, key: str) -> Path | None:
        """A finished stage folder (any index: passes may have been inserted) whose stage.json has this key."""
        for d in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if d.is_dir() and not d.name.startswith("."):
                info = read_json(d / STAGE_FILE)
                if info and info.get("key") == key and info.get("status") == "ran":
                    return d
        return None

    def place(self, src: Path, index: int, name: str) -> Path:
        """Move a built (or cached) stage folder to its final name, replacing what was there."""
        dest = self.stage_dir(index, name)
        if src == dest:
            return dest
        if dest.exists():
            trash = self.root / f".building-old-{dest.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(dest, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(src, dest)
        return dest
