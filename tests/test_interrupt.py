"""Interruption: a compile stopped mid-benchmark keeps what it finished, and the re-run resumes from it."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FAST_BENCH, TESTS, mlp_recipe, write_recipe


def start_compile(recipe: Path, out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    cmd = [sys.executable, "-m", "optimizer", "compile", str(recipe), "--out", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def as_measured(metrics: dict[str, Any]) -> dict[str, Any]:
    """A report's stage metrics as metrics.json holds them: the report widens each in-run interval by the run's
    spread between sessions (measure.instances) and keeps the in-run one beside it."""
    out = copy.deepcopy(metrics)
    for scen in out.get("scenarios", {}).values():
        vs = scen.get("vs_parent") or {}
        if "in_run_low" in vs:
            vs["low"], vs["high"] = vs.pop("in_run_low"), vs.pop("in_run_high")
            vs.pop("instance_sd")
            vs["verdict"] = "faster" if vs["low"] > 1 else "slower" if vs["high"] < 1 else "within noise"
    return out


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"compile ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killed_mid_benchmark_resumes_with_same_numbers(tmp_path: Path, sig: signal.Signals) -> None:
    # Rounds long enough that the signal lands while ort_session is being timed.
    data = mlp_recipe(benchmark={**FAST_BENCH, "warmup": 2, "rounds": 6, "iterations": 3, "min_round_seconds": 0.25})
    recipe = write_recipe(tmp_path, data)
    out = tmp_path / "out"
    proc = start_compile(recipe, out)
    wait_for(out / "01-export" / "metrics.json", proc)
    time.sleep(0.3)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130
        report = json.loads((out / "report.json").read_text())
        assert [s["status"] for s in report["stages"]] == ["ran", "ran", "interrupted"]
    assert not (out / "02-ort_session" / "metrics.json").exists()
    before = {n: json.loads((out / n / "metrics.json").read_text()) for n in ("00-source", "01-export")}

    rerun = start_compile(recipe, out)
    rerun.communicate(timeout=300)
    assert rerun.returncode == 0
    report = json.loads((out / "report.json").read_text())
    # The ort_session artifact was finished before the signal (its benchmark was not): reused, then measured.
    assert [s["status"] for s in report["stages"]] == ["cached", "cached", "cached"]
    assert (out / "02-ort_session" / "metrics.json").is_file()
    assert report["stages"][2]["metrics"]["scenarios"]["b1"]["latency"]["n"] > 0
    for stage, name in zip(report["stages"][:2], before, strict=True):
        assert as_measured(stage["metrics"]) == before[name]["metrics"]
    assert not list(out.glob(".building-*")) and not list(out.rglob(".*.tmp-*"))
