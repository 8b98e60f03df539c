"""Run history, diff, bundles (export/verify/bench) and the HTML report, through the CLI."""

from __future__ import annotations

import copy
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mlp_recipe, write_recipe
from test_recipe import run_cli

from optimizer.report.screenshot import chromium, rendered_dom, screenshot


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("runs")
    history = tmp / "history.sqlite"
    data = mlp_recipe()
    recipe = write_recipe(tmp, data)
    a, b = tmp / "a", tmp / "b"
    assert run_cli("--history", str(history), "compile", str(recipe), "--out", str(a)).returncode == 0
    data["passes"][1]["config"] = {"graph_optimization_level": "basic"}  # one pass changed
    write_recipe(tmp, data)
    assert run_cli("--history", str(history), "compile", str(recipe), "--out", str(b)).returncode == 0
    return tmp, history, a, b


@pytest.mark.slow
def test_runs_are_recorded_and_listed(two_runs: tuple[Path, Path, Path, Path]) -> None:
    _, history, a, b = two_runs
    proc = run_cli("--history", str(history), "runs")
    assert proc.returncode == 0
    assert str(a) in proc.stdout and str(b) in proc.stdout and "tiny-mlp" in proc.stdout


@pytest.mark.slow
def test_diff_by_id_and_folder(two_runs: tuple[Path, Path, Path, Path]) -> None:
    _, history, a, b = two_runs
    by_id = run_cli("--history", str(history), "diff", "1", "2", "--format", "json")
    assert by_id.returncode == 0, by_id.stderr
    d = json.loads(by_id.stdout)
    assert {r["stage"] for r in d["rows"]} == {"source", "export", "ort_session"}
    for r in d["rows"]:
        assert r["raw_ratio"] == pytest.approx(r["p50_a"] / r["p50_b"])
        assert r["low"] <= r["high"] and r["verdict"] in ("faster", "slower", "within noise", "control")
        # Stage 0 is the control, shown on raw P50s; every other stage by its own interleaved ratio, B over A.
        assert r["basis"].startswith("raw P50") == (r["stage"] == "source")
        if r["stage"] == "source":
            assert r["verdict"] == "control"
        else:
            assert r["ratio"] == pytest.approx(r["vs_parent_b"] / r["vs_parent_a"], rel=1e-6)
            assert r["low"] <= r["ratio"] <= r["high"]
    assert d["final_stage"] == "ort_session" and len(d["totals"]) == 2
    md = run_cli("--history", str(history), "diff", str(a), str(b), "--format", "md")
    assert md.returncode == 0 and "| scenario | stage | A ms | B ms |" in md.stdout
    table = run_cli("--history", str(history), "diff", str(a), str(b))
    assert table.returncode == 0 and "final stage ort_session" in table.stdout


@pytest.mark.slow
def test_fail_on_regression_gate(two_runs: tuple[Path, Path, Path, Path]) -> None:
    tmp, history, a, _ = two_runs
    report = json.loads((a / "report.json").read_text())
    slower = copy.deepcopy(report)
    stage = next(s for s in slower["stages"] if s["name"] == "export")
    # What a 3x slower pass shows: its interleaved ratio (the tiny MLP's export ratio is known only to about
    # 2x either way: its calls take 10 microseconds).
    for m in stage["metrics"]["scenarios"].values():
        m["samples_ms"] = [x * 3 for x in m["samples_ms"]]
        m["latency"]["p50_ms"] *= 3
        for k in ("ratio", "low", "high"):
            m["vs_parent"][k] /= 3
    (tmp / "slow.json").write_text(json.dumps(slower))
    gate = run_cli(
        "--history", str(history), "diff", str(a / "report.json"), str(tmp / "slow.json"), "--fail-on-regression", "10"
    )
    assert gate.returncode == 3
    # Flagged in at least one scenario: the tiny MLP's intervals are so wide that one scenario's 3x can stay
    # within the combined noise on a busy machine (it was b8 alone once), but never every scenario's.
    assert re.search(r"export on b\d+: 200\.0% slower", gate.stderr), gate.stderr
    same = run_cli("--history", str(history), "diff", str(a), str(a), "--fail-on-regression", "10")
    assert same.returncode == 0


@pytest.mark.slow
def test_bundle_export_verify_and_tamper(two_runs: tuple[Path, Path, Path, Path]) -> None:
    tmp, history, a, _ = two_runs
    bundle = tmp / "bundle"
    proc = run_cli("--history", str(history), "export", str(a), "--stage", "ort_session", "--out", str(bundle))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["inputs"][0] == {"name": "x", "dtype": "float32", "onnx_type": "FLOAT", "shape": ["batch", 16]}
    assert manifest["runtime"]["onnxruntime_session"]["graph_optimization_level"] == "all"
    assert set(manifest["files"]) == {
        "model.onnx",
        "reference.npz",
        "polygraphy_inputs.json",
        "polygraphy_outputs.json",
    }
    # The bundle checks without this tool: Polygraphy's own runner, inputs and expected outputs.
    poly = subprocess.run(
        [str(Path(sys.executable).parent / "polygraphy"), "run", str(bundle / "model.onnx"), "--onnxrt",
         "--load-inputs", str(bundle / "polygraphy_inputs.json"),
         "--load-outputs", str(bundle / "polygraphy_outputs.json"), "--atol", "1e-5", "--rtol", "1e-4"],
        capture_output=True, text=True,
    )
    assert poly.returncode == 0 and "PASSED" in poly.stdout + poly.stderr, (poly.stdout + poly.stderr)[-1500:]
    assert manifest["benchmark"]["b1"]["latency"]["p50_ms"] > 0
    assert run_cli("verify", str(bundle)).returncode == 0
    bench = run_cli("bench", str(bundle), "--rounds", "2", "--iterations", "3")
    assert bench.returncode == 0 and "b8: P50" in bench.stdout
    model = bundle / "model.onnx"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    model.write_bytes(bytes(raw))
    bad = run_cli("verify", str(bundle))
    assert bad.returncode == 1
    assert "model.onnx: sha256 differs from the manifest" in bad.stderr


@pytest.mark.slow
def test_triton_bundle_and_best_stage(two_runs: tuple[Path, Path, Path, Path]) -> None:
    tmp, history, a, _ = two_runs
    repo = tmp / "triton"
    proc = run_cli("--history", str(history), "export", str(a), "--format", "triton", "--out", str(repo))
    assert proc.returncode == 0, proc.stderr
    config = (repo / "tiny_mlp" / "config.pbtxt").read_text()
    assert 'platform: "onnxruntime_onnx"' in config and "max_batch_size: 8" in config
    assert 'name: "x"' in config and "TYPE_FP32" in config and "dims: [ 16 ]" in config
    assert (repo / "tiny_mlp" / "1" / "model.onnx").is_file()
    assert run_cli("verify", str(repo / "tiny_mlp")).returncode == 0
    trt = run_cli("--history", str(history), "export", str(a), "--format", "tensorrt", "--out", str(tmp / "trt"))
    assert trt.returncode == 2 and "not a TensorRT engine" in trt.stderr


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_report_renders_with_its_charts(two_runs: tuple[Path, Path, Path, Path]) -> None:
    _, _, a, _ = two_runs
    html_file = a / "report.html"
    dom = rendered_dom(html_file)
    for kind in ("waterfall", "distribution", "ops", "opdelta", "accuracy"):
        assert f'class="chart {kind}"' in dom, kind
    assert dom.count('class="delta"') >= 2  # ort_session against export: op types with their time difference
    assert dom.count('class="chart waterfall"') == 2  # one per scenario
    assert dom.count('class="bar"') >= 6
    png = screenshot(html_file, a / "report.png")
    width, height = png_size(png)
    assert width >= 1000 and height >= 1000
    assert png.stat().st_size > 20_000  # a rendered page, not a blank one
