"""GPU runner logic checked on the CPU by injecting the device pieces: a graph whose replay reads the buffers it was
captured with, streams that record what ran on them. Each fails on the defect it pins (issue: GPU path correct
before it meets a GPU); the true-GPU versions are the gpu-marked tests in test_gpu_logic.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from optimizer.runtime.runners.torch_runner import TorchSession
from optimizer.runtime.runners.trt_runner import TrtSession

CAPTURING: list[Any] = []  # the graph being captured, if any


class FakeStream:
    def __init__(self, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: Any) -> None:
        pass


class FakeGraph:
    """Replays what was captured: a closure over the static buffers, read at replay time, as CUDA graphs do."""

    def __init__(self) -> None:
        self.work: list[Any] = []
        self.replayed_on: list[Any] = []

    def replay(self) -> None:
        self.replayed_on.append(CURRENT[-1])
        with torch.inference_mode():  # the captured kernels write tensors made under inference mode
            for fn in self.work:
                fn()


CURRENT: list[Any] = [FakeStream("default")]


@contextlib.contextmanager
def fake_graph_capture(graph: FakeGraph, stream: Any = None) -> Any:
    CAPTURING.append(graph)
    try:
        yield
    finally:
        CAPTURING.pop()


@contextlib.contextmanager
def fake_stream_ctx(stream: Any) -> Any:
    CURRENT.append(stream)
    try:
        yield
    finally:
        CURRENT.pop()


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if CAPTURING:
            out = torch.empty_like(x)
            CAPTURING[-1].work.append(lambda: out.copy_(x * 2))  # reads the static buffer x when replayed
            return [out]
        return [x * 2]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: CURRENT[-1])
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_ctx)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph_capture)


def test_second_feed_of_a_captured_shape_is_not_the_first_feeds_output(fake_cuda: None) -> None:
    session = TorchSession(Doubler(), ["y"], ["x"], 1, device="cpu", cuda_graph=True)
    a, b = np.full((2, 3), 1.0, np.float32), np.full((2, 3), 5.0, np.float32)
    pa, pb = session.prepare({"x": a}), session.prepare({"x": b})
    assert len(session._graphs) == 1  # one capture for the shape
    np.testing.assert_array_equal(session.to_numpy(session.run(pb))[0], 2 * b)
    np.testing.assert_array_equal(session.to_numpy(session.run(pa))[0], 2 * a)


def test_first_feed_of_a_captured_shape_after_another_feed_is_its_own(fake_cuda: None) -> None:
    """Call order 0, 1, 0: the graph was captured with feed 0; its static inputs must not be feed 0's own tensors,
    or its third run skips the copy and replays feed 1."""
    session = TorchSession(Doubler(), ["y"], ["x"], 1, device="cpu", cuda_graph=True)
    pa, pb = (session.prepare({"x": np.full((2, 3), v, np.float32)}) for v in (1.0, 5.0))
    for prepared, expected in ((pa, 2.0), (pb, 10.0), (pa, 2.0)):  # constants: a CPU tensor shares its array
        np.testing.assert_array_equal(session.to_numpy(session.run(prepared))[0], np.full((2, 3), expected))


class FakeEvent:
    def __init__(self, **_: Any) -> None:
        self.streams: list[Any] = []

    def record(self, stream: Any = None) -> None:
        self.streams.append(stream)


def test_tensorrt_graph_replays_on_the_stream_its_events_time(fake_cuda: None) -> None:
    session = TrtSession.__new__(TrtSession)  # no engine needed: run() is what is checked
    session.torch = SimpleNamespace(cuda=SimpleNamespace(stream=fake_stream_ctx))
    session.stream = SimpleNamespace(name="trt", synchronize=lambda: None)
    session._events = (FakeEvent(), FakeEvent())
    graph = FakeGraph()
    session.run({"graph": graph, "inputs": {}, "outputs": {}})
    assert graph.replayed_on == [session.stream]
    assert session._events[0].streams == [session.stream] == session._events[1].streams


# ---------------------------------------------------------------- ONNX Runtime on CUDA
class FakeOrtSession:
    """An InferenceSession that, like ORT when the CUDA provider cannot load, opened with the CPU provider alone."""

    def __init__(self, path: str, so: Any = None, providers: Any = None) -> None:
        self.asked = providers

    def get_providers(self) -> list[str]:
        return ["CPUExecutionProvider"]

    def get_outputs(self) -> list[Any]:
        return [SimpleNamespace(name="y")]

    def get_inputs(self) -> list[Any]:
        return [SimpleNamespace(name="x")]


class HandleStream:
    """A torch.cuda.Stream with the handles a real device gives: new streams nonzero, the default one 0."""

    made = 0

    def __init__(self) -> None:
        HandleStream.made += 1
        self.cuda_stream = 0x5000 + HandleStream.made


@pytest.fixture
def torch_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))  # the legacy stream
    monkeypatch.setattr(torch.cuda, "Stream", HandleStream)


def test_ort_computes_on_a_stream_of_its_own_never_the_legacy_default(torch_stream: None) -> None:
    """cudaStreamBeginCapture may not be initiated on the legacy default stream (handle 0), which is what torch's
    current stream is outside a `torch.cuda.stream` block."""
    from optimizer.core.errors import OptimizerError
    from optimizer.runtime.sessions import providers_for

    (name, options), cpu = providers_for({"cuda_graph": True}, "cuda")
    assert name == "CUDAExecutionProvider" and cpu == "CPUExecutionProvider"
    assert options["has_user_compute_stream"] == "1" and options["user_compute_stream"] != "0"
    assert options["enable_cuda_graph"] == "1"
    (_, given), _ = providers_for({}, "cuda", compute_stream=0x7777)
    assert given["user_compute_stream"] == str(0x7777)  # the caller's stream, whose events time the runs
    with pytest.raises(OptimizerError, match="legacy default stream"):
        providers_for({}, "cuda", compute_stream=0)


def test_ort_cuda_session_records_its_events_on_the_stream_ort_computes_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, torch_stream: None
) -> None:
    import onnxruntime as ort
    from conftest import mlp_recipe, write_recipe

    import optimizer.runtime.gpu
    from optimizer.core.artifact import Artifact
    from optimizer.recipe.loading import load_recipe
    from optimizer.runtime.runners.ort_runner import OrtRunner

    class CudaSession(FakeOrtSession):
        def get_providers(self) -> list[str]:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

        def run_with_iobinding(self, binding: Any, options: Any = None) -> None:
            pass

    monkeypatch.setattr(ort, "InferenceSession", CudaSession)
    monkeypatch.setattr(optimizer.runtime.gpu, "ort_cuda_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe()))
    with OrtRunner(Artifact("onnx", tmp_path / "m.onnx"), recipe, device="cuda").load() as session:
        (_, options), _ = session.session.asked
        session.run((SimpleNamespace(), [], None))
        assert options["user_compute_stream"] == str(session.stream.cuda_stream) != "0"
        assert session._events[0].streams == [session.stream] == session._events[1].streams


def test_cuda_session_that_fell_back_to_the_cpu_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, torch_stream: None
) -> None:
    import onnxruntime as ort
    from conftest import mlp_recipe, write_recipe

    import optimizer.runtime.gpu
    from optimizer.core.artifact import Artifact
    from optimizer.core.errors import OptimizerError
    from optimizer.recipe.loading import load_recipe
    from optimizer.runtime.runners.ort_runner import OrtRunner

    monkeypatch.setattr(ort, "InferenceSession", FakeOrtSession)
    monkeypatch.setattr(optimizer.runtime.gpu, "ort_cuda_reason", lambda: None)
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe()))
    runner = OrtRunner(Artifact("onnx", tmp_path / "m.onnx"), recipe, device="cuda")
    with pytest.raises(OptimizerError, match="without its CUDA execution provider"), runner.load():
        pass


def test_int8_for_tensorrt_is_symmetric_and_the_tensorrt_pass_checks_it(tmp_path: Any) -> None:
    import onnx
    from test_verdicts import sensitive_chain

    from optimizer.runtime.gpu.profiles import asymmetric_qdq_reason
    from passes.quantize.calibration import FeedReader
    from passes.quantize.config import QuantizeConfig, symmetric_activations
    from passes.quantize.modes import int8_static

    assert symmetric_activations(QuantizeConfig(mode="int8_static"), "cuda") is True
    assert symmetric_activations(QuantizeConfig(mode="int8_static"), "cpu") is False
    src = tmp_path / "chain.onnx"
    sensitive_chain(src, layers=3, width=16)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.normal(size=(2, 16)).astype(np.float32)} for _ in range(4)]
    for symmetric in (False, True):
        dst = tmp_path / f"q{symmetric}.onnx"
        int8_static(src, dst, FeedReader(feeds, ["x"]), "minmax", True, symmetric, ["MatMul"], [], 99.99)
        reason = asymmetric_qdq_reason(onnx.load(str(dst)))
        if symmetric:
            assert reason is None
        else:
            assert reason is not None and "uint8" in reason and "symmetric" in reason


# ---------------------------------------------------------------- TensorRT contexts per shape
class FakeContext:
    def __init__(self, max_batch: int = 8) -> None:
        self.max_batch, self.shapes = max_batch, {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shapes[name] = shape
        return shape[0] <= self.max_batch  # TensorRT returns False outside the profile

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes["x"]

    def set_tensor_address(self, name: str, ptr: int) -> None:
        pass

    def execute_async_v3(self, stream: int) -> bool:
        return True


def _trt_session(cuda_graph: bool) -> TrtSession:
    session = TrtSession.__new__(TrtSession)
    contexts: list[FakeContext] = []

    def create() -> FakeContext:
        contexts.append(FakeContext())
        return contexts[-1]

    session.engine = SimpleNamespace(
        create_execution_context=create, get_tensor_dtype=lambda n: SimpleNamespace(name="FLOAT")
    )
    session.torch, session.trt, session.device = torch, None, "cpu"
    session.context, session.runtime, session._graphs = create(), {"cuda_graph": cuda_graph}, {}
    session.input_names, session.output_names = ["x"], ["y"]
    session.stream = SimpleNamespace(cuda_stream=1, synchronize=lambda: None)
    session.created = contexts  # type: ignore[attr-defined]
    return session


def test_tensorrt_graphs_get_one_context_per_shape(fake_cuda: None) -> None:
    session = _trt_session(cuda_graph=True)
    feeds = [np.zeros(shape, np.float32) for shape in ((2, 4), (3, 4), (2, 4))]
    prepared = [session.prepare({"x": f}) for f in feeds]
    assert len(session._graphs) == 2 and len(session.created) == 3  # the session's own + one per shape
    assert prepared[0]["context"] is prepared[2]["context"] is not prepared[1]["context"]
    assert prepared[0]["context"].shapes["x"] == (2, 4) and prepared[1]["context"].shapes["x"] == (3, 4)
    assert prepared[0]["static"] is prepared[2]["static"] and prepared[0]["inputs"] is not prepared[2]["inputs"]


def test_tensorrt_shape_outside_the_profile_says_so(fake_cuda: None) -> None:
    from optimizer.core.errors import OptimizerError

    session = _trt_session(cuda_graph=False)
    with pytest.raises(OptimizerError, match="outside the engine's optimization profile"):
        session.prepare({"x": np.zeros((9, 4), np.float32)})
    bf16 = _trt_session(cuda_graph=False)
    bf16.engine.get_tensor_dtype = lambda n: SimpleNamespace(name="BF16")
    assert bf16._dtype("x") is torch.bfloat16


# ---------------------------------------------------------------- Triton configs, parsed by Triton's own schema
def _model_config_pb2() -> Any:
    """tritonclient's generated model_config protobuf, loaded by file (its package __init__ wants grpc)."""
    import importlib.util

    spec = importlib.util.find_spec("tritonclient")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("tritonclient is not installed (dev extra)")
    path = next(iter(spec.submodule_search_locations)) + "/grpc/model_config_pb2.py"
    module_spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _report(device: str, threads: int) -> Any:
    from test_report_schema import report_of

    settings = {"device": device, "threads": threads, "benchmark": {}, "accuracy": {}}
    scenarios = [{"name": "b1", "batch": 1, "seq": 1}, {"name": "b8", "batch": 8, "seq": 1}]
    return report_of([], scenarios, settings=settings)


@pytest.mark.parametrize(("level", "expected"), [("disable_all", 2), ("basic", -1), ("extended", 1), ("all", None)])
def test_triton_config_parses_and_serves_as_measured(level: str, expected: int | None) -> None:
    from google.protobuf import text_format

    from optimizer.deploy.triton import triton_config

    pb2 = _model_config_pb2()
    inputs = [{"name": "input_ids", "dtype": "int64", "onnx_type": "INT64", "shape": ["batch", "seq"]}]
    outputs = [{"name": "emb", "dtype": "float16", "onnx_type": "FLOAT16", "shape": ["batch", "seq", 384]}]
    for device, kind in (("cpu", pb2.ModelInstanceGroup.KIND_CPU), ("cuda", pb2.ModelInstanceGroup.KIND_GPU)):
        text = triton_config("m", inputs, outputs, _report(device, 3), {"graph_optimization_level": level})
        config = text_format.Parse(text, pb2.ModelConfig())
        assert config.max_batch_size == 8 and config.instance_group[0].kind == kind
        assert config.input[0].data_type == pb2.TYPE_INT64 and config.output[0].data_type == pb2.TYPE_FP16
        assert list(config.output[0].dims) == [-1, 384]
        assert config.parameters["intra_op_thread_count"].string_value == "3"
        assert config.optimization.graph.level == (expected if expected is not None else 0)
        assert config.optimization.HasField("graph") == (expected is not None)


def test_triton_config_refuses_a_type_triton_lacks() -> None:
    from optimizer.core.errors import OptimizerError
    from optimizer.deploy.triton import triton_config

    fp8 = [{"name": "y", "dtype": "float8e4m3fn", "onnx_type": "FLOAT8E4M3FN", "shape": ["batch", 4]}]
    with pytest.raises(OptimizerError, match="'y' has type FLOAT8E4M3FN"):
        triton_config("m", fp8, fp8, _report("cpu", 2), {})


# ---------------------------------------------------------------- export --format tensorrt
@pytest.mark.slow
def test_tensorrt_bundle_from_a_run_with_an_engine_stage(tmp_path: Any) -> None:
    import json

    from conftest import mlp_recipe, write_recipe

    from optimizer.core.artifact import Artifact, file_sha256
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import unchecked_reason, verify_bundle
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import write_report

    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe()))
    run = tmp_path / "run"
    report = write_report(recipe, Pipeline(recipe, run).execute(), run, 1.0)
    # An engine stage as a GPU machine writes it: a serialized engine (a fixture here) and engine.json beside it.
    folder = run / "03-tensorrt"
    folder.mkdir()
    (folder / "model.plan").write_bytes(b"fixture engine: not a real plan" * 10)
    (folder / "engine.json").write_text(json.dumps({"tensorrt": "10.13", "gpu": "NVIDIA H200"}))
    trt_stage = report.stages[-1].model_copy(update=dict(
        index=3, name="tensorrt", type="tensorrt", parent="ort_session", folder=folder.name,
        artifact=Artifact("trt_engine", folder / "model.plan"),
    ))
    report.stages.append(trt_stage)
    plan = folder / "model.plan"  # stage.json as the pipeline writes it: export ships only files it recorded
    (folder / "stage.json").write_text(json.dumps({"key": trt_stage.key, "status": "ran", "file_sha256": {
        "model.plan": file_sha256(plan)}, "file_sizes": {"model.plan": plan.stat().st_size}}))
    out = export_bundle(report, "tensorrt", "tensorrt", tmp_path / "bundle")
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "model.plan", "engine.json", "reference.npz", "polygraphy_inputs.json", "polygraphy_outputs.json"
    }
    assert manifest["model"] == "model.plan" and manifest["tolerance"]["against"] == "stage 0"
    with np.load(out / "reference.npz") as ref:
        assert {"b1/in/x", "b1/out/logits", "b8/out/logits"} <= set(ref.files)
    assert verify_bundle(out) == [] and "tensorrt" in (unchecked_reason(out) or "")
    (out / "model.plan").write_bytes(b"tampered")
    assert any("model.plan: sha256 differs" in p for p in verify_bundle(out))
    with pytest.raises(Exception, match="not a TensorRT engine"):
        export_bundle(report, "ort_session", "tensorrt", tmp_path / "bundle2")


# ---------------------------------------------------------------- NVML
class FakeNvml:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        raise RuntimeError("not this way")  # force the CUDA_VISIBLE_DEVICES path

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        self.calls.append(f"index {i}")
        return f"handle {i}"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        return SimpleNamespace(gpu=50)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        return SimpleNamespace(used=2**30)

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 300_000


def test_nvml_samples_the_visible_device_and_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from optimizer.runtime.gpu.nvml import NvmlSampler

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    import threading

    before = threading.active_count()
    with NvmlSampler() as sampler:
        assert threading.active_count() == before  # no thread beside the timed calls (GIL contention)
        for _ in range(3):  # the harness samples between rounds
            sampler.sample()
    assert fake.calls[0] == "init" and "index 3" in fake.calls and fake.calls[-1] == "shutdown"
    assert sampler.summary()["power_max_w"] == 300.0 and sampler.summary()["samples"] == 3


# ---------------------------------------------------------------- ONNX Runtime CUDA graphs: one id per shape
class FakeOrtValue:
    def __init__(self, arr: np.ndarray) -> None:
        self.data = arr.copy()

    @staticmethod
    def ortvalue_from_numpy(arr: np.ndarray, device: str, index: int) -> FakeOrtValue:
        return FakeOrtValue(arr)

    def update_inplace(self, arr: np.ndarray) -> None:
        self.data[...] = arr


class FakeRunOptions:
    def __init__(self) -> None:
        self.entries: dict[str, str] = {}

    def add_run_config_entry(self, key: str, value: str) -> None:
        self.entries[key] = value


class FakeBinding:
    def __init__(self) -> None:
        self.inputs: dict[str, Any] = {}
        self.out: np.ndarray | None = None

    def bind_ortvalue_input(self, name: str, value: FakeOrtValue) -> None:
        self.inputs[name] = value

    def bind_input(self, name: str, device: str, index: int, dtype: Any, shape: list[int], ptr: int) -> None:
        """Bound by address, as ORT does: a replay reads whatever that memory holds then."""
        self.inputs[name] = (ptr, np.dtype(dtype), tuple(shape))

    def read(self, name: str) -> np.ndarray:
        import ctypes

        value = self.inputs[name]
        if isinstance(value, FakeOrtValue):
            return value.data
        ptr, dtype, shape = value
        size = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=dtype).reshape(shape).copy()

    def bind_output(self, name: str, device: str, index: int) -> None:
        pass

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        assert self.out is not None, "outputs never written (a replay of another shape's graph)"
        return [self.out]


class FakeGraphSession:
    """ORT with enable_cuda_graph: the first runs of a graph id capture it over that binding's buffers; later
    runs with the id replay it, reading the captured buffers and writing the captured binding's outputs."""

    def __init__(self) -> None:
        self.captured: dict[str, FakeBinding] = {}
        self.ids: list[str] = []
        self.options: list[dict[str, str]] = []

    def io_binding(self) -> FakeBinding:
        return FakeBinding()

    def run_with_iobinding(self, binding: FakeBinding, options: FakeRunOptions | None = None) -> None:
        gid = (options.entries.get("gpu_graph_id") if options else None) or "0"
        self.ids.append(gid)
        self.options.append(dict(options.entries) if options else {})
        target = self.captured.setdefault(gid, binding)
        target.out = target.read("x") * 2


def test_ort_cuda_graph_per_shape_and_each_feed_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    from optimizer.runtime.runners.ort_runner import OrtCudaSession

    monkeypatch.setattr(ort, "OrtValue", FakeOrtValue)
    monkeypatch.setattr(ort, "RunOptions", FakeRunOptions)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_ctx)
    session = OrtCudaSession.__new__(OrtCudaSession)
    session.session, session.runtime = FakeGraphSession(), {"cuda_graph": True}
    session.input_names, session.output_names = ["x"], ["y"]
    session.device_name, session.stream = "cpu", FakeStream("ort")
    a, b, c = (np.full(shape, v, np.float32) for shape, v in (((1, 4), 1.0), ((2, 4), 3.0), ((1, 4), 5.0)))
    pa, pb, pc = (session.prepare({"x": f}) for f in (a, b, c))
    for prepared, expected in ((pa, 2.0), (pb, 6.0), (pc, 10.0), (pa, 2.0)):  # a, its own graph, a's shape, a again
        got = session.to_numpy(session.run(prepared))[0]
        np.testing.assert_array_equal(got, np.full(got.shape, expected))
    assert set(session.session.ids) == {"1", "2"}  # one graph id per shape, never ORT's shared default
    # Timed runs do not synchronize inside ORT: the end event follows the last kernel, not the host's wait.
    assert all(o.get("disable_synchronize_execution_providers") == "1" for o in session.session.options)
    assert session._events[0].streams[-1] is session.stream is session._events[1].streams[-1]


def test_tensorrt_builds_with_tf32_unless_asked(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Polygraphy's CreateConfig clears TensorRT's TF32 flag unless tf32=True: FP32 layers would be built strict
    (slower than TensorRT's default) without anything saying so. It is the pass's choice, passed either way."""
    import polygraphy.backend.trt as pg

    import optimizer.runtime.gpu
    from passes.tensorrt import TensorRTConfig, build_engine

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(pg, "Profile", lambda: SimpleNamespace(add=lambda *a, **k: None))
    monkeypatch.setattr(pg, "NetworkFromOnnxPath", lambda *a, **k: None)
    monkeypatch.setattr(pg, "CreateConfig", lambda **kw: asked.append(kw))
    monkeypatch.setattr(pg, "EngineBytesFromNetwork", lambda *a, **k: lambda: b"engine")
    monkeypatch.setattr(optimizer.runtime.gpu, "tensorrt_major", lambda: 11)
    trt = SimpleNamespace(MemoryPoolType=SimpleNamespace(WORKSPACE=0), IProgressMonitor=object)
    ctx = SimpleNamespace(stage_dir=tmp_path, progress=lambda *a: None)
    for cfg in (TensorRTConfig(), TensorRTConfig(tf32=False)):
        assert build_engine(trt, tmp_path / "m.onnx", {}, cfg, ctx) == b"engine"  # type: ignore[arg-type]
    assert [kw["tf32"] for kw in asked] == [True, False]


# ---------------------------------------------------------------- cuda_graph on a PyTorch forward
TINY_BERT = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 100}
TINY_GPT2 = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100, "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parametrize("model, output", [
    ({"source": "hf_config", "architecture": "bert", "config": TINY_BERT, "attn_implementation": "sdpa"},
     "last_hidden_state"),
    ({"source": "hf_config", "architecture": "bert", "config": TINY_BERT, "attn_implementation": "eager"},
     "last_hidden_state"),
    ({"source": "hf_config", "architecture": "gpt2", "task": "causal-lm", "config": TINY_GPT2}, "logits"),
])
def test_cuda_graph_declines_a_forward_that_reads_the_host_during_the_pass(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, model: dict, output: str
) -> None:
    """transformers' mask builder reads a 2-D attention mask on the host (is_nonzero), illegal while capturing:
    the pass finds it on the CPU before anything is captured and declines with the reason, instead of the
    failure surfacing in the benchmark."""
    from conftest import mlp_recipe, write_recipe

    import optimizer.runtime.gpu
    from optimizer.core.artifact import Artifact
    from optimizer.recipe.loading import load_recipe
    from optimizer.runtime.inputs import build_feeds
    from optimizer.runtime.runners.torch_runner import TorchRunner
    from passes.cuda_graph import CudaGraphConfig, CudaGraphPass

    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 100]},
              {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "fill": "ones"}]
    data = mlp_recipe(model=model, inputs=inputs, target={"device": "cuda"},
                      scenarios=[{"name": "b1", "batch": 1, "seq": 8}])
    data.pop("outputs", None)
    recipe = load_recipe(write_recipe(tmp_path, data))
    monkeypatch.setattr(optimizer.runtime.gpu, "cuda_reason", lambda: None)  # as on a GPU machine
    ctx = SimpleNamespace(recipe=recipe, feeds=build_feeds(recipe, 1, per_scenario=False),
                          session=lambda a, device: TorchRunner(a, recipe, device=device).load())
    source = Artifact("torch", None, input_names=["input_ids", "attention_mask"], output_names=[output])
    reason = CudaGraphPass(CudaGraphConfig()).skip_reason(source, ctx)  # type: ignore[arg-type]
    assert reason is not None and "is_nonzero" in reason and "reads tensors back to the host" in reason


def test_cuda_graph_takes_a_forward_without_host_reads(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import mlp_recipe, write_recipe

    import optimizer.runtime.gpu
    from optimizer.core.artifact import Artifact
    from optimizer.recipe.loading import load_recipe
    from optimizer.runtime.inputs import build_feeds
    from optimizer.runtime.runners.torch_runner import TorchRunner
    from passes.cuda_graph import CudaGraphConfig, CudaGraphPass

    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(target={"device": "cuda"})))
    monkeypatch.setattr(optimizer.runtime.gpu, "cuda_reason", lambda: None)
    ctx = SimpleNamespace(recipe=recipe, feeds=build_feeds(recipe, 1, per_scenario=False),
                          session=lambda a, device: TorchRunner(a, recipe, device=device).load())
    source = Artifact("torch", None, input_names=["x"], output_names=["logits"])
    assert CudaGraphPass(CudaGraphConfig()).skip_reason(source, ctx) is None  # type: ignore[arg-type]


def test_tensorrt_event_span_holds_the_enqueue_only(fake_cuda: None) -> None:
    """Shapes and tensor addresses are host-side setup: set before the start event, not inside the span."""
    log: list[str] = []

    class Event:
        def __init__(self, name: str) -> None:
            self.name = name

        def record(self, stream: Any = None) -> None:
            log.append(self.name)

    class Context:
        def set_input_shape(self, name: str, shape: Any) -> bool:
            log.append("set_input_shape")
            return True

        def set_tensor_address(self, name: str, ptr: int) -> None:
            log.append("set_tensor_address")

        def execute_async_v3(self, stream: int) -> bool:
            log.append("enqueue")
            return True

    session = TrtSession.__new__(TrtSession)
    session.torch = torch
    session.stream = SimpleNamespace(cuda_stream=1, synchronize=lambda: None)
    session._events = (Event("start"), Event("end"))
    x = torch.zeros(2)
    session.run({"graph": None, "context": Context(), "inputs": {"x": x}, "outputs": {"y": x}})
    assert log[log.index("start"):] == ["start", "enqueue", "end"], log


def test_gpu_busy_time_counts_overlapping_kernels_once() -> None:
    from optimizer.runtime.gpu.kernels import count_trace_events

    events = [  # two calls; in the first, two kernels overlap on two streams for 50 of their 100 us
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 100}, {"cat": "kernel", "name": "b", "ts": 50, "dur": 100},
        {"cat": "kernel", "name": "a", "ts": 1000, "dur": 100},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
    ]
    assert count_trace_events(events, 2)["busy_ms"] == pytest.approx((150 + 100) / 1000 / 2)


# ---------------------------------------------------------------- ORT capture: ORT's rule, and verified
def _placed_graph(path: Any, copies: bool) -> None:
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape_on_cpu")]  # ORT keeps shape nodes on the CPU
    if copies:
        nodes.append(helper.make_node("MemcpyToHost", ["x"], ["xh"], name="to_host"))
    nodes.append(helper.make_node("Identity", ["x"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph), str(path))


@pytest.mark.parametrize("copies", [False, True])
def test_ort_capture_eligibility_is_orts_own_rule(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                  copies: bool) -> None:
    """Nodes ORT keeps on the CPU on purpose (shape arithmetic) do not block a capture; a host-device copy in the
    placed graph does. The old check (disable_cpu_ep_fallback) refused both."""
    import optimizer.runtime.sessions
    from passes.cuda_graph import memcpy_reason

    asked: list[dict[str, Any]] = []

    def placed_session(path: Any, runtime: Any, threads: int, device: str, **kw: Any) -> None:
        asked.append(kw)
        _placed_graph(kw["optimized_path"], copies)

    monkeypatch.setattr(optimizer.runtime.sessions, "ort_session", placed_session)
    reason = memcpy_reason(tmp_path / "m.onnx")
    assert "config" not in asked[0]  # CPU fallback allowed, as ORT itself would place the graph
    assert (reason is not None and "to_host" in reason and "host-device copies" in reason) if copies else reason is None


def test_a_stage_is_called_captured_only_when_a_graph_was_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """ORT declines a capture with a warning only: the stage must not say "captured" while running eagerly."""
    import optimizer.runtime.gpu.kernels as kernels
    from optimizer.core.errors import PassError
    from passes.cuda_graph import verify_captured

    session = SimpleNamespace(prepare=lambda feed: feed, run=lambda prepared: None)
    feeds = [SimpleNamespace(scenario=SimpleNamespace(name="b1"), timing={"x": 1})]
    eager = {"kernels": 40.0, "launches": 40.0, "graph_launches": 0.0, "memcpy": 0.0, "calls": 3}
    monkeypatch.setattr(kernels, "profile_kernels", lambda fn, calls=3: eager)
    with pytest.raises(PassError, match="ran the stage eagerly"):
        verify_captured(session, feeds)
    replayed = {**eager, "launches": 1.0, "graph_launches": 1.0}
    monkeypatch.setattr(kernels, "profile_kernels", lambda fn, calls=3: replayed)
    assert verify_captured(session, feeds)["b1"]["graph_launches"] == 1.0
    monkeypatch.setattr(kernels, "profile_kernels", lambda fn, calls=3: {"reason": "CUPTI busy"})
    assert verify_captured(session, feeds) == {"reason": "capture not verified: CUPTI busy"}


# ---------------------------------------------------------------- GPU memory of any runtime
class DeviceMemory:
    """A device whose memory a runtime outside PyTorch (a TensorRT engine, ORT's arena) allocates: torch's
    allocator never sees it; the process's device memory does."""

    def __init__(self) -> None:
        self.outside = 0  # bytes a non-torch runtime holds
        self.torch = 0

    def mem_get_info(self) -> tuple[int, int]:
        total = 80 * 2**30
        return total - (self.outside + self.torch + 500 * 2**20), total  # 500 MB: the CUDA context


def test_gpu_memory_counts_what_a_runtime_outside_pytorch_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from optimizer.runtime.gpu.memory import MEM_GET_INFO, GpuMemoryProbe

    device = DeviceMemory()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py (the GPU machine lacks it): the fallback
    for name, fn in {"synchronize": lambda: None, "empty_cache": lambda: None, "reset_peak_memory_stats": lambda: None,
                     "memory_allocated": lambda: device.torch, "max_memory_allocated": lambda: device.torch,
                     "mem_get_info": device.mem_get_info}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    probe = GpuMemoryProbe("cuda").start()
    device.outside += 300 * 2**20  # the engine's weights and its context's activation memory
    mb, method = probe.result()
    assert mb == pytest.approx(300) and method == MEM_GET_INFO
    assert GpuMemoryProbe("cpu").start().result() == (None, None)


def test_gpu_memory_reads_nvmls_per_process_figure_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys

    from optimizer.runtime.gpu.memory import NVML, process_device_bytes

    used = {"me": 700 * 2**20}
    fake = SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: "gpu", nvmlDeviceGetHandleByUUID=lambda u: "gpu",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=9 * 2**30),  # another process: not ours
            SimpleNamespace(pid=os.getpid(), usedGpuMemory=used["me"]),
        ],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="GPU-x"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert process_device_bytes() == (700 * 2**20, NVML)
