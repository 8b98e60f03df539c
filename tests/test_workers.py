"""Many recipes at once: the host's bench slot keeps timings apart, every report records its timed windows, and
`optimizer compile A B DIR --workers N` gives what serial compiles give, with reports and history from the driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.cli.app import main
from optimizer.core.metrics import TimedWindow
from optimizer.measure import bench_slot
from optimizer.report.history import list_runs
from optimizer.report.schema import RunReport, read_report
from optimizer.report.windows import overlapping_windows, report_windows

HOLD = textwrap.dedent("""
    import json, sys, time
    from optimizer.measure.bench_slot import bench_slot
    print("ready", flush=True)
    sys.stdin.readline()  # both processes start asking at once
    with bench_slot(sys.argv[1]) as w:
        time.sleep(0.5)
    print(json.dumps(w.to_json()), flush=True)
""")


def small(name: str, **overrides: Any) -> dict[str, Any]:
    """The tiny MLP, one scenario, export only: a recipe that compiles in seconds."""
    return mlp_recipe(name=name, scenarios=[{"name": "b1", "batch": 1, "seq": 1}], passes=[{"type": "export"}],
                      **overrides)


def compile_code(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def window(host: str, start: float, end: float, what: str = "x") -> dict[str, Any]:
    return {"host": host, "start": start, "end": end, "pid": 1, "what": what}


# ------------------------------------------------------------ the bench slot
@pytest.mark.slow
def test_bench_slot_excludes_a_second_process() -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", HOLD, f"p{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
        for i in range(2)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    windows = [TimedWindow.model_validate(json.loads(p.communicate()[0].strip().splitlines()[-1])) for p in procs]
    a, b = sorted(windows, key=lambda w: w.start)
    assert a.end - a.start >= 0.5 and b.end - b.start >= 0.5
    assert b.start >= a.end  # the second waited for the first: held 0.5 s each, one after the other
    assert a.host == b.host == bench_slot.hostname() and a.pid != b.pid


def test_bench_slot_is_reentrant_and_collects_windows() -> None:
    with bench_slot.collect_windows() as seen:
        with bench_slot.bench_slot("outer") as outer:
            assert bench_slot.holding()
            with bench_slot.bench_slot("inner") as inner:
                assert inner is None  # already held by this process: no second lock, no window of its own
        assert not bench_slot.holding()
    assert outer is not None and [w.what for w in seen] == ["outer"] and seen[0].end >= seen[0].start > 0


def test_overlapping_windows_same_host_only() -> None:
    from test_report_schema import report_of

    def rep(*windows: dict[str, Any]) -> RunReport:
        return report_of([{"index": 0, "name": "source", "type": "source", "parent": None, "status": "ran",
                           "pass_timed_windows": list(windows)}])

    a = rep(window("h1", 10.0, 20.0, "a"), window("h1", 30.0, 40.0, "b"))
    b = rep(window("h1", 19.0, 25.0, "c"), window("h2", 10.0, 40.0, "d"))
    pairs = overlapping_windows([a, b])
    assert [(x.what, y.what) for x, y in pairs] == [("a", "c")]
    assert overlapping_windows([a]) == [] and len(report_windows(b)) == 2
    assert overlapping_windows([a, a]) == []  # one window reported twice is not an overlap with itself


# ------------------------------------------------------------ many recipes
@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same recipes compiled one after another and by a pool of 2 workers (a folder of them, with one whose
    export fails and one that does not load)."""
    root = tmp_path_factory.mktemp("workers")
    folder = root / "recipes"
    folder.mkdir()
    write_recipe(folder, small("w-one"), "one.yaml")
    write_recipe(folder, small("w-two", seed=1), "two.yaml")
    write_recipe(folder, small("w-bad", model={"source": "factory", "target": "tiny_models:data_dependent"}),
                 "three.yaml")
    write_recipe(folder, {**small("w-broken"), "benchmark": {"rounds": "many"}}, "zz-broken.yaml")
    history = root / "history.sqlite"
    serial = compile_code("--history", str(history), "compile", str(folder / "one.yaml"), str(folder / "two.yaml"),
                          "--out", str(root / "serial"))
    start = time.perf_counter()
    pooled = compile_code("--history", str(history), "compile", str(folder), "--out", str(root / "pool"),
                          "--workers", "2")
    return {"root": root, "history": history, "serial": serial, "pooled": pooled,
            "pool_seconds": time.perf_counter() - start}


@pytest.mark.slow
def test_pool_gives_the_serial_statuses_and_no_overlapping_windows(compiled: dict[str, Any]) -> None:
    root = compiled["root"]
    assert compiled["serial"] == 0
    reports = []
    for name in ("w-one", "w-two"):
        serial, pooled = (read_report(root / side / name / "report.json") for side in ("serial", "pool"))
        assert [(s.name, s.status) for s in pooled.stages] == [(s.name, s.status) for s in serial.stages]
        assert [s.status for s in pooled.stages] == ["ran", "ran"]
        assert pooled.outcome == serial.outcome == "ok"
        assert pooled.run_dir == str(root / "pool" / name)
        reports.append(pooled)
    windows = [w for r in reports for w in report_windows(r)]
    # per recipe: calibration before and after, and per stage its timing and its op profile
    timed = sorted(w.what for w in windows if not w.what.startswith("calibration"))
    assert timed == sorted([f"{s} {part}" for s in ("source", "export") for part in ("timing", "profile")] * 2)
    assert {w.pid for w in windows}.isdisjoint({os.getpid()})  # timed in the workers ...
    reports.append(read_report(root / "pool" / "w-bad" / "report.json"))
    assert overlapping_windows(reports) == []  # ... never two at once


@pytest.mark.slow
def test_a_failing_recipe_keeps_the_others_and_the_exit_code_is_the_worst(compiled: dict[str, Any]) -> None:
    root = compiled["root"]
    assert compiled["pooled"] == 2  # zz-broken.yaml does not load (2), w-bad's export fails (1): the worst
    bad = read_report(root / "pool" / "w-bad" / "report.json")
    assert bad.failed_stages == ["export"] and bad.outcome == "failed"
    assert read_report(root / "pool" / "w-one" / "report.json").outcome == "ok"
    assert not (root / "pool" / "w-broken").exists()


@pytest.mark.slow
def test_history_is_written_by_the_driver_alone(compiled: dict[str, Any], tmp_path: Path) -> None:
    runs = list_runs(compiled["history"], limit=100)
    # serial: 2 runs; pool: 3 reports (the broken recipe never ran); each once, from the driver
    assert sorted(r["recipe"] for r in runs) == sorted(["w-one", "w-two", "w-one", "w-two", "w-bad"])
    pooled = {r["recipe"]: r["run_dir"] for r in runs if "/pool/" in r["run_dir"]}
    assert pooled == {n: str(compiled["root"] / "pool" / n) for n in ("w-one", "w-two", "w-bad")}


# ------------------------------------------------------------ another host
@pytest.mark.slow
def test_a_worker_on_another_host_hands_its_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.engine.jobs import Job, merge_phases, receive, run_phase
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import build_report

    path = write_recipe(tmp_path, small("w-remote"))
    run_dir = tmp_path / "runs" / "w-remote"
    monkeypatch.setattr(bench_slot, "hostname", lambda: "elsewhere")
    job = Job(path, run_dir)
    built = run_phase(job, "driver-host", "build")
    assert built.packed is None and built.workdir is not None and Path(built.workdir).is_dir()
    measured = run_phase(job, "driver-host", "measure", built.workdir)
    assert measured.packed and not Path(built.workdir).exists() and not run_dir.exists()  # nothing written here
    result = receive(merge_phases(built, measured))
    assert [r.status for r in result.records] == ["ran", "ran"]  # as built, not "cached" by the measure phase
    export = result.records[1].artifact
    assert export is not None and export.path is not None and export.path.is_relative_to(run_dir)
    assert export.path.is_file()
    report = build_report(load_recipe(path), result.records, run_dir, result.wall_seconds)
    assert {w.host for w in report_windows(report)} == {"elsewhere"}
    assert report.machine is not None and report.machine.calibration is not None
    assert report.machine.calibration.after_ms is not None  # machine.json came back with the stages


def test_ctx_time_holds_the_bench_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hybrid search's timings (ctx.time while a pass builds) take the slot too, and only for the timing."""
    from optimizer.core.pass_base import PassContext
    from optimizer.measure import services
    from optimizer.recipe.loading import load_recipe
    from optimizer.runtime.runners.base import Session

    class Still(Session):
        output_names = ["y"]

        def run(self, prepared: Any) -> Any:
            return prepared

        def to_numpy(self, outputs: Any) -> list[Any]:
            return []

    held: list[bool] = []

    def fake_measure(child: Any, parent: Any, settings: Any, *_: Any) -> None:
        held.append(bench_slot.holding())
        child.rounds, parent.rounds = [[1.0, 1.1, 0.9]] * 4, [[2.0, 2.1, 1.9]] * 4

    monkeypatch.setattr(services, "measure", fake_measure)
    recipe = load_recipe(write_recipe(tmp_path, small("w-ctx")))
    ctx = PassContext(recipe, "int8_hybrid", tmp_path, None, services.MeasureServices())  # type: ignore[arg-type]
    with bench_slot.collect_windows() as seen:
        result = ctx.time(Still(), Still(), [{}])
    assert held == [True] and not bench_slot.holding()
    assert [w.what for w in seen] == ["int8_hybrid hybrid timing"] and result.ratio == pytest.approx(2.0)


@pytest.mark.slow
def test_pool_hands_each_stage_end_to_the_driver(tmp_path: Path) -> None:
    """The driver gets each recipe's records as its stages end (before run_pool returns), so it can write the
    in-progress report a serial compile writes: `optimizer report RUN` during a pooled compile."""
    from optimizer.engine.jobs import Job
    from optimizer.engine.pool import run_pool
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import write_report

    paths = [write_recipe(tmp_path, small(f"w-live{i}", seed=i), f"{i}.yaml") for i in range(2)]
    jobs = [Job(p, tmp_path / "runs" / f"w-live{i}", measure=False) for i, p in enumerate(paths)]  # quick
    seen: dict[str, list[list[str]]] = {}
    outcomes: list[str] = []

    def on_records(job: Job, records: list[Any]) -> None:
        seen.setdefault(job.run_dir.name, []).append([r.status for r in records])
        write_report(load_recipe(job.recipe_path), records, job.run_dir, 1.0, in_progress=True)
        outcomes.append(read_report(job.run_dir / "report.json").outcome)

    results = run_pool(jobs, 2, on_records=on_records)
    assert [r.error for r in results] == [None, None]
    # after the source stage (export not reached yet), then after the export stage
    assert seen == {f"w-live{i}": [["ran", "not run"], ["ran", "ran"]] for i in range(2)}
    assert set(outcomes) == {"incomplete"}


@pytest.mark.slow
def test_ctrl_c_starts_no_queued_recipe(tmp_path: Path) -> None:
    """Ctrl-C during `--workers 2` with 3 recipes: the queued third never starts, the two running stop, and the
    summary counts what did finish cleanly."""
    import re
    import signal

    from conftest import TESTS

    folder = tmp_path / "recipes"
    folder.mkdir()
    for name in ("i-a", "i-b", "i-c"):
        write_recipe(folder, {**small(name), "passes": [{"type": "export"}, {"type": "ort_session"}]}, f"{name}.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimizer.cli.app", "--history", str(tmp_path / "h.sqlite"), "compile", str(folder),
         "--workers", "2", "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TESTS.parent, env=env,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the first stage line: both workers busy, the third recipe queued
    assert first.startswith(("i-a: 00 source", "i-b: 00 source")), first
    start = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert time.perf_counter() - start < 60
    assert not (tmp_path / "out" / "i-c").exists()  # never started
    assert "i-c.yaml: interrupted before its first stage finished" in err
    summary = re.search(r"interrupted: (\d) of 3 recipes finished cleanly", err)
    assert summary is not None, err
    ok = [n for n in ("i-a", "i-b") if (tmp_path / "out" / n / "report.json").is_file()
          and read_report(tmp_path / "out" / n / "report.json").outcome == "ok"]
    assert int(summary.group(1)) == len(ok)
