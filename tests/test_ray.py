"""`optimizer compile --backend ray`: a local Ray (2 CPUs, one bench) compiles two tiny recipes, build tasks then
measure tasks, into the same run folders and reports as a local compile."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import write_recipe
from test_workers import compile_code, small

from optimizer.report.schema import read_report
from optimizer.report.windows import overlapping_windows, report_windows

ray = pytest.importorskip("ray")

TESTS = Path(__file__).parent


@pytest.fixture
def local_ray(monkeypatch: pytest.MonkeyPatch) -> Any:
    # Ray's workers import the recipes' factories (tiny_models) and inherit the debug setting from this env.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    ray.init(num_cpus=2, resources={"bench": 1}, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_two_recipes_through_ray(local_ray: Any, tmp_path: Path) -> None:
    a = write_recipe(tmp_path, small("r-one"), "one.yaml")
    b = write_recipe(tmp_path, small("r-two", seed=1), "two.yaml")
    history = tmp_path / "history.sqlite"
    code = compile_code("--history", str(history), "compile", str(a), str(b), "--out", str(tmp_path / "runs"),
                        "--backend", "ray")
    assert code == 0
    reports = [read_report(tmp_path / "runs" / n / "report.json") for n in ("r-one", "r-two")]
    for report in reports:
        assert [(s.name, s.status) for s in report.stages] == [("source", "ran"), ("export", "ran")]
        assert report.outcome == "ok"
        whats = [w.what for w in report_windows(report)]
        assert "source timing" in whats and "export timing" in whats
    assert overlapping_windows(reports) == []
    # every measure task gave the bench back (Ray reports freed resources a moment after the task ends)
    deadline = time.monotonic() + 10
    while local_ray.available_resources().get("bench") != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert local_ray.available_resources().get("bench") == 1


def test_cuda_recipes_ask_ray_for_a_gpu(tmp_path: Path) -> None:
    """The options the driver builds per task (no GPU needed to check them): a cuda recipe's measure task asks
    for a whole GPU and the bench, pinned to the node it was built on; its build task for a share of a GPU."""
    from optimizer.engine.jobs import Job
    from optimizer.engine.ray_backend import BUILD_GPU_SHARE, recipe_device, task_options

    cuda = write_recipe(tmp_path, small("r-cuda", target={"device": "cuda"}), "cuda.yaml")
    cpu = write_recipe(tmp_path, small("r-cpu"), "cpu.yaml")
    assert [recipe_device(Job(p, tmp_path / "runs")) for p in (cuda, cpu)] == ["cuda", "cpu"]
    node = "ab" * 28
    measure = task_options("cuda", "measure", 1, node)
    assert measure["num_gpus"] == 1 and measure["resources"] == {"bench": 1} and measure["num_cpus"] == 1
    assert measure["scheduling_strategy"].node_id == node and measure["scheduling_strategy"].soft is False
    build = task_options("cuda", "build", 1)
    assert build["num_gpus"] == BUILD_GPU_SHARE and "resources" not in build and "scheduling_strategy" not in build
    assert not any("num_gpus" in task_options("cpu", phase, 1, node) for phase in ("build", "measure"))
    for options in (measure, build):
        ray.remote(lambda: None).options(**options)  # Ray accepts them as task options


def test_an_address_with_no_head_is_one_line_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ray alone retries its GCS for minutes, printing warnings: a head that refuses a connection is one line."""
    import time

    from optimizer.core.errors import OptimizerError
    from optimizer.engine.ray_backend import check_address

    a = write_recipe(tmp_path, small("r-one"), "one.yaml")
    b = write_recipe(tmp_path, small("r-two", seed=1), "two.yaml")
    start = time.perf_counter()
    code = compile_code("--history", str(tmp_path / "h.sqlite"), "compile", str(a), str(b), "--backend", "ray",
                        "--address", "127.0.0.1:1", "--out", str(tmp_path / "runs"))
    assert code == 2 and time.perf_counter() - start < 15
    assert capsys.readouterr().err.strip() == "error: --address 127.0.0.1:1: no Ray head there (Connection refused)"
    assert not (tmp_path / "runs").exists() and not ray.is_initialized()
    with pytest.raises(OptimizerError, match=r"^--address nonsense: expected host:port"):
        check_address("nonsense")
    check_address("auto")  # Ray's to resolve


@pytest.mark.slow
def test_ctrl_c_reports_what_finished(tmp_path: Path) -> None:
    """Ctrl-C during `--backend ray`: the tasks are cancelled, "interrupted" is said, exit 130, in seconds."""
    import signal
    import subprocess
    import sys
    import time

    for name in ("r-a", "r-b", "r-c"):
        write_recipe(tmp_path, {**small(name), "passes": [{"type": "export"}, {"type": "ort_session"}]}, f"{name}.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimizer.cli.app", "--history", str(tmp_path / "h.sqlite"), "compile",
         *(str(tmp_path / f"{n}.yaml") for n in ("r-a", "r-b", "r-c")), "--backend", "ray", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TESTS.parent, env=env,
    )
    deadline = time.monotonic() + 120
    while not (out.is_dir() and any(out.iterdir())) and time.monotonic() < deadline:  # a build task has begun
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    start = time.perf_counter()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert time.perf_counter() - start < 60
    assert "interrupted: the workers stopped; the reports of what they finished follow" in err
    assert "recipes finished cleanly" in err
