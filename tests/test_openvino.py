"""OpenVINO stages: IR conversion with precision options, NNCF INT8, what ran, the bundle, and the CPU check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.ov_engine import compile_config, openvino_reason, precision_ran

needs_openvino = pytest.mark.skipif(openvino_reason() is not None, reason=str(openvino_reason()))


def ov_report(tmp_path: Path, stages: int) -> Any:
    """The first `stages` passes of ov_recipe compiled, and the run's report."""
    from optimizer.report.build import build_report

    data = ov_recipe()
    data["passes"] = data["passes"][:stages]
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = Pipeline(recipe, tmp_path / "run").execute()
    return build_report(recipe, records, tmp_path / "run", 1.0)


def ov_recipe(**overrides: Any) -> dict[str, Any]:
    return mlp_recipe(
        name="ov-mlp",
        passes=[
            {"type": "export"},
            {"type": "openvino", "name": "ov_f32", "config": {"precision": "f32"}},
            {"type": "openvino", "name": "ov_bf16", "from": "ov_f32", "config": {"precision": "bf16"}},
            {"type": "nncf_int8", "name": "ov_int8", "from": "ov_f32", "config": {"samples": 8}},
        ],
        **overrides,
    )


@pytest.mark.slow
@needs_openvino
def test_openvino_stages_run_and_say_what_precision_ran(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, ov_recipe()))
    records = {r.name: r for r in Pipeline(recipe, tmp_path / "run").execute()}
    assert all(records[n].status == "ran" for n in ("ov_f32", "ov_bf16", "ov_int8")), {
        n: (r.status, r.reason) for n, r in records.items()}
    f32, int8 = records["ov_f32"], records["ov_int8"]
    assert f32.artifact is not None and f32.artifact.kind == "openvino" and f32.artifact.path.name == "model.xml"
    assert (f32.artifact.path.parent / "model.bin").is_file()
    assert f32.notes["precision"]["asked"] == "f32" and f32.notes["precision"]["hint"] == "f32"
    assert set(f32.notes["precision"]["layers"]) == {"f32"}  # every executed layer in f32
    assert f32.metrics["runtime"]["runtime"] == "openvino" and f32.metrics["within_budget"]
    assert f32.metrics["scenarios"]["b1"]["vs_parent"] is not None  # timed against the ONNX export it came from
    assert f32.metrics["scenarios"]["b1"]["profile"]["source"] == "openvino"  # performance counters per layer type
    assert int8.notes["fake_quantize_nodes"] >= 2 and int8.notes["int8_layers"] >= 2
    from optimizer.runtime.cpu_features import int8_reduce_range  # x86 without VNNI: 7-bit weights everywhere

    assert int8.notes["overflow_fix"]["value"] == ("enable" if int8_reduce_range()[0] else "first_layer_only")
    assert any(p in ("i8", "u8") for p in int8.notes["precision"]["layers"])
    bf16 = records["ov_bf16"].notes["precision"]
    capabilities = records["ov_bf16"].metrics["runtime"]["precision"]
    assert bf16["asked"] == "bf16" and capabilities["asked"] == "bf16"
    # Either the CPU has bf16 and layers ran in it, or the stage says it ran f32 instead.
    assert "bf16" in bf16["layers"] or "no bf16" in bf16["note"]


def test_a_bf16_request_on_a_cpu_without_bf16_says_what_ran_instead() -> None:
    """A compiled model as OpenVINO returns it on a CPU without bf16: the hint falls back to f32, every layer f32."""

    class Info(dict):  # rt_info values: OVAny-like, read with astype(str)
        pass

    class Value:
        def __init__(self, v: str) -> None:
            self.v = v

        def astype(self, _: type) -> str:
            return self.v

    class Op:
        def __init__(self, layer: str, precision: str) -> None:
            self.info = {"layerType": Value(layer), "runtimePrecision": Value(precision)}

        def get_rt_info(self) -> dict[str, Value]:
            return self.info

    class Type:
        def get_type_name(self) -> str:
            return "f32"

    class Compiled:
        def get_property(self, key: str) -> Any:
            assert key == "INFERENCE_PRECISION_HINT"
            return Type()

        def get_runtime_model(self) -> Any:
            ops = [Op("Input", "f32"), Op("FullyConnected", "f32"), Op("Softmax", "f32"), Op("Output", "f32")]
            return type("M", (), {"get_ops": lambda self: ops})()

    ran = precision_ran(Compiled(), "bf16", ["FP32", "INT8", "EXPORT_IMPORT"])
    assert ran["hint"] == "f32" and ran["layers"] == {"f32": 2}
    assert ran["note"] == ("bf16 asked, but this CPU has no bf16 (OpenVINO's capabilities: FP32, INT8, "
                           "EXPORT_IMPORT): ran f32")


def test_compile_options_come_from_the_artifact_and_the_target() -> None:
    config = compile_config({"ov_precision": "bf16", "ov_hint": "throughput", "ov_streams": 2, "ov_denormals": True},
                            threads=2)
    assert config == {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "bf16",
                      "NUM_STREAMS": 2, "CPU_DENORMALS_OPTIMIZATION": True}
    assert "INFERENCE_PRECISION_HINT" not in compile_config({"ov_precision": "default"}, threads=1)


@pytest.mark.slow
@needs_openvino
def test_openvino_bundle_exports_verifies_and_benches(tmp_path: Path) -> None:
    from optimizer.core.errors import OptimizerError
    from optimizer.deploy.bench import bench_bundle
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import verify_bundle

    report = ov_report(tmp_path, 2)
    out = export_bundle(report, "ov_f32", "openvino", tmp_path / "bundle")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "openvino" and manifest["runtime"]["openvino"]["ov_precision"] == "f32"
    assert sorted(manifest["files"]) == ["model.bin", "model.xml", "reference.npz"]
    assert verify_bundle(out) == []
    timed = bench_bundle(out, rounds=2, iterations=3)
    assert set(timed) == {"b1", "b8"} and timed["b1"]["latency"]["p50_ms"] > 0
    (out / "model.bin").write_bytes(b"changed")
    assert any("sha256 differs" in p for p in verify_bundle(out))
    with pytest.raises(OptimizerError, match="--format openvino: stage 'export' is onnx"):
        export_bundle(report, "export", "openvino", tmp_path / "b2")
    with pytest.raises(OptimizerError, match=r"--format openvino takes it"):
        export_bundle(report, "ov_f32", "onnx", tmp_path / "b3")
    auto = export_bundle(report, "ov_f32", "auto", tmp_path / "b4")  # the CLI's default: the stage's own format
    assert json.loads((auto / "manifest.json").read_text())["format"] == "openvino"
    assert json.loads((export_bundle(report, "export", "auto", tmp_path / "b5") / "manifest.json").read_text())[
        "format"] == "onnx"


@pytest.mark.slow
@needs_openvino
def test_triton_repository_for_the_openvino_backend(tmp_path: Path) -> None:
    """`--format triton` of an OpenVINO stage: the OpenVINO backend's layout and parameters, parsed by Triton's own
    model-config schema, and a bundle verify checks like the others."""
    from google.protobuf import text_format
    from test_gpu_injected import _model_config_pb2

    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import verify_bundle

    report = ov_report(tmp_path, 3)
    root = export_bundle(report, "ov_bf16", "triton", tmp_path / "repo")
    assert (root / "1" / "model.xml").is_file() and (root / "1" / "model.bin").is_file()
    pb2 = _model_config_pb2()
    config = text_format.Parse((root / "config.pbtxt").read_text(), pb2.ModelConfig())
    assert config.backend == "openvino" and config.max_batch_size == 0
    assert config.input[0].data_type == pb2.TYPE_FP32 and list(config.input[0].dims) == [-1, 16]
    assert config.parameters["PERFORMANCE_HINT"].string_value == "LATENCY"
    assert config.parameters["INFERENCE_NUM_THREADS"].string_value == "1"
    assert config.parameters["HINT_BF16"].string_value == "YES"
    assert verify_bundle(root) == []


@pytest.mark.slow
@needs_openvino
def test_accuracy_controlled_int8_is_judged_by_our_metric(tmp_path: Path) -> None:
    """NNCF's accuracy-aware quantization with our accuracy implementation as its metric: the drop it may allow is
    the budget's floor less the margin, and it validated through ctx.check."""
    data = ov_recipe(accuracy={"metric": "cosine", "min": 0.99, "samples": 2})
    data["passes"] = [*data["passes"][:2], {"type": "nncf_int8", "name": "ov_int8_ac", "config": {
        "samples": 8, "accuracy_control": True, "margin": 0.004}}]
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = {r.name: r for r in Pipeline(recipe, tmp_path / "run").execute()}
    stage = records["ov_int8_ac"]
    assert stage.status == "ran", stage.reason
    control = stage.notes["accuracy_control"]
    assert control["metric"] == "cosine" and control["max_drop"] == pytest.approx(1 - 0.994)
    assert control["validations"] >= 1 and stage.notes["int8_layers"] >= 1


# ---------------------------------------------------------------- what an adversarial try found
@pytest.mark.slow
@needs_openvino
def test_an_openvino_stage_from_an_fp16_graph_finds_its_inputs(tmp_path: Path) -> None:
    """The compiled model names the input port after the fused input Cast; the tensor keeps the name `x`."""
    data = ov_recipe()
    data["passes"] = [{"type": "export"}, {"type": "quantize", "name": "h", "config": {"mode": "fp16"}},
                      {"type": "openvino", "name": "ov", "from": "h"}]
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = {r.name: r for r in Pipeline(recipe, tmp_path / "run").execute()}
    assert records["ov"].status == "ran", records["ov"].reason


def test_openvino_errors_keep_the_line_that_says_why() -> None:
    from optimizer.runtime.ov_engine import error_line

    e = RuntimeError("Check 'false' failed at src/frontends/common/unconverted_ops_report.cpp:151:\n"
                     "FrontEnd API failed with GeneralFailure:\nNo conversion rule found for operations: Inverse")
    assert error_line(e) == "FrontEnd API failed with GeneralFailure:"
    e = RuntimeError("Exception from src/inference/src/cpp/core.cpp:132:\nWrong value -5 for property key NUM_STREAMS")
    assert error_line(e) == "Wrong value -5 for property key NUM_STREAMS"


def test_accuracy_control_without_a_floor_is_refused_by_validate(tmp_path: Path) -> None:
    from optimizer.core.errors import RecipeError

    data = ov_recipe(accuracy={"metric": "max_abs", "max": 0.1, "samples": 2})
    data["passes"] = [{"type": "export"}, {"type": "openvino"}, {"type": "nncf_int8", "config": {
        "accuracy_control": True}}]
    with pytest.raises(RecipeError, match=r"passes\[2\]\.config\.accuracy_control: needs a minimum"):
        load_recipe(write_recipe(tmp_path, data))
    data["accuracy"] = {"metric": "cosine", "min": 0.99, "samples": 2}
    data["passes"][2]["config"]["margin"] = 0.5
    with pytest.raises(RecipeError, match=r"passes\[2\]\.config\.margin"):
        load_recipe(write_recipe(tmp_path, data, "m.yaml"))


@pytest.mark.slow
@needs_openvino
def test_tampered_openvino_manifests_are_one_line_each(tmp_path: Path) -> None:
    from optimizer.core.errors import OptimizerError
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.openvino_bundle import runtime_of
    from optimizer.deploy.verify import verify_bundle

    report = ov_report(tmp_path, 2)
    out = export_bundle(report, "ov_f32", "auto", tmp_path / "bundle")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"]["mode"] == "f32" and manifest["precision"]["layers"] == {"f32": 2}
    for runtime, field in (({"openvino": None, "threads": 1}, "runtime.openvino"),
                           ({"openvino": {"ov_streams": -5}, "threads": 1}, "ov_streams"),
                           ({"openvino": {"ov_denormals": "no"}, "threads": 1}, "ov_denormals"),
                           ({"openvino": {"ov_hint": "bogus"}, "threads": 1}, "ov_hint"),
                           ({"openvino": {}, "threads": 10**12}, "runtime.threads")):
        with pytest.raises(OptimizerError, match=field.replace(".", r"\.")):
            runtime_of({**manifest, "runtime": runtime})
    assert verify_bundle(out) == []


@pytest.mark.slow
def test_openvino_telemetry_is_left_out(tmp_path: Path) -> None:
    """OpenVINO's converter and NNCF count and send usage through openvino_telemetry (into ~/intel): importing
    OpenVINO through us leaves that module out, so nothing is written outside the folders the user named."""
    import subprocess
    import sys

    code = ("from optimizer.runtime.ov_engine import openvino_module, nncf_module; openvino_module(); nncf_module(); "
            "import sys; print(sys.modules['openvino_telemetry'])")
    if openvino_reason() is not None:
        pytest.skip(str(openvino_reason()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "None", out.stderr[-1500:]
    assert not (tmp_path / "intel").exists()


@pytest.mark.slow
@needs_openvino
def test_ignored_names_that_match_nothing_fail_the_stage_with_the_name(tmp_path: Path) -> None:
    data = ov_recipe()
    data["passes"] = [{"type": "export"}, {"type": "openvino"},
                      {"type": "nncf_int8", "config": {"samples": 4, "ignored_names": ["no_such_node"]}}]
    data["on_failure"] = "continue"
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = {r.name: r for r in Pipeline(recipe, tmp_path / "run").execute()}
    stage = records["nncf_int8"]
    assert stage.status == "failed" and "no_such_node" in (stage.reason or ""), stage.reason
    assert records["openvino"].status == "ran"  # what ran before it is kept


@pytest.mark.slow
@needs_openvino
def test_static_shapes_compile_per_input_shape_and_change_only_that(tmp_path: Path) -> None:
    """A `static_shapes` stage after an OpenVINO stage keeps its parent's precision and hint (it changes only what
    it names), compiles the IR reshaped to each shape it is fed, with the same outputs, and says so; past
    MAX_STATIC_SHAPES the dynamic model runs, and the bundle carries the option."""
    import numpy as np

    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import verify_bundle
    from optimizer.report.build import build_report
    from optimizer.runtime.runners.ov_runner import MAX_STATIC_SHAPES, OvRunner

    data = ov_recipe()
    data["passes"] = data["passes"][:2] + [
        {"type": "openvino", "name": "ov_static", "from": "ov_f32", "config": {"static_shapes": True}},
        {"type": "openvino", "name": "ov_same", "from": "ov_f32", "config": {"precision": "f32"}}]
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = {r.name: r for r in Pipeline(recipe, tmp_path / "run").execute()}
    static = records["ov_static"]
    assert static.status == "ran", static.reason
    assert records["ov_same"].status == "unchanged"  # the parent's IR and options: nothing to time
    assert static.artifact.runtime["ov_precision"] == "f32" and static.artifact.runtime["ov_static_shapes"] is True
    assert static.notes["precision"]["asked"] == "f32"
    assert static.metrics["runtime"]["static_shapes"].startswith("compiled per input shape, up to 8 shapes: ")
    with OvRunner(static.artifact, recipe).load() as session:
        feeds = [{"x": np.random.default_rng(b).standard_normal((b, 16)).astype(np.float32)}
                 for b in range(1, MAX_STATIC_SHAPES + 3)]
        dynamic = OvRunner(records["ov_f32"].artifact, recipe)
        with dynamic.load() as plain:
            for feed in feeds:
                got = session.to_numpy(session.run(session.prepare(feed)))[0]
                want = plain.to_numpy(plain.run(plain.prepare(feed)))[0]
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        shapes = session.static_shapes()
    assert len(shapes["static"]) == MAX_STATIC_SHAPES and shapes["static"][0] == [[1, 16]]
    assert shapes["dynamic"] == [[[MAX_STATIC_SHAPES + 1, 16]], [[MAX_STATIC_SHAPES + 2, 16]]]
    report = build_report(recipe, list(records.values()), tmp_path / "run", 1.0)
    out = export_bundle(report, "ov_static", "openvino", tmp_path / "bundle")
    assert json.loads((out / "manifest.json").read_text())["runtime"]["openvino"]["ov_static_shapes"] is True
    assert verify_bundle(out) == []
