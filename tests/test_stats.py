"""Statistics that decide whether a pass helped: checked on synthetic timings with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from optimizer.measure.accuracy import AccuracyMeter, budget_verdict
from optimizer.measure.stats import latency_stats, speedup
from optimizer.recipe.schema import AccuracyBudget


def rounds(
    rng: np.random.Generator, center: float, spread: float, n_rounds: int = 10, n: int = 10
) -> list[list[float]]:
    return [list(rng.normal(center, spread, n)) for _ in range(n_rounds)]


def test_latency_percentiles() -> None:
    stats = latency_stats(list(range(1, 101)))
    assert stats.p50_ms == pytest.approx(50.5)
    assert stats.p90_ms == pytest.approx(90.1)
    assert stats.p99_ms == pytest.approx(99.01)
    assert stats.mean_ms == pytest.approx(50.5)
    assert stats.min_ms == 1
    assert stats.cv == pytest.approx(np.std(range(1, 101), ddof=1) / 50.5)


def test_clear_speedup_is_faster() -> None:
    rng = np.random.default_rng(1)
    s = speedup(rounds(rng, 20.0, 0.5), rounds(rng, 10.0, 0.3))
    assert s.ratio == pytest.approx(2.0, rel=0.05)
    assert s.verdict == "faster" and s.low > 1.8


def test_slowdown_is_slower() -> None:
    rng = np.random.default_rng(2)
    s = speedup(rounds(rng, 10.0, 0.3), rounds(rng, 14.0, 0.3))
    assert s.verdict == "slower" and s.high < 1.0


def test_same_distribution_is_within_noise() -> None:
    rng = np.random.default_rng(3)
    s = speedup(rounds(rng, 10.0, 1.0), rounds(rng, 10.0, 1.0))
    assert s.verdict == "within noise"
    assert s.low <= 1.0 <= s.high


def test_drift_shared_by_both_sides_is_carried_out() -> None:
    """The machine slows down 3x over the run; interleaved rounds still see the true 1.25x."""
    rng = np.random.default_rng(4)
    drift = np.linspace(1.0, 3.0, 10)
    parent = [list(rng.normal(12.5 * d, 0.1, 10)) for d in drift]
    child = [list(rng.normal(10.0 * d, 0.1, 10)) for d in drift]
    s = speedup(parent, child)
    assert s.verdict == "faster"
    assert s.low > 1.15 and s.high < 1.35


def test_accuracy_metrics() -> None:
    ref = np.array([[1.0, 2.0, 3.0], [0.0, 5.0, 1.0]])
    got = ref + np.array([[0.0, 0.1, 0.0], [0.0, 0.0, 0.0]])
    meter = AccuracyMeter(["logits"])
    meter.add([ref], [got])
    acc = meter.per_output["logits"]
    assert acc.max_abs == pytest.approx(0.1)
    assert acc.max_rel == pytest.approx(0.1 / 5.0)
    expected = float(ref.ravel() @ got.ravel() / np.linalg.norm(ref) / np.linalg.norm(got))
    assert acc.cosine == pytest.approx(expected)
    assert acc.top1 == 1.0
    swapped = ref.copy()
    swapped[0] = [3.0, 2.0, 1.0]
    meter.add([ref], [swapped])
    assert acc.top1 == pytest.approx(3 / 4)


def test_budget_verdict() -> None:
    acc = {"y": {"cosine": 0.985, "max_abs": 0.2, "max_rel": 0.01, "top1": None}}
    ok, why, _ = budget_verdict(acc, AccuracyBudget(metric="cosine", min=0.99))
    assert not ok and "0.985 < 0.99" in why
    ok, _, _ = budget_verdict(acc, AccuracyBudget(metric="max_abs", max=0.5))
    assert ok


def test_interleaved_twin_rounds_take_each_session_in_turn() -> None:
    """Scripts' side-by-side timing with two sessions a name: each session used evenly, the parent on its own
    schedule so that every pairing of the parent's and a child's sessions occurs; one session a name is the
    plain interleaved_rounds."""
    from optimizer.measure.harness import interleaved_rounds, interleaved_twin_rounds

    class Counting:
        def __init__(self) -> None:
            self.calls = 0

        def run(self, prepared: object) -> None:
            self.calls += 1

    sessions = {"p": [Counting(), Counting()], "c": [Counting(), Counting()]}
    timed, used = interleaved_twin_rounds(sessions, {n: [[0], [0]] for n in sessions}, 8, 3, parent="p")
    assert [len(r) for r in timed["c"]] == [3] * 8
    assert used["c"].count(0) == used["c"].count(1) == 4 and used["p"].count(0) == used["p"].count(1) == 4
    assert set(zip(used["p"], used["c"], strict=True)) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    one = interleaved_rounds({"a": Counting()}, {"a": [0]}, 4, 2, settle_ms=0)  # type: ignore[dict-item]
    assert [len(r) for r in one["a"]] == [2] * 4
