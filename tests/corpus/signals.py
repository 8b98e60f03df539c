"""Adversarial cases of issue 47, class 7: signals, locks and the environment (cli.app's SIGTERM and exit-130
line for every command, deploy.staging's leftovers, measure.bench_slot's wait and its path, report.history's)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import signal
import subprocess
import sys
import threading
import time

from optimizer.core.errors import OptimizerError

from .adversarial import Shared, _refused

KIND = "R4.7 signals, locks and the environment"


@contextlib.contextmanager
def _env(name: str, value: str):  # type: ignore[no-untyped-def]
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def add_cases(r: Shared) -> None:
    from optimizer.deploy.export import export_bundle
    from optimizer.measure.bench_slot import bench_slot, slot_path
    from optimizer.report.history import default_path, load_report

    r.work.mkdir(parents=True, exist_ok=True)

    def slot_missing_folder() -> bool | str:
        with _env("OPTIMIZER_BENCH_SLOT", str(r.work / "no" / "slot.lock")):
            return _refused(slot_path, OptimizerError)

    def slot_a_folder() -> bool | str:
        with _env("OPTIMIZER_BENCH_SLOT", str(r.work)):
            return _refused(slot_path, OptimizerError)

    def history_a_folder() -> bool | str:
        with _env("OPTIMIZER_HISTORY", str(r.work)):
            try:
                default_path()
            except OptimizerError as e:
                return True if "folder" in str(e) and "damaged" not in str(e) else f"said: {e}"
        return "accepted"

    def leftover_cleared() -> bool | str:
        left = r.work / ".out.partial-killed"
        left.mkdir()
        (left / "model.onnx").write_bytes(b"half")
        export_bundle(load_report(str(r.run)), "ort_session", "onnx", r.work / "out")
        return True if not left.exists() and (r.work / "out" / "manifest.json").is_file() else "left behind"

    def wait_said() -> bool | str:
        path = r.work / "slot.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: the same process's bench_slot waits on it too
        threading.Timer(0.5, os.close, (fd,)).start()
        err = io.StringIO()
        with _env("OPTIMIZER_BENCH_SLOT", str(path)), contextlib.redirect_stderr(err), bench_slot("corpus"):
            pass
        return True if "waiting for the bench slot" in err.getvalue() else f"silent: {err.getvalue()!r}"

    def sigterm_bench() -> bool | str:
        path = r.work / "slot2.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "optimizer", "bench", str(r.bundle)], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={**os.environ, "OPTIMIZER_BENCH_SLOT": str(path), "OPTIMIZER_DEBUG": ""})
            time.sleep(6)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            os.close(fd)
        return True if proc.returncode == 130 and "interrupted" in err else f"exit {proc.returncode}: {err[-200:]!r}"

    r.out.add(KIND, "OPTIMIZER_BENCH_SLOT in a missing folder", slot_missing_folder)
    r.out.add(KIND, "OPTIMIZER_BENCH_SLOT naming a folder", slot_a_folder)
    r.out.add(KIND, "OPTIMIZER_HISTORY naming a folder", history_a_folder)
    r.out.add(KIND, "a killed export's .partial-* folder", leftover_cleared)
    r.out.add(KIND, "waiting for the bench slot", wait_said)
    r.out.add(KIND, "SIGTERM during bench", sigterm_bench)
