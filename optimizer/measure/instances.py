"""The spread between sessions of one artifact, pooled over a run, in every stage's interval.

Each stage timed against its parent ran `benchmark.instances` sessions a side in turn (measure.harness) and
read the spread between them off its rounds, per scenario (stats.instance_variance). One stage's reading rests on
a contrast or two, so the run pools the readings of the stages that share a scenario and a pair of runtimes
(the spread depends on the call: 5-10% for sub-ms ONNX Runtime calls here, 1% for 17 ms ones), and widens each
stage's in-run interval by it with Student's t on the pooled contrasts. The stages' measured metrics (and their
metrics.json) keep the in-run interval; the report and the batch sweep read stages through `stage_reports`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optimizer.core.stage import StageRecord, StageReport
from optimizer.measure.stats import widened


def _pool_key(stage: StageReport, by: dict[str, StageReport], scenario: str) -> tuple[str, str, str]:
    against = by.get(by[stage.parent].measured_against or stage.parent) if stage.parent in by else None
    parent_kind = against.artifact.kind if against is not None and against.artifact is not None else "?"
    return scenario, parent_kind, stage.artifact.kind if stage.artifact is not None else "?"


# (ratio field, its reading's variance field, its df field): the task time's ratio and a decoder's TPOT ratio
RATIOS = (("vs_parent", "instance_variance", "instance_df"), ("tpot_vs_parent", "tpot_instance_variance",
                                                                 "tpot_instance_df"))


def pooled_spreads(stages: Sequence[StageReport], var_field: str = "instance_variance",
                   df_field: str = "instance_df") -> dict[tuple[str, str, str], tuple[float, int]]:
    """(scenario, parent's artifact kind, stage's) -> (variance, contrasts): the df-weighted mean of the stages'
    unclipped readings, clipped at 0 once pooled."""
    by = {s.name: s for s in stages}
    sums: dict[tuple[str, str, str], list[float]] = {}
    for st in stages:
        if st.metrics is None:
            continue
        for scen, m in st.metrics.scenarios.items():
            var, df = getattr(m, var_field), getattr(m, df_field)
            if var is not None and df:
                acc = sums.setdefault(_pool_key(st, by, scen), [0.0, 0])
                acc[0] += var * df
                acc[1] += df
    return {k: (max(total / df, 0.0), int(df)) for k, (total, df) in sums.items()}


def spread_over_run(stages: Sequence[StageReport], confidence: float) -> None:
    """Widen (in place) every ratio whose stage read the spread between sessions, by its pool's."""
    by = {s.name: s for s in stages}
    for ratio_field, var_field, df_field in RATIOS:
        pools = pooled_spreads(stages, var_field, df_field)
        for st in stages:
            if st.metrics is None:
                continue
            for scen, m in st.metrics.scenarios.items():
                vs = getattr(m, ratio_field)
                if vs is None or m.instance_factor is None or getattr(m, var_field) is None:
                    continue
                variance, df = pools[_pool_key(st, by, scen)]
                low, high, verdict = widened(vs.ratio, vs.low, vs.high, variance, m.instance_factor, df, confidence)
                setattr(m, ratio_field, vs.model_copy(update={
                    "low": low, "high": high, "verdict": verdict, "in_run_low": vs.low, "in_run_high": vs.high,
                    "instance_sd": float(np.sqrt(variance)),
                }))


def stage_reports(records: Sequence[StageRecord], confidence: float) -> list[StageReport]:
    """The records as the report holds them, their intervals widened by the run's spread between sessions."""
    stages = [rec.to_report() for rec in records]
    spread_over_run(stages, confidence)
    return stages
