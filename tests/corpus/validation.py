"""Adversarial cases of issue 28 (validation); see tests/corpus/adversarial.py.

R3.5: a recipe that validates must not go wrong at compile: what load can know it refuses (RecipeError naming the
field), what only run time knows fails the one part it concerns with the reason (stage 0, a sweep batch).
R3.8: every JSON file is strict (no Infinity/NaN), and diff/select of impossible timings are one line.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimizer.core.errors import InputError, OptimizerError

from .adversarial import Shared, _refused

KIND5 = "R3.5 recipes that validate, then fail"
KIND8 = "R3.8 numbers other tools cannot read"
FEW_ROUNDS = {"warmup": 1, "rounds": 2, "iterations": 1, "memory": "inline", "settle_ms": 0, "instances": 1,
              "denormal_probe": False}

Change = Callable[[dict[str, Any]], None]


def _input(**fields: Any) -> Change:
    return lambda d: d["inputs"][0].update(fields)


LOAD_CASES: dict[str, Change] = {
    "scenario dims batch 0": lambda d: d["scenarios"][0].update(dims={"batch": 0}),
    "scenario dims batch -3": lambda d: d["scenarios"][0].update(dims={"batch": -3}),
    "scenario dims seq 0": lambda d: d["scenarios"][0].update(dims={"seq": 0}),
    "scenario dims other -1": lambda d: d["scenarios"][0].update(dims={"heads": -1}),
    "int64 range [0.2, 0.8]": _input(dtype="int64", range=[0.2, 0.8]),
    "int32 range past int32": _input(dtype="int32", range=[0, 1e10]),
    "float16 range past float16": _input(dtype="float16", range=[0, 1e6]),
    "seed -1": lambda d: d.update(seed=-1),
    "hf_config seed -1": lambda d: d.update(model={"source": "hf_config", "architecture": "bert", "seed": -1}),
    "two inputs, one name": lambda d: d["inputs"].append(copy.deepcopy(d["inputs"][0])),
    "accuracy.output not in outputs": lambda d: (d.update(outputs=["out"]), d["accuracy"].update(output="x")),
    "benchmark.settle_ms inf": lambda d: d["benchmark"].update(settle_ms=math.inf),
    "input shape [batch, 10**12]": _input(shape=["batch", 10**12]),
    "scenario batch 10**12": lambda d: d["scenarios"][0].update(batch=10**12),
    "sweep batch 10**12": lambda d: d.update(batch_sweep={"batches": [1, 10**12], "latency_budget_ms": 5}),
}


def _parse(data: dict[str, Any], work: Path) -> Callable[[], Any]:
    from optimizer.recipe.loading import parse_recipe

    return lambda: parse_recipe(data, "adversarial.yaml", work)


def _onnx_output_case(r: Shared) -> bool | str:
    model = r.work / "m.onnx"
    shutil.copy(r.run / "01-export" / "model.onnx", model)
    data = copy.deepcopy(r.base)
    data.update(model={"source": "onnx", "path": str(model)}, passes=[])
    data["accuracy"]["output"] = "not-an-output"
    return _refused(_parse(data, r.work))


def _torch_output_case(r: Shared) -> bool | str:
    """A PyTorch model's outputs are known once it runs: stage 0 fails, as a usage error (exit 2), naming them."""
    from optimizer.engine.pipeline import Pipeline

    data = copy.deepcopy(r.base)
    data["accuracy"]["output"] = "not-an-output"
    records = Pipeline(_parse(data, r.work)(), r.work / "torch-output", measure=False).execute()
    first = records[0]
    if first.status != "failed" or first.error_kind != "input":
        return f"stage 0 {first.status}: {first.reason}"
    return True if "accuracy.output" in (first.reason or "") and all(x.status == "not run" for x in records[1:]) \
        else f"stages {[(x.status, x.reason) for x in records]}"


def _feeds_case(r: Shared) -> bool | str:
    """Inputs within the cap one by one, more than the machine has all together: one InputError, nothing
    allocated (the guard stops an allocation instead of filling the memory)."""
    from optimizer.runtime import inputs

    data = copy.deepcopy(r.base)
    data["inputs"][0]["shape"] = ["batch", 2**27]
    recipe = _parse(data, r.work)()
    real = inputs._generate

    def allocated(*args: Any) -> Any:
        raise AssertionError("build_feeds allocated inputs it cannot hold")

    inputs._generate = allocated  # type: ignore[assignment]
    try:
        return _refused(lambda: inputs.build_feeds(recipe, 10**6), InputError)
    finally:
        inputs._generate = real  # type: ignore[assignment]


def _sweep_run(r: Shared) -> Path:
    """A run with too few calls to bound its medians (Infinity in report.json and metrics.json before) and a
    sweep whose largest batch cannot fit its memory budget."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.report.build import write_report

    data = copy.deepcopy(r.base)
    data.update(benchmark=FEW_ROUNDS, passes=[{"type": "export"}],
                batch_sweep={"batches": [1, 2, 2**26], "latency_budget_ms": 1000, "memory_budget_mb": 64})
    recipe = _parse(data, r.work)()
    out = r.work / "few-rounds"
    write_report(recipe, Pipeline(recipe, out).execute(), out, 0.0)
    return out


def _sweep_case(run: Path) -> bool | str:
    sweep = json.loads((run / "report.json").read_text()).get("batch_sweep") or {}
    rows, skipped = [x["batch"] for x in sweep.get("rows", [])], sweep.get("skipped") or []
    if rows != [1, 2] or [s["batch"] for s in skipped] != [2**26]:
        return f"rows {rows}, skipped {skipped}"
    return True


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _all_strict(folder: Path) -> bool | str:
    files = sorted(folder.rglob("*.json"))
    for path in files:
        try:
            _strict(path.read_text())
        except ValueError as e:
            return f"{path.relative_to(folder)}: {e}"
    return True if files else "no JSON files"


def _zeroed(run: Path, out: Path) -> Path:
    data = json.loads((run / "report.json").read_text())
    for stage in data["stages"]:
        for entry in ((stage.get("metrics") or {}).get("scenarios") or {}).values():
            entry["latency"].update(p50_ms=0.0, mean_ms=0.0)
            entry["throughput"]["samples_per_s"] = 0.0
            entry.pop("samples_ms", None)
        stage["vs_source"] = {}
        stage["throughput_vs_source"] = {}
    out.write_text(json.dumps(data))
    return out


def _json_cases(r: Shared, run: Path) -> None:
    from optimizer.engine.rundir import write_json
    from optimizer.report.diff import diff_reports
    from optimizer.report.schema import read_report
    from optimizer.report.select import PRESETS, parse_weights, recommend

    def writer() -> bool | str:
        path = r.work / "inf.json"
        write_json(path, {"a": math.inf, "b": [math.nan], "c": -math.inf})
        return True if _strict(path.read_text()) == {"a": None, "b": [None], "c": None} else path.read_text()

    r.out.add(KIND8, "write_json of inf and NaN", writer)
    r.out.add(KIND8, "run folder of a few-rounds compile", lambda: _all_strict(run))
    r.out.add(KIND8, "report.json with nulls reads back", lambda: read_report(run / "report.json") is not None)
    r.out.add(KIND8, "bundle manifest.json", lambda: _all_strict(r.bundle))
    good = read_report(run / "report.json")
    zero = r.work / "zero.json"

    def refuses(fn: Callable[[], Any]) -> Callable[[], bool | str]:
        return lambda: _refused(fn, OptimizerError)

    r.out.add(KIND8, "diff with zero latencies (B)",
              refuses(lambda: diff_reports(good, read_report(_zeroed(run, zero)))))
    r.out.add(KIND8, "diff with zero latencies (A)",
              refuses(lambda: diff_reports(read_report(_zeroed(run, zero)), good)))
    r.out.add(KIND8, "select with zero latencies",
              refuses(lambda: recommend(read_report(_zeroed(run, zero)), PRESETS["seed-latency"])))
    r.out.add(KIND8, "select weight inf", lambda: _refused(lambda: parse_weights("latency=inf"), ValueError))


def add_cases(r: Shared) -> None:
    r.work.mkdir(parents=True, exist_ok=True)
    for label, change in LOAD_CASES.items():
        data = copy.deepcopy(r.base)
        change(data)
        r.out.add(KIND5, label, lambda d=data: _refused(_parse(d, r.work)))
    r.out.add(KIND5, "accuracy.output of an ONNX source", lambda: _onnx_output_case(r))
    r.out.add(KIND5, "accuracy.output of a PyTorch model", lambda: _torch_output_case(r))
    r.out.add(KIND5, "inputs more than the machine holds", lambda: _feeds_case(r))
    runs: list[Path] = []

    def sweep() -> bool | str:
        runs.append(_sweep_run(r))
        return _sweep_case(runs[0])

    r.out.add(KIND5, "sweep batch over the memory budget", sweep)
    if runs:
        _json_cases(r, runs[0])
    else:
        r.out.add(KIND8, "a few-rounds compile", lambda: "the compile the JSON cases read failed")
