"""Statistics for timings: percentiles, and whether a speedup between two interleaved stages is real.

A speedup is parent_median / child_median. Its confidence interval comes from a bootstrap over rounds:
rounds alternate parent and child, so drift of the machine (thermal, other load) hits both sides of a round
alike and the per-round ratios carry it out. The change is called real only when the interval excludes 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LatencyStats:
    n: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    std_ms: float
    min_ms: float
    cv: float

    @staticmethod
    def of(samples_ms: list[float] | np.ndarray) -> LatencyStats:
        a = np.asarray(samples_ms, dtype=np.float64)
        mean = float(a.mean())
        std = float(a.std(ddof=1)) if a.size > 1 else 0.0
        p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
        return LatencyStats(int(a.size), p50, p90, p99, mean, std, float(a.min()), std / mean if mean else 0.0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Speedup:
    ratio: float  # > 1: the child is faster than the parent
    low: float
    high: float
    verdict: str  # "faster" | "slower" | "within noise"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def speedup(
    parent_rounds: list[list[float]],
    child_rounds: list[list[float]],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Speedup:
    """parent/child ratio of medians, with a bootstrap-over-rounds confidence interval."""
    p_med = np.array([np.median(r) for r in parent_rounds])
    c_med = np.array([np.median(r) for r in child_rounds])
    ratio = float(np.median(np.concatenate(parent_rounds)) / np.median(np.concatenate(child_rounds)))
    per_round = p_med / c_med
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per_round), size=(resamples, len(per_round)))
    boot = np.median(per_round[idx], axis=1)
    alpha = (1 - confidence) / 2
    low, high = (float(x) for x in np.quantile(boot, [alpha, 1 - alpha]))
    low, high = min(low, ratio), max(high, ratio)
    verdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"
    return Speedup(ratio, low, high, verdict)


def median_ci_halfwidth(samples: list[float] | np.ndarray) -> float:
    """Relative half-width of the median's distribution-free 95% interval (order statistics: ranks
    n/2 -/+ 1.96 sqrt(n)/2). Infinite with too few samples to say."""
    a = np.sort(np.asarray(samples, dtype=np.float64))
    n = a.size
    if n < 6:
        return float("inf")
    half = 1.96 * np.sqrt(n) / 2
    lo, hi = int(np.floor(n / 2 - half)), int(np.ceil(n / 2 + half))
    lo, hi = max(lo, 0), min(hi, n - 1)
    med = float(np.median(a))
    return float((a[hi] - a[lo]) / (2 * med)) if med > 0 else float("inf")
