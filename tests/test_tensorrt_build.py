"""The TensorRT pass and runner go through Polygraphy's loaders (network from ONNX, builder config, engine bytes,
engine from a file) and check the engine against ONNX Runtime with Polygraphy's comparator. TensorRT itself cannot
run here: the device pieces are injected (a stand-in `tensorrt` module, the loaders recording what they are
handed), while Polygraphy's comparator and logger are the real ones, on ONNX Runtime's CPU provider."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimizer.core.errors import PassError


def _matmul_model(path: Path, dtype: Any = np.float32) -> Path:
    """x @ w with float32 input and output; with dtype float16 the weights and the MatMul are float16 inside."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(dtype), "w")
    if dtype == np.float16:
        nodes = [
            helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
            helper.make_node("MatMul", ["x16", "w"], ["y16"], name="mm"),
            helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT),
        ]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


# ---------------------------------------------------------------- the comparator (real Polygraphy, real ORT)
def test_cross_check_of_identical_graphs_passes_with_zero_error(tmp_path: Path) -> None:
    from optimizer.runtime.crosscheck import cross_check, onnxruntime_runner

    model = _matmul_model(tmp_path / "m.onnx")
    feeds = [{"x": np.ones((1, 8), np.float32)}, {"x": np.full((5, 8), 0.5, np.float32)}]
    out = cross_check(onnxruntime_runner(model, "a"), onnxruntime_runner(model, "b"), feeds, atol=1e-6, rtol=1e-6)
    assert out["passed"] is True and out["feeds"] == 2
    assert out["outputs"]["y"]["max_absdiff"] == 0.0


def test_cross_check_reports_the_error_of_a_lower_precision_graph(tmp_path: Path) -> None:
    """An FP16 copy of the graph differs by a real, non-zero amount: reported per output, failing tight tolerances."""
    from optimizer.runtime.crosscheck import cross_check, onnxruntime_runner

    fp32 = _matmul_model(tmp_path / "fp32.onnx")
    fp16 = _matmul_model(tmp_path / "fp16.onnx", np.float16)
    feeds = [{"x": np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)}]
    ref = onnxruntime_runner(fp32, "fp32")
    cand = onnxruntime_runner(fp16, "fp16")
    out = cross_check(ref, cand, feeds, atol=1e-7, rtol=1e-7)
    y = out["outputs"]["y"]
    assert out["passed"] is False and y["passed"] is False
    assert 1e-5 < y["max_absdiff"] < 0.1  # float16 rounding of weights and inputs, not garbage
    loose = cross_check(ref, cand, feeds, atol=0.1, rtol=0.1)
    assert loose["passed"] is True


# ---------------------------------------------------------------- the build (device pieces injected)
class Recorder:
    """Stands in for a Polygraphy loader: records its arguments, returns `result` when called."""

    made: dict[str, list[Recorder]] = {}
    real: dict[str, Any] = {}  # the Polygraphy loaders stood in for

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        Recorder.made.setdefault(type(self).__name__, []).append(self)

    def __call__(self) -> Any:
        return b"serialized-engine"


def fake_tensorrt(version: str) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version  # type: ignore[attr-defined]
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")  # type: ignore[attr-defined]
    trt.HardwareCompatibilityLevel = types.SimpleNamespace(AMPERE_PLUS="AMPERE_PLUS")  # type: ignore[attr-defined]

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    trt.IProgressMonitor = IProgressMonitor  # type: ignore[attr-defined]
    return trt


@pytest.fixture
def injected_trt(monkeypatch: pytest.MonkeyPatch) -> Any:
    import polygraphy.backend.trt as pg_trt

    Recorder.made = {}
    names = ("NetworkFromOnnxPath", "CreateConfig", "EngineBytesFromNetwork")
    Recorder.real = {name: getattr(pg_trt, name) for name in names}
    for name in names:
        monkeypatch.setattr(pg_trt, name, type(name, (Recorder,), {}))

    def use(version: str) -> None:
        monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(version))

    return use


def _tensorrt_pass(tmp_path: Path, **config: Any) -> tuple[Any, Any, Any]:
    from optimizer.core.artifact import Artifact
    from optimizer.core.pass_base import PassContext
    from optimizer.measure.services import MeasureServices
    from optimizer.recipe.schema import Recipe
    from passes.tensorrt import TensorRTConfig, TensorRTPass

    recipe = Recipe.model_validate({
        "name": "trt",
        "model": {"source": "onnx", "path": str(tmp_path / "m.onnx")},
        "target": {"device": "cuda"},
        "inputs": [{"name": "x", "shape": ["batch", 8], "dtype": "float32"}],
        "scenarios": [{"name": "b4", "batch": 4}, {"name": "b1", "batch": 1}, {"name": "b16", "batch": 16}],
    })
    stage_dir = tmp_path / "run" / "01-tensorrt"
    stage_dir.mkdir(parents=True)
    ctx = PassContext(recipe, "tensorrt", stage_dir, None, MeasureServices())  # type: ignore[arg-type]
    artifact = Artifact("onnx", _matmul_model(tmp_path / "m.onnx"))
    return TensorRTPass(TensorRTConfig(cross_check=False, **config)), artifact, ctx


@pytest.mark.parametrize("version, asks_strong_typing", [("10.13.3.9", True), ("11.4.0.106", False)])
def test_engine_is_built_through_polygraphy_with_the_recipes_profile(
    tmp_path: Path, injected_trt: Any, version: str, asks_strong_typing: bool
) -> None:
    injected_trt(version)
    tensorrt_pass, artifact, ctx = _tensorrt_pass(tmp_path, optimization_level=5, workspace_gb=2)
    result = tensorrt_pass.run(artifact, ctx)

    (network,) = Recorder.made["NetworkFromOnnxPath"]
    assert network.args == (str(artifact.path),)
    assert network.kwargs["strongly_typed"] is asks_strong_typing  # 11 is always strongly typed, 10 must be asked
    (config,) = Recorder.made["CreateConfig"]
    (profile,) = config.kwargs["profiles"]
    x = profile["x"]
    assert (tuple(x.min), tuple(x.opt), tuple(x.max)) == ((1, 8), (4, 8), (16, 8))  # opt: the first scenario's
    assert config.kwargs["builder_optimization_level"] == 5
    assert config.kwargs["memory_pool_limits"] == {"WORKSPACE": 2 * 2**30}
    assert config.kwargs["load_timing_cache"] is None  # nothing to load yet
    (build,) = Recorder.made["EngineBytesFromNetwork"]
    assert build.args[0] is network and build.kwargs["config"] is config
    assert build.kwargs["save_timing_cache"] == str(ctx.stage_dir.parent / "timing.cache")
    assert result.artifact.path.read_bytes() == b"serialized-engine"
    for name, (call,) in Recorder.made.items():  # every keyword we handed it exists in the real loader
        assert set(call.kwargs) <= _keywords(Recorder.real[name]), name


def test_a_second_build_loads_the_timing_cache(tmp_path: Path, injected_trt: Any) -> None:
    injected_trt("10.13.3.9")
    tensorrt_pass, artifact, ctx = _tensorrt_pass(tmp_path)
    (ctx.stage_dir.parent / "timing.cache").write_bytes(b"cache")
    tensorrt_pass.run(artifact, ctx)
    assert Recorder.made["CreateConfig"][0].kwargs["load_timing_cache"] == str(ctx.stage_dir.parent / "timing.cache")


def test_parser_errors_reach_the_one_line_error(tmp_path: Path, injected_trt: Any, monkeypatch: Any) -> None:
    """Polygraphy logs the parser's errors and raises a bare 'Could not parse ONNX correctly': the stage's error
    must carry the parser's own words (which node, which op)."""
    import polygraphy.backend.trt as pg_trt
    from polygraphy.logger import G_LOGGER

    injected_trt("10.13.3.9")

    class Failing(Recorder):
        def __call__(self) -> Any:
            G_LOGGER.error("In node 0 with name: mm and operator: MatMul (parseNode): UNSUPPORTED_NODE")
            G_LOGGER.critical("Could not parse ONNX correctly")

    monkeypatch.setattr(pg_trt, "EngineBytesFromNetwork", Failing)
    tensorrt_pass, artifact, ctx = _tensorrt_pass(tmp_path)
    with pytest.raises(PassError) as err:
        tensorrt_pass.run(artifact, ctx)
    assert "UNSUPPORTED_NODE" in str(err.value) and "mm" in str(err.value)
    assert (ctx.stage_dir / "polygraphy.log").is_file()


# ---------------------------------------------------------------- what "TensorRT is here" means
def test_tensorrt_reason_needs_a_supported_major_that_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.runtime import gpu

    monkeypatch.setattr(gpu, "cuda_reason", lambda: None)
    monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda name: object())
    gpu.tensorrt_reason.cache_clear()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("8.6.1"))
    assert "8.6.1" in (gpu.tensorrt_reason() or "") and "10" in (gpu.tensorrt_reason() or "")
    gpu.tensorrt_reason.cache_clear()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.13.3.9"))
    assert gpu.tensorrt_reason() is None
    gpu.tensorrt_reason.cache_clear()
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # present on disk, fails to import (libraries missing)
    assert "import" in (gpu.tensorrt_reason() or "")
    gpu.tensorrt_reason.cache_clear()


def _keywords(fn: Any) -> set[str]:
    """Parameter names of a function or class; a loader's __init__ may pass **kwargs to its base: all count."""
    import inspect

    chain = [c.__init__ for c in fn.__mro__ if "__init__" in vars(c)] if isinstance(fn, type) else [fn]
    return {p for f in chain for p in inspect.signature(f).parameters}


def test_the_engine_loader_takes_the_keywords_we_pass() -> None:
    """The one Polygraphy call no test here runs: loading an engine for the runner and the cross-check."""
    from polygraphy.backend.trt import EngineFromPath, TrtRunner

    assert {"path"} <= _keywords(EngineFromPath) and {"engine", "name"} <= _keywords(TrtRunner)


def test_the_engine_is_cross_checked_on_every_scenarios_feed(tmp_path: Path, injected_trt: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The cross-check as the pass runs it, with ONNX Runtime standing in for the engine: one feed per scenario,
    the tolerance of the engine's precision, the result in engine.json."""
    from optimizer.runtime import crosscheck
    from optimizer.runtime.inputs import build_feeds

    injected_trt("10.13.3.9")
    tensorrt_pass, artifact, ctx = _tensorrt_pass(tmp_path)
    tensorrt_pass.config = tensorrt_pass.config.model_copy(update={"cross_check": True})
    ctx = type(ctx)(ctx.recipe, ctx.stage_name, ctx.stage_dir, build_feeds(ctx.recipe, 1), ctx.services)
    monkeypatch.setattr(crosscheck, "tensorrt_runner", lambda path: crosscheck.onnxruntime_runner(artifact.path, "e"))
    tensorrt_pass.run(artifact, ctx)
    check = json.loads((ctx.stage_dir / "engine.json").read_text())["cross_check"]
    assert check["feeds"] == 3 and check["atol"] == 1e-3 and check["passed"] is True
    assert check["outputs"]["y"]["max_absdiff"] == 0.0
