"""A verdict at the budget's edge (issue 28, class 9): the worst of n samples is unstable, so the budget metric
carries an interval of the quantile it estimates; a stage whose interval straddles the line is "at the edge, not
resolved", and `best` prefers a resolved stage that is as fast within noise."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import mlp_recipe
from corpus.edge import _spread as spread  # 40 cosines spread like a log-normal's quantiles
from scipy import stats
from test_verdicts import disagreeing_report

from optimizer.core.metrics import Speedup
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.accuracy import AccuracyMeter, budget_verdict
from optimizer.measure.best import best_stage
from optimizer.measure.stats import low_quantile_bound
from optimizer.recipe.loading import parse_recipe
from optimizer.recipe.schema import AccuracyBudget


def _cosines(rng: np.random.Generator, n: int, mu: float, sd: float) -> np.ndarray:
    return 1.0 - np.exp(rng.normal(mu, sd, n))


def test_the_interval_covers_the_quantile_it_claims() -> None:
    """90% two-sided: over many sets of 40 log-normal distances, the 1/41 quantile is inside ~90% of the time."""
    rng = np.random.default_rng(0)
    n, mu, sd = 40, math.log(0.004), 0.5
    true = 1.0 - math.exp(mu + stats.norm.ppf(1 - 1 / (n + 1)) * sd)
    hits = 0
    for _ in range(300):
        p, low, high = low_quantile_bound(_cosines(rng, n, mu, sd))  # type: ignore[misc]
        assert p == pytest.approx(1 / 41)
        hits += low <= true <= high
    assert 0.85 <= hits / 300 <= 0.95
    assert low_quantile_bound([0.999, 0.998]) is None  # no spread to estimate from two samples


def _pooled_accuracy(cosines: np.ndarray) -> dict:
    """An encoder output whose per-sentence pooled embeddings have exactly these cosines to the reference."""
    rng = np.random.default_rng(1)
    n, seq, hidden = len(cosines), 4, 32
    ref, got = np.empty((n, seq, hidden)), np.empty((n, seq, hidden))
    for i, c in enumerate(cosines):  # every position of a row alike, so the pooled vectors are these two
        v = rng.normal(size=hidden)
        v /= np.linalg.norm(v)
        w = rng.normal(size=hidden)
        w -= (w @ v) * v
        w /= np.linalg.norm(w)
        ref[i], got[i] = v, c * v + math.sqrt(1 - c * c) * w  # cosine c
    meter = AccuracyMeter(["last_hidden_state"])
    meter.add([ref], [got], np.ones((n, seq), np.int64))
    return meter.to_json()


def test_a_stage_just_above_the_line_is_at_the_edge_and_one_well_above_is_resolved() -> None:
    budget = AccuracyBudget(metric="pooled_cosine", min=0.99)
    near = _pooled_accuracy(np.array(spread(0.0034)))  # worst 0.9907: the main job, 0.001 above the line
    edge = budget_verdict(near, budget)
    assert near["last_hidden_state"]["pooled_cosine"] > 0.99 and edge.within
    assert edge.edge and "at the edge, not resolved" in edge.why and "(90%)" in edge.why
    far = budget_verdict(_pooled_accuracy(np.array(spread(0.0005))), budget)
    assert far.within and not far.edge and "is above 0.99" in far.why
    below = budget_verdict(_pooled_accuracy(np.array(spread(0.05))), budget)
    assert not below.within and not below.edge and "is below 0.99" in below.why


def test_best_prefers_a_resolved_stage_to_an_equally_fast_one_at_the_edge() -> None:
    report = disagreeing_report()  # `a` 2.0x, `b` 1.2x, `c` REJECTED
    a, b = report.stages[2].metrics, report.stages[3].metrics
    assert a is not None and b is not None
    b.scenarios["b1"].vs_parent = Speedup(ratio=1.95, low=1.85, high=2.05, verdict="faster")  # tied with a
    a.budget_edge = True
    best, why = best_stage(report.stages, report.scenario_names)
    assert best is not None and best.name == "b", why
    assert "preferred to `a`" in why and "edge" in why
    b.scenarios["b1"].vs_parent = Speedup(ratio=1.2, low=1.15, high=1.25, verdict="faster")  # a faster beyond noise
    best, why = best_stage(report.stages, report.scenario_names)
    assert best is not None and best.name == "a" and "at the budget's edge, not resolved" in why


@pytest.mark.slow
def test_a_compiled_stage_carries_its_interval(tmp_path: Path) -> None:
    recipe = parse_recipe(mlp_recipe(accuracy={"min": 0.99, "samples": 4}), "edge.yaml", tmp_path)
    records = Pipeline(recipe, tmp_path / "run").execute()
    metrics = records[2].metrics
    assert metrics is not None and metrics["budget_edge"] is False
    low, high, p = metrics["accuracy"][next(iter(metrics["accuracy"]))]["cosine_bound"]
    assert 0.999 < low <= high <= 1.0 and 0 < p < 0.5  # ort_session computes what PyTorch does
    assert "quantile" in metrics["budget"]
