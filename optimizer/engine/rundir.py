"""The run folder: one sub-folder per stage, named `NN-name`, plus report files.

Writes are atomic (temp name, then rename), so a run killed at any point never leaves a half-written
artifact or report that a later run would trust. A stage is built in `.building-NN-name/` and renamed
into place only when its pass succeeded and stage.json is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import IO, Any

from optimizer.core.jsonio import strict_json_dumps

STAGE_FILE = "stage.json"
METRICS_FILE = "metrics.json"
LOCK_FILE = ".lock"
# What only a run folder holds (an older version's too, which wrote no lock): a folder with other files in it is
# the user's, and compile would replace them. recipe.yaml alone is allowed: `compile --model` writes it first, and
# compile itself never writes or deletes it.
RUN_FILES = (LOCK_FILE, "report.json", "machine.json")
STAGE_FOLDER = re.compile(r"\d{2}-.+")
ALLOWED_ALONE = ("recipe.yaml",)


def content_hash(*parts: Any) -> str:
    """A stable hash of JSON-able parts (dict keys sorted), for cache keys. Taken as the strict writer writes them,
    so data and its round trip through write_json/read_json (inf read back as null) hash alike."""
    blob = strict_json_dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_json(path: Path, data: Any) -> None:
    """Strict JSON (core.jsonio: non-finite floats as null), written atomically."""
    write_text(path, strict_json_dumps(data, indent=2))


def write_text(path: Path, text: str) -> None:
    """Atomic: a temp file renamed into place. A failed write (disk full, read-only) removes the temp file and is
    one OptimizerError naming the file; what was at `path` before stays as it was."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open_new(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        from optimizer.core.errors import OptimizerError

        raise OptimizerError(f"{path}: cannot write ({e.strerror or e})") from None


def open_new(path: Path, mode: str = "wb") -> IO[Any]:
    """A file created anew at `path` for writing, never through a symbolic link: whatever is at that name (a
    killed run's temp file, or a link planted in a handed-over run folder) is removed first (unlink removes the
    link, not its target), and O_EXCL | O_NOFOLLOW refuse a name that reappears in between."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(fd, mode)


def remove(path: Path) -> None:
    """Delete a folder of ours; a link at its name is removed itself, never the folder it points to."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def foreign_reason(root: Path) -> str | None:
    """Why compile must not write into `root`, or None: it is new, empty, a run folder, or holds only a recipe."""
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:  # not there yet (it is made), or unreadable (the write probe says so)
        return None
    if not names or set(names) <= set(ALLOWED_ALONE):
        return None
    if any((root / f).is_file() and not (root / f).is_symlink() for f in RUN_FILES):
        return None
    if any(STAGE_FOLDER.fullmatch(n) and (root / n / STAGE_FILE).is_file() for n in names):
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{root}: not a run folder and not empty ({shown}): compile writes stage folders and reports there "
            "and would replace what is in it; give a new or empty folder (or a run folder) as --out")


def check_run_folder(root: Path) -> None:
    """Refuse (OptimizerError) a run folder that is the user's folder of other files."""
    reason = foreign_reason(root)
    if reason:
        from optimizer.core.errors import OptimizerError

        raise OptimizerError(reason)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def changed_files(files: list[Path], info: dict[str, Any]) -> list[Path]:
    """The files (of a stage's artifact) that are missing or differ in size or sha256 from what its stage.json
    recorded (`file_sizes`, `file_sha256`); a file stage.json has no digest for counts as changed when it records
    digests at all. The cache reuses a stage only when this is empty, and export ships only such files."""
    from optimizer.core.artifact import file_sha256

    sizes, digests = info.get("file_sizes"), info.get("file_sha256")
    return [
        f for f in files
        if not f.is_file()
        or (sizes is not None and sizes.get(f.name) != f.stat().st_size)
        or (digests is not None and digests.get(f.name) != file_sha256(f))
    ]


class RunDir:
    def __init__(self, root: Path) -> None:
        self.root = root

    def prepare(self) -> None:
        check_run_folder(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            open_new(probe).close()
            probe.unlink()
        except OSError as e:
            from optimizer.core.errors import OptimizerError

            raise OptimizerError(f"{self.root}: cannot write the run folder ({e.strerror or e})") from None
        self._lock()
        for leftover in self.root.glob(".building-*"):
            remove(leftover)

    def _lock(self) -> None:
        """One writer per run folder: a second compile into it is refused, not interleaved. The lock file is
        never opened through a symbolic link (a handed-over folder's link would make us truncate its target)."""
        import errno
        import fcntl

        from optimizer.core.errors import OptimizerError

        path = self.root / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            why = "a symbolic link, not the run folder's own lock file; remove it" if e.errno == errno.ELOOP \
                else f"cannot open the run folder's lock ({e.strerror or e})"
            raise OptimizerError(f"{path}: {why}") from None
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
        self._lock_fd: int | None = fd  # held until release() or the process ends

    def writer_pid(self) -> int | None:
        """The pid of the compile writing this run folder now, or None when no process holds it."""
        import fcntl

        try:  # a link at the lock's name is nobody's lock: never read through it
            fd = os.open(self.root / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
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
        remove(d)
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
            remove(trash)
            os.replace(dest, trash)
            remove(trash)
        os.replace(src, dest)
        return dest
