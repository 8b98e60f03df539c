"""Denormal floats flushed to zero (ort_session denormal_as_zero), and the probe that says where it would pay."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import mlp_recipe, write_recipe
from onnx import TensorProto, helper, numpy_helper

from optimizer.engine.pipeline import Pipeline
from optimizer.measure.denormal_probe import PENALTY_FLOOR
from optimizer.recipe.loading import load_recipe
from optimizer.recipe.schema import Recipe
from optimizer.report.build import build_report
from optimizer.report.markdown import denormal_line
from optimizer.runtime.denormals import caller_flush_supported, process_denormal_penalty
from optimizer.runtime.sessions import ort_session

needs_flush = pytest.mark.skipif(not caller_flush_supported(), reason="this CPU cannot flush denormals")
TINY = 1e-39  # a denormal float32 (the smallest normal is 1.18e-38)


def scale_graph(path: Path) -> None:
    """y = x * 1e-39: denormal outputs unless the thread that runs the Mul flushes them to zero."""
    tiny = numpy_helper.from_array(np.array(TINY, np.float32), "tiny")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "tiny"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])], [tiny],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def denormal_graph(path: Path, width: int) -> None:
    """y = x + exp(4x - 95): for x in [-1, 1) the exponentials are denormal (1e-43 to 1e-39), as the softmax of a
    masked attention score is; the sum is x itself to float32 precision, so flushing them does not move y."""
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("four", 4.0), ("shift", 95.0))]
    nodes = [
        helper.make_node("Mul", ["x", "four"], ["scaled"]),
        helper.make_node("Sub", ["scaled", "shift"], ["score"]),
        helper.make_node("Exp", ["score"], ["prob"]),
        helper.make_node("Exp", ["score"], ["prob2"]),
        helper.make_node("Add", ["prob", "prob2"], ["probs"]),
        helper.make_node("Add", ["x", "probs"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "denormals",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])], consts,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@needs_flush
def test_a_flushing_session_flushes_the_calling_thread_during_its_calls_only(tmp_path: Path) -> None:
    scale_graph(tmp_path / "m.onnx")
    x = np.ones(8, np.float32)
    plain = ort_session(tmp_path / "m.onnx", {}, 1)
    flushed = ort_session(tmp_path / "m.onnx", {"denormal_as_zero": True}, 1)
    assert np.all(flushed.run(None, {"x": x})[0] == 0)  # one thread: the calling thread did the Mul
    assert np.all(plain.run(None, {"x": x})[0] > 0)  # and the other session is not flushed by it
    assert np.float32(TINY) * np.float32(1.0) > 0  # nor is the rest of the process after the call


@pytest.mark.slow
@needs_flush
def test_a_flushing_session_opened_first_does_not_flush_the_next(tmp_path: Path) -> None:
    """ONNX Runtime sets the calling thread's mode from the first session of a process and never again: a
    flushing stage opened before its parent would flush the parent too. Needs a fresh process to be first."""
    scale_graph(tmp_path / "m.onnx")
    code = textwrap.dedent(f"""
        import numpy as np
        from optimizer.runtime.sessions import ort_session
        x = np.ones(8, np.float32)
        flushed = ort_session({str(tmp_path / 'm.onnx')!r}, {{"denormal_as_zero": True}}, 1)
        plain = ort_session({str(tmp_path / 'm.onnx')!r}, {{}}, 1)
        print(int(np.all(plain.run(None, {{"x": x}})[0] > 0)), int(np.all(flushed.run(None, {{"x": x}})[0] == 0)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1", "1"], out.stderr[-2000:]


def denormal_recipe(tmp_path: Path) -> Recipe:
    denormal_graph(tmp_path / "den.onnx", 1 << 16)
    data = mlp_recipe(
        name="denormals",
        model={"source": "onnx", "path": "den.onnx"},
        inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 1 << 16], "range": [-1, 1]}],
        scenarios=[{"name": "b1", "batch": 1, "seq": 1}],
        benchmark={"warmup": 3, "rounds": 8, "iterations": 10, "memory": "inline", "settle_ms": 5, "instances": 1},
        passes=[{"type": "ort_session"},
                {"type": "ort_session", "name": "flush_denormals", "config": {"denormal_as_zero": True}}],
    )
    return load_recipe(write_recipe(tmp_path, data))


def check_found_and_faster(tmp_path: Path, recipe: Recipe) -> None:
    """The probe's finding on the stage that computes on denormals; the flushing stage faster, within budget."""
    records = Pipeline(recipe, tmp_path / "run").execute()
    report = build_report(recipe, records, tmp_path / "run", 1.0)
    plain, flushed = report.stage("ort_session"), report.stage("flush_denormals")
    assert plain is not None and flushed is not None and plain.metrics and flushed.metrics
    probe = plain.metrics.scenarios["b1"].denormal_probe
    assert probe is not None and probe.verdict == "faster" and probe.ratio > 1.2, probe
    assert flushed.metrics.scenarios["b1"].denormal_probe is None  # flushed already: not probed
    vs = flushed.metrics.scenarios["b1"].vs_parent
    assert vs is not None and vs.verdict == "faster", vs
    assert flushed.metrics.within_budget and flushed.metrics.runtime["denormal_as_zero"] is True
    assert flushed.notes["denormals"]["denormal_as_zero"] is True
    lines = [f for f in report.findings if "denormal" in f]
    assert any(f.startswith("ort_session (ort_session) runs faster with denormal floats flushed") and
               "the run's flush_denormals flushes them" in f for f in lines), report.findings


def check_not_probed(tmp_path: Path, recipe: Recipe) -> None:
    """A CPU that computes on denormals at full speed: no stage probed, no finding, the legend says why; the
    flushing stage still runs flushed and within budget."""
    records = Pipeline(recipe, tmp_path / "run").execute()
    report = build_report(recipe, records, tmp_path / "run", 1.0)
    plain, flushed = report.stage("ort_session"), report.stage("flush_denormals")
    assert plain is not None and flushed is not None and plain.metrics and flushed.metrics
    assert plain.metrics.scenarios["b1"].denormal_probe is None
    assert not [f for f in report.findings if "with denormal floats flushed" in f], report.findings
    assert "handles them in hardware" in " ".join(denormal_line(report))
    assert flushed.metrics.within_budget and flushed.metrics.runtime["denormal_as_zero"] is True


@pytest.mark.slow
@needs_flush
def test_denormals_on_this_cpu_as_it_is(tmp_path: Path) -> None:
    """Nothing injected: the run's own reading of this CPU decides, and the test asserts what follows from it. On
    a CPU that pays for denormals (Intel cores take a microcode assist) the probe finds them and the flushing stage
    is faster; on one that does not (AMD Zen 3 and Zen 4, the machines this project has run on lately) no stage
    is probed and the report says why. The deterministic test below covers the paying branch on every CPU."""
    if process_denormal_penalty() >= PENALTY_FLOOR:
        check_found_and_faster(tmp_path, denormal_recipe(tmp_path))
    else:
        check_not_probed(tmp_path, denormal_recipe(tmp_path))


def test_the_penalty_reading_sees_a_cpu_that_pays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's penalty injected where a CPU pays it: numpy's multiply on denormal inputs made 4x as slow
    (busy-waiting after the real multiply, as a microcode assist would). The reading must see it, the probe's gate
    open on it, and the legend say so; a 1.0x reading keeps the gate shut."""
    import time

    from optimizer.core.artifact import Artifact
    from optimizer.measure.denormal_probe import probe_reason
    from optimizer.runtime import denormals

    real = np.multiply
    tiny = np.finfo(np.float32).tiny

    def assisted(a: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = real(a, *args, **kwargs)
        head = np.abs(np.asarray(a).ravel()[:64])
        if head.size and head.max() < tiny:  # denormal (or zero) inputs: the slow path
            end = time.perf_counter() + 3 * (time.perf_counter() - t0)
            while time.perf_counter() < end:
                pass
        return out

    monkeypatch.setattr(np, "multiply", assisted)
    penalty = denormals.denormal_penalty(size=1 << 16, repeats=7)
    monkeypatch.setattr(np, "multiply", real)
    assert penalty > 2.5, penalty
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe()))
    stage = Artifact(kind="onnx", path=tmp_path / "m.onnx")
    monkeypatch.setattr(denormals, "process_denormal_penalty", lambda: penalty)
    if caller_flush_supported():
        assert probe_reason(stage, recipe) is None
    monkeypatch.setattr(denormals, "process_denormal_penalty", lambda: 1.0)
    if caller_flush_supported():
        assert "at full speed (1.00x" in (probe_reason(stage, recipe) or "")


@pytest.mark.slow
@needs_flush
def test_probe_finding_and_verdict_with_a_deterministic_denormal_cost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same chain on any CPU: an unflushed session is made 3 ms slower a call (what a CPU with a denormal
    penalty does to this graph), so probe, metrics, verdict and finding are checked without hanging on the CPU."""
    import time

    from optimizer.runtime.runners.ort_runner import OrtSession

    real_run = OrtSession.run

    def run(self: OrtSession, prepared: Any) -> Any:
        if not self.runtime.get("denormal_as_zero"):
            time.sleep(0.003)
        return real_run(self, prepared)

    monkeypatch.setattr(OrtSession, "run", run)
    monkeypatch.setattr("optimizer.runtime.denormals.process_denormal_penalty", lambda: 20.0)
    check_found_and_faster(tmp_path, denormal_recipe(tmp_path))


def test_the_probe_is_off_where_it_cannot_apply(tmp_path: Path) -> None:
    from optimizer.core.artifact import Artifact
    from optimizer.measure.denormal_probe import probe_reason

    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe()))
    onnx_art = Artifact(kind="onnx", path=tmp_path / "m.onnx")
    assert "flushes denormals already" in probe_reason(onnx_art.derive(runtime={"denormal_as_zero": True}), recipe)
    assert "only ONNX Runtime stages" in probe_reason(Artifact(kind="torch", path=None), recipe)
    off = load_recipe(write_recipe(tmp_path, mlp_recipe(benchmark={"denormal_probe": False}), "off.yaml"))
    assert "denormal_probe is off" in probe_reason(onnx_art, off)
