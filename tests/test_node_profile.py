"""Issue 17, the rest: ORT's nodes a pass created or removed, every scenario's profile, `optimizer diff` per part
and per scenario; issue 16: a generation stage's TPOT against the FP32 export, chained."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import mlp_recipe, write_recipe
from onnx import TensorProto, helper, numpy_helper
from test_report_schema import report_of

from optimizer.core.metrics import NodeTimes
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.profiles import digest
from optimizer.recipe.loading import load_recipe
from optimizer.report.build import build_report
from optimizer.report.diff import diff_reports
from optimizer.report.diff import to_markdown as diff_markdown
from optimizer.report.explain import between_runs, explain_all, explain_scenarios, node_diff
from optimizer.report.html import to_html
from optimizer.report.markdown import to_markdown
from optimizer.report.schema import RunReport, parse_report
from optimizer.report.tables import stage_rows, tpot_vs_export
from optimizer.runtime.runners.ort_runner import profile_runs, split_runs


# ---------------------------------------------------------------- ORT's profile per node, from events
def _run(ts: int, dur: int) -> dict[str, Any]:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def _node(ts: int, node: str, op: str, dur_us: int) -> dict[str, Any]:
    return {"cat": "Node", "name": f"{node}_kernel_time", "ts": ts, "dur": dur_us, "args": {"op_name": op}}


def test_nodes_per_run_are_medians_and_only_the_slowest_are_named() -> None:
    events = [_run(0, 900), _node(5, "mm", "MatMul", 800)]  # the warm-up: dropped
    for k in range(1, 4):
        t = k * 1000
        events += [_run(t, 300), _node(t + 1, "mm", "MatMul", 40 * k), _node(t + 2, "mm2", "MatMul", 20),
                   _node(t + 3, "add", "Add", 10)]
    prof = profile_runs(events, top=2)
    assert prof.nodes == {"mm": 0.08, "mm2": 0.02}  # median of 40/80/120 us; `add` below the top 2
    assert prof.node_ops == {"mm": "MatMul", "mm2": "MatMul"}
    assert prof.node_count == 3 and prof.names == ["add", "mm", "mm2"]
    assert prof.node_total_ms == pytest.approx(0.11) and prof.ops == {"MatMul": 0.1, "Add": 0.01}
    # two feeds in one session, the first run 4 times, the second after it: one group per feed
    groups = split_runs([*events, _run(5000, 10), _node(5001, "x", "Relu", 5), _run(6000, 10)], 4)
    assert [sum(e.get("name") == "model_run" for e in g) for g in groups] == [4, 2]
    assert [e["name"] for e in groups[1] if e["cat"] == "Node"] == ["x_kernel_time"]


def test_a_pass_that_renames_every_node_falls_back_to_op_types() -> None:
    def times(names: list[str], op: str) -> NodeTimes:
        return NodeTimes(top=[(n, op, 0.1) for n in names], nodes=len(names), total_ms=0.1 * len(names),
                         digests=sorted(digest(n) for n in names))

    renamed = node_diff(times([f"a{i}" for i in range(30)], "MatMul"), times([f"b{i}" for i in range(30)], "MatMul"))
    assert renamed is not None and renamed.renamed and renamed.shared == 0
    assert renamed.line() == (
        "nodes: all 30 new and all 30 gone (0% of the parent's node names still run: the pass renamed them), "
        "so by op type only"
    )
    kept = node_diff(times(["a", "b", "c"], "Add"), times(["a", "b", "fused"], "Add"))
    assert kept is not None and not kept.renamed and kept.shared == pytest.approx(2 / 3)
    assert kept.new == [("fused", "Add", 0.1)] and kept.gone == [("c", "Add", 0.1)]
    assert kept.line() == "new nodes: fused +0.1 ms; gone: c -0.1 ms"


# ---------------------------------------------------------------- a real run: ORT fuses MatMul + Add, drops Transposes
def _graph(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n)
             for n, s in (("w1", (64, 256)), ("b1", (256,)), ("w2", (256, 64)))]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["ha"], name="add1"),
        helper.make_node("Relu", ["ha"], ["r"], name="relu"),
        helper.make_node("Transpose", ["r"], ["t1"], name="t1", perm=[1, 0]),
        helper.make_node("Transpose", ["t1"], ["t2"], name="t2", perm=[1, 0]),
        helper.make_node("MatMul", ["t2", "w2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, RunReport]:
    tmp = tmp_path_factory.mktemp("nodes")
    data = mlp_recipe(
        model={"source": "onnx", "path": str(_graph(tmp / "m.onnx"))},
        inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 64]}],
        scenarios=[{"name": "b1", "batch": 1, "seq": 1}, {"name": "b64", "batch": 64, "seq": 1}],
        passes=[{"type": "ort_session"}],
    )
    recipe = load_recipe(write_recipe(tmp, data))
    records = Pipeline(recipe, tmp / "out").execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    return recipe, build_report(recipe, records, tmp / "out", 1.0)


def test_every_scenario_is_profiled_with_its_nodes(fused_run: tuple[Any, RunReport]) -> None:
    _, report = fused_run
    source, fused = report.stages
    for st in (source, fused):
        assert st.metrics is not None
        for scen in ("b1", "b64"):
            sm = st.metrics.scenarios[scen]
            assert sm.profile is not None and sm.profile.source == "onnxruntime" and sm.profile.node_time is not None
            nt = sm.profile.node_time
            assert nt.total_ms == pytest.approx(sum(ms for _, _, ms in nt.top), abs=1e-4)  # fewer than the top keeps
            # medians per op type and per node over the same runs: near, not equal (a median of sums is no sum)
            assert sum(sm.profile.op_time_ms.values()) == pytest.approx(nt.total_ms, rel=0.25)
        # the stage-level fields are the first scenario's, as before
        b1 = st.metrics.scenarios["b1"].profile
        assert b1 is not None and st.metrics.op_time_ms == b1.op_time_ms
    src = source.metrics.scenarios["b1"].profile.node_time  # type: ignore[union-attr]
    ops = {name: op for name, op, _ in src.top}
    assert set(ops) == {"mm1", "add1", "relu", "t1", "t2", "mm2"} and ops["t1"] == "Transpose"
    assert src.digests == sorted(digest(n) for n in ops)
    big, small = (source.metrics.scenarios[s].profile.op_time_ms["MatMul"] for s in ("b64", "b1"))  # type: ignore[union-attr]
    assert big > small  # 64 rows through the same MatMuls: each scenario's own feed


def test_the_explanation_names_the_nodes_the_pass_created_and_removed(fused_run: tuple[Any, RunReport]) -> None:
    _, report = fused_run
    fused = report.stage("ort_session")
    assert fused is not None
    found = explain_scenarios(report, fused)
    assert set(found) == {"b1", "b64"}
    for scen, (e,) in found.items():
        assert e.scenario == scen and e.nodes is not None
        new = {name: op for name, op, _ in e.nodes.new}
        assert len(new) == 1 and next(iter(new.values())) == "FusedGemm", new  # MatMul + Add (+ Relu) fused
        assert {name for name, _, _ in e.nodes.gone} == {"mm1", "add1", "relu", "t1", "t2"}
        assert e.nodes.shared == pytest.approx(1 / 6) and not e.nodes.renamed  # mm2 kept its name
        assert all(ms > 0 for _, _, ms in e.nodes.new + e.nodes.gone)
        assert {r.op for r in e.rows if r.change == "gone"} == {"Add", "Relu", "Transpose"}
    md = to_markdown(report)
    section = md[md.index("## Why"):md.index("## Stages")]
    assert "new nodes: " in section and "FusedGemm" in section and "gone: mm1 -" in section
    assert "- b64: ort_session: " in section and "; new nodes: " in section  # the other scenario: one line
    assert "new nodes: " in to_html(report)


def test_an_old_report_without_scenario_profiles_explains_its_first_scenario(fused_run: tuple[Any, RunReport]) -> None:
    _, report = fused_run
    data = report.to_json()
    for st in data["stages"]:
        for sm in st["metrics"]["scenarios"].values():
            sm.pop("profile")
    old = parse_report(data, "old report")
    fused = old.stage("ort_session")
    assert fused is not None
    (e,) = explain_all(old, fused)
    assert e.scenario == "b1" and e.nodes is None and {r.op for r in e.rows} >= {"FusedGemm", "Transpose"}
    assert explain_all(old, fused, "b64") == [] and set(explain_scenarios(old, fused)) == {"b1"}
    assert "## Why" in to_markdown(old)


def test_diff_explains_each_judged_scenario(fused_run: tuple[Any, RunReport]) -> None:
    _, a = fused_run
    b = copy.deepcopy(a)
    st = b.stage("ort_session")
    assert st is not None and st.metrics is not None
    sm = st.metrics.scenarios["b64"]
    assert sm.vs_parent is not None and sm.profile is not None
    sm.vs_parent = sm.vs_parent.model_copy(
        update={"ratio": sm.vs_parent.ratio / 3, "low": sm.vs_parent.low / 3, "high": sm.vs_parent.high / 3}
    )
    sm.profile.op_time_ms = {**sm.profile.op_time_ms, "FusedGemm": sm.profile.op_time_ms["FusedGemm"] + 1.0}
    d = diff_reports(a, b)
    change = next(c for c in d.op_changes if c.stage == "ort_session")
    assert change.scenario == "b64" and change.part == "call" and change.kind == "ops"
    assert change.ops[0][0] == "FusedGemm" and change.ops[0][3] == pytest.approx(1.0)
    assert change.nodes == "new nodes: none; gone: none"  # same graph in both runs
    assert "Why `ort_session` moved, by op type, on b64" in diff_markdown(d)


# ---------------------------------------------------------------- generation: diff per prefill and decode step
LAT = {"n": 40, "p90_ms": 1.0, "p99_ms": 1.0, "mean_ms": 1.0, "std_ms": 0.1, "min_ms": 1.0, "cv": 0.1}


def _lat(p50: float, std: float = 0.1) -> dict[str, Any]:
    return {**LAT, "p50_ms": p50, "mean_ms": p50, "std_ms": std}


def _gen_stage(index: int, name: str, parent: str | None, tpot: float, parent_tpot: float | None,
               agreement: float, ops: dict[str, float] | None = None, **scen: Any) -> dict[str, Any]:
    sm: dict[str, Any] = {"latency": _lat(10 * tpot), "throughput": {"samples_per_s": 1.0}, "iterations": 16,
                          "tpot": _lat(tpot), "ttft": _lat(2 * tpot), **scen}
    if parent_tpot is not None:
        sm.update(parent_tpot=_lat(parent_tpot), parent_ttft=_lat(2 * parent_tpot),
                  parent_latency=_lat(10 * parent_tpot))
    acc = {"logits": {"cosine": 0.99, "token_agreement": agreement}}
    metrics = {"workload": "generation", "within_budget": True, "budget": "ok", "accuracy": acc,
               "scenarios": {"s": sm}, "op_time_ms": ops or {"MatMul": tpot}, "op_time_source": "onnxruntime",
               "prefill_op_time_ms": {"MatMul": 2 * tpot}}
    kind = "torch" if index == 0 else "onnx"
    return {"index": index, "name": name, "type": "x", "parent": parent, "status": "ran", "metrics": metrics,
            "artifact": {"kind": kind, "path": f"/m{index}.onnx" if kind == "onnx" else None}}


def _gen_report(stages: list[dict[str, Any]]) -> RunReport:
    report = report_of(stages, [{"name": "s", "batch": 1, "seq": 16, "new_tokens": 8}])
    report.recipe = report.recipe.model_copy(update={"workload": "generation"})
    return report


def test_diff_between_runs_covers_the_prefill_and_the_decode_step() -> None:
    a = _gen_report([_gen_stage(0, "source", None, 5.0, None, 1.0), _gen_stage(1, "export", "source", 4.0, 5.0, 1.0)])
    b = _gen_report([_gen_stage(0, "source", None, 5.0, None, 1.0),
                     _gen_stage(1, "export", "source", 4.5, 5.0, 1.0, ops={"MatMul": 4.0, "Cast": 0.5})])
    parts = between_runs(a.stages[1], b.stages[1], "s")
    assert [e.per for e in parts] == ["prefill", "decode step"]
    prefill, step = parts
    assert prefill.measured_delta_ms == pytest.approx(1.0) and step.measured_delta_ms == pytest.approx(0.5)
    assert [(r.op, r.delta_ms, r.change) for r in step.rows] == [("Cast", 0.5, "new"), ("MatMul", 0.0, "")]
    assert prefill.rows[0].delta_ms == pytest.approx(1.0)  # MatMul 8 -> 9 ms per prefill
    assert "TPOT P50 +0.50 ms" in step.coverage() and "TTFT P50 +1.00 ms" in prefill.coverage()


# ---------------------------------------------------------------- issue 16: TPOT against the FP32 export, chained
def test_tpot_against_the_export_is_chained_with_its_interval() -> None:
    vs = {"ratio": 1.6, "low": 1.5, "high": 1.7, "verdict": "faster"}
    report = _gen_report([
        _gen_stage(0, "source", None, 12.0, None, 1.0),
        _gen_stage(1, "export", "source", 10.0, 12.0, 1.0),
        _gen_stage(2, "int8", "export", 8.0, 10.0, 0.95),  # interval from the TPOT spread
        _gen_stage(3, "int4", "int8", 5.0, 8.0, 0.9, tpot_vs_parent=vs),  # a recorded bootstrap interval
    ])
    export, int8, int4 = (report.stage(n) for n in ("export", "int8", "int4"))
    assert export is not None and int8 is not None and int4 is not None
    t8 = tpot_vs_export(report, int8, "s")
    assert t8 is not None and t8.ratio == pytest.approx(1.25) and t8.path == ["export", "int8"] and not t8.chained
    se = 1.2533 * 0.1 / math.sqrt(16)  # standard error of a median: std 0.1 ms, one sample per generation (16)
    rel = math.hypot(se / 8.0, se / 10.0)
    assert t8.approximate and t8.low == pytest.approx(1.25 * math.exp(-1.96 * rel))
    assert t8.high == pytest.approx(1.25 * math.exp(1.96 * rel))
    t4 = tpot_vs_export(report, int4, "s")
    assert t4 is not None and t4.chained and t4.path == ["export", "int8", "int4"]
    assert t4.ratio == pytest.approx(1.25 * 1.6) and t4.low == pytest.approx(t8.low * 1.5)
    assert t4.high == pytest.approx(t8.high * 1.7)
    assert tpot_vs_export(report, report.stages[0], "s") is None  # the PyTorch source is not on the path
    cells = {r["stage"]: r["tpot_vs_export"] for r in stage_rows(report, "s")}
    assert cells["01 export"] == "1.00x (export)" and cells["00 source"] == "-"
    assert cells["03 int4"] == f"2.00x chained ({t4.low:.2f}-{t4.high:.2f})"
    md = to_markdown(report)
    assert "| TPOT vs export |" in md and "## Decode speed against the FP32 export (`export`)" in md
    assert (f"- int4 on s: TPOT 2.00x against export (faster, 95% interval {t4.low:.2f}-{t4.high:.2f}, approximate, "
            "chained over export -> int8 -> int4); token agreement 0.900") in md


def test_compare_output_names_the_nodes_and_every_scenario(fused_run: tuple[Any, RunReport]) -> None:
    from optimizer.engine.compare import B_STAGE, CompareSide
    from optimizer.report.compare import detail_lines, summarize

    _, report = fused_run
    data = report.to_json()
    data["stages"][1]["name"] = B_STAGE  # the compare run's shape: A is stage 0, B substitutes it
    run = parse_report(data, "compare run")
    s = summarize(run, CompareSide("A", Path("a.onnx"), "a.onnx"), CompareSide("B", Path("b.onnx"), "b.onnx"), [])
    e = s.explanation
    assert e is not None and e.nodes is not None
    assert e.scenario == "b1" and e.nodes.shared == pytest.approx(1 / 6) and not e.nodes.renamed
    assert [n.op for n in e.nodes.new] == ["FusedGemm"]
    assert {n.node for n in e.nodes.gone} == {"mm1", "add1", "relu", "t1", "t2"}
    assert [o.scenario for o in s.scenario_explanations] == ["b64"]
    lines = detail_lines(s)
    assert any(x.startswith("by node: new nodes: ") for x in lines), lines
    assert any(x.startswith("why on b64: B: ") and "; new nodes: " in x for x in lines), lines



def test_a_long_headline_is_cut_to_the_chart_with_the_whole_line_on_hover() -> None:
    """The v1 MiniLM report's int8_dynamic headline is longer than the chart is wide: cut, whole on hover."""
    import re

    from optimizer.report.html import HEADLINE_CHARS, op_delta_chart
    from optimizer.report.schema import read_report

    report = read_report(Path(__file__).parent / "data" / "report_v1_minilm.json")
    svg = op_delta_chart(report)
    heads = re.findall(r'font-weight="bold"><title>([^<]*)</title>([^<]*)</text>', svg)
    assert heads, svg[:500]
    assert all(len(shown) <= HEADLINE_CHARS for _, shown in heads)
    cut = [(whole, shown) for whole, shown in heads if len(whole) > HEADLINE_CHARS]
    assert cut and all(shown.endswith("…") and whole.startswith(shown[:-1]) for whole, shown in cut)
