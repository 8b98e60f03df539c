"""End to end on the tiny MLP: stages, folders, report numbers, caching, failures and skips."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import mlp_recipe, write_recipe
from onnx import TensorProto, helper

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.report.build import write_report


def compile_recipe(path: Path, out: Path) -> dict:
    """The report as report.json holds it (a RunReport's JSON)."""
    recipe = load_recipe(path)
    records = Pipeline(recipe, out).execute()
    return json.loads(json.dumps(write_report(recipe, records, out, 0.0).to_json()))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    tmp = tmp_path_factory.mktemp("run")
    path = write_recipe(tmp, mlp_recipe())
    out = tmp / "out"
    return path, out, compile_recipe(path, out)


def stage(report: dict, name: str) -> dict:
    return next(s for s in report["stages"] if s["name"] == name)


def test_stage_folders_are_named_after_stages(first_run: tuple[Path, Path, dict]) -> None:
    _, out, report = first_run
    assert [s["status"] for s in report["stages"]] == ["ran", "ran", "ran"]
    assert (out / "00-source" / "stage.json").is_file()
    assert (out / "01-export" / "model.onnx").is_file()
    assert (out / "02-ort_session" / "model.onnx").is_file()
    assert (out / "report.json").is_file() and (out / "report.md").is_file()
    onnx.checker.check_model(str(out / "01-export" / "model.onnx"))


def test_report_numbers(first_run: tuple[Path, Path, dict]) -> None:
    _, out, report = first_run
    assert report["schema_version"] == 3 and report["outcome"] == "ok"
    exp = stage(report, "export")
    # The exported graph computes what PyTorch computes.
    acc = exp["metrics"]["accuracy"]["logits"]
    assert acc["cosine"] > 0.99999 and acc["max_abs"] < 1e-4 and acc["top1"] == 1.0
    for scen in ("b1", "b8"):
        m = exp["metrics"]["scenarios"][scen]
        lat = m["latency"]
        assert 0 < lat["min_ms"] <= lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"]
        assert m["iterations"] == 4 * 3
        batch = 1 if scen == "b1" else 8
        assert m["throughput"]["samples_per_s"] == pytest.approx(batch * 1000 / lat["mean_ms"])
        vs = m["vs_parent"]
        assert vs["low"] <= vs["ratio"] <= vs["high"]
        assert m["parent_latency"]["n"] == 12
    # Stage 0 compared with itself is exact.
    src = stage(report, "source")["metrics"]["accuracy"]["logits"]
    assert src["cosine"] == pytest.approx(1.0) and src["max_abs"] == 0.0
    # vs stage 0 is the product of the ratios along the chain.
    ort = stage(report, "ort_session")
    for scen in ("b1", "b8"):
        chain = (
            exp["metrics"]["scenarios"][scen]["vs_parent"]["ratio"]
            * ort["metrics"]["scenarios"][scen]["vs_parent"]["ratio"]
        )
        assert ort["vs_source"][scen] == pytest.approx(chain)
    assert ort["metrics"]["runtime"]["graph_optimization_level"] == "all"
    assert exp["metrics"]["runtime"]["graph_optimization_level"] == "disable_all"
    assert exp["metrics"]["graph"]["nodes"] == sum(exp["metrics"]["graph"]["op_types"].values()) > 0
    assert exp["metrics"]["size_bytes"] == (out / "01-export" / "model.onnx").stat().st_size
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["stages"][1]["metrics"] == exp["metrics"]


def test_rerun_is_cached_with_identical_numbers(first_run: tuple[Path, Path, dict]) -> None:
    path, out, report = first_run
    again = compile_recipe(path, out)
    assert [s["status"] for s in again["stages"]] == ["cached", "cached", "cached"]
    for a, b in zip(report["stages"], again["stages"], strict=True):
        assert a["metrics"] == b["metrics"]


@pytest.mark.slow
def test_editing_the_last_pass_reruns_only_it(tmp_path: Path) -> None:
    data = mlp_recipe()
    path = write_recipe(tmp_path, data)
    out = tmp_path / "out"
    first = compile_recipe(path, out)
    data["passes"][1]["config"] = {"graph_optimization_level": "basic"}
    write_recipe(tmp_path, data)
    second = compile_recipe(path, out)
    assert [s["status"] for s in second["stages"]] == ["cached", "cached", "ran"]
    assert second["stages"][1]["metrics"] == first["stages"][1]["metrics"]
    assert stage(second, "ort_session")["metrics"]["runtime"]["graph_optimization_level"] == "basic"


@pytest.mark.slow
def test_branches_are_measured_against_their_named_parent(tmp_path: Path) -> None:
    data = mlp_recipe(
        passes=[
            {"type": "export"},
            {"type": "ort_session", "name": "ort_basic", "config": {"graph_optimization_level": "basic"}},
            {"type": "ort_session", "name": "ort_all", "from": "export"},
        ]
    )
    report = compile_recipe(write_recipe(tmp_path, data), tmp_path / "out")
    assert stage(report, "ort_all")["parent"] == "export"
    assert (tmp_path / "out" / "03-ort_all" / "model.onnx").is_file()
    exp_ratio = stage(report, "export")["metrics"]["scenarios"]["b1"]["vs_parent"]["ratio"]
    own = stage(report, "ort_all")["metrics"]["scenarios"]["b1"]["vs_parent"]["ratio"]
    assert stage(report, "ort_all")["vs_source"]["b1"] == pytest.approx(exp_ratio * own)


@pytest.mark.slow
def test_failed_export_is_recorded_and_the_report_written(tmp_path: Path) -> None:
    data = mlp_recipe(model={"source": "factory", "target": "tiny_models:data_dependent"})
    report = compile_recipe(write_recipe(tmp_path, data), tmp_path / "out")
    assert report["outcome"] == "failed" and report["failed_stages"] == ["export"]
    exp = stage(report, "export")
    assert exp["status"] == "failed" and "torch.onnx.export" in exp["reason"]
    assert stage(report, "ort_session")["status"] == "not run"
    # Stage 0 was measured before the failure and its numbers are kept.
    assert stage(report, "source")["metrics"]["scenarios"]["b1"]["latency"]["p50_ms"] > 0
    assert json.loads((tmp_path / "out" / "report.json").read_text())["failed_stages"] == ["export"]
    assert not list((tmp_path / "out").glob(".building-*"))


def test_source_that_is_not_a_module_fails_stage_0(tmp_path: Path) -> None:
    data = mlp_recipe(model={"source": "factory", "target": "tiny_models:not_a_module"})
    report = compile_recipe(write_recipe(tmp_path, data), tmp_path / "out")
    src = stage(report, "source")
    assert src["status"] == "failed" and "not a torch.nn.Module" in src["reason"]
    assert [s["status"] for s in report["stages"][1:]] == ["not run", "not run"]


def tiny_onnx(path: Path) -> None:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.arange(12, dtype=np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Relu", ["mm"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.slow
def test_onnx_source_skips_export_with_reason(tmp_path: Path) -> None:
    tiny_onnx(tmp_path / "tiny.onnx")
    data = mlp_recipe(
        model={"source": "onnx", "path": "tiny.onnx"},
        inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
    )
    report = compile_recipe(write_recipe(tmp_path, data), tmp_path / "out")
    assert stage(report, "export")["status"] == "skipped"
    assert "takes torch artifacts, got onnx" in stage(report, "export")["reason"]
    ort = stage(report, "ort_session")
    assert ort["status"] == "ran"
    # The skipped stage passes its input through: ort_session is timed against stage 0.
    assert ort["metrics"]["scenarios"]["b8"]["parent_latency"]["n"] == 12
    assert ort["metrics"]["accuracy"]["y"]["max_abs"] == 0.0


def test_input_name_the_model_does_not_take(tmp_path: Path) -> None:
    data = mlp_recipe(inputs=[{"name": "pixels", "dtype": "float32", "shape": ["batch", 16]}])
    report = compile_recipe(write_recipe(tmp_path, data), tmp_path / "out")
    src = stage(report, "source")
    assert src["status"] == "failed"
    assert "inputs[0].name: 'pixels' is not an input of MLP.forward (it takes: x)" in src["reason"]


@pytest.mark.slow
def test_memory_is_probed_in_a_fresh_process_per_stage(tmp_path: Path) -> None:
    """Default memory measurement: each stage served once in a new process. An MLP with 64 MiB of weights
    (16 x 4096 + 4096 x 4096 floats) costs at least its weights in every stage, PyTorch and ONNX alike, and
    about the same in each: the figures no longer depend on which stage ran first."""
    data = mlp_recipe(
        model={"source": "factory", "target": "tiny_models:mlp", "kwargs": {"hidden": 4096, "classes": 4096}},
        benchmark={"warmup": 1, "rounds": 2, "iterations": 1},
        passes=[{"type": "export"}, {"type": "ort_session"}],
    )
    report = compile_recipe(write_recipe(tmp_path, data), tmp_path / "out")
    weights_mb = (16 * 4096 + 4096 * 4096) * 4 / 2**20
    peaks = []
    for st in report["stages"]:
        memory = st["metrics"]["memory"]
        assert memory["method"] == "process", memory
        assert st["metrics"]["memory_mb"] == memory["peak_mb"]
        assert weights_mb * 0.95 < memory["peak_mb"] < weights_mb * 4, (st["name"], memory)
        peaks.append(memory["peak_mb"])
    assert max(peaks) < 2.5 * min(peaks), peaks


def test_each_stage_says_where_its_measurement_time_went(first_run: tuple[Path, Path, dict]) -> None:
    """Every measured stage books its bench time to the harness's steps (scripts/compile_phases.py reads them):
    each step took some time, and together they are the stage's measurement, bar the pipeline's own work."""
    _, out, report = first_run
    for st in report["stages"]:
        phases = st["metrics"]["phase_seconds"]
        assert set(phases) == {"load", "accuracy", "time", "profile", "memory"}, st["name"]
        assert all(v > 0 for v in phases.values())
        # the "time" step holds at least every timed call of the stage itself
        timed = sum(m["latency"]["mean_ms"] * m["latency"]["n"] for m in st["metrics"]["scenarios"].values()) / 1e3
        assert 0 < timed <= phases["time"], st["name"]
        assert sum(phases.values()) <= st["bench_seconds"]
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "compile_phases.py"
    shown = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                           check=True).stdout
    assert "| stage | pass | load | accuracy | time | profile | memory | other | stage total |" in shown
    assert "| **all stages** |" in shown and "share of wall time" in shown
