"""The one timing loop (measure.harness.interleave): forward stages, the scripts' side-by-side timing and
generation stages all go through it, so a generation stage settles every switch and stops adding rounds by the
same rule as a forward stage (issue #30)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from optimizer.measure import harness
from optimizer.measure.generation import timed_generation_rounds
from optimizer.measure.harness import Timed, interleaved_rounds, measure
from optimizer.measure.stats import calls_to_resolve, latency_stats
from optimizer.recipe.schema import BenchmarkSettings
from optimizer.runtime.generation import Generation


class FakeGen:
    """A generator that logs (name, prompt tokens, new tokens) per call and reports a task time that varies a
    little from call to call (a tail to resolve)."""

    def __init__(self, name: str, log: list[Any], ms: float = 10.0) -> None:
        self.name, self.log, self.ms, self.n = name, log, ms, 0

    def generate(self, prompt: np.ndarray, new: int, keep_logits: bool = True) -> Generation:
        self.log.append((self.name, int(prompt.shape[1]), new))
        self.n += 1
        e2e = self.ms * (1 + 0.01 * (self.n % 7))
        return Generation(np.zeros((1, new), np.int64), ttft_ms=e2e / 2, tpot_ms=[e2e / 2 / (new - 1)] * (new - 1),
                          e2e_ms=e2e)


class CountingSession:
    def __init__(self) -> None:
        self.calls = 0

    def run(self, prepared: Any) -> Any:
        self.calls += 1
        return prepared


def test_generation_rounds_resolve_the_tail_as_forward_rounds_do() -> None:
    """`resolve_tail` adds rounds until the P99 is bounded (368 calls): forward timing did, generation timing
    stopped at `rounds` and reported a P99 it could not bound."""
    settings = BenchmarkSettings(warmup=0, rounds=2, iterations=10, resolve_tail=True, max_rounds=60, settle_ms=0)
    prompts = [np.ones((1, 12), np.int64)]
    runs, used, rounds = timed_generation_rounds([("child", [FakeGen("c0", [])])], prompts, 4, settings)
    e2e = [g.e2e_ms for rnd in runs["child"] for g in rnd]
    assert calls_to_resolve(0.99) == 368
    assert rounds == 37 and len(e2e) == 370 and used["child"] == [0] * 37
    assert latency_stats(e2e).p99_ci is not None
    child = Timed(CountingSession(), [0, 1])  # type: ignore[arg-type]
    measure(child, None, settings)
    assert len(child.rounds) == rounds  # the same rule on the same numbers of calls


def test_every_timed_generation_round_follows_a_pause_and_a_settle_on_its_own_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two generators a side, two prompts in turn: each side's round is the settle_ms pause, a short untimed
    generation on the generator about to be timed (the first 8 tokens of the prompt the round times first, 2
    new), then the timed generation; the sides alternate (ABBA) and each side's generators are taken in turn."""
    log: list[Any] = []
    monkeypatch.setattr(harness.time, "sleep", lambda s: log.append(("sleep", s)))
    sides = [("child", [FakeGen("c0", log), FakeGen("c1", log)]), ("parent", [FakeGen("p0", log), FakeGen("p1", log)])]
    settings = BenchmarkSettings(rounds=4, iterations=1, settle_ms=40, instances=2)
    prompts = [np.ones((1, 30), np.int64), np.ones((1, 6), np.int64)]
    runs, used, rounds = timed_generation_rounds(sides, prompts, 5, settings)

    def turn(gen: str, seq: int) -> list[Any]:
        return [("sleep", 0.04), (gen, min(8, seq), 2), (gen, seq, 5)]

    assert rounds == 4 and used == {"child": [0, 0, 1, 1], "parent": [0, 0, 1, 1]}
    assert log == (turn("c0", 30) + turn("p0", 30) + turn("p0", 6) + turn("c0", 6)
                   + turn("c1", 30) + turn("p1", 30) + turn("p1", 6) + turn("c1", 6))
    assert [len(r) for r in runs["child"]] == [1] * 4 and [len(r) for r in runs["parent"]] == [1] * 4


def test_forward_scripts_and_generation_time_through_the_same_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """harness.measure (forward stages, ctx.time, the denormal probe), the scripts' interleaved_rounds and
    generation timing each run harness.interleave, with their own kind of side."""
    seen: list[list[str]] = []
    interleave = harness.interleave

    def spy(sides: Any, *args: Any, **kwargs: Any) -> int:
        seen.append([type(s).__name__ for s in sides])
        return interleave(sides, *args, **kwargs)

    monkeypatch.setattr(harness, "interleave", spy)
    settings = BenchmarkSettings(warmup=0, rounds=2, iterations=2, settle_ms=0)
    child, parent = Timed(CountingSession(), [0, 1]), Timed(CountingSession(), [0, 1])  # type: ignore[arg-type]
    measure(child, parent, settings)
    timed = interleaved_rounds({"a": CountingSession(), "b": CountingSession()}, {"a": [0], "b": [0]}, 2, 2,  # type: ignore[dict-item]
                               settle_ms=0)
    log: list[Any] = []
    runs, _, _ = timed_generation_rounds([("child", [FakeGen("c0", log)]), ("parent", [FakeGen("p0", log)])],
                                         [np.ones((1, 10), np.int64)], 3, settings)
    assert seen == [["CallsSide", "CallsSide"], ["CallsSide", "CallsSide"], ["GenerationSide", "GenerationSide"]]
    assert [len(r) for r in child.rounds] == [2, 2] and [len(r) for r in timed["b"]] == [2, 2]
    assert [len(r) for r in runs["parent"]] == [2, 2]
