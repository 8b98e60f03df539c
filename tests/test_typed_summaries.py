"""Issue 30, item 2: `optimizer compare`'s and `optimizer diff`'s summaries are typed models, and the JSON they
write (compare.json, `diff --format json`) keeps its keys, their order and their values, pinned here on small
hand-written reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from test_report_schema import report_of
from test_verdicts import _latency, _stage

from optimizer.core.jsonio import strict_json_dumps
from optimizer.engine.compare import CompareSide
from optimizer.measure.profiles import digest
from optimizer.report.schema import RunReport

SCENARIOS = [{"name": "b1", "batch": 1, "seq": 1}, {"name": "b8", "batch": 8, "seq": 1}]
SIDES = (CompareSide("A", Path("a.onnx"), "a.onnx"), CompareSide("B", Path("b.onnx"), "b.onnx"))


def _written(model: Any) -> str:
    """What the command writes: strict JSON of the summary (key order included)."""
    return strict_json_dumps(model.to_json(), indent=2)


def _nodes(top: list[tuple[str, str, float]]) -> dict[str, Any]:
    return {"top": top, "nodes": len(top), "total_ms": sum(ms for _, _, ms in top),
            "digests": sorted(digest(n) for n, _, _ in top)}


def _entry(p50: float, vs: float | None = None, **more: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"latency": _latency(p50), "throughput": {"samples_per_s": 1000 / p50}, **more}
    if vs is not None:
        e["vs_parent"] = {"ratio": vs, "low": vs * 0.97, "high": vs * 1.03, "verdict": "faster"}
    return e


# ---------------------------------------------------------------- optimizer compare
def _compare_run(b_status: str = "ran", b_measured: bool = True) -> RunReport:
    """A (stage 0) against B: B faster on b1, slower on b8; op-type profiles on both scenarios, ORT nodes on b1."""
    a = _stage(0, "source", None, None, 1.0, type="source", size=2**20)
    a["artifact"]["runtime"] = {"graph_optimization_level": "disable_all"}
    a["metrics"].update(nodes_executed=6, op_time_ms={"MatMul": 0.5, "Transpose": 0.2, "Add": 0.1})
    a["metrics"]["scenarios"]["b1"]["profile"] = {
        "source": "onnxruntime",
        "node_time": _nodes([("mm1", "MatMul", 0.3), ("t1", "Transpose", 0.2), ("mm2", "MatMul", 0.2),
                             ("add1", "Add", 0.1)]),
    }
    a["metrics"]["scenarios"]["b8"] = _entry(4.0, profile={"source": "onnxruntime", "op_time_ms": {"MatMul": 2.0}})
    b = _stage(1, "b", "source", None, 0.8, size=3 * 2**19)
    b["status"] = b_status
    b["metrics"].update(nodes_executed=4, memory_mb=12.0, accuracy={"y": {"cosine": 0.9995, "max_abs": 0.01}},
                        op_time_ms={"FusedGemm": 0.4, "MatMul": 0.2})
    b["metrics"]["scenarios"]["b1"].update(
        parent_latency=_latency(1.0), rounds=10,
        vs_parent={"ratio": 1.25, "low": 1.2, "high": 1.3, "verdict": "faster"},
        profile={"source": "onnxruntime", "node_time": _nodes([("fused", "FusedGemm", 0.4), ("mm2", "MatMul", 0.2)])},
    )
    b["metrics"]["scenarios"]["b8"] = _entry(
        5.0, parent_latency=_latency(4.0), rounds=10, vs_parent={"ratio": 0.8, "low": 0.75, "high": 0.85,
                                                                 "verdict": "slower"},
        profile={"source": "onnxruntime", "op_time_ms": {"MatMul": 2.5}},
    )
    if b_status == "failed":
        b["reason"] = "b: boom"
    if b_status == "failed" or not b_measured:
        b["metrics"] = None
    settings = {"device": "cpu", "threads": 1, "benchmark": {}, "accuracy": {"metric": "cosine", "min": 0.99}}
    return report_of([a, b], SCENARIOS, settings=settings)


B1_SUMMARY = "B: -0.20 ms per call: FusedGemm +0.40 ms (new), MatMul -0.30, Transpose -0.20 (gone), Add -0.10 (gone)"
B1_COVERAGE = ("the profile's kernel time changed by -0.20 ms (b1, ONNX Runtime profiler); measured P50 1.000 -> "
               "0.800 ms (-0.200 ms, B/A 0.80x: B faster); the profile's change is 100% of it")
B1_NODES = "new nodes: fused +0.4 ms; gone: mm1 -0.3 ms, t1 -0.2 ms, add1 -0.1 ms"
B8_SUMMARY = "B: +0.50 ms per call: MatMul +0.50 ms"
B8_COVERAGE = ("the profile's kernel time changed by +0.50 ms (b8, ONNX Runtime profiler); measured P50 4.000 -> "
               "5.000 ms (+1.000 ms, B/A 1.25x: B slower); the profile's change is 50% of it")


def _compare_head(status: str, reason: str | None) -> dict[str, Any]:
    return {
        "a": {"origin": "a.onnx", "path": "a.onnx", "stage": "source"},
        "b": {"origin": "b.onnx", "path": "b.onnx", "stage": "b"},
        "graph_optimization_level": "disable_all",
        "device": "cpu",
        "threads": 1,
        "run_dir": "/nowhere",
        "notes": ["a note"],
        "status": status,
        "reason": reason,
        "scenarios": [],
        "accuracy": {},
        "explanation": None,
    }


def _scenario_row(scen: str, pa: float, pb: float, vs: float, low: float, high: float, verdict: str) -> dict[str, Any]:
    return {"scenario": scen, "p50_a_ms": pa, "p50_b_ms": pb, "ratio": 1 / vs, "low": 1 / high, "high": 1 / low,
            "verdict": verdict, "rounds": 10, "launches_a": None, "launches_b": None, "launches": "n/a on cpu"}


def test_compare_json_keeps_its_keys_and_values() -> None:
    from optimizer.report.compare import summarize

    s = summarize(_compare_run(), *SIDES, ["a note"])
    b1_rows = [
        {"op": "FusedGemm", "a_ms": 0.0, "b_ms": 0.4, "delta_ms": 0.4 - 0.0, "change": "new"},
        {"op": "MatMul", "a_ms": 0.5, "b_ms": 0.2, "delta_ms": 0.2 - 0.5, "change": ""},
        {"op": "Transpose", "a_ms": 0.2, "b_ms": 0.0, "delta_ms": 0.0 - 0.2, "change": "gone"},
        {"op": "Add", "a_ms": 0.1, "b_ms": 0.0, "delta_ms": 0.0 - 0.1, "change": "gone"},
    ]
    expected = {
        **_compare_head("ran", None),
        "scenarios": [_scenario_row("b1", 1.0, 0.8, 1.25, 1.2, 1.3, "B faster"),
                      _scenario_row("b8", 4.0, 5.0, 0.8, 0.75, 0.85, "B slower")],
        "accuracy": {"y": {"cosine": 0.9995, "max_abs": 0.01}},
        "explanation": {
            "scenario": "b1",
            "part": "call",
            "summary": B1_SUMMARY,
            "coverage": B1_COVERAGE,
            "profile_delta_ms": sum(r["delta_ms"] for r in b1_rows),
            "measured_delta_ms": 0.8 - 1.0,
            "rows": b1_rows,
            "nodes": {
                "line": B1_NODES,
                "new": [{"node": "fused", "op": "FusedGemm", "ms": 0.4}],
                "gone": [{"node": "mm1", "op": "MatMul", "ms": 0.3}, {"node": "t1", "op": "Transpose", "ms": 0.2},
                         {"node": "add1", "op": "Add", "ms": 0.1}],
                "shared": 0.25,
                "renamed": False,
            },
        },
        "budget": "y cosine 0.999",
        "within_budget": True,
        "kernels_run": {"a": 6, "b": 4},
        "size_mb": {"a": 1.0, "b": 1.5},
        "memory_mb": {"a": 10.0, "b": 12.0},
        "scenario_explanations": [{
            "scenario": "b8",
            "part": "call",
            "summary": B8_SUMMARY,
            "coverage": B8_COVERAGE,
            "profile_delta_ms": 2.5 - 2.0,
            "measured_delta_ms": 5.0 - 4.0,
            "rows": [{"op": "MatMul", "a_ms": 2.0, "b_ms": 2.5, "delta_ms": 2.5 - 2.0, "change": ""}],
            "nodes": None,
        }],
    }
    assert _written(s) == strict_json_dumps(expected, indent=2)


def test_compare_prints_the_same_lines_from_the_typed_summary() -> None:
    from optimizer.report.compare import detail_lines, headline, op_rows, summarize, table_rows, to_markdown

    s = summarize(_compare_run(), *SIDES, ["a note"])
    assert headline(s) == [
        "A: a.onnx (stage source)  B: b.onnx (stage b)",
        "both run by ONNX Runtime with graph_optimization_level=disable_all, threads: 1, on cpu, same inputs, "
        "interleaved rounds (ABBA)",
    ]
    assert detail_lines(s) == [
        "accuracy of B against A, y: cosine 0.9995, max_abs 0.01",
        "budget: y cosine 0.999 (within)",
        "kernels run per call (ONNX Runtime profile): 6 -> 4 (-33%)",
        "size on disk: 1.0 -> 1.5 MB; memory (peak of serving): 10.0 -> 12.0 MB",
        f"why, by op type: {B1_SUMMARY} ({B1_COVERAGE})",
        f"by node: {B1_NODES}",
        f"why on b8: {B8_SUMMARY} ({B8_COVERAGE})",
        "note: a note",
    ]
    assert table_rows(s) == [
        {"scenario": "b1", "A P50 ms": "1.000", "B P50 ms": "0.800", "B/A latency": "0.80x",
         "95% interval": "0.77-0.83", "verdict": "B faster", "kernel launches/call": "n/a on cpu"},
        {"scenario": "b8", "A P50 ms": "4.000", "B P50 ms": "5.000", "B/A latency": "1.25x",
         "95% interval": "1.18-1.33", "verdict": "B slower", "kernel launches/call": "n/a on cpu"},
    ]
    assert op_rows(s)[0] == {"op type": "FusedGemm (new)", "A ms": "0.000", "B ms": "0.400", "B - A ms": "+0.400"}
    assert [r["op type"] for r in op_rows(s, top=2)] == ["FusedGemm (new)", "MatMul"]
    md = to_markdown(s)
    assert md.startswith("# optimizer compare\n\n- A: a.onnx (stage source)")
    assert "| b8 | 4.000 | 5.000 | 1.25x | 1.18-1.33 | B slower | n/a on cpu |" in md
    assert "**B " not in md  # B ran: no status line
    assert "| Transpose (gone) | 0.200 | 0.000 | -0.200 |" in md


@pytest.mark.parametrize(
    ("status", "measured", "reason"), [("failed", False, "b: boom"), ("ran", False, "not measured")]
)
def test_compare_json_of_an_unmeasured_b_is_its_head_only(status: str, measured: bool, reason: str) -> None:
    """B failed or was not measured: the keys after `explanation` are absent, as before."""
    from optimizer.report.compare import detail_lines, summarize, to_markdown

    s = summarize(_compare_run(status, measured), *SIDES, ["a note"])
    assert _written(s) == strict_json_dumps(_compare_head(status, reason), indent=2)
    assert detail_lines(s) == ["why, by op type: no profile of both stages", "note: a note"]
    assert f"**B {status}**: {reason}" in to_markdown(s)


# ---------------------------------------------------------------- optimizer diff
def _diff_run(run_dir: str, b: bool) -> RunReport:
    """source -> export -> a, and a stage only this run has. In B: stage 0 slower on both scenarios, export's own
    ratio moved 1%, a's doubled on b1 (and a has no b8), a's MatMul time cut in its profile."""
    stages = []
    for i, (name, parent) in enumerate((("source", None), ("export", "source"), ("a", "export"),
                                        ("only_b" if b else "only_a", "a"))):
        st = _stage(i, name, parent, None, 10.0, kind="torch" if i == 0 else "onnx",
                    type="source" if i == 0 else "quantize")
        vs = None if i == 0 else 1.5
        scen = {"b1": _entry(10.0, vs), "b8": _entry(10.0, vs)}
        if b and name == "source":
            scen = {"b1": _entry(10.5), "b8": _entry(10.5)}
        if b and name == "export":
            scen = {"b1": _entry(10.0, 1.5 * 1.01), "b8": _entry(10.0, 1.5 * 0.99)}
        if name == "a":
            st["metrics"]["op_time_ms"] = {"MatMul": 0.4 if b else 1.0, "Add": 0.5}
            if b:
                scen = {"b1": _entry(5.0, 3.0)}
                st["vs_source"] = {"b1": 3.0}
        st["metrics"]["scenarios"] = scen
        stages.append(st)
    return report_of(stages, SCENARIOS, run_dir=run_dir)


ROW_HEAD = ["scenario", "stage", "type", "status_a", "status_b"]
FIGURES = ["p50_a", "p50_b", "raw_ratio", "ratio", "basis", "low", "high", "verdict", "vs_parent_a", "vs_parent_b",
           "vs_source_a", "vs_source_b", "cosine_a", "cosine_b"]
OWN = "its own ratio vs its input (interleaved, both runs)"


def test_diff_json_keeps_its_keys_and_values() -> None:
    from optimizer.report.diff import MIN_BETWEEN_RUNS, diff_reports

    d = diff_reports(_diff_run("/runs/a", False), _diff_run("/runs/b", True))
    data = json.loads(_written(d))
    assert list(data) == ["a", "b", "only_in_a", "only_in_b", "rows", "machine_drift", "final_stage", "judged_rows",
                          "totals", "op_changes"]
    assert data["a"] == {"run_dir": "/runs/a", "created": "2026-01-01T00:00:00+00:00", "recipe": "t"}
    assert data["b"] == {"run_dir": "/runs/b", "created": "2026-01-01T00:00:00+00:00", "recipe": "t"}
    assert (data["only_in_a"], data["only_in_b"]) == (["only_a"], ["only_b"])
    assert (data["machine_drift"], data["final_stage"], data["judged_rows"]) == (None, "a", 3)
    rows = {(r["scenario"], r["stage"]): r for r in data["rows"]}
    assert list(rows) == [("b1", "source"), ("b1", "export"), ("b1", "a"), ("b8", "source"), ("b8", "export"),
                          ("b8", "a")]
    head = {"type": "quantize", "status_a": "ran", "status_b": "ran"}
    # stage 0: the control, its raw P50 change (no spread in these latencies: the interval is the ratio itself)
    control = 10.0 / 10.5
    for scen in ("b1", "b8"):
        r = rows[(scen, "source")]
        assert list(r) == ROW_HEAD + FIGURES
        assert r == {"scenario": scen, "stage": "source", **head, "type": "source", "p50_a": 10.0, "p50_b": 10.5,
                     "raw_ratio": control, "ratio": control, "basis": "raw P50 (the control, not judged)",
                     "low": control, "high": control, "verdict": "control", "vs_parent_a": None, "vs_parent_b": None,
                     "vs_source_a": None, "vs_source_b": None, "cosine_a": 0.999, "cosine_b": 0.999}
    # judged by their own ratio: between_runs and control_widening come before the figures
    for scen, move in (("b1", 1.01), ("b8", 0.99)):
        r = rows[(scen, "export")]
        assert list(r) == [*ROW_HEAD, "between_runs", "control_widening", *FIGURES]
        assert r["between_runs"] == pytest.approx(1.4826 * math.log(2))  # a's move: the only other pass
        assert r["control_widening"] == abs(math.log(10.5 / 10.0))  # timed against stage 0
        assert r["ratio"] == math.exp(math.log(1.5 * move) - math.log(1.5)) and r["raw_ratio"] == 1.0
        assert r["low"] < r["ratio"] < r["high"] and r["verdict"] == "within noise" and r["basis"] == OWN
        assert (r["vs_parent_a"], r["vs_parent_b"], r["vs_source_b"]) == (1.5, 1.5 * move, None)
    a = rows[("b1", "a")]
    assert list(a) == [*ROW_HEAD, "between_runs", "control_widening", *FIGURES]
    assert (a["between_runs"], a["control_widening"]) == (MIN_BETWEEN_RUNS, 0.0)
    assert (a["p50_a"], a["p50_b"], a["raw_ratio"], a["verdict"]) == (10.0, 5.0, 2.0, "faster")
    assert a["ratio"] == math.exp(math.log(3.0) - math.log(1.5)) and a["low"] < a["ratio"] < a["high"]
    assert (a["vs_parent_a"], a["vs_parent_b"], a["vs_source_a"], a["vs_source_b"]) == (1.5, 3.0, None, 3.0)
    # a has no b8 in B: the row says only what each side's stage did
    assert rows[("b8", "a")] == {"scenario": "b8", "stage": "a", **head}
    assert data["totals"] == [a]
    assert data["op_changes"] == [{
        "stage": "a",
        "scenario": "b1",
        "part": "call",
        "kind": "ops",
        "summary": "a from A to B: -0.60 ms per call: MatMul -0.60 ms",
        "coverage": "the profile's kernel time changed by -0.60 ms of the measured -5.00 ms (12%, b1, "
                    "ONNX Runtime profiler)",
        "nodes": None,
        "ops": [["MatMul", 1.0, 0.4, 0.4 - 1.0], ["Add", 0.5, 0.5, 0.0]],
    }]


def test_diff_prints_the_same_lines_from_the_typed_summary() -> None:
    from optimizer.report.diff import diff_reports, regressions, table_rows, to_markdown

    ra, rb = _diff_run("/runs/a", False), _diff_run("/runs/b", True)
    d = diff_reports(ra, rb)
    assert not regressions(d, 5)
    cells = table_rows(d)
    assert cells[0] == {"scenario": "b1", "stage": "source", "A ms": "10.00", "B ms": "10.50", "A/B": "0.95x",
                        "verdict": "control (0.95-0.95)", "vs parent A -> B": "-",
                        "accuracy A -> B": "0.99900 -> 0.99900"}
    assert cells[2]["verdict"].startswith("B faster (") and cells[2]["vs parent A -> B"] == "1.50x -> 3.00x"
    assert cells[-1] == {"scenario": "b8", "stage": "a", "A ms": "-", "B ms": "-", "A/B": "-",
                         "verdict": "ran / ran", "vs parent A -> B": "-", "accuracy A -> B": "-"}
    md = to_markdown(d)
    assert md.startswith("**A**: `/runs/a` (2026-01-01T00:00:00+00:00) vs **B**: `/runs/b`")
    assert "the intervals of the 3 judged rows hold together at 95%" in md and "calibration" not in md
    assert "**Final stage `a`**: b1 10.00 -> 5.00 ms (2.00x, faster)" in md
    assert ("**Why `a` moved, by op type, on b1**: a from A to B: -0.60 ms per call: MatMul -0.60 ms (the profile's "
            "kernel time changed by -0.60 ms of the measured -5.00 ms (12%, b1, ONNX Runtime profiler))") in md
    assert md.endswith("\nStages only in A: only_a\n\nStages only in B: only_b")
    # the other way round, a's pass is 2x slower: a regression, in the same words as before
    back = diff_reports(rb, ra)
    assert regressions(back, 5) == [f"a on b1: 100.0% slower, {OWN} (P50 5.00 -> 10.00 ms)"]
