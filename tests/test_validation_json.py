"""Issue 28, classes 5 and 8: recipes that validated and then went wrong at compile; JSON other tools cannot read.

Class 5: validation refuses what compile would trip over (scenario dims, integer ranges, seeds, duplicate names,
an accuracy output that does not exist, sizes no machine holds); what only run time can tell (memory) skips the
part that cannot fit with its reason and keeps the rest. Class 8: every JSON file is strict (no Infinity/NaN),
readers take the nulls, and diff/select of a report with zero latencies is one line.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TESTS, mlp_recipe, write_recipe

from optimizer.core.errors import InputError, OptimizerError, RecipeError
from optimizer.recipe.loading import parse_recipe

FEW_ROUNDS = {"warmup": 1, "rounds": 2, "iterations": 1, "memory": "inline", "settle_ms": 0, "instances": 1,
              "denormal_probe": False}


def refused(data: dict[str, Any], tmp_path: Path, field: str, words: str = "") -> RecipeError:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "x.yaml", tmp_path)
    assert info.value.field == field, str(info.value)
    assert words in str(info.value), str(info.value)
    return info.value


def strict_load(text: str) -> Any:
    """json.loads as a parser in another language reads it: Infinity and NaN are not JSON."""
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


# ---------------------------------------------------------------- class 5: validation
@pytest.mark.parametrize(
    ("dims", "field"),
    [
        ({"batch": 0}, "scenarios[0].dims.batch"),
        ({"batch": -3}, "scenarios[0].dims.batch"),
        ({"seq": 0}, "scenarios[0].dims.seq"),
        ({"heads": -1}, "scenarios[0].dims.heads"),
    ],
)
def test_scenario_dims_keep_the_size_rules(tmp_path: Path, dims: dict[str, int], field: str) -> None:
    data = mlp_recipe()
    data["scenarios"][0]["dims"] = dims
    refused(data, tmp_path, field)


def test_scenario_dims_bind_other_names(tmp_path: Path) -> None:
    data = mlp_recipe(inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", "width"]}])
    for s in data["scenarios"]:
        s["dims"] = {"width": 16}
    recipe = parse_recipe(data, "x.yaml", tmp_path)
    assert recipe.scenarios[1].bindings() == {"batch": 8, "seq": 1, "width": 16}


@pytest.mark.parametrize(
    ("dtype", "rng", "words"),
    [
        ("int64", [0.2, 0.8], "no integer"),
        ("int32", [0, 1e10], "int32"),
        ("int64", [0, 1e30], "int64"),
        ("float16", [0, 1e6], "float16"),
    ],
)
def test_input_range_fits_its_dtype(tmp_path: Path, dtype: str, rng: list[float], words: str) -> None:
    data = mlp_recipe(inputs=[{"name": "x", "dtype": dtype, "shape": ["batch", 16], "range": rng}])
    refused(data, tmp_path, "inputs[0].range", words)


def test_integer_range_draws_the_integers_inside(tmp_path: Path) -> None:
    from optimizer.runtime.inputs import build_feeds

    data = mlp_recipe(inputs=[{"name": "x", "dtype": "int64", "shape": ["batch", 64], "range": [-0.5, 1.5]}])
    feeds = build_feeds(parse_recipe(data, "x.yaml", tmp_path), 2)
    values = np.concatenate([f["x"].ravel() for sf in feeds for f in sf.samples])
    assert set(values.tolist()) == {0, 1}


@pytest.mark.parametrize("where", ["recipe", "hf_config"])
def test_negative_seed_refused(tmp_path: Path, where: str) -> None:
    if where == "recipe":
        refused(mlp_recipe(seed=-1), tmp_path, "seed")
    else:
        model = {"source": "hf_config", "architecture": "bert", "seed": -1}
        refused(mlp_recipe(model=model), tmp_path, "model.seed")


def test_two_inputs_with_one_name_refused(tmp_path: Path) -> None:
    data = mlp_recipe()
    data["inputs"].append(dict(data["inputs"][0]))
    refused(data, tmp_path, "inputs[1].name", "twice")


def test_accuracy_output_outside_the_outputs_refused(tmp_path: Path) -> None:
    data = mlp_recipe(outputs=["out"])
    data["accuracy"]["output"] = "logits"
    refused(data, tmp_path, "accuracy.output", "'out'")


def _identity_onnx(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_accuracy_output_of_an_onnx_source_checked_at_load(tmp_path: Path) -> None:
    _identity_onnx(tmp_path / "m.onnx")
    data = mlp_recipe(model={"source": "onnx", "path": "m.onnx"}, passes=[])
    data["accuracy"]["output"] = "y"
    parse_recipe(data, "x.yaml", tmp_path)
    data["accuracy"]["output"] = "logits"
    refused(data, tmp_path, "accuracy.output", "'y'")


@pytest.mark.slow
def test_accuracy_output_of_a_torch_model_fails_stage_0(tmp_path: Path) -> None:
    """The outputs of a PyTorch model are known once it runs: stage 0 fails with the field and the outputs, the
    other stages do not run, and the compile exits 2."""
    data = mlp_recipe()
    data["accuracy"]["output"] = "probs"
    path = write_recipe(tmp_path, data)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OPTIMIZER_HISTORY": str(tmp_path / "h.sqlite")}
    env.pop("OPTIMIZER_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "optimizer", "compile", str(path), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "accuracy.output" in proc.stderr and "'probs'" in proc.stderr and "logits" in proc.stderr, proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [s["status"] for s in report["stages"]] == ["failed", "not run", "not run"]


def test_accuracy_output_checked_when_stage_0_is_cached(tmp_path: Path) -> None:
    from optimizer.engine.pipeline import Pipeline

    data = mlp_recipe(passes=[])
    Pipeline(parse_recipe(data, "x.yaml", tmp_path), tmp_path / "run", measure=False).execute()
    data["accuracy"]["output"] = "probs"
    records = Pipeline(parse_recipe(data, "x.yaml", tmp_path), tmp_path / "run", measure=False).execute()
    assert records[0].status == "failed" and "accuracy.output" in (records[0].reason or "")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["inputs"][0].update(shape=["batch", 10**12]), "inputs[0].shape"),
        (lambda d: d["scenarios"][1].update(batch=10**12), "scenarios[1].batch"),
        (lambda d: d.update(batch_sweep={"batches": [1, 10**12], "latency_budget_ms": 5}), "batch_sweep.batches[1]"),
        (lambda d: d.update(inputs=[], text={"sentences": ["a"]}) or d["scenarios"][0].update(seq=10**12),
         "scenarios[0].seq"),
    ],
)
def test_sizes_no_machine_holds_refused(tmp_path: Path, change: Any, field: str) -> None:
    data = copy.deepcopy(mlp_recipe())
    change(data)
    refused(data, tmp_path, field, "elements")


def test_feeds_that_cannot_be_held_are_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tensor is within the cap, but all the samples together are more than this machine has: refused
    before anything is allocated (the guard fails the test instead of filling the machine's memory)."""
    from optimizer.runtime import inputs

    def allocated(*args: Any) -> Any:
        raise AssertionError("build_feeds allocated inputs it cannot hold")

    monkeypatch.setattr(inputs, "_generate", allocated)
    data = mlp_recipe(inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 2**27]}])
    data["accuracy"]["samples"] = 10**6
    with pytest.raises(InputError, match="available"):
        inputs.build_feeds(parse_recipe(data, "x.yaml", tmp_path), 10**6)


@pytest.mark.slow
def test_sweep_skips_a_batch_that_cannot_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.engine import sweep as sweep_module
    from optimizer.engine.pipeline import Pipeline
    from optimizer.report.build import write_report

    real = sweep_module.build_feeds

    def guarded(recipe: Any, *args: Any, **kwargs: Any) -> Any:  # fail the test, not the machine's memory
        assert all(s.batch < 2**20 for s in recipe.scenarios), "the sweep allocated a batch over its budget"
        return real(recipe, *args, **kwargs)

    monkeypatch.setattr(sweep_module, "build_feeds", guarded)

    sweep = {"batches": [1, 2, 2**26], "latency_budget_ms": 1000, "memory_budget_mb": 64}
    data = mlp_recipe(benchmark=FEW_ROUNDS, batch_sweep=sweep, passes=[{"type": "export"}])
    recipe = parse_recipe(data, "x.yaml", tmp_path)
    report = write_report(recipe, Pipeline(recipe, tmp_path / "run").execute(), tmp_path / "run", 0.0)
    assert report.batch_sweep is not None
    assert [r.batch for r in report.batch_sweep.rows] == [1, 2]
    skipped = report.batch_sweep.skipped or []
    assert [s.batch for s in skipped] == [2**26] and "memory" in skipped[0].reason
    assert report.batch_sweep.max_batch == 2


# ---------------------------------------------------------------- class 8: strict JSON
def test_writer_turns_non_finite_floats_into_null(tmp_path: Path) -> None:
    from optimizer.core.jsonio import strict_json_dumps
    from optimizer.engine.rundir import write_json

    data = {"a": math.inf, "b": [math.nan, 1.5], "c": np.float32("inf"), "d": (np.float64(-math.inf),), "e": 2}
    write_json(tmp_path / "x.json", data)
    assert strict_load((tmp_path / "x.json").read_text()) == {"a": None, "b": [None, 1.5], "c": None, "d": [None],
                                                              "e": 2}
    assert strict_json_dumps(np.array([1.0, math.nan])) == "[1.0, null]"


@pytest.fixture(scope="module")
def few_rounds_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with too few calls to bound its medians: report.json and metrics.json held Infinity."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.report.build import write_report

    tmp = tmp_path_factory.mktemp("few")
    recipe = parse_recipe(mlp_recipe(benchmark=FEW_ROUNDS), "x.yaml", tmp)
    write_report(recipe, Pipeline(recipe, tmp / "run").execute(), tmp / "run", 0.0)
    return tmp / "run"


@pytest.mark.slow
def test_run_folder_json_is_strict_and_reads_back(few_rounds_run: Path) -> None:
    from optimizer.report.schema import read_report

    files = sorted(few_rounds_run.rglob("*.json"))
    assert any(p.name == "metrics.json" for p in files)
    for path in files:
        strict_load(path.read_text())
    report = read_report(few_rounds_run / "report.json")
    entry = report.stages[0].scenario("b1")
    assert entry is not None and entry.median_ci_halfwidth is None


@pytest.mark.slow
def test_nulls_keep_the_cache(few_rounds_run: Path) -> None:
    """metrics.json read back with null where it was measured as inf still matches its checksum: served from the
    cache, not measured again."""
    from optimizer.engine.pipeline import Pipeline

    recipe = parse_recipe(mlp_recipe(benchmark=FEW_ROUNDS), "x.yaml", few_rounds_run.parent)
    records = Pipeline(recipe, few_rounds_run).execute()
    assert [r.cache_note for r in records] == [None, None, None]
    assert all(r.status == "cached" for r in records[1:]), [r.status for r in records]


@pytest.mark.slow
def test_manifest_is_strict(few_rounds_run: Path, tmp_path: Path) -> None:
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.manifest import MANIFEST
    from optimizer.report.schema import read_report

    report = read_report(few_rounds_run / "report.json")
    report.stages[2].metrics.accuracy["logits"].max_abs = math.inf  # type: ignore[union-attr]
    bundle = export_bundle(report, "ort_session", "onnx", tmp_path / "bundle")
    strict_load((bundle / MANIFEST).read_text())


def _zero_latencies(run: Path, tmp_path: Path) -> Path:
    data = json.loads((run / "report.json").read_text())
    for stage in data["stages"]:
        for entry in ((stage.get("metrics") or {}).get("scenarios") or {}).values():
            for key in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "min_ms"):
                entry["latency"][key] = 0.0
            entry["throughput"]["samples_per_s"] = 0.0
            entry.pop("samples_ms", None)
            if entry.get("vs_parent"):
                entry["vs_parent"].update(ratio=0.0, low=0.0, high=0.0)
        stage["vs_source"] = {k: 0.0 for k in stage.get("vs_source") or {}}
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow
def test_diff_and_select_of_zero_latencies_are_one_line(few_rounds_run: Path, tmp_path: Path) -> None:
    from optimizer.report.diff import diff_reports
    from optimizer.report.schema import read_report
    from optimizer.report.select import PRESETS, recommend

    zero = read_report(_zero_latencies(few_rounds_run, tmp_path))
    good = read_report(few_rounds_run / "report.json")
    for fn in (lambda: diff_reports(good, zero), lambda: diff_reports(zero, good),
               lambda: recommend(zero, PRESETS["seed-latency"])):
        with pytest.raises(OptimizerError, match="not a measured time"):
            fn()
    data = json.loads((few_rounds_run / "report.json").read_text())
    data["stages"][2]["metrics"]["scenarios"]["b8"]["latency"]["p50_ms"] = 0.0
    (tmp_path / "one.json").write_text(json.dumps(data))
    with pytest.raises(OptimizerError, match="'ort_session', scenario 'b8': latency.p50_ms is 0.0"):
        diff_reports(good, read_report(tmp_path / "one.json"))


def test_select_refuses_non_finite_weights() -> None:
    from optimizer.report.select import parse_weights

    with pytest.raises(ValueError, match="finite"):
        parse_weights("latency=inf")


def test_openvino_manifest_reads_without_serializer_warnings(tmp_path: Path) -> None:
    """An OpenVINO bundle's runtime is read back as OvRuntime and dumped as one: the discriminator sees the model
    instance at dump time, and taking it for ONNX Runtime printed pydantic's serializer warning on every verify
    and bench of an OpenVINO bundle."""
    import hashlib
    import warnings

    from optimizer.deploy.manifest import MANIFEST, read_manifest

    (tmp_path / "model.xml").write_text("<net/>")
    digest = hashlib.sha256(b"<net/>").hexdigest()
    (tmp_path / MANIFEST).write_text(json.dumps({
        "format": "openvino", "files": {"model.xml": digest}, "model": "model.xml",
        "tolerance": {"min_cosine": 0.99, "max_abs_relative": 0.01},
        "runtime": {"openvino": {}, "device": "CPU", "threads": 2},
    }))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manifest = read_manifest(tmp_path)
    assert manifest["runtime"]["openvino"] == {} and manifest["runtime"]["threads"] == 2
