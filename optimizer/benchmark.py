"""The one benchmark harness every stage goes through.

A stage is timed interleaved with its parent: warm-up for both, then `rounds` rounds, each running the
parent and the child `iterations` times (the order flips every round, ABBA, so neither side always runs
first after the other's cache footprint). The first call after each switch is run untimed: the other
session's worker threads are still spinning then (ONNX Runtime spins after a run), and that contention
belongs to neither stage. Each call is timed alone with perf_counter_ns around `run`, which is all the
harness adds to a bare loop (scripts/bench_harness_overhead.py measures that).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optimizer.recipe import BenchmarkSettings
from optimizer.runners.base import Session
from optimizer.stats import median_ci_halfwidth


@dataclass
class Timed:
    """One side of a measurement: the prepared input and the latencies of every round."""

    session: Session
    prepared: Any
    rounds: list[list[float]] = field(default_factory=list)
    device_rounds: list[list[float]] = field(default_factory=list)  # GPU time per call (CUDA events)

    def samples(self) -> list[float]:
        return [x for r in self.rounds for x in r]


def time_calls(session: Session, prepared: Any, n: int) -> list[float]:
    """n timed calls, in milliseconds."""
    run = session.run
    clock = time.perf_counter_ns
    out: list[float] = []
    for _ in range(n):
        t0 = clock()
        run(prepared)
        out.append((clock() - t0) / 1e6)
    return out


def time_calls_device(session: Session, prepared: Any, n: int) -> tuple[list[float], list[float]]:
    """n timed calls on a GPU session: host latency (ms) and the GPU time its CUDA events measured (ms)."""
    run, device_ms = session.run, session.last_device_ms  # type: ignore[attr-defined]
    clock = time.perf_counter_ns
    host: list[float] = []
    device: list[float] = []
    for _ in range(n):
        t0 = clock()
        run(prepared)
        host.append((clock() - t0) / 1e6)
        device.append(device_ms())
    return host, device


def warm_up(session: Session, prepared: Any, n: int) -> float:
    """Run n untimed calls; return the last call's latency (ms) as an estimate for sizing rounds."""
    last = time_calls(session, prepared, max(n, 1))
    return last[-1]


def iterations_for(settings: BenchmarkSettings, estimate_ms: float) -> int:
    if settings.min_round_seconds <= 0 or estimate_ms <= 0:
        return settings.iterations
    return max(settings.iterations, math.ceil(settings.min_round_seconds * 1000 / estimate_ms))


def measure(
    child: Timed,
    parent: Timed | None,
    settings: BenchmarkSettings,
    on_round: Callable[[int], None] | None = None,
) -> None:
    """Fill child.rounds (and parent.rounds) with interleaved timings. Both sessions must be warm."""
    sides = [s for s in (parent, child) if s is not None]
    estimate = max(warm_up(s.session, s.prepared, 1) for s in sides)
    n = iterations_for(settings, estimate)
    r = 0
    while r < settings.rounds or (
        settings.target_ci > 0 and r < settings.max_rounds and median_ci_halfwidth(child.samples()) > settings.target_ci
    ):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            if parent is not None:
                side.session.run(side.prepared)  # untimed: settles the switch from the other session
            if getattr(side.session, "device_time", False):
                host, device = time_calls_device(side.session, side.prepared, n)
                side.rounds.append(host)
                side.device_rounds.append(device)
            else:
                side.rounds.append(time_calls(side.session, side.prepared, n))
        r += 1
        if on_round:
            on_round(r)


def interleaved_p50(
    sessions: dict[str, Session], prepared: dict[str, Any], rounds: int, iterations: int
) -> dict[str, float]:
    """P50 (ms) of several sessions timed in turns, round by round (order flipped every round), for
    side-by-side comparisons in scripts. Each block starts with one untimed call, as in `measure`."""
    import numpy as np

    for name, session in sessions.items():
        warm_up(session, prepared[name], 2)
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    order = list(sessions)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            sessions[name].run(prepared[name])
            samples[name] += time_calls(sessions[name], prepared[name], iterations)
    return {name: float(np.median(x)) for name, x in samples.items()}
