"""Findings of a user-style try of the measurement and the report (F1): each test fails on the code before its fix."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import mlp_recipe
from onnx import TensorProto, helper, numpy_helper

from optimizer.core.artifact import Artifact
from optimizer.recipe.loading import parse_recipe


def _matmul_onnx(path: Path) -> Path:
    """x [batch, 16] -> logits [batch, 10]: one MatMul, the smallest stage a recipe for tiny_models:mlp can run."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 10)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.slow
def test_memory_probe_after_onnxruntime_quantization_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`import onnxruntime.quantization` puts onnxruntime/transformers (with its optimizer.py) on sys.path: the probe's
    child imported that as `optimizer` and the stage's memory fell back to the in-process estimate."""
    import onnxruntime.quantization  # noqa: F401 - what a quantize pass imports

    from optimizer.measure.memprobe import probe
    from optimizer.runtime.childpath import ROOT

    # as under the installed `optimizer` command: our package comes from the editable install's finder, the
    # repository is not on sys.path
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and Path(p).resolve() != Path(ROOT)])
    assert any(Path(p, "optimizer.py").is_file() for p in sys.path if p), "the setup this test is about"
    recipe = parse_recipe(mlp_recipe(scenarios=[{"name": "b1", "batch": 1, "seq": 1}]), "r.yaml", tmp_path)
    artifact = Artifact("onnx", _matmul_onnx(tmp_path / "m.onnx"), input_names=["x"], output_names=["logits"])
    result = probe(artifact, recipe)
    assert "reason" not in result, result
    assert result["peak_mb"] >= 0 and result["runtime_mb"] > 10


def test_child_sys_path_puts_us_first_and_drops_shadowing_folders(tmp_path: Path) -> None:
    from optimizer.runtime.childpath import ROOT, child_sys_path

    (tmp_path / "optimizer.py").write_text("")
    out = child_sys_path(["", "/somewhere", str(tmp_path), ROOT])
    assert out[0] == ROOT and out.count(ROOT) == 1
    assert str(tmp_path) not in out and "/somewhere" in out and "" not in out


# ---------------------------------------------------------------- best: no win on an insignificant size
def _st(index: int, name: str, parent: str | None, vs: tuple[float, float, float] | None, size: int,
        kind: str = "onnx") -> dict[str, Any]:
    scen: dict[str, Any] = {"latency": {"n": 12, "p50_ms": 1.0, "p90_ms": 1.0, "p99_ms": 1.0, "mean_ms": 1.0,
                                        "std_ms": 0.0, "min_ms": 1.0, "cv": 0},
            "throughput": {"samples_per_s": 1000.0}}
    if vs is not None:
        scen["vs_parent"] = {"ratio": vs[0], "low": vs[1], "high": vs[2], "verdict": "within noise"}
    return {"index": index, "name": name, "type": "x", "parent": parent, "status": "ran", "measured_against": name,
            "artifact": {"kind": kind, "path": f"/nowhere/{name}", "runtime": {}, "meta": {}}, "notes": {},
            "metrics": {"within_budget": True, "budget": "ok", "size_bytes": size, "memory_mb": 10.0,
                        "accuracy": {"y": {"cosine": 1.0}}, "scenarios": {"b1": scen}}}


def _tiny_run(int8: tuple[float, float, float], int8_size: int) -> tuple[str | None, str]:
    """The tester's run: stage 0, export, ort_session, and an int8 stage a few KB smaller."""
    from test_report_schema import report_of

    from optimizer.measure.best import best_stage

    report = report_of([
        _st(0, "source", None, None, 9000, kind="torch"),
        _st(1, "export", "source", (1.0, 0.9, 1.1), 9000),
        _st(2, "ort_session", "export", (1.0, 0.8, 1.25), 9000),
        _st(3, "int8_dynamic", "ort_session", int8, int8_size),
    ])
    best, why = best_stage(report.stages, report.scenario_names)
    return (best.name if best else None), why


def test_best_needs_a_material_size_difference() -> None:
    """int8 is tied in speed and 4 KB smaller: 4 KB is no reason to prefer it over the faster stage."""
    name, why = _tiny_run((0.95, 0.8, 1.12), 5000)
    assert name == "export", why  # the fastest of the ties (ratio 1.0 against stage 0 through export)
    assert "is smaller" not in why and "none smaller by 10% and 1 MB" in why


def _best_of_export_and_int8(export_vs: tuple[float, float, float], int8_parent: str,
                             int8_vs: tuple[float, float, float]) -> tuple[Any, str]:
    """best_stage over source (90 MB, PyTorch), export (90 MB, from source) and int8_dynamic (23 MB)."""
    from test_report_schema import report_of

    from optimizer.measure.best import best_stage

    mb = 2**20
    report = report_of([
        _st(0, "source", None, None, 90 * mb, kind="torch"),
        _st(1, "export", "source", export_vs, 90 * mb),
        _st(2, "int8_dynamic", int8_parent, int8_vs, 23 * mb),
    ])
    return best_stage(report.stages, report.scenario_names)


def test_best_may_prefer_a_materially_smaller_tied_stage() -> None:
    name, why = _tiny_run((0.95, 0.8, 1.12), 9000)  # same size: no
    assert name == "export"
    best, why = _best_of_export_and_int8((1.0, 0.9, 1.1), "export", (0.97, 0.85, 1.1))
    assert best is not None and best.name == "int8_dynamic", why
    assert "(23.0 MB vs 90.0 MB)" in why


def test_a_stage_slower_than_stage_0_beyond_noise_is_not_best_when_another_is_not() -> None:
    """int8 (0.78x, interval below 1) ties the fastest only through the wide interval of the others."""
    best, why = _best_of_export_and_int8((0.9, 0.5, 1.6), "source", (0.78, 0.7, 0.87))
    assert best is not None and best.name == "export", why


def test_small_sizes_keep_their_digits() -> None:
    from optimizer.measure.best import format_size
    from optimizer.report.tables import size_mb_cell

    assert size_mb_cell(5000) == "0.00477" and size_mb_cell(9000) == "0.00858"
    assert size_mb_cell(90 * 2**20) == "90.0" and size_mb_cell(None) == "-"
    assert format_size(5000) == "4.9 KB" and format_size(3 * 2**20) == "3.0 MB"


# ---------------------------------------------------------------- an export failure keeps its cause
@pytest.mark.slow
def test_a_failed_export_names_the_data_dependent_expression_and_the_line(tmp_path: Path) -> None:
    """The reason was torch's banner ("... This is step 1/3 ... Next steps:") with its colour codes."""
    from conftest import write_recipe
    from test_pipeline import compile_recipe

    data = mlp_recipe(model={"source": "factory", "target": "tiny_models:data_dependent"},
                      scenarios=[{"name": "b1", "batch": 1, "seq": 1}], passes=[{"type": "export"}])
    report = compile_recipe(write_recipe(tmp_path, data), tmp_path / "out")
    reason = next(s for s in report["stages"] if s["name"] == "export")["reason"]
    assert "\x1b" not in reason and "step 1/3" not in reason and "Next steps" not in reason
    assert "data-dependent expression" in reason, reason
    assert "tiny_models.py:" in reason and "`if y.sum() > 0:`" in reason, reason


def test_error_line_skips_banners_and_keeps_plain_first_lines() -> None:
    from optimizer.runtime.errortext import error_line

    assert error_line("\x1b[91mbad shape\x1b[0m for x\nmore") == "bad shape for x"
    assert error_line("") == "" and error_line("", "RuntimeError") == "RuntimeError"
    banner = "Failed to export the model with torch.export. \x1b[96mThis is step 1/3\x1b[0m. Next steps:\n- Modify it\n"
    assert error_line(banner + "<class 'torch._dynamo.exc.Unsupported'>: no graph break here") == (
        "Unsupported: no graph break here")


# ---------------------------------------------------------------- no profiler chatter in the terminal
@pytest.mark.slow
def test_the_torch_profiler_prints_no_usdt_lines_and_other_native_output_goes_through() -> None:
    import subprocess

    code = (
        "import os, torch\n"
        "from optimizer.measure.profiles import profile_torch\n"
        "m, x = torch.nn.Linear(4, 4), torch.randn(2, 4)\n"
        "def fn():\n    os.write(2, b'native line\\n'); return m(x)\n"
        "ops, _ = profile_torch(fn, 3, False)\n"
        "print(sorted(ops))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "aten::linear" in proc.stdout
    assert "USDT" not in proc.stderr and "profiler_start" not in proc.stderr, proc.stderr
    assert proc.stderr.count("native line") == 4  # the warm-up call and the 3 profiled ones


# ---------------------------------------------------------------- a ratio whose parent ran far from its own speed
def _lat(p50: float) -> dict[str, Any]:
    return {"n": 12, "p50_ms": p50, "p90_ms": p50, "p99_ms": p50, "mean_ms": p50, "std_ms": 0.0, "min_ms": p50, "cv": 0}


def test_a_parent_that_ran_far_slower_beside_the_stage_makes_a_finding() -> None:
    """The tester's `01 export ... 1054.62x`: the PyTorch parent ran 7.89 ms beside the stage, 0.039 ms alone."""
    from test_report_schema import report_of

    from optimizer.report.findings import findings

    source, export = _st(0, "source", None, None, 9000, kind="torch"), _st(1, "export", "source", None, 9000)
    source["metrics"]["scenarios"]["b1"]["latency"] = _lat(0.039)
    scen = export["metrics"]["scenarios"]["b1"]
    scen["latency"], scen["parent_latency"] = _lat(0.0075), _lat(7.89)
    scen["vs_parent"] = {"ratio": 1054.62, "low": 1000.0, "high": 1100.0, "verdict": "faster"}
    lines = [f for f in findings(report_of([source, export])) if "unreliable" in f]
    assert lines == [
        "export (x) on b1: its input (source) ran 7.89 ms (P50) beside this stage against 0.039 ms on its own "
        "(202.3x): the ratio 1054.62x is unreliable; re-run on a quiet machine"
    ]
    scen["parent_latency"] = _lat(0.1)  # 2.6x: within what the interleaving is trusted with
    assert not [f for f in findings(report_of([source, export])) if "unreliable" in f]
