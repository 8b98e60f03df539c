"""Batch sweep: one stage's latency, throughput and memory across batch sizes, and the batching to deploy.

For each batch size the stage is timed on inputs of the recipe's first scenario's sequence length with the
same harness (warm-up, then `benchmark.rounds` x `benchmark.iterations` calls). The recommendation, like the
seeds' dynamic batching configuration:
  max_batch        the largest batch whose P99 stays within `latency_budget_ms` and whose memory growth stays
                   within `memory_budget_mb` (default: half the memory available now);
  preferred_batch  the smallest batch within max_batch that reaches 90% of the best throughput seen there,
                   so requests are not held back for a batch that barely adds throughput.
`optimizer export --format triton` writes these into config.pbtxt.
"""

from __future__ import annotations

import gc
from typing import Any

from optimizer.core.errors import InputError, OptimizerError
from optimizer.core.stage import StageRecord
from optimizer.measure.best import choose_stage
from optimizer.measure.harness import time_calls, warm_up
from optimizer.measure.instances import stage_reports
from optimizer.measure.stats import latency_stats
from optimizer.recipe.schema import Recipe, Scenario
from optimizer.runtime.inputs import build_feeds, sample_bytes
from optimizer.runtime.runners import runner_for


def pick_sweep_stage(recipe: Recipe, records: list[StageRecord]) -> StageRecord | None:
    """The stage to sweep, chosen as `optimizer export --stage` chooses (measure.best.choose_stage: for "best"
    the one rule), or None."""
    name = recipe.batch_sweep.stage if recipe.batch_sweep else "best"
    try:
        stages = stage_reports(records, recipe.benchmark.confidence)  # as the report reads them
        chosen = choose_stage(stages, [s.name for s in recipe.scenarios], name)
    except OptimizerError:
        return None
    return next(r for r in records if r.name == chosen.name)


def _batch_scenario(recipe: Recipe, batch: int) -> Scenario:
    """The first scenario at another batch size (its seq and other dims kept; one sample)."""
    first = recipe.scenarios[0]
    return Scenario(name=f"b{batch}", batch=batch, seq=first.seq, dims=first.dims)


def _time_batch(session: Any, recipe: Recipe, scenario: Scenario) -> dict[str, Any]:
    import psutil

    sub = recipe.model_copy(update={"scenarios": [scenario]})
    feed = next(iter(build_feeds(sub, 1))).timing
    prepared = session.prepare(feed)
    before = psutil.Process().memory_info().rss
    warm_up(session, prepared, max(recipe.benchmark.warmup, 2))
    grown = (psutil.Process().memory_info().rss - before) / 2**20
    samples = [
        x for _ in range(recipe.benchmark.rounds) for x in time_calls(session, prepared, recipe.benchmark.iterations)
    ]
    lat = latency_stats(samples)
    return {
        "batch": scenario.batch,
        "p50_ms": lat.p50_ms,
        "p99_ms": lat.p99_ms,
        "samples_per_s": scenario.batch * 1000 / lat.mean_ms,
        "memory_growth_mb": max(grown, 0.0),
    }


def _skip_reason(recipe: Recipe, scenario: Scenario, budget_mb: float, failed: int | None) -> str | None:
    """Why a batch is not timed, before anything is allocated: its inputs alone are over the memory budget, or a
    smaller batch already could not be allocated."""
    if failed is not None and scenario.batch >= failed:
        return f"not tried: batch {failed} could not be allocated"
    need = sample_bytes(recipe, scenario) / 2**20
    if need > budget_mb:
        return f"its inputs alone take {need:,.0f} MB, over the memory budget of {budget_mb:,.0f} MB"
    return None


def run_sweep(recipe: Recipe, stage: StageRecord, progress: Any = None) -> dict[str, Any]:
    """The sweep's result (core.metrics.BatchSweep's JSON). A batch that cannot fit in memory is skipped with the
    reason (`skipped`), and the batches that fit are kept."""
    import psutil

    cfg = recipe.batch_sweep
    assert cfg is not None and stage.artifact is not None
    seq = recipe.scenarios[0].seq
    memory_budget = cfg.memory_budget_mb or psutil.virtual_memory().available / 2**20 / 2
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    failed: int | None = None  # the smallest batch whose allocation failed: larger ones are not tried
    gc.collect()
    with runner_for(stage.artifact, recipe).load() as session:
        for i, batch in enumerate(cfg.batches):
            scenario = _batch_scenario(recipe, batch)
            reason = _skip_reason(recipe, scenario, memory_budget, failed)
            if reason is None:
                try:
                    rows.append(_time_batch(session, recipe, scenario))
                except (MemoryError, InputError) as e:  # InputError: build_feeds found it cannot hold them
                    failed = batch if failed is None else min(failed, batch)
                    reason = f"could not be allocated ({type(e).__name__}: {str(e)[:200]})"
                    gc.collect()
            if reason is not None:
                skipped.append({"batch": batch, "reason": reason})
            if progress:
                progress("batch sweep", i + 1, len(cfg.batches))
    fits = [r for r in rows if r["p99_ms"] <= cfg.latency_budget_ms and r["memory_growth_mb"] <= memory_budget]
    if not fits:
        return {
            "stage": stage.name,
            "seq": seq,
            "rows": rows,
            "skipped": skipped,
            "max_batch": None,
            "preferred_batch": None,
            "why": f"no batch meets P99 <= {cfg.latency_budget_ms} ms" + (
                f" and memory within {memory_budget:,.0f} MB" if skipped else ""),
        }
    max_row = max(fits, key=lambda r: r["batch"])
    best_tp = max(r["samples_per_s"] for r in fits if r["batch"] <= max_row["batch"])
    preferred = min((r for r in fits if r["samples_per_s"] >= 0.9 * best_tp), key=lambda r: r["batch"])
    why = (
        f"max_batch {max_row['batch']}: the largest batch with P99 {max_row['p99_ms']:.1f} ms <= "
        f"{cfg.latency_budget_ms} ms and memory within {memory_budget:.0f} MB; preferred_batch "
        f"{preferred['batch']}: the smallest reaching 90% of the best throughput ({best_tp:.1f} samples/s)"
    )
    return {
        "stage": stage.name,
        "seq": seq,
        "rows": rows,
        "skipped": skipped,
        "latency_budget_ms": cfg.latency_budget_ms,
        "memory_budget_mb": memory_budget,
        "max_batch": max_row["batch"],
        "preferred_batch": preferred["batch"],
        "why": why,
    }
