"""Op-type profiles beyond ONNX Runtime's forward call (issue 17): the PyTorch source profiled by the PyTorch
profiler, generation stages per prefill and per decode step, CUDA kernels by name (injected events here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe
from test_generation import recipe_data
from test_report_schema import report_of

from optimizer.engine.pipeline import Pipeline
from optimizer.measure.profiles import (
    MARK,
    cuda_kernel_times,
    decode_per_step,
    kernel_family,
    kernel_totals,
    median_per_name,
    ops_per_call,
)
from optimizer.recipe.loading import load_recipe
from optimizer.report.build import build_report
from optimizer.report.explain import explain, explain_all
from optimizer.report.findings import findings
from optimizer.report.html import to_html
from optimizer.report.markdown import to_markdown
from optimizer.report.schema import RunReport


# ---------------------------------------------------------------- a PyTorch stage 0 and the export against it
@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], RunReport]:
    tmp = tmp_path_factory.mktemp("mlp")
    data = mlp_recipe(
        model={"source": "factory", "target": "tiny_models:mlp", "kwargs": {"hidden": 256}},
        scenarios=[{"name": "b8", "batch": 8, "seq": 1}],
        passes=[{"type": "export"}],
    )
    recipe = load_recipe(write_recipe(tmp, data))
    records = Pipeline(recipe, tmp / "out").execute()
    return records, build_report(recipe, records, tmp / "out", 1.0)


@pytest.mark.slow
def test_the_pytorch_source_gets_a_pytorch_profile(mlp_run: tuple[list[Any], RunReport]) -> None:
    records, _ = mlp_run
    source, export = records[0].metrics, records[1].metrics
    assert source["op_time_source"] == "torch" and export["op_time_source"] == "onnxruntime"
    ops = source["op_time_ms"]
    # Linear -> GELU -> Linear: the outermost aten ops only (aten::addmm runs inside aten::linear, not beside it)
    assert {"aten::linear", "aten::gelu"} <= set(ops) and "aten::addmm" not in ops, ops
    assert all(op.startswith("aten::") for op in ops) and ops["aten::linear"] > 0 and ops["aten::gelu"] > 0
    total, p50 = sum(ops.values()), source["scenarios"]["b8"]["latency"]["p50_ms"]
    assert 0 < total < 3 * p50, (total, p50)  # one call's op time, of the same order as the call
    assert {"Gemm", "Gelu"} <= set(export["op_time_ms"]) or {"MatMul", "Gelu"} <= set(export["op_time_ms"])


@pytest.mark.slow
def test_export_is_explained_against_the_pytorch_profile(mlp_run: tuple[list[Any], RunReport]) -> None:
    records, report = mlp_run
    export = report.stage("export")
    assert export is not None
    (e,) = explain_all(report, export)
    assert e.sources == ("torch", "onnxruntime") and not e.comparable and e.per == "call"
    assert e.parent_total_ms == pytest.approx(sum(records[0].metrics["op_time_ms"].values()))
    assert e.stage_total_ms == pytest.approx(sum(records[1].metrics["op_time_ms"].values()))
    summary = e.summary()
    assert summary.startswith("export: ") and "PyTorch" in summary and "ONNX Runtime" in summary
    assert "profiles from two runtimes, op types not matched" in summary and "aten::linear" in summary
    assert "PyTorch profiler against ONNX Runtime profiler" in e.coverage()
    assert e.measured_delta_ms is not None
    md = to_markdown(report)
    assert "| source (PyTorch) | ms | export (ONNX Runtime) | ms |" in md and "| aten::linear | " in md
    html = to_html(report)
    assert "aten::linear (PyTorch)" in html and "class=\"chart opdelta\"" in html


# ---------------------------------------------------------------- generation: prefill and decode step
@pytest.fixture(scope="module")
def gen_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], RunReport]:
    """recipes/gpt2-cpu.yaml's shape (export, then INT4 weight-only) at the tests' tiny size, one scenario."""
    tmp = tmp_path_factory.mktemp("gen")
    int4 = {"mode": "weight_only", "weight_only": {"bits": 4, "block_size": 32}}
    data = recipe_data([{"type": "export"}, {"type": "quantize", "name": "int4", "config": int4}])
    data["scenarios"] = [{"name": "s", "batch": 1, "seq": 16, "new_tokens": 6}]
    recipe = load_recipe(write_recipe(tmp, data))
    records = Pipeline(recipe, tmp / "out").execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    return records, build_report(recipe, records, tmp / "out", 1.0)


@pytest.mark.slow
def test_generation_stages_profile_the_prefill_and_the_decode_step(gen_report: tuple[list[Any], RunReport]) -> None:
    records, _ = gen_report
    source, export, int4 = (r.metrics for r in records)
    assert source["op_time_source"] == "torch"
    for part in ("prefill_op_time_ms", "op_time_ms"):
        assert source[part] and all(op.startswith("aten::") for op in source[part]), source[part]
        assert export[part] and int4[part] and not any(op.startswith("aten::") for op in export[part])
        assert "MatMulNBits" in int4[part] and "MatMulNBits" not in export[part]
    assert export["op_time_source"] == int4["op_time_source"] == "onnxruntime"
    assert export["nodes_executed"] > 20
    scen = export["scenarios"]["s"]
    # One decode step and one prefill, not the whole generation (prefill + 5 steps). At this size ONNX Runtime's
    # profiler adds more per node than the node takes (a step profiles at ~3x its measured TPOT), so the bound is
    # the generation's time, not the step's.
    step, prefill = sum(export["op_time_ms"].values()), sum(export["prefill_op_time_ms"].values())
    assert 0 < step < scen["latency"]["p50_ms"] and 0 < prefill < scen["latency"]["p50_ms"], (step, prefill, scen)
    torch_step = sum(source["op_time_ms"].values())
    assert 0 < torch_step < source["scenarios"]["s"]["latency"]["p50_ms"] / 2, torch_step
    assert scen["parent_ttft"]["n"] == scen["ttft"]["n"] and scen["parent_tpot"]["n"] == scen["tpot"]["n"]


@pytest.mark.slow
def test_generation_stages_are_explained_per_prefill_and_per_decode_step(
    gen_report: tuple[list[Any], RunReport],
) -> None:
    _, report = gen_report
    int4, export = report.stage("int4"), report.stage("export")
    assert int4 is not None and export is not None
    parts = explain_all(report, int4)
    assert [e.per for e in parts] == ["prefill", "decode step"] and all(e.comparable for e in parts)
    assert all(e.sources == ("onnxruntime", "onnxruntime") for e in parts)
    assert not any(r.op.startswith("aten::") for e in parts for r in e.rows)
    for e in parts:
        new = {r.op for r in e.rows if r.change == "new"}
        gone = {r.op for r in e.rows if r.change == "gone"}
        assert "MatMulNBits" in new and gone & {"MatMul", "Gemm"}, (new, gone)
        assert e.measured_delta_ms is not None  # TTFT / TPOT of stage and parent, same interleaved session
        label = "TTFT P50" if e.per == "prefill" else "TPOT P50"
        assert label in e.coverage(), e.coverage()
        assert f"int4: {e.profile_delta_ms:+.2f} ms per {e.per}: " in e.summary(len(e.rows))
        assert "MatMulNBits +" in e.summary(len(e.rows))
    assert [e.per for e in explain_all(report, export)] == ["prefill", "decode step"]
    assert not any(e.comparable for e in explain_all(report, export))  # PyTorch loop against ONNX Runtime
    md = to_markdown(report)
    assert "ms per prefill: " in md and "ms per decode step: " in md
    # an inversion's finding carries both parts
    sm = int4.metrics.scenarios["s"] if int4.metrics is not None else None
    assert sm is not None and sm.vs_parent is not None
    sm.vs_parent = sm.vs_parent.model_copy(update={"ratio": 0.5, "low": 0.45, "high": 0.55, "verdict": "slower"})
    said = next(f for f in findings(report) if f.startswith("int4 (") and "slower than its" in f)
    assert "int4: " in said and "ms per prefill" in said and "ms per decode step" in said, said


def test_decode_step_is_the_difference_of_two_profiles() -> None:
    whole = {"aten::addmm": 10.0, "aten::cat": 1.0, "aten::ones_like": 0.2}
    prefill = {"aten::addmm": 4.0, "aten::ones_like": 0.3}
    assert decode_per_step(whole, prefill, 3) == {"aten::addmm": 2.0, "aten::cat": pytest.approx(1 / 3)}
    calls = [{"a": 1.0, "b": 1.0}, {"a": 1.2}, {"a": 90.0, "b": 1.0}]  # one preempted call does not move a median
    assert median_per_name(calls) == {"a": 1.2, "b": 1.0}


# ---------------------------------------------------------------- CUDA kernels by name, from injected events
GEMM = "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(cutlass_80_tensorop_s1688gemm::P)"
GELU = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&)"
    "::{lambda(float)#1}, at::detail::Array<char*, 2> >(int, at::detail::Array<char*, 2>)"
)
ADD = (
    "void onnxruntime::cuda::_BinaryElementWiseSimple<true, float, float, float, onnxruntime::cuda::OP_Add<float, "
    "float, float>, 256, 4>(float const*, float const*, float*, int)"
)


def test_kernel_names_without_templates_keep_what_they_compute() -> None:
    assert kernel_family(GEMM) == "cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4"
    assert kernel_family(GELU) == "vectorized_elementwise_kernel[GeluCUDAKernelImpl]"
    assert kernel_family(ADD) == "_BinaryElementWiseSimple[OP_Add]"
    assert kernel_family("ampere_sgemm_32x32_sliced1x4_tn") == "ampere_sgemm_32x32_sliced1x4_tn"


def _trace(gemms: int, adds: int) -> list[dict[str, Any]]:
    kernels = [{"cat": "kernel", "name": GEMM, "dur": 30.0}] * gemms
    kernels += [{"cat": "kernel", "name": ADD, "dur": 5.0}] * adds
    launches = [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 4.0}] * (gemms + adds)
    return [*kernels, *launches, {"cat": "cpu_op", "name": "aten::mm", "dur": 50.0}]


def test_kernel_time_per_name_from_injected_cupti_events(monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.runtime import gpu
    from optimizer.runtime.gpu import kernels

    assert kernel_totals(_trace(2, 3)) == {
        "cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4": pytest.approx(0.06),
        "_BinaryElementWiseSimple[OP_Add]": pytest.approx(0.015),
    }
    calls: list[int] = []

    def fake_trace(fn: Any, n: int, cuda: bool) -> list[dict[str, Any]]:
        calls.append(n)
        return _trace(2 * n, n)

    monkeypatch.setattr(gpu, "cuda_reason", lambda: None)
    monkeypatch.setattr(kernels, "trace_events", fake_trace)
    got = cuda_kernel_times(lambda: None, calls=3)
    assert calls == [3] and got["cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4"] == pytest.approx(0.18)
    monkeypatch.setattr(gpu, "cuda_reason", lambda: "no CUDA device")
    assert cuda_kernel_times(lambda: None) == {}


def test_pytorch_ops_on_cuda_take_their_kernels_device_time() -> None:
    def ev(name: str, parent: Any, cpu: float, dev: float) -> Any:
        return SimpleNamespace(name=name, cpu_parent=parent, cpu_time_total=cpu, device_time_total=dev)

    call0, call1 = ev(f"{MARK}0", None, 0, 0), ev(f"{MARK}1", None, 0, 0)
    lin0 = ev("aten::linear", call0, 20.0, 300.0)
    events = [call0, lin0, ev("aten::addmm", lin0, 15.0, 300.0), ev("aten::gelu", call0, 5.0, 40.0),
              call1, ev("aten::linear", call1, 22.0, 310.0), ev("aten::zeros", None, 9.0, 0.0)]
    assert ops_per_call(events, cuda=True) == [{"aten::linear": 0.3, "aten::gelu": 0.04}, {"aten::linear": 0.31}]
    assert ops_per_call(events, cuda=False)[0] == {"aten::linear": 0.02, "aten::gelu": 0.005}


def _gpu_stage(index: int, name: str, parent: str | None, source: str, ops: dict[str, float],
               kernel_ms: dict[str, float], launches: float) -> dict[str, Any]:
    lat = {"n": 3, "p50_ms": 1.0, "p90_ms": 1.0, "p99_ms": 1.0, "mean_ms": 1.0, "std_ms": 0.0, "min_ms": 1.0, "cv": 0.0}
    k = {"kernels": launches, "launches": launches, "graph_launches": 0.0, "memcpy": 0.0, "calls": 3}
    scen = {"latency": lat, "throughput": {"samples_per_s": 1000.0}, "cuda_kernels": k}
    if parent:
        scen["parent_latency"] = {**lat, "p50_ms": 0.8}
    metrics = {"within_budget": True, "budget": "ok", "accuracy": {}, "scenarios": {"b1": scen},
               "op_time_ms": ops, "op_time_source": source, "kernel_time_ms": kernel_ms}
    return {"index": index, "name": name, "type": "x", "parent": parent, "status": "ran", "metrics": metrics}


def test_gpu_stages_are_explained_by_kernel_name_with_launches() -> None:
    """A PyTorch source and an ONNX export on CUDA: their op types are two vocabularies, their kernels one; the
    kernel comparison leads, with the seeds' launches per call."""
    gemm, add = "ampere_sgemm_128x64_tn", "_BinaryElementWiseSimple[OP_Add]"
    report = report_of([
        _gpu_stage(0, "base", None, "torch", {"aten::linear": 0.5}, {gemm: 0.40, "gelu_kernel": 0.05}, 100),
        _gpu_stage(1, "flash", "base", "onnxruntime", {"MatMul": 0.45, "Add": 0.2}, {gemm: 0.41, add: 0.19}, 137),
    ])
    flash = report.stage("flash")
    assert flash is not None
    ops, kern = explain_all(report, flash)
    assert not ops.comparable and kern.comparable and kern.kernels and kern.sources == ("cupti", "cupti")
    assert explain(report, flash) == kern
    assert kern.rows[0].op == add and kern.rows[0].change == "new" and kern.rows[0].delta_ms == pytest.approx(0.19)
    assert kern.profile_delta_ms == pytest.approx(0.15) and kern.measured_delta_ms == pytest.approx(0.2)
    summary = kern.summary()
    assert summary.startswith("flash: +0.15 ms per call in CUDA kernels: _BinaryElementWiseSimple[OP_Add] +0.19 ms")
    assert summary.endswith("kernel launches per call 100 -> 137 (+37%)")
    assert "(75%, b1, CUDA kernels, CUPTI)" in kern.coverage()
    assert "| CUDA kernel | base ms | flash ms | change ms |" in to_markdown(report)



@pytest.mark.slow
def test_generation_report_shows_tpot_against_the_export(gen_report: tuple[list[Any], RunReport]) -> None:
    """Issue 16: the weight-only stage's TPOT ratio against the FP32 export, with its token agreement."""
    from optimizer.report.tables import stage_rows, tpot_vs_export

    _, report = gen_report
    int4 = report.stage("int4")
    assert int4 is not None and int4.metrics is not None
    sm = int4.metrics.scenarios["s"]
    assert sm.tpot is not None and sm.parent_tpot is not None
    t = tpot_vs_export(report, int4, "s")
    # the interleaved TPOT ratio with its own interval (measured per round), not an estimate
    assert sm.tpot_vs_parent is not None
    assert t is not None and t.path == ["export", "int4"] and not t.chained and not t.approximate
    assert t.ratio == pytest.approx(sm.tpot_vs_parent.ratio) and t.low <= t.ratio <= t.high
    cell = next(r["tpot_vs_export"] for r in stage_rows(report, "s") if r["stage"].endswith("int4"))
    assert cell == f"{t.ratio:.2f}x ({t.low:.2f}-{t.high:.2f})"
    agree = int4.metrics.first_accuracy.token_agreement  # type: ignore[union-attr]
    md = to_markdown(report)
    assert f"- int4 on s: TPOT {t.ratio:.2f}x against export (" in md and f"token agreement {agree:.3f}" in md
