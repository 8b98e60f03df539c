"""Issue 47, class 7 (signals, locks and the environment): every command answers SIGTERM as Ctrl-C (exit 130 and a
line, bench included); an export clears the staging folders killed exports into the same --out left; a wait for
the bench slot another process holds is said; OPTIMIZER_BENCH_SLOT and OPTIMIZER_HISTORY that cannot be what
they name are one line, exit 2."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import TESTS, mlp_recipe


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS), **extra}
    env.pop("OPTIMIZER_DEBUG", None)
    return env


def _run(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "optimizer.cli.app", *args], cwd=cwd, env=_env(**env), text=True,
                          capture_output=True, timeout=180)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("signals")
    (root / "r.yaml").write_text(yaml.safe_dump(mlp_recipe(), sort_keys=False))
    got = _run("compile", str(root / "r.yaml"), "--out", str(root / "run"), "--no-history", cwd=root)
    assert got.returncode == 0, got.stderr
    got = _run("export", str(root / "run"), "--stage", "ort_session", "--out", str(root / "bundle"), cwd=root)
    assert got.returncode == 0, got.stderr
    return root


def _held_slot(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _wait_for(path: Path, text: str, seconds: float = 60) -> str:
    end = time.time() + seconds
    while time.time() < end:
        got = path.read_text() if path.exists() else ""
        if text in got:
            return got
        time.sleep(0.2)
    return path.read_text() if path.exists() else ""


def test_sigterm_during_bench_exits_130_with_a_line(bundle: Path, tmp_path: Path) -> None:
    slot = tmp_path / "slot.lock"
    fd = _held_slot(slot)  # bench waits on it: it is surely in the middle of the command when SIGTERM comes
    err = tmp_path / "err.txt"
    try:
        with err.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "optimizer.cli.app", "bench", str(bundle / "bundle")],
                                    cwd=tmp_path, env=_env(OPTIMIZER_BENCH_SLOT=str(slot)), stderr=f,
                                    stdout=subprocess.DEVNULL, text=True)
            said = _wait_for(err, "waiting for the bench slot")
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
    finally:
        os.close(fd)
    assert "waiting for the bench slot" in said, said
    assert rc == 130, (rc, err.read_text())
    assert "interrupted" in err.read_text(), err.read_text()


def test_a_compile_waiting_for_the_bench_slot_says_so(tmp_path: Path) -> None:
    slot = tmp_path / "slot.lock"
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(mlp_recipe(), sort_keys=False))
    fd = _held_slot(slot)
    err = tmp_path / "err.txt"
    released = False
    try:
        with err.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "optimizer.cli.app", "compile", "r.yaml", "--out", "run",
                                     "--no-history"], cwd=tmp_path, env=_env(OPTIMIZER_BENCH_SLOT=str(slot)),
                                    stderr=f, stdout=subprocess.DEVNULL, text=True)
            said = _wait_for(err, "waiting for the bench slot", 90)
            os.close(fd)
            released = True
            rc = proc.wait(180)
    finally:
        if not released:
            os.close(fd)
    assert "waiting for the bench slot" in said and str(slot) in said, said
    assert rc == 0, err.read_text()


def test_export_clears_what_a_killed_export_into_the_same_out_left(bundle: Path, tmp_path: Path) -> None:
    left = tmp_path / ".b.partial-k1ll3d"
    (left / "model.onnx").parent.mkdir()
    (left / "model.onnx").write_bytes(b"half")
    other = tmp_path / ".c.partial-k1ll3d"  # another --out's: not this export's to clear
    other.mkdir()
    got = _run("export", str(bundle / "run"), "--stage", "ort_session", "--out", str(tmp_path / "b"), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert not left.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.partial-k1ll3d", "b"]


def test_bench_slot_in_a_missing_folder_is_one_line(bundle: Path, tmp_path: Path) -> None:
    slot = tmp_path / "no" / "such" / "slot.lock"
    got = _run("bench", str(bundle / "bundle"), cwd=tmp_path, OPTIMIZER_BENCH_SLOT=str(slot))
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "OPTIMIZER_BENCH_SLOT" in lines[0] and str(slot.parent) in lines[0], got.stderr


def test_history_naming_a_folder_is_a_correct_line(tmp_path: Path) -> None:
    folder = tmp_path / "hist"
    folder.mkdir()
    got = _run("runs", cwd=tmp_path, OPTIMIZER_HISTORY=str(folder))
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "OPTIMIZER_HISTORY" in lines[0] and "folder" in lines[0], got.stderr
    assert "damaged" not in got.stderr and "move it aside" not in got.stderr


def test_a_command_called_in_process_gives_the_callers_signal_handlers_back(tmp_path: Path) -> None:
    """main(argv) from Python (a script, a notebook, the tests) is not the process's end: an export ignores
    Ctrl-C once its bundle is in place, and that ignore outlived the call, so every later child of the caller was
    started with SIGINT ignored (the suite's Ctrl-C tests exited 0 after an in-process export)."""
    from conftest import compile_mlp

    from optimizer.cli.app import main

    run = compile_mlp(tmp_path / "run")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit) as done:
        main(["--history", str(tmp_path / "h.sqlite"), "export", str(run), "--stage", "ort_session",
              "--out", str(tmp_path / "bundle")])
    assert done.value.code == 0
    assert {s: signal.getsignal(s) for s in before} == before
