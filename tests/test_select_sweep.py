"""Composite scores and the deployment decision, the batch sweep, adaptive rounds and the scenario summary."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_BENCH, mlp_recipe, write_recipe
from test_recipe import run_cli

from optimizer.engine.pipeline import Pipeline
from optimizer.measure.stats import median_ci_halfwidth
from optimizer.recipe.loading import load_recipe
from optimizer.report.build import write_report
from optimizer.report.schema import RunReport
from optimizer.report.select import PRESETS, deployability, parse_weights, rank, recommend
from optimizer.report.tables import scenario_summary


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunReport, Path]:
    tmp = tmp_path_factory.mktemp("sweep")
    data = mlp_recipe(
        passes=[
            {"type": "export"},
            {"type": "ort_session"},
            {"type": "quantize", "name": "int8", "from": "export", "config": {"mode": "int8_dynamic"}},
        ],
        batch_sweep={"stage": "ort_session", "batches": [1, 4, 16], "latency_budget_ms": 1000},
    )
    data["inputs"] = [{"name": "x", "dtype": "float32", "shape": ["batch", 4, 16]}]
    recipe = load_recipe(write_recipe(tmp, data))
    out = tmp / "out"
    records = Pipeline(recipe, out).execute()
    return write_report(recipe, records, out, 0.0), out


def test_weights_presets_and_parsing() -> None:
    assert parse_weights("seed-latency") == {"latency": 0.4, "throughput": 0.3, "accuracy": 0.3}
    assert parse_weights("seed-deploy") == PRESETS["seed-deploy"]
    assert parse_weights("latency=0.7, accuracy=0.3") == {"latency": 0.7, "accuracy": 0.3}
    with pytest.raises(ValueError, match="unknown term 'speed'"):
        parse_weights("speed=1")


@pytest.mark.slow
def test_scores_are_the_weighted_normalized_terms(swept: tuple[RunReport, Path]) -> None:
    report, _ = swept
    w = PRESETS["seed-latency"]
    ranking = rank(report, w)
    for rows in ranking.values():
        assert [r.score for r in rows] == sorted((r.score for r in rows), reverse=True)
        source = next(r for r in rows if r.stage == "source")
        assert source.score == pytest.approx(1.0)  # every term is 1.0 for stage 0
        for r in rows:
            assert r.score == pytest.approx(sum(v * r.terms[k] for k, v in w.items()))
    stage = {s.name: s for s in report.stages}
    # Throughput: ratio of mean times in the interleaved sessions, chained to stage 0 like the latency ratio.
    for scen in ("b1", "b8"):
        export, ort = (stage[n].scenario(scen) for n in ("export", "ort_session"))
        assert export and ort and export.parent_latency and ort.parent_latency
        expected = (export.parent_latency.mean_ms / export.latency.mean_ms) * (
            ort.parent_latency.mean_ms / ort.latency.mean_ms
        )
        row = next(r for r in ranking[scen] if r.stage == "ort_session")
        assert row.terms["throughput"] == pytest.approx(expected)
    assert deployability(stage["source"]) == 0.25
    assert deployability(stage["ort_session"]) == 1.0
    assert deployability(stage["int8"]) == 0.5


@pytest.mark.slow
def test_recommendation_never_picks_a_rejected_stage(swept: tuple[RunReport, Path]) -> None:
    report, _ = swept
    rejected = copy.deepcopy(report)
    best, _ = recommend(rejected, {"latency": 1.0})
    for st in rejected.stages:
        if st.name == best and st.metrics is not None:
            st.metrics.within_budget = False
    second, lines = recommend(rejected, {"latency": 1.0})
    assert second is not None and second != best
    assert lines[0].startswith(f"Deploy `{second}`")
    # Wherever the rejected stage still tops a scenario, the output says why it is not the one.
    tops = [rows[0].stage for rows in rank(rejected, {"latency": 1.0}).values()]
    flagged = [line for line in lines if f"`{best}` scores higher" in line]
    assert len(flagged) == tops.count(best)


@pytest.mark.slow
def test_select_cli(swept: tuple[RunReport, Path]) -> None:
    _, out = swept
    for weights in ("seed-latency", "seed-deploy"):
        proc = run_cli("select", str(out), "--weights", weights)
        assert proc.returncode == 0, proc.stderr
        assert "Deploy `" in proc.stdout
    bad = run_cli("select", str(out), "--weights", "speed=1")
    assert bad.returncode == 2 and "--weights: unknown term 'speed'" in bad.stderr


@pytest.mark.slow
def test_batch_sweep_and_recommendation(swept: tuple[RunReport, Path]) -> None:
    report, out = swept
    sweep = report.batch_sweep
    assert sweep is not None and sweep.stage == "ort_session" and [r.batch for r in sweep.rows] == [1, 4, 16]
    for r in sweep.rows:
        assert r.samples_per_s > 0 and r.p50_ms <= r.p99_ms
    assert sweep.max_batch == 16  # a tiny MLP stays far inside a 1 s budget
    best = max(r.samples_per_s for r in sweep.rows)
    pref = next(r for r in sweep.rows if r.batch == sweep.preferred_batch)
    assert pref.samples_per_s >= 0.9 * best
    assert all(r.samples_per_s < 0.9 * best for r in sweep.rows if r.batch < pref.batch)
    config_dir = out.parent / "triton"
    assert (
        run_cli("export", str(out), "--stage", "ort_session", "--format", "triton", "--out", str(config_dir)).returncode
        == 0
    )
    config = next(config_dir.glob("*/config.pbtxt")).read_text()
    assert "max_batch_size: 16" in config and f"preferred_batch_size: [ {sweep.preferred_batch} ]" in config


@pytest.mark.slow
def test_scenario_summary_has_every_stage_and_scenario(swept: tuple[RunReport, Path]) -> None:
    report, _ = swept
    head, rows = scenario_summary(report)
    assert head == ["stage", "b1", "b8"]
    assert len(rows) == len(report.stages) and rows[1][1].endswith(" ms)") and "x (" in rows[1][1]


def test_median_interval_and_adaptive_rounds(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    assert median_ci_halfwidth(rng.normal(10, 0.1, 400)) < median_ci_halfwidth(rng.normal(10, 0.1, 40))
    assert median_ci_halfwidth([1.0, 2.0]) == float("inf")
    data = mlp_recipe(
        benchmark={**FAST_BENCH, "warmup": 1, "rounds": 2, "iterations": 2, "target_ci": 1e-9, "max_rounds": 5},
        passes=[],
    )
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    m = records[0].metrics["scenarios"]["b1"]
    assert m["rounds"] == 5 and m["iterations"] == 10  # an unreachable target stops at max_rounds
