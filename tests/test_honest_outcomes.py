"""Honest outcomes (issue: nothing trusted blindly, class 5): a killed run never reads as ok, a full disk or a
broken history is one line with the right exit code while the results still show, reports of another schema or
of another model are not compared as if they were the same thing."""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe
from test_recipe import TESTS, run_cli


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("finished")
    recipe = write_recipe(tmp, mlp_recipe())
    proc = run_cli("compile", str(recipe), "--out", str(tmp / "run"), "--no-history")
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert len(lines) == 1, stderr
    return lines[0]


# ---------------------------------------------------------------- kill -9
@pytest.mark.slow
def test_a_killed_run_does_not_report_ok(tmp_path: Path) -> None:
    """The report is rewritten after every stage; until the run ends it must not say ok."""
    slow = {**mlp_recipe()["benchmark"], "rounds": 40}
    recipe = write_recipe(tmp_path, mlp_recipe(benchmark=slow, passes=[{"type": "export"}, {"type": "ort_session"}]))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimizer", "compile", str(recipe), "--out", str(out), "--no-history"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while not (out / "report.json").is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed: make it slower"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((out / "report.json").read_text())
    assert report["outcome"] == "incomplete"
    assert any(st["status"] == "pending" for st in report["stages"])
    shown = run_cli("report", str(out))  # a reader says what happened
    assert shown.returncode == 0 and "incomplete" in shown.stdout and "killed" in shown.stdout


# ---------------------------------------------------------------- disk full while writing the report
@pytest.mark.slow
def test_disk_full_writing_the_report_is_one_line_and_the_results_still_show(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, mlp_recipe())
    out = tmp_path / "run"
    # A sitecustomize that makes writes of report.html fail with ENOSPC after writing part of the file (the
    # run folder's writes create their temp file with rundir.open_new).
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import errno\n"
        "import optimizer.engine.rundir as rd\n"
        "real = rd.open_new\n"
        "def open_new(path, mode='wb'):\n"
        "    f = real(path, mode)\n"
        "    if '.report.html.tmp' in path.name:\n"
        "        write = f.write\n"
        "        def full(data):\n"
        "            write(data[:100])\n"
        f"            raise OSError({errno.ENOSPC}, 'No space left on device')\n"
        "        f.write = full\n"
        "    return f\n"
        "rd.open_new = open_new\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{hook}:{TESTS}"}
    proc = subprocess.run(
        [sys.executable, "-m", "optimizer", "compile", str(recipe), "--out", str(out), "--no-history"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert "report.html" in line and "No space left on device" in line
    assert "ort_session" in proc.stdout  # the results table was printed all the same
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]  # no temp file left behind
    assert json.loads((out / "report.json").read_text())["outcome"] == "ok"  # what could be written, was


# ---------------------------------------------------------------- the history
@pytest.mark.slow
def test_a_corrupt_history_does_not_hide_the_results(tmp_path: Path) -> None:
    history = tmp_path / "history.sqlite"
    history.write_bytes(b"this is not a database" * 100)
    recipe = write_recipe(tmp_path, mlp_recipe())
    proc = run_cli("--history", str(history), "compile", str(recipe), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr  # the compile itself succeeded
    assert "ort_session" in proc.stdout
    assert "not recorded in the run history" in proc.stderr and str(history) in proc.stderr


def _history_with_runs(finished_run: Path, path: Path, n: int = 3) -> None:
    from optimizer.report.history import record
    from optimizer.report.schema import read_report

    report = read_report(finished_run / "report.json")
    for _ in range(n):
        record(report, path)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


@pytest.mark.slow
def test_a_page_corrupted_history_is_one_line(finished_run: Path, tmp_path: Path) -> None:
    history = tmp_path / "history.sqlite"
    _history_with_runs(finished_run, history)
    with sqlite3.connect(history) as conn:
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'runs'").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(history.read_bytes())
    start = (root - 1) * size
    data[start : start + size] = b"\xff" * size  # the runs table's root page; file header and schema intact
    history.write_bytes(bytes(data))
    for args in (("runs",), ("diff", "1", "2")):
        proc = run_cli("--history", str(history), *args)
        assert proc.returncode == 2, proc.stderr
        line = _one_error_line(proc.stderr)
        assert str(history) in line and "damaged" in line


# ---------------------------------------------------------------- reports we cannot compare or read
@pytest.mark.slow
def test_unknown_schema_version_is_refused(finished_run: Path, tmp_path: Path) -> None:
    report = json.loads((finished_run / "report.json").read_text())
    report["schema_version"] = 99
    newer = tmp_path / "report.json"
    newer.write_text(json.dumps(report))
    proc = run_cli("diff", str(finished_run), str(newer))
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "schema_version 99" in line and str(newer) in line


@pytest.mark.slow
def test_a_v1_report_still_shows_and_diffs_against_a_v3_one(finished_run: Path) -> None:
    """Reports written before schema_version 3 are upgraded when read: `report` and `diff` take them as they are."""
    v1 = TESTS / "data" / "report_v1_minilm.json"
    assert json.loads(v1.read_text())["schema_version"] == 1
    assert json.loads((finished_run / "report.json").read_text())["schema_version"] == 3
    shown = run_cli("report", str(v1))
    assert shown.returncode == 0, shown.stderr
    assert "b1-natural (batch 1, natural lengths 11-19 tokens" in shown.stdout
    assert "best: `int8_dynamic`" in shown.stdout
    both = run_cli("diff", str(v1), str(finished_run), "--different-models", "--format", "json")
    assert both.returncode == 0, both.stderr
    assert json.loads(both.stdout)["a"]["recipe"] == "minilm-cpu"


@pytest.mark.slow
def test_diff_of_runs_of_different_models_says_so(finished_run: Path, tmp_path: Path) -> None:
    report: dict[str, Any] = json.loads((finished_run / "report.json").read_text())
    report["recipe"]["name"] = "other"
    report["recipe"]["model"] = {"source": "factory", "target": "tiny_models:data_dependent", "kwargs": {}}
    other = tmp_path / "report.json"
    other.write_text(json.dumps(report))
    proc = run_cli("diff", str(finished_run), str(other))
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "different models" in line and "--different-models" in line
    forced = run_cli("diff", str(finished_run), str(other), "--different-models")
    assert forced.returncode == 0 and "different models" in forced.stdout


def test_report_write_failure_removes_its_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.core.errors import OptimizerError
    from optimizer.engine import rundir

    real = rundir.open_new

    def full(path: Path, mode: str = "wb") -> Any:  # the temp file fills the disk part way through
        f = real(path, mode)
        write = f.write

        def partial(data: Any) -> int:
            write(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

        f.write = partial  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(rundir, "open_new", full)
    with pytest.raises(OptimizerError, match=r"x\.json: cannot write \(No space left on device\)"):
        rundir.write_json(tmp_path / "x.json", {"a": 1})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
