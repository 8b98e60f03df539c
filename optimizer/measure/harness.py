"""The one benchmark harness every stage goes through.

A stage is timed interleaved with its parent: warm-up for both, then `rounds` rounds, each running the
parent and the child `iterations` times (the order flips every round, ABBA, so neither side always runs
first after the other's cache footprint). Each switch waits `settle_ms` and then runs one untimed call: the other
session's worker threads keep spinning after its last call (ONNX Runtime spins), and on 2 cores they made the
next 25-40 ms of the new side's calls 2.5x slower (MiniLM at natural lengths, 3 ms calls); that contention
belongs to neither stage. One untimed call alone, as before, settled 17 ms calls but not 3 ms ones. Each call
is timed alone with perf_counter_ns around `run`, which is all the
harness adds to a bare loop (benchmarks/bench_harness_overhead.py measures that).

`interleave` is the one loop that does all this, for every workload: a side is an adapter that settles an
instance and times a round (`CallsSide`: calls of a session, host and GPU time; measure.generation's
`GenerationSide`: whole generations), and the stop rule is fixed rounds or `until_resolved` (`rounds`, fewer
once the ratios to the parent are beyond doubt, more until the median is within target_ci and the P99 bounded).
`measure` (forward stages, ctx.time, the denormal probe), the scripts' `interleaved_*` and generation timing are
its callers.

A scenario's inputs are run in turn, not only its first: call i of a round runs input (offset + i) mod n, and
the parent and the child run the same inputs in the same round, so a natural-length mix is timed as served and
the interleaved ratio still compares like with like.

Two sessions of one artifact are not equally fast: identical ONNX Runtime sessions of a sub-millisecond model
differed by up to 7.5% here over 40 rounds (paired 95% interval 1.01-1.16; 2.5% for 20 ms MiniLM calls;
benchmarks/bench_instances.py), a property of the session (where its weights and arena landed), not of the pass.
One instance per side would put that into the pass's ratio with a narrow interval, so each side can carry twins
(more instances of the same artifact), taken in turn by pairs of rounds (both orders each; `instance_for`),
and `stats.instance_variance` reads the instance spread off the rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from optimizer.measure.stats import median_ci_halfwidth, quantile_ci, speedup
from optimizer.recipe.schema import BenchmarkSettings
from optimizer.runtime.runners.base import Session


@dataclass
class Timed:
    """One side of a measurement: the prepared inputs (run in turn) and the latencies of every round."""

    session: Session
    inputs: list[Any]
    rounds: list[list[float]] = field(default_factory=list)
    device_rounds: list[list[float]] = field(default_factory=list)  # GPU time per call (CUDA events)
    input_rounds: list[list[int]] = field(default_factory=list)  # which input each timed call ran
    # More instances of the same artifact, each with its own prepared inputs, taken in turn by round
    twins: list[tuple[Session, list[Any]]] = field(default_factory=list)
    instance_rounds: list[int] = field(default_factory=list)  # which instance ran each round (0: `session`)

    @property
    def instances(self) -> int:
        return 1 + len(self.twins)

    def instance(self, k: int) -> tuple[Session, list[Any]]:
        return (self.session, self.inputs) if k == 0 else self.twins[k - 1]

    def samples(self) -> list[float]:
        return [x for r in self.rounds for x in r]

    def sequence(self, offset: int, n: int, inputs: list[Any] | None = None) -> list[Any]:
        inputs = self.inputs if inputs is None else inputs
        return [inputs[(offset + i) % len(inputs)] for i in range(n)]


def time_calls(session: Session, prepared: Any, n: int) -> list[float]:
    """n timed calls on one input, in milliseconds."""
    return time_sequence(session, [prepared] * n)


def time_sequence(session: Session, inputs: list[Any]) -> list[float]:
    """One timed call per input, in order, in milliseconds."""
    run = session.run
    clock = time.perf_counter_ns
    out: list[float] = []
    for prepared in inputs:
        t0 = clock()
        run(prepared)
        out.append((clock() - t0) / 1e6)
    return out


def time_sequence_device(session: Session, inputs: list[Any]) -> tuple[list[float], list[float]]:
    """One timed call per input on a GPU session: host latency (ms) and the GPU time its CUDA events measured."""
    run, device_ms = session.run, session.last_device_ms  # type: ignore[attr-defined]
    clock = time.perf_counter_ns
    host: list[float] = []
    device: list[float] = []
    for prepared in inputs:
        t0 = clock()
        run(prepared)
        host.append((clock() - t0) / 1e6)
        device.append(device_ms())
    return host, device


def warm_up(session: Session, prepared: Any, n: int) -> float:
    """Run n untimed calls; return the last call's latency (ms) as an estimate for sizing rounds."""
    last = time_calls(session, prepared, max(n, 1))
    return last[-1]


def warm_up_all(session: Session, inputs: list[Any], n: int) -> float:
    """At least n untimed calls and every input once (each shape warmed); the mean latency of the last pass."""
    calls = max(n, len(inputs))
    times = time_sequence(session, [inputs[i % len(inputs)] for i in range(calls)])
    return float(sum(times[-len(inputs) :]) / len(inputs)) if len(times) >= len(inputs) else times[-1]


def iterations_for(settings: BenchmarkSettings, estimate_ms: float) -> int:
    if settings.min_round_seconds <= 0 or estimate_ms <= 0:
        return settings.iterations
    return max(settings.iterations, math.ceil(settings.min_round_seconds * 1000 / estimate_ms))


def instances_for(settings: BenchmarkSettings) -> int:
    """Sessions a side: `benchmark.instances`, or 1 when there are too few rounds for a second to be timed in
    both orders (instance_for changes sessions every two rounds)."""
    return settings.instances if settings.rounds >= 4 else 1


def twins_refused(copies: int, error: BaseException) -> str:
    """Why a stage was timed with one session a side though `benchmark.instances` asked for more."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (f"benchmark.instances: {copies} more session(s) a side could not load ({first}); timed with one a side, "
            "so the intervals leave out the spread between sessions")


def instance_for(r: int, is_child: bool, child_instances: int, instances: int) -> int:
    """Which instance a side runs in round r. Pairs of rounds (both orders) keep one pairing; the child steps
    through its instances pair by pair, the parent one step further every kc pairs, so each side uses its
    instances evenly every 2k rounds and every pairing occurs within 2 x kc x kp rounds."""
    pair = r // 2
    return (pair if is_child else pair + pair // child_instances) % instances


class Side(Protocol):
    """One side of an interleaved measurement, as `interleave` drives it: `instances` sessions (or generators)
    of one artifact, settled and timed a round at a time, each round's samples kept on the side."""

    @property
    def instances(self) -> int: ...

    def settle(self, k: int, r: int) -> None:
        """One untimed call on instance k, on what round r times first (its weights and caches back)."""

    def timed_round(self, k: int, r: int) -> None:
        """Round r on instance k: its timed calls, recorded on the side with k."""


def interleave(
    sides: Sequence[Side],
    settle_ms: float,
    more: Callable[[int], bool],
    parent: Side | None = None,
    on_round: Callable[[int], None] | None = None,
) -> int:
    """The one timing loop: rounds while more(r), the sides in the given order and reversed every other round
    (ABBA), each side on instance_for's instance (`parent` on the parent's schedule, the others on the child's,
    paced by the first other side's instance count). With more than one side every turn first sleeps settle_ms
    (the other side's pool threads stop spinning) and settles the side about to be timed. on_round(rounds done)
    after each round. Returns the rounds run."""
    lead = next((s.instances for s in sides if s is not parent), 1)
    r = 0
    while more(r):
        for side in sides if r % 2 == 0 else sides[::-1]:
            k = instance_for(r, side is not parent, lead, side.instances)
            if len(sides) > 1:
                time.sleep(settle_ms / 1000)
                side.settle(k, r)
            side.timed_round(k, r)
        r += 1
        if on_round:
            on_round(r)
    return r


def fixed_rounds(rounds: int) -> Callable[[int], bool]:
    """The stop rule of exactly `rounds` rounds."""
    return lambda r: r < rounds


EARLY_CONFIDENCE = 0.99  # an interim look at the ratio: stricter than the report's 95% (several looks a stage)
# Fewer rounds than this make too thin an interval to report (a bootstrap over 4 rounds' ratios is narrower than
# any honest 95% interval of their median); 6 is the fewest `rounds` the shipped recipes use.
EARLY_MIN_ROUNDS = 6


RoundsPair = tuple[list[list[float]], list[list[float]]]


def verdict_beyond_doubt(parent_rounds: list[list[float]], child_rounds: list[list[float]], margin: float) -> bool:
    """Whether the child/parent ratio is settled whatever more rounds show: its 99% interval (bootstrap over
    rounds, stats.speedup) lies wholly above 1 + margin or wholly below 1 / (1 + margin). The margin leaves room
    for the spread between sessions that the run pools later (measure.instances), which widens the interval."""
    if margin <= 0 or len(child_rounds) < EARLY_MIN_ROUNDS or len(parent_rounds) != len(child_rounds):
        return False
    s = speedup(parent_rounds, child_rounds, EARLY_CONFIDENCE)
    return s.low > 1 + margin or s.high < 1 / (1 + margin)


def until_resolved(
    settings: BenchmarkSettings,
    samples: Callable[[], list[float]],
    ratios: Callable[[], Sequence[RoundsPair]] | None = None,
) -> Callable[[int], bool]:
    """The stages' stop rule: `settings.rounds` rounds, fewer when every ratio to the parent (ratios(): each
    the parent's and the child's rounds of one figure) is beyond doubt after a pair of rounds (both orders) from
    EARLY_MIN_ROUNDS on, then (when asked) more until the median of samples() is within target_ci and
    (resolve_tail) its P99 is bounded, up to max_rounds."""

    def latency_resolved() -> bool:
        taken = samples()
        if settings.target_ci > 0 and median_ci_halfwidth(taken) > settings.target_ci:
            return False
        return not settings.resolve_tail or quantile_ci(taken, 0.99) is not None

    def more(r: int) -> bool:
        if r < settings.rounds:
            early = (ratios is not None and r >= EARLY_MIN_ROUNDS and r % 2 == 0
                     and all(verdict_beyond_doubt(p, c, settings.early_stop_margin) for p, c in ratios()))
            return not (early and latency_resolved())
        return r < settings.max_rounds and not latency_resolved()

    return more


@dataclass
class CallsSide:
    """A Timed side as `interleave` times it: `calls` calls a round on the inputs in turn (from offset
    r x calls), host latency each, and the GPU's own time too when the session keeps one and `device` allows."""

    timed: Timed
    calls: int
    device: bool = True

    @property
    def instances(self) -> int:
        return self.timed.instances

    def _inputs(self, k: int, r: int) -> tuple[Session, list[Any], int]:
        session, inputs = self.timed.instance(k)
        offset = (r * self.calls) % len(self.timed.inputs)
        return session, self.timed.sequence(offset, self.calls, inputs), offset

    def settle(self, k: int, r: int) -> None:
        session, inputs, _ = self._inputs(k, r)
        session.run(inputs[0])

    def timed_round(self, k: int, r: int) -> None:
        side = self.timed
        session, inputs, offset = self._inputs(k, r)
        if self.device and getattr(session, "device_time", False):
            host, device = time_sequence_device(session, inputs)
            side.rounds.append(host)
            side.device_rounds.append(device)
        else:
            side.rounds.append(time_sequence(session, inputs))
        side.input_rounds.append([(offset + i) % len(side.inputs) for i in range(self.calls)])
        side.instance_rounds.append(k)


def measure(
    child: Timed,
    parent: Timed | None,
    settings: BenchmarkSettings,
    on_round: Callable[[int], None] | None = None,
) -> None:
    """Fill child.rounds (and parent.rounds) with interleaved timings (`interleave`, the parent first in round
    0, until_resolved on the child's latencies and the ratio). Both sessions must be warm. Raises ValueError when
    the two sides hold different numbers of inputs."""
    if parent is not None and len(parent.inputs) != len(child.inputs):
        raise ValueError(f"parent has {len(parent.inputs)} inputs, the child {len(child.inputs)}: they must match")
    timed = [s for s in (parent, child) if s is not None]
    estimate = max(warm_up_all(*s.instance(k), 1) for s in timed for k in range(s.instances))
    n = iterations_for(settings, estimate)
    sides = [CallsSide(s, n) for s in timed]
    ratios = (lambda: [(parent.rounds, child.rounds)]) if parent is not None else None
    interleave(sides, settings.settle_ms, until_resolved(settings, child.samples, ratios),
               parent=sides[0] if parent is not None else None, on_round=on_round)


def interleaved_rounds(
    sessions: dict[str, Session], inputs: dict[str, list[Any]], rounds: int, iterations: int, settle_ms: float = 50.0
) -> dict[str, list[list[float]]]:
    """Several sessions timed in turns, round by round (order flipped every round), each round running the same
    inputs (cycled) on every session, for side-by-side comparisons in scripts: session -> rounds of latencies."""
    twins = {name: [s] for name, s in sessions.items()}
    return interleaved_twin_rounds(twins, {n: [x] for n, x in inputs.items()}, rounds, iterations, None, settle_ms)[0]


def interleaved_twin_rounds(
    sessions: dict[str, list[Session]],
    inputs: dict[str, list[list[Any]]],
    rounds: int,
    iterations: int,
    parent: str | None = None,
    settle_ms: float = 50.0,
) -> tuple[dict[str, list[list[float]]], dict[str, list[int]]]:
    """interleaved_rounds where each name has several sessions of one artifact (inputs prepared per session),
    taken in turn by pairs of rounds as `measure` takes twins (`parent` on the parent's schedule, the others on
    the child's), through `interleave` for `rounds` rounds, host latency only: name -> rounds of latencies, and
    name -> the session each round used (for instance_variance)."""
    for name, twins in sessions.items():
        for k, session in enumerate(twins):
            warm_up_all(session, inputs[name][k], 2)
    timed = {
        name: Timed(twins[0], inputs[name][0], twins=list(zip(twins[1:], inputs[name][1:], strict=True)))
        for name, twins in sessions.items()
    }
    sides = {name: CallsSide(t, iterations, device=False) for name, t in timed.items()}
    interleave(list(sides.values()), settle_ms, fixed_rounds(rounds), parent=sides.get(parent or ""))
    return {n: t.rounds for n, t in timed.items()}, {n: t.instance_rounds for n, t in timed.items()}


def interleaved_p50(
    sessions: dict[str, Session], prepared: dict[str, Any], rounds: int, iterations: int
) -> dict[str, float]:
    """P50 (ms) of several sessions timed in turns on one input each (see interleaved_rounds)."""
    import numpy as np

    timed = interleaved_rounds(sessions, {n: [p] for n, p in prepared.items()}, rounds, iterations)
    return {name: float(np.median([x for r in rs for x in r])) for name, rs in timed.items()}
