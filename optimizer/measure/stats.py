"""Statistics for timings: percentiles, and whether a speedup between two interleaved stages is real.

A speedup is parent_median / child_median. Its confidence interval comes from a bootstrap over rounds:
rounds alternate parent and child, so drift of the machine (thermal, other load) hits both sides of a round
alike and the per-round ratios carry it out. That interval is about these two sessions; two sessions of one
artifact differ too (measure.harness), so when each side ran several sessions the run widens the interval by
the spread between them (`instance_variance`, `widened`, pooled by measure.instances). The change is called
real only when the interval excludes 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import bdtr, stdtrit  # binomial CDF, Student's t quantile (scipy.stats takes a second to import)

from optimizer.core.metrics import Latency, Speedup, SpeedVerdict


def quantile_ci(samples: list[float] | np.ndarray, q: float, confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval of the q-quantile from order statistics: sorted samples x(l) <= Q_q <= x(u)
    with probability >= confidence, l and u from the binomial count of samples below Q_q. None when the calls
    cannot bound it (u would be past the largest sample: a P99 needs about 370 calls)."""
    a = np.sort(np.asarray(samples, dtype=np.float64))
    n = a.size
    if n < 2:
        return None
    alpha = (1 - confidence) / 2
    cdf = bdtr(np.arange(n + 1), n, q)  # P(B <= k), B ~ Binomial(n, q)
    lower = int(np.searchsorted(cdf, alpha, side="right"))  # x(lower), 1-based rank lower: P(B < lower) <= alpha
    upper = int(np.searchsorted(cdf, 1 - alpha, side="left")) + 1  # P(B < upper) >= 1 - alpha
    if lower < 1 or upper > n:
        return None
    return float(a[lower - 1]), float(a[upper - 1])


def low_quantile_bound(
    similarities: list[float] | np.ndarray, confidence: float = 0.90
) -> tuple[float, float, float] | None:
    """(p, low, high): an interval, at `confidence` (two-sided), of the p-quantile of similarities like these
    (cosines <= 1), with p = 1/(n+1): where the worst of another n samples typically falls. The worst of n is
    the point figure; this says how sure it is. Model: the distances 1 - s are log-normal (errors of quantized
    or reordered arithmetic are products of many small factors), so the bound on a normal quantile of
    log(1 - s) is the one-sided tolerance factor from the noncentral t (scipy.stats.nct). None below 3 samples
    (no spread to estimate)."""
    from scipy import stats

    s = np.asarray(similarities, dtype=np.float64)
    n = s.size
    if n < 3 or not np.isfinite(s).all():
        return None
    x = np.log(np.maximum(1.0 - s, 1e-15))  # identical outputs: distance 0 clipped, a bound at ~1 - 1e-15
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    p = 1.0 / (n + 1)
    z = float(stats.norm.ppf(1 - p))
    tail = (1 - confidence) / 2
    k_far = float(stats.nct.ppf(1 - tail, n - 1, z * math.sqrt(n))) / math.sqrt(n)
    k_near = float(stats.nct.ppf(tail, n - 1, z * math.sqrt(n))) / math.sqrt(n)
    return p, 1.0 - math.exp(mean + k_far * sd), 1.0 - math.exp(mean + k_near * sd)


def calls_to_resolve(q: float, confidence: float = 0.95) -> int:
    """The fewest calls whose q-quantile interval is bounded (the upper rank fits inside the sample)."""
    return math.ceil(math.log((1 - confidence) / 2) / math.log(q))


def latency_stats(samples_ms: list[float] | np.ndarray) -> Latency:
    """The report's Latency (core.metrics) of timed calls: percentiles, mean, spread and the tail intervals."""
    a = np.asarray(samples_ms, dtype=np.float64)
    mean = float(a.mean())
    std = float(a.std(ddof=1)) if a.size > 1 else 0.0
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return Latency(
        n=int(a.size),
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        mean_ms=mean,
        std_ms=std,
        min_ms=float(a.min()),
        cv=std / mean if mean else 0.0,
        p90_ci=quantile_ci(a, 0.90),
        p99_ci=quantile_ci(a, 0.99),
    )


def speedup(
    parent_rounds: list[list[float]],
    child_rounds: list[list[float]],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Speedup:
    """parent/child ratio of medians (> 1: the child is faster), with a bootstrap-over-rounds confidence interval:
    the report's Speedup (core.metrics) with its four fields set."""
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
    return Speedup(ratio=ratio, low=low, high=high, verdict=speed_verdict(low, high))


@dataclass(frozen=True)
class InstanceSpread:
    """One stage's reading of the spread between sessions of an artifact, for one scenario."""

    variance: float  # log scale, method of moments: unclipped (may be < 0), so that pooling stays unbiased
    df: int  # contrasts it rests on: (instances - 1) per side that ran more than one
    factor: float  # how much of it the ratio carries: sum of squared instance shares, parent's plus child's


def _shares(labels: list[int]) -> float:
    counts = np.bincount(labels)
    return float(np.sum((counts / counts.sum()) ** 2))


def instance_variance(
    parent_rounds: list[list[float]],
    child_rounds: list[list[float]],
    parent_instances: list[int],
    child_instances: list[int],
) -> InstanceSpread | None:
    """The variance (log scale) of one session's own effect on its speed, from interleaved rounds in which each
    side took several sessions of its artifact in turn; None when no side ran two sessions with rounds to spare.
    Method of moments on the per-round log ratios (the order effect of odd and even rounds taken out first): the
    spread of each side's per-session means, less what the within-cell round noise puts there, over the sides
    (both run on one runtime)."""
    ratios = np.log([np.median(p) / np.median(c) for p, c in zip(parent_rounds, child_rounds, strict=True)])
    order = np.arange(len(ratios)) % 2
    for o in (0, 1):  # who ran first after the other's footprint is not a session's property
        if np.any(order == o):
            ratios[order == o] -= ratios[order == o].mean() - ratios.mean()
    cells: dict[tuple[int, int], list[float]] = {}
    for value, pk, ck in zip(ratios, parent_instances, child_instances, strict=True):
        cells.setdefault((pk, ck), []).append(float(value))
    dof = sum(len(v) - 1 for v in cells.values()) - 1  # one more for the order means
    if dof < 1:
        return None
    noise = sum(float(np.sum((np.asarray(v) - np.mean(v)) ** 2)) for v in cells.values()) / dof
    estimates, df = [], 0
    for labels in (child_instances, parent_instances):
        groups: dict[int, list[float]] = {}
        for value, k in zip(ratios, labels, strict=True):
            groups.setdefault(k, []).append(float(value))
        if len(groups) < 2:
            continue
        means = [float(np.mean(v)) for v in groups.values()]
        expected_noise = noise * float(np.mean([1 / len(v) for v in groups.values()]))
        estimates.append(float(np.var(means, ddof=1)) - expected_noise)
        df += len(groups) - 1
    if not estimates:
        return None
    return InstanceSpread(float(np.mean(estimates)), df, _shares(parent_instances) + _shares(child_instances))


def widened(ratio: float, low: float, high: float, variance: float, factor: float, df: int,
            confidence: float = 0.95) -> tuple[float, float, SpeedVerdict]:
    """(low, high, verdict) of a ratio whose in-run interval is low-high, widened by the instance spread: the
    ratio carries factor x `variance` (log) that no round shows, known from `df` contrasts (Student's t)."""
    extra = float(stdtrit(max(df, 1), (1 + confidence) / 2)) * math.sqrt(max(variance, 0.0) * factor)
    if extra == 0.0:  # no spread: the in-run interval as it is (the log round trip would move it by an ulp)
        return low, high, speed_verdict(low, high)
    low = ratio * math.exp(-math.hypot(math.log(ratio / low), extra))
    high = ratio * math.exp(math.hypot(math.log(high / ratio), extra))
    return low, high, speed_verdict(low, high)


def speed_verdict(low: float, high: float) -> SpeedVerdict:
    """A change is real only when its interval excludes 1."""
    return "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"


def speedup_with_spread(
    timed: dict[str, list[list[float]]], used: dict[str, list[int]], parent: str, child: str
) -> Speedup:
    """parent/child from interleaved_twin_rounds' output (rounds and the session each round used), its in-run
    interval widened by the spread between sessions of one artifact when the rounds show it."""
    s = speedup(timed[parent], timed[child])
    spread = instance_variance(timed[parent], timed[child], used[parent], used[child])
    if spread is None:
        return s
    low, high, verdict = widened(s.ratio, s.low, s.high, spread.variance, spread.factor, spread.df)
    return Speedup(ratio=s.ratio, low=low, high=high, verdict=verdict)


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
