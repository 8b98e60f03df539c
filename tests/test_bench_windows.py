"""The host's bench slot is held only while something is timed: a stage's warm-up and interleaved rounds, its op
profile, `optimizer bench`; never its loading, its accuracy run or its memory probe (issue 18)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.engine.pipeline import Pipeline
from optimizer.measure import bench_slot, forward, harness
from optimizer.recipe.loading import load_recipe

SLOW_ACCURACY_S = 0.6


@pytest.fixture(scope="module")
def slow_accuracy_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny MLP (source, export) measured with an accuracy run that takes SLOW_ACCURACY_S longer, noting
    whether the slot was held in each part."""
    tmp = tmp_path_factory.mktemp("windows")
    recipe = load_recipe(write_recipe(tmp, mlp_recipe(name="w-slow", passes=[{"type": "export"}])))
    held: dict[str, list[bool]] = {"accuracy": [], "timing": [], "memory": []}
    accuracy, measure, memory = forward._accuracy, forward.measure, forward.stage_memory

    def slow_accuracy(*args: Any) -> Any:
        held["accuracy"].append(bench_slot.holding())
        time.sleep(SLOW_ACCURACY_S)
        return accuracy(*args)

    def timed(*args: Any) -> Any:
        held["timing"].append(bench_slot.holding())
        return measure(*args)

    def probed(*args: Any) -> Any:
        held["memory"].append(bench_slot.holding())
        return memory(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forward, "_accuracy", slow_accuracy)
        mp.setattr(forward, "measure", timed)
        mp.setattr(forward, "stage_memory", probed)
        records = Pipeline(recipe, tmp / "run", use_cache=False).execute()
    return {"records": records, "held": held}


@pytest.mark.slow
def test_timing_holds_the_slot_and_accuracy_does_not(slow_accuracy_run: dict[str, Any]) -> None:
    held = slow_accuracy_run["held"]
    assert held["accuracy"] == [False, False] and held["memory"] == [False, False]
    assert held["timing"] == [True] * 4  # two stages, two scenarios each


@pytest.mark.slow
def test_windows_cover_the_timing_but_not_the_accuracy_run(slow_accuracy_run: dict[str, Any]) -> None:
    for rec in slow_accuracy_run["records"]:
        windows = rec.metrics["timed_windows"]
        assert [w["what"] for w in windows] == [f"{rec.name} timing", f"{rec.name} profile"]
        assert windows[0]["end"] <= windows[1]["start"]
        held = sum(w["end"] - w["start"] for w in windows)
        assert held > 0
        # the measurement took the slow accuracy run longer than the slot was held
        assert rec.bench_seconds - held >= SLOW_ACCURACY_S


@pytest.mark.slow
def test_bench_of_a_bundle_holds_the_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.deploy.bench import bench_bundle
    from optimizer.deploy.export import export_bundle
    from optimizer.report.build import build_report

    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(name="w-bundle", passes=[{"type": "export"}])))
    records = Pipeline(recipe, tmp_path / "run").execute()
    bundle = export_bundle(build_report(recipe, records, tmp_path / "run", 1.0), "export", "onnx",
                           tmp_path / "bundle")
    held: list[bool] = []
    time_calls = harness.time_calls

    def timed(*args: Any) -> list[float]:
        held.append(bench_slot.holding())
        return time_calls(*args)

    monkeypatch.setattr(harness, "time_calls", timed)
    with bench_slot.collect_windows() as windows:
        result = bench_bundle(bundle, rounds=2, iterations=3)
    # per reference scenario: the warm-up and 2 rounds, all in the slot
    assert len(result) == 2 and held == [True] * 3 * len(result)
    assert [w.what for w in windows] == [f"bench {bundle.name}"] and not bench_slot.holding()
    assert all(r["latency"]["p50_ms"] > 0 for r in result.values())


@pytest.mark.slow
def test_generation_windows_cover_the_timing_but_not_the_accuracy_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from test_generation import recipe_data

    from optimizer.measure import generation

    held: dict[str, list[bool]] = {"accuracy": [], "timing": []}
    agreement, interleave = generation.agreement, harness.interleave

    def slow_agreement(*args: Any) -> Any:
        held["accuracy"].append(bench_slot.holding())
        time.sleep(SLOW_ACCURACY_S / 2)  # twice per stage: one sample in each of two scenarios
        return agreement(*args)

    def timed(*args: Any, **kwargs: Any) -> int:
        held["timing"].append(bench_slot.holding())
        return interleave(*args, **kwargs)

    monkeypatch.setattr(generation, "agreement", slow_agreement)
    monkeypatch.setattr(harness, "interleave", timed)
    recipe = load_recipe(write_recipe(tmp_path, recipe_data([{"type": "export"}])))
    records = Pipeline(recipe, tmp_path / "run").execute()
    assert held["accuracy"] == [False] * 4 and held["timing"] and all(held["timing"])
    for rec in records:
        windows = rec.metrics["timed_windows"]
        assert [w["what"] for w in windows] == [f"{rec.name} timing", f"{rec.name} profile"]
        assert rec.bench_seconds - sum(w["end"] - w["start"] for w in windows) >= SLOW_ACCURACY_S
