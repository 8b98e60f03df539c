"""Property-based checks (hypothesis) of the classes of bad input: any name, any number, any manifest. Each
property says what must hold for every value: a clear refusal (RecipeError, a listed problem) or a value that is
safe to use; never a raw exception, never a path outside the folder the user named."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optimizer.core.errors import RecipeError
from optimizer.deploy import manifest as bundle_manifest
from optimizer.deploy.verify import verify_bundle
from optimizer.engine.rundir import RunDir
from optimizer.recipe.loading import parse_recipe
from optimizer.recipe.schema import SAFE_NAME

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Tally:
    """What a property did with its generated inputs: a property that refuses every input checks nothing but the
    refusal, so each test asserts that a share of its inputs got through to the checks (and that some were refused,
    so the refusal is exercised too)."""

    def __init__(self) -> None:
        self.counts = {"checked": 0, "refused": 0}

    def __call__(self, outcome: str) -> None:
        self.counts[outcome] += 1

    def assert_shares(self, checked: float, refused: float = 0.0) -> None:
        n = sum(self.counts.values())
        assert n >= 100, self.counts
        assert self.counts["checked"] >= checked * n, f"too few inputs reached the checks: {self.counts}"
        assert self.counts["refused"] >= refused * n, f"too few inputs were refused: {self.counts}"
# Names a user (or an attacker) might type: paths, dots, separators, control characters, long strings.
NAMES = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["..", ".", "/", "a/../../b", "/etc/passwd", "a\x00b", "x" * 65, "a|b", "-a", ".hidden", "ok"]),
    st.from_regex(SAFE_NAME, fullmatch=True),
)


def _parse(data: dict[str, Any]) -> Any:
    return parse_recipe(data, "r.yaml", Path("."))


@pytest.mark.slow
def test_any_name_is_refused_or_stays_inside_the_run_folder(tmp_path: Path) -> None:
    tally = Tally()
    name_is_refused_or_stays_inside(tmp_path=tmp_path, tally=tally)
    tally.assert_shares(checked=0.2, refused=0.2)


@SETTINGS
@given(name=NAMES, where=st.sampled_from(["recipe", "stage", "scenario"]))
def name_is_refused_or_stays_inside(name: str, where: str, tmp_path: Path, tally: Tally) -> None:
    data = mlp_recipe()
    if where == "recipe":
        data["name"] = name
    elif where == "stage":
        data["passes"] = [{"type": "export", "name": name}]
    else:
        data["scenarios"] = [{"name": name, "batch": 1}]
    try:
        recipe = _parse(data)
    except RecipeError:
        tally("refused")
        return
    tally("checked")
    assert SAFE_NAME.fullmatch(name)
    root = tmp_path / "run"
    for i, spec in enumerate(recipe.passes, start=1):
        folder = RunDir(root).stage_dir(i, spec.stage_name)
        assert folder.resolve().parent == root.resolve()


FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10))


def test_any_accuracy_budget_is_refused_or_finite() -> None:
    tally = Tally()
    budget_is_refused_or_finite(tally=tally)
    tally.assert_shares(checked=0.2, refused=0.01)  # refused: NaN, inf (a few percent of the floats drawn)


@SETTINGS
@given(low=FLOATS, high=FLOATS)
def budget_is_refused_or_finite(low: float, high: float, tally: Tally) -> None:
    data = mlp_recipe(accuracy={"metric": "cosine", "min": low, "max": high, "samples": 2})
    try:
        recipe = _parse(data)
    except RecipeError:
        tally("refused")
        return
    tally("checked")
    for value in (recipe.accuracy.min, recipe.accuracy.max):
        assert value is None or math.isfinite(value)


def test_any_sizes_are_refused_or_usable() -> None:
    tally = Tally()
    sizes_are_refused_or_usable(tally=tally)
    tally.assert_shares(checked=0.15, refused=0.2)


# field: (a valid value, any value). With every field drawn from "any", an input is almost never valid as a whole
# (4 of 300 were), so the property would check little but refusals. So a draw k picks the mix: k < 6 breaks field k
# alone, 6-8 draw every field from "any" (several broken at once), 9-11 keep every field valid.
SIZE_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "batch": (st.integers(1, 5), st.integers(-5, 5)),
    "dim": (st.integers(1, 5), st.integers(-5, 5)),
    "rounds": (st.integers(1, 3), st.integers(-3, 3)),
    "batches": (st.lists(st.integers(1, 8), min_size=1, max_size=4), st.lists(st.integers(-3, 8), max_size=4)),
    "low": (st.floats(-10, 0), FLOATS),
    "high": (st.floats(0.5, 10), FLOATS),
}


def _sizes(k: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        name: anything if k == i or 6 <= k <= 8 else valid
        for i, (name, (valid, anything)) in enumerate(SIZE_FIELDS.items())
    })


@SETTINGS
@given(fields=st.integers(0, 11).flatmap(_sizes))
def sizes_are_refused_or_usable(fields: dict[str, Any], tally: Tally) -> None:
    batch, dim, rounds, batches, low, high = (fields[k] for k in SIZE_FIELDS)
    data = mlp_recipe(
        inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", dim], "range": [low, high]}],
        scenarios=[{"name": "s", "batch": batch}],
        benchmark={"rounds": rounds},
        batch_sweep={"batches": batches, "latency_budget_ms": 10},
    )
    try:
        recipe = _parse(data)
    except RecipeError:
        tally("refused")
        return
    tally("checked")
    assert recipe.scenarios[0].batch >= 1 and dim >= 0 and recipe.benchmark.rounds >= 1
    assert recipe.batch_sweep is not None and batches and min(batches) >= 1
    lo, hi = recipe.inputs[0].range or (0.0, 1.0)
    assert math.isfinite(lo) and math.isfinite(hi) and lo < hi


FILE_NAMES = st.one_of(
    st.text(min_size=1, max_size=40),
    st.sampled_from(["../outside.txt", "/etc/hostname", "a/../../outside.txt", "model.onnx", "sub/x", "./model.onnx",
                     "a\x00b", ".", ""]),
)
# Manifests of the right shape, so that verify gets past reading them to the files they list (which is where it
# could read outside the bundle): without these, every generated manifest was refused before any file was hashed.
SHAPED = st.fixed_dictionaries({
    "format": st.sampled_from(["onnx", "triton", "tensorrt"]),
    "files": st.tuples(st.booleans(), st.dictionaries(FILE_NAMES, st.text(max_size=64), max_size=2)).map(
        lambda t: {"model.onnx": "0" * 64, **t[1]} if t[0] else t[1]),
    "model": st.one_of(st.just("model.onnx"), FILE_NAMES),
    "tolerance": st.fixed_dictionaries({"min_cosine": st.floats(-1, 1), "max_abs_relative": st.floats(0, 1)}),
    "runtime": st.just({"onnxruntime_session": {}, "threads": 1}),
})
ANY_MANIFEST = st.one_of(
    st.fixed_dictionaries({
        "format": st.sampled_from(["onnx", "tensorrt", "triton", 3, None]),
        "files": st.dictionaries(FILE_NAMES, st.one_of(st.text(max_size=64), st.integers())),
        "model": st.one_of(FILE_NAMES, st.none(), st.integers()),
        "tolerance": st.one_of(st.floats(), st.text()),
    }),
    st.lists(st.integers(), max_size=3),
    st.text(max_size=20),
    st.dictionaries(st.text(max_size=10), st.integers(), max_size=3),
)
MANIFESTS = st.integers(0, 1).flatmap(lambda k: SHAPED if k else ANY_MANIFEST)  # half of them shaped


@pytest.mark.slow
def test_verify_never_reads_outside_and_never_blows_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tally = Tally()
    verify_never_reads_outside(tmp_path=tmp_path, monkeypatch=monkeypatch, tally=tally)
    tally.assert_shares(checked=0.1)  # "checked": the manifest got as far as hashing the files it lists


@SETTINGS
@given(manifest=MANIFESTS)
def verify_never_reads_outside(manifest: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally: Tally) -> None:
    root = tmp_path / "bundle"
    root.mkdir(exist_ok=True)
    for p in root.iterdir():
        p.unlink()
    (tmp_path / "outside.txt").write_text("not yours")
    (root / "model.onnx").write_bytes(b"not a model")
    (root / bundle_manifest.MANIFEST).write_text(json.dumps(manifest))
    read: list[Path] = []
    real = bundle_manifest.file_sha256

    def recording(path: Path, *a: Any) -> str:
        read.append(Path(path).resolve())
        return real(path, *a)

    monkeypatch.setattr(bundle_manifest, "file_sha256", recording)  # what verify hashes with
    problems = verify_bundle(root)  # a list of problems, never an exception
    assert isinstance(problems, list) and problems, "a made-up manifest must not verify"
    assert all(p.is_relative_to(root.resolve()) for p in read), read
    tally("checked" if read else "refused")


# ---------------------------------------------------------------- any report.json: read, or one line
REPORT_V1 = json.loads((Path(__file__).parent / "data" / "report_v1_minilm.json").read_text())
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=12,
)


def _places(x: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path inside a JSON value (the value itself included)."""
    inner = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else []
    return [at, *(p for k, v in inner for p in _places(v, (*at, k)))]


PLACES = _places(REPORT_V1)


@pytest.mark.slow
def test_any_damage_to_a_report_reads_or_is_one_line() -> None:
    """One value anywhere in a real report replaced by any JSON: the reader gives a RunReport or one
    OptimizerError naming the file; never another exception."""
    tally = Tally()
    damage_reads_or_is_one_line(tally=tally)
    tally.assert_shares(checked=0.1, refused=0.1)


@SETTINGS
@given(place=st.sampled_from(PLACES), value=JSON, version=st.sampled_from([1, 2, 3]))
def damage_reads_or_is_one_line(place: tuple[Any, ...], value: Any, version: int, tally: Tally) -> None:
    from optimizer.core.errors import OptimizerError
    from optimizer.report.schema import RunReport, parse_report

    data: Any = json.loads(json.dumps({**REPORT_V1, "schema_version": version}))
    if place:
        parent = data
        for key in place[:-1]:
            parent = parent[key]
        parent[place[-1]] = value
    else:
        data = value
    try:
        report = parse_report(data, "damaged/report.json")
    except OptimizerError as e:
        assert str(e).startswith("damaged/report.json: ") and "\n" not in str(e)
        tally("refused")
        return
    assert isinstance(report, RunReport)
    tally("checked")
