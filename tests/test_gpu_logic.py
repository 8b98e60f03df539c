"""GPU stages: the logic that needs no GPU runs everywhere; what needs one is marked `gpu` and skips here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.core.artifact import Artifact
from optimizer.core.errors import InputError
from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe, parse_recipe
from optimizer.runtime.gpu import cuda_reason, ort_cuda_reason, tensorrt_reason
from optimizer.runtime.gpu.nvml import NvmlSampler
from optimizer.runtime.gpu.profiles import cuda_graph_blockers, derive_profiles, precision_summary
from optimizer.runtime.runners import runner_reason


def test_profiles_cover_every_scenario() -> None:
    shapes = {"input_ids": ["batch", "seq"], "pixel": ["batch", 3, 224, 224]}
    scenarios = [{"batch": 1, "seq": 128}, {"batch": 8, "seq": 512}, {"batch": 4, "seq": 64}]
    p = derive_profiles(shapes, scenarios)
    assert p["input_ids"] == {"min": (1, 64), "opt": (1, 128), "max": (8, 512)}
    assert p["pixel"] == {"min": (1, 3, 224, 224), "opt": (1, 3, 224, 224), "max": (8, 3, 224, 224)}
    with pytest.raises(InputError, match="dim 'frames' is not bound"):
        derive_profiles({"video": ["batch", "frames"]}, scenarios)


def test_precision_and_capture_eligibility_from_the_graph() -> None:
    assert precision_summary({"QuantizeLinear": 4, "MatMul": 2}, 0).startswith("int8")
    assert precision_summary({"MatMul": 2}, 12).startswith("fp16")
    assert precision_summary({"MatMul": 2}, 0).startswith("fp32")
    assert cuda_graph_blockers({"Loop": 1, "MatMul": 3, "If": 2}) == ["If", "Loop"]
    assert cuda_graph_blockers({"MatMul": 3}) == []


def test_runner_reasons_follow_the_target() -> None:
    cpu = parse_recipe(mlp_recipe())
    cuda = parse_recipe(mlp_recipe(target={"device": "cuda"}))
    onnx_art = Artifact("onnx", Path("m.onnx"))
    assert runner_reason(onnx_art, cpu) is None
    assert runner_reason(onnx_art, cuda) == ort_cuda_reason()
    assert runner_reason(Artifact("trt_engine", Path("e.plan")), cpu) == tensorrt_reason()
    assert runner_reason(Artifact("torch", None), cuda) == cuda_reason()


@pytest.mark.slow
@pytest.mark.skipif(cuda_reason() is None, reason="this test is about a machine without CUDA")
def test_gpu_passes_skip_with_reasons_and_the_rest_runs(tmp_path: Path) -> None:
    data = mlp_recipe(
        passes=[{"type": "export"}, {"type": "cuda_graph"}, {"type": "tensorrt"}, {"type": "ort_session"}]
    )
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    status = {r.name: (r.status, r.reason) for r in records}
    assert status["cuda_graph"] == ("skipped", cuda_reason())
    assert status["tensorrt"][0] == "skipped" and status["tensorrt"][1] == tensorrt_reason()
    assert status["ort_session"][0] == "ran"
    # Skipped stages pass their input through: ort_session is timed against export.
    assert records[-1].metrics["scenarios"]["b1"]["parent_latency"]["n"] > 0


@pytest.mark.skipif(cuda_reason() is None, reason="this test is about a machine without a GPU")
def test_nvml_sampler_without_a_device_says_why() -> None:
    with NvmlSampler() as s:
        s.sample()
        pass
    summary = s.summary()
    assert summary == {"reason": s.reason} and s.reason.startswith("NVML unavailable")
    assert s.samples == []


def _gpu_recipe(tmp_path: Path, passes: list[dict]) -> Path:
    data = mlp_recipe(target={"device": "cuda"}, passes=passes)
    data["inputs"] = [{"name": "x", "dtype": "float32", "shape": ["batch", 4, 16]}]
    return write_recipe(tmp_path, data)


@pytest.mark.gpu
def test_torch_cuda_graph_matches_eager_and_reports_gpu_time(tmp_path: Path) -> None:
    records = Pipeline(load_recipe(_gpu_recipe(tmp_path, [{"type": "cuda_graph"}])), tmp_path / "out").execute()
    graph = records[1]
    assert graph.status == "ran", graph.reason
    m = graph.metrics["scenarios"]["b1"]
    assert m["gpu_latency"]["p50_ms"] > 0 and m["transfers"]["h2d_ms"] >= 0
    assert graph.metrics["accuracy"]["logits"]["cosine"] > 0.99999
    assert graph.metrics["runtime"]["cuda_graph"] is True


@pytest.mark.gpu
@pytest.mark.skipif(ort_cuda_reason() is not None, reason=f"{ort_cuda_reason()}")
def test_ort_cuda_io_binding_and_graph(tmp_path: Path) -> None:
    passes = [{"type": "export"}, {"type": "ort_session"}, {"type": "cuda_graph"}]
    records = Pipeline(load_recipe(_gpu_recipe(tmp_path, passes)), tmp_path / "out").execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    assert records[-1].metrics["runtime"]["io_binding"] is True
    assert records[-1].metrics["accuracy"]["logits"]["cosine"] > 0.9999


@pytest.mark.gpu
@pytest.mark.skipif(tensorrt_reason() is not None, reason=f"{tensorrt_reason()}")
def test_tensorrt_engine_builds_runs_and_records_metadata(tmp_path: Path) -> None:
    passes = [{"type": "export"}, {"type": "tensorrt"}, {"type": "cuda_graph"}]
    records = Pipeline(load_recipe(_gpu_recipe(tmp_path, passes)), tmp_path / "out").execute()
    trt = records[2]
    assert trt.status == "ran", trt.reason
    assert trt.notes["profiles"]["x"]["max"] == [8, 4, 16]
    assert (tmp_path / "out" / "timing.cache").is_file()
    assert trt.metrics["accuracy"]["logits"]["cosine"] > 0.999
    assert np.isfinite(records[3].metrics["scenarios"]["b8"]["gpu_latency"]["p50_ms"])


@pytest.mark.slow
@pytest.mark.skipif(cuda_reason() is None, reason="this test is about a machine without CUDA")
def test_cuda_recipe_without_cuda_is_a_clear_usage_error(tmp_path: Path) -> None:
    from test_recipe import run_cli

    recipe = _gpu_recipe(tmp_path, [{"type": "export"}])
    proc = run_cli("compile", str(recipe), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {recipe}: target.device cuda: {cuda_reason()}"


def test_kernel_and_launch_counts_from_a_trace() -> None:
    """Kineto's trace categories: kernels run on the device, launch calls on the host (runtime or driver API,
    with suffixes), a CUDA graph replay as one launch that still runs all of its kernels."""
    from optimizer.runtime.gpu.kernels import count_trace_events

    eager = [{"cat": "kernel", "name": "gemm"}] * 6 + [
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel"},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernelExC_v11060"},
        {"cat": "cuda_driver", "name": "cuLaunchKernel_ptsz"},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel"},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync"},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD"},
        {"cat": "cpu_op", "name": "aten::mm"},
    ]
    counts = count_trace_events(eager, calls=2)
    assert counts == {"kernels": 3.0, "launches": 2.0, "graph_launches": 0.0, "memcpy": 0.5, "busy_ms": 0.0, "calls": 2}
    graph = [{"cat": "kernel", "name": "gemm"}] * 6 + [{"cat": "cuda_runtime", "name": "cudaGraphLaunch"}] * 2
    counts = count_trace_events(graph, calls=2)
    assert counts["kernels"] == 3.0 and counts["launches"] == 1.0 and counts["graph_launches"] == 1.0


def test_kernel_profile_without_cuda_gives_the_reason() -> None:
    from optimizer.runtime.gpu.kernels import profile_kernels

    if cuda_reason() is None:
        pytest.skip("this test is about a machine without CUDA")
    assert profile_kernels(lambda: None) == {"reason": cuda_reason()}


def test_profiler_trace_is_read_back_with_its_categories() -> None:
    """The trace plumbing the CUDA count stands on, on the CPU: torch ops come back as cpu_op events, none is
    taken for a kernel or a launch."""
    import torch

    from optimizer.runtime.gpu.kernels import count_trace_events, trace_events

    x = torch.ones(8, 8)
    events = trace_events(lambda: torch.mm(x, x), calls=2, cuda=False)
    assert sum(e.get("cat") == "cpu_op" and e.get("name") == "aten::mm" for e in events) == 2
    assert count_trace_events(events, 2)["kernels"] == 0 and count_trace_events(events, 2)["launches"] == 0


def test_more_kernel_launches_than_the_parent_is_a_finding() -> None:
    """The seeds' "37% more kernel launches", said in the report's findings and shown as a column."""
    from test_report_schema import report_of

    from optimizer.report.findings import findings
    from optimizer.report.tables import columns, stage_rows

    def stage(index: int, name: str, parent: str | None, launches: float) -> dict:
        k = {"kernels": 300.0, "launches": launches, "graph_launches": 0.0, "memcpy": 0.0, "calls": 3, "busy_ms": 0.6}
        lat = {"n": 3, "p50_ms": 1.0, "p90_ms": 1.0, "p99_ms": 1.0, "mean_ms": 1.0, "std_ms": 0.0, "min_ms": 1.0}
        span = {**lat, "p50_ms": 0.8, "cv": 0.01}
        scen = {"latency": {**lat, "cv": 0.01}, "throughput": {"samples_per_s": 1000.0}, "cuda_kernels": k,
                "gpu_latency": span}
        metrics = {"within_budget": True, "budget": "ok", "accuracy": {}, "scenarios": {"b1": scen}}
        return {"index": index, "name": name, "type": "x", "parent": parent, "status": "ran", "metrics": metrics}

    report = report_of([stage(0, "base", None, 301), stage(1, "flash", "base", 412), stage(2, "lean", "flash", 400)])
    said = findings(report)
    assert said == ["flash (x) on b1: 37% more kernel launches per call than its input (base): 412 vs 301"]
    assert columns(report)[-2:] == [("gpu_time", "span/busy ms"), ("kernels", "kernels/launches")]
    assert [r["kernels"] for r in stage_rows(report, "b1")] == ["300/301", "300/412", "300/400"]
    assert stage_rows(report, "b1")[0]["gpu_time"] == "0.80/0.60"  # event span, then GPU busy time (CUPTI)


@pytest.mark.gpu
def test_cuda_graph_replay_cuts_host_launches(tmp_path: Path) -> None:
    records = Pipeline(load_recipe(_gpu_recipe(tmp_path, [{"type": "cuda_graph"}])), tmp_path / "out").execute()
    eager, graph = (r.metrics["scenarios"]["b1"]["cuda_kernels"] for r in records)
    assert eager["kernels"] >= 1 and eager["graph_launches"] == 0
    assert graph["graph_launches"] == 1 and graph["launches"] < eager["launches"]


def test_a_cpu_build_of_torch_is_known_without_importing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_reason reads torch/version.py first: `cuda = None` is a CPU build, a version string a CUDA build
    (then torch itself is asked whether a device is there)."""
    import importlib.util
    from types import SimpleNamespace

    from optimizer.runtime import gpu

    real = importlib.util.find_spec
    fake = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "torch" else real(name, *a))
    (tmp_path / "version.py").write_text("__version__ = '2.11.0'\ncuda: Optional[str] = None\n")
    assert gpu._torch_is_cpu_build()
    (tmp_path / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    assert not gpu._torch_is_cpu_build()
