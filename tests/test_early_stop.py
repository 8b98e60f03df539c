"""Rounds stop once the verdict is beyond doubt (issue #30, item 6): a stage 3x faster than its parent does not
need ten rounds to say so. The rule (harness.until_resolved) looks at the ratio's 99% interval after each pair
of rounds from 6 rounds on (the fewest the shipped recipes run), and stops when it clears 1 by
`early_stop_margin`; a ratio near 1 runs every round, and the latency goals (target_ci, resolve_tail) still
hold."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from optimizer.measure import harness
from optimizer.measure.generation import timed_generation_rounds
from optimizer.measure.harness import Timed, measure, verdict_beyond_doubt
from optimizer.measure.stats import speedup
from optimizer.recipe.schema import BenchmarkSettings
from optimizer.runtime.generation import Generation


class FixedSession:
    """A session whose every call takes `ms` (times a little deterministic noise): harness.time_sequence is
    replaced by one that reads it, so the rule sees exactly these numbers."""

    def __init__(self, ms: float, seed: int) -> None:
        self.ms, self.rng = ms, np.random.default_rng(seed)

    def run(self, prepared: Any) -> Any:
        return prepared

    def latencies(self, n: int) -> list[float]:
        return [self.ms * float(x) for x in 1 + 0.02 * self.rng.standard_normal(n)]


@pytest.fixture(autouse=True)
def fixed_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "time_sequence", lambda session, inputs: session.latencies(len(inputs)))
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)


def sides(child_ms: float, parent_ms: float, instances: int = 2) -> tuple[Timed, Timed]:
    def timed(ms: float, seed: int) -> Timed:
        twins = [(FixedSession(ms, seed + k), [0, 1]) for k in range(1, instances)]
        return Timed(FixedSession(ms, seed), [0, 1], twins=twins)  # type: ignore[arg-type]

    return timed(child_ms, 0), timed(parent_ms, 100)


@pytest.mark.parametrize(("child_ms", "parent_ms"), [(1.0, 3.0), (3.0, 1.0)])
def test_a_verdict_beyond_doubt_stops_at_six_rounds(child_ms: float, parent_ms: float) -> None:
    """3x faster or 3x slower: 6 rounds (three pairs, both twins of each side used), not 10; the report's 95%
    interval from those rounds gives the same verdict."""
    child, parent = sides(child_ms, parent_ms)
    measure(child, parent, BenchmarkSettings(rounds=10, iterations=5, settle_ms=0))
    assert len(child.rounds) == len(parent.rounds) == 6
    assert child.instance_rounds == [0, 0, 1, 1, 0, 0] and parent.instance_rounds == [0, 0, 1, 1, 1, 1]
    verdict = speedup(parent.rounds, child.rounds).verdict
    assert verdict == ("faster" if child_ms < parent_ms else "slower")


def test_a_ratio_near_one_runs_every_round() -> None:
    """5% faster is a verdict the margin (10%) does not call early: all 10 rounds."""
    child, parent = sides(1.0, 1.05)
    measure(child, parent, BenchmarkSettings(rounds=10, iterations=5, settle_ms=0))
    assert len(child.rounds) == 10


def test_margin_zero_keeps_every_round() -> None:
    child, parent = sides(1.0, 3.0)
    measure(child, parent, BenchmarkSettings(rounds=10, iterations=5, settle_ms=0, early_stop_margin=0))
    assert len(child.rounds) == 10


def test_looks_come_after_whole_pairs_of_rounds() -> None:
    """A look only after both orders of a pair: `rounds` 9 with a clear verdict stops at 6; `rounds` 6 or fewer
    are run in full (the floor)."""
    child, parent = sides(1.0, 3.0)
    measure(child, parent, BenchmarkSettings(rounds=9, iterations=5, settle_ms=0))
    assert len(child.rounds) == 6
    child, parent = sides(1.0, 3.0)
    measure(child, parent, BenchmarkSettings(rounds=4, iterations=5, settle_ms=0))
    assert len(child.rounds) == 4


def test_a_stage_without_parent_runs_its_rounds() -> None:
    child, _ = sides(1.0, 3.0)
    measure(child, None, BenchmarkSettings(rounds=10, iterations=5, settle_ms=0))
    assert len(child.rounds) == 10


def test_latency_goals_still_hold_after_an_early_verdict() -> None:
    """resolve_tail asks for a bounded P99 (368 calls): the verdict is clear at 4 rounds, the tail is not, so
    rounds go on until the tail is (37 rounds of 10 calls), as before."""
    child, parent = sides(1.0, 3.0)
    settings = BenchmarkSettings(rounds=10, iterations=10, settle_ms=0, resolve_tail=True, max_rounds=60)
    measure(child, parent, settings)
    assert len(child.rounds) == 37


def test_the_interim_look_is_stricter_than_the_report() -> None:
    """Six rounds whose ratios reach below the margin's edge are not beyond doubt, though the 95% interval of the
    same rounds already says faster."""
    parent = [[1.25], [1.05], [1.3], [1.2], [1.04], [1.22]]
    child = [[1.0]] * 6
    assert speedup(parent, child).low > 1.0
    assert not verdict_beyond_doubt(parent, child, 0.10)
    assert verdict_beyond_doubt([[1.5], [1.4], [1.6], [1.45], [1.5], [1.55]], child, 0.10)
    assert not verdict_beyond_doubt([[1.5], [1.4], [1.6], [1.45]], child[:4], 0.10)  # under 6 rounds: never


class FakeGen:
    """A generation of `ms` task time whose steps take `step_ms` each (default: half the task over the steps)."""

    def __init__(self, ms: float, step_ms: float | None = None) -> None:
        self.ms, self.step_ms = ms, step_ms

    def generate(self, prompt: np.ndarray, new: int, keep_logits: bool = True) -> Generation:
        step = self.step_ms if self.step_ms is not None else self.ms / 2 / (new - 1)
        return Generation(np.zeros((1, new), np.int64), ttft_ms=self.ms - step * (new - 1),
                          tpot_ms=[step] * (new - 1), e2e_ms=self.ms)


def test_generation_stages_stop_by_the_same_rule() -> None:
    """Two generators a side, the child 3x faster in task time and per token: 6 rounds of 10; a tie runs all 10;
    a faster prefill with the same time per token (TPOT near 1) runs all 10 too, so TPOT's verdict keeps every
    round."""
    prompts = [np.ones((1, 12), np.int64)]
    settings = BenchmarkSettings(rounds=10, iterations=2, settle_ms=0, instances=2)
    fast = [("child", [FakeGen(10.0), FakeGen(10.5)]), ("parent", [FakeGen(30.0), FakeGen(31.0)])]
    assert timed_generation_rounds(fast, prompts, 4, settings)[2] == 6
    tie = [("child", [FakeGen(10.0), FakeGen(10.5)]), ("parent", [FakeGen(10.2), FakeGen(10.1)])]
    assert timed_generation_rounds(tie, prompts, 4, settings)[2] == 10
    prefill_only = [("child", [FakeGen(10.0, 1.0), FakeGen(10.5, 1.02)]),
                    ("parent", [FakeGen(30.0, 1.01), FakeGen(31.0, 1.0)])]
    assert timed_generation_rounds(prefill_only, prompts, 4, settings)[2] == 10
