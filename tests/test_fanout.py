"""ctx.map: a pass's independent evaluations (the hybrid search's per-node sensitivities) spread over worker
processes with `optimizer compile --workers N`, giving the numbers a serial run gives (issue 18)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe
from test_hybrid_gpu import run_pass, sensitive_graph
from test_workers import compile_code

from optimizer.core.errors import PassError
from optimizer.core.pass_base import PassContext
from optimizer.measure import services
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.inputs import build_feeds


def where(ctx: PassContext, item: int) -> tuple[int, int, int | None]:
    """item doubled, the process it ran in and its sessions' threads."""
    if item < 0:
        raise PassError(f"item {item}: negative")
    return item * 2, os.getpid(), ctx.recipe.target.threads


def context(tmp_path: Path, workers: int, threads: int = 4) -> tuple[PassContext, list[tuple[str, int, int]]]:
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(target={"device": "cpu", "threads": threads})))
    seen: list[tuple[str, int, int]] = []
    ctx = PassContext(recipe, "s", tmp_path, build_feeds(recipe, 2), services.MeasureServices(workers),
                      progress=lambda what, done, total: seen.append((what, done, total)))
    return ctx, seen


def test_serial_map_runs_here_in_order(tmp_path: Path) -> None:
    ctx, seen = context(tmp_path, 1)
    assert ctx.map(where, [3, 1, 2], "doubling") == [(6, os.getpid(), 4), (2, os.getpid(), 4), (4, os.getpid(), 4)]
    assert seen == [("doubling", 1, 3), ("doubling", 2, 3), ("doubling", 3, 3)]


@pytest.mark.slow
def test_two_workers_share_the_threads_and_keep_the_order(tmp_path: Path) -> None:
    ctx, seen = context(tmp_path, 2)
    out = ctx.map(where, list(range(6)), "doubling")
    assert [x for x, _, _ in out] == [0, 2, 4, 6, 8, 10]
    pids = {pid for _, pid, _ in out}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert {threads for _, _, threads in out} == {2}  # 4 threads // 2 workers
    assert [done for _, done, _ in seen] == [1, 2, 3, 4, 5, 6]  # progress in this process, as items finish
    assert ctx.recipe.target.threads == 4  # the workers' copy changed, not this one


@pytest.mark.slow
def test_a_worker_error_is_raised_here(tmp_path: Path) -> None:
    ctx, _ = context(tmp_path, 2)
    with pytest.raises(PassError, match="item -1: negative"):
        ctx.map(where, [1, -1, 2])


def _sensitivity(tmp_path: Path, workers: int) -> dict[str, float]:
    """The CPU hybrid search's per-node INT8 sensitivities on the 5-MatMul graph."""
    from passes.quantize import hybrid

    tmp_path.mkdir()
    src = tmp_path / "sensitive.onnx"
    sensitive_graph(src)
    recipe = load_recipe(write_recipe(tmp_path, {
        "name": "fanout", "model": {"source": "onnx", "path": "sensitive.onnx"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4, 32]}], "outputs": ["y"],
        "scenarios": [{"name": "b2", "batch": 2, "seq": 1}], "target": {"device": "cpu", "threads": 2},
        "accuracy": {"metric": "cosine", "min": 0.99, "samples": 4}, "passes": [],
    }))
    feeds = build_feeds(recipe, 4)
    ctx = PassContext(recipe, "hybrid", tmp_path, feeds, services.MeasureServices(workers))
    evaluator = hybrid.Evaluator(src, feeds.by_scenario["b2"].samples, [], ctx, {})
    state = hybrid.Search(budget=0.99, margin=0.0, choose="most_int8")
    work = tmp_path / "work"
    work.mkdir()
    nodes = ["normal_1", "outlier_in", "outlier_overflow", "normal_2", "normal_3"]
    hybrid.search(src, work, nodes, evaluator, state, False, ["MatMul"], lambda *_: None, timed=False)
    assert not list(work.glob("single*"))  # each node's graph is removed once scored
    return state.sensitivity


@pytest.mark.slow
def test_cpu_hybrid_sensitivities_are_the_serial_ones(tmp_path: Path) -> None:
    serial, pooled = _sensitivity(tmp_path / "serial", 1), _sensitivity(tmp_path / "pool", 2)
    assert pooled == serial  # equal numbers, not merely close
    assert serial["outlier_in"] > 0.5 and serial["normal_1"] < 1e-2  # and real ones


@pytest.mark.slow
def test_gpu_hybrid_simulated_sensitivities_are_the_serial_ones(tmp_path: Path) -> None:
    runs = {}
    for workers in (1, 2):
        folder = tmp_path / str(workers)
        folder.mkdir()
        _, record, _ = run_pass(folder, services.MeasureServices(workers))
        runs[workers] = record
    table = {w: [(n["node"], n["sensitivity_int8"], n["sensitivity_fp16"], n["precision"]) for n in r["nodes"]]
             for w, r in runs.items()}
    assert table[2] == table[1]
    assert runs[2]["simulation_runs"] == runs[1]["simulation_runs"] and runs[2]["counts"] == runs[1]["counts"]
    assert {n["node"]: n["sensitivity_int8"] > 0.5 for n in runs[2]["nodes"]}["outlier_in"]


@pytest.mark.slow
def test_compile_workers_with_one_recipe_reach_the_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    init = services.MeasureServices.__init__

    def record(self: Any, workers: int = 1) -> None:
        made.append(workers)
        init(self, workers)

    monkeypatch.setattr(services.MeasureServices, "__init__", record)
    path = write_recipe(tmp_path, mlp_recipe(name="fan", passes=[{"type": "export"}]))
    assert compile_code("compile", str(path), "--no-bench", "--workers", "2", "--out", str(tmp_path / "run")) == 0
    assert made == [2]  # in this process: the one recipe compiles here, its passes fan out over 2


@pytest.mark.slow
def test_workers_import_our_optimizer_after_onnxruntime_transformers(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime.transformers appends its folder (which holds an optimizer.py) to sys.path; a worker started
    after that (the hybrid search runs after fuse) must still import ours, wherever the compile was started."""
    import onnxruntime.transformers

    import optimizer

    ort_dir = str(Path(onnxruntime.transformers.__file__).parent)
    assert (Path(ort_dir) / "optimizer.py").is_file()
    root = str(Path(optimizer.__file__).resolve().parents[1])
    here = str(Path(__file__).parent)
    # as under the `optimizer` console script: neither the working folder nor our root on the path
    monkeypatch.setattr(sys, "path", [here, *(p for p in sys.path if p not in ("", root, os.getcwd(), ort_dir)),
                                      ort_dir])
    ctx, _ = context(tmp_path, 2)
    assert [x for x, _, _ in ctx.map(where, [1, 2])] == [2, 4]
    assert root not in sys.path  # put back as it was
