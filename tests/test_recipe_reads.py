"""A stage's cache key holds what its pass reads of the recipe (issue 50, item 1): each pass declares the recipe
fields it reads (Pass.reads / recipe_reads), the key holds their values, and a pass that reads a field it did not
declare fails (optimizer.recipe.reads.RecipeView) instead of being served a stage built under another value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult
from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.recipe.reads import KEYED, RecipeView, UndeclaredRead, key_part, require, restricted


def _compile(folder: Path, out: Path, data: dict[str, Any]) -> list[Any]:
    recipe = load_recipe(write_recipe(folder, data))
    return Pipeline(recipe, out, measure=False).execute()


def test_editing_accuracy_min_rebuilds_the_hybrid_stage(tmp_path: Path) -> None:
    """The hybrid search takes its budget from accuracy.min: a stage chosen under 0.9 is not the one for 0.9999."""
    passes = [{"type": "export"}, {"type": "quantize", "name": "hybrid", "config": {"mode": "hybrid"}}]
    out = tmp_path / "out"
    first = _compile(tmp_path, out, mlp_recipe(passes=passes, accuracy={"metric": "cosine", "min": 0.9, "samples": 2}))
    assert first[2].status == "ran" and first[2].notes["budget_cosine"] == 0.9
    again = _compile(tmp_path, out, mlp_recipe(passes=passes,
                                                accuracy={"metric": "cosine", "min": 0.9999, "samples": 2}))
    assert again[2].status == "ran", "the stage chosen under accuracy.min 0.9 was reused for 0.9999"
    assert again[2].notes["budget_cosine"] == 0.9999


# ------------------------------------------------------------------ the mechanism

CALLS: list[Any] = []


class ProbeConfig(PassConfig):
    field: str = "accuracy.min"
    declare: bool = True


class ProbePass(Pass[ProbeConfig]):
    """Reads one recipe field (declared or not) and passes its input on; CALLS records each run and the value."""

    name = "reads_probe"
    summary = "test pass"
    Config = ProbeConfig

    def recipe_reads(self, recipe: Any) -> tuple[str, ...]:
        return (self.config.field,) if self.config.declare else ()

    def run(self, artifact: Any, ctx: PassContext) -> PassResult:
        value: Any = ctx.recipe
        for name in self.config.field.split("."):
            value = getattr(value, name)
        CALLS.append(value)
        return PassResult(artifact, modified=False, notes={"read": value})


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    from optimizer.core import registry

    monkeypatch.setitem(registry.PASSES, "reads_probe", "test_recipe_reads:ProbePass")
    CALLS.clear()
    return CALLS


def _probe_recipe(config: dict[str, Any], min_: float = 0.9) -> dict[str, Any]:
    return mlp_recipe(passes=[{"type": "export"}, {"type": "reads_probe", "config": config}],
                      accuracy={"metric": "cosine", "min": min_, "samples": 2})


def test_a_declared_field_is_in_the_stage_key(tmp_path: Path, probe: list[Any]) -> None:
    out = tmp_path / "out"
    _compile(tmp_path, out, _probe_recipe({}))
    _compile(tmp_path, out, _probe_recipe({}))  # nothing changed: the stage is reused
    assert probe == [0.9]
    _compile(tmp_path, out, _probe_recipe({}, min_=0.95))  # the field it read changed: built again
    assert probe == [0.9, 0.95]


def test_a_pass_cannot_read_a_field_it_does_not_declare(tmp_path: Path, probe: list[Any]) -> None:
    recipe = load_recipe(write_recipe(tmp_path, _probe_recipe({"declare": False})))
    with pytest.raises(UndeclaredRead, match="'accuracy.min'.*does not declare"):
        Pipeline(recipe, tmp_path / "out", measure=False, debug=True).execute()
    # not under --debug: the stage fails with the reason, the run goes on
    records = Pipeline(recipe, tmp_path / "out2", measure=False, debug=False).execute()
    assert records[2].status == "failed" and "does not declare" in (records[2].reason or "")
    assert probe == []


def test_fields_every_key_holds_need_no_declaration(tmp_path: Path, probe: list[Any]) -> None:
    for field in ("target.device", "scenarios", "seed", "workload"):
        _compile(tmp_path, tmp_path / field, _probe_recipe({"field": field, "declare": False}))
    assert probe[0] == "cpu" and probe[2:] == [0, "forward"]


def _recipe(tmp_path: Path, **overrides: Any) -> Any:
    return load_recipe(write_recipe(tmp_path, mlp_recipe(**overrides)))


def test_the_view_answers_declared_fields_sections_and_nothing_else(tmp_path: Path) -> None:
    import pickle

    recipe = _recipe(tmp_path)
    view = restricted(recipe, ("accuracy.min",))
    assert view.accuracy.min == 0.99 and view.accuracy.samples == 2  # samples: KEYED (the feeds)
    assert isinstance(view.accuracy, RecipeView) and view.model is recipe.model  # a KEYED section as it is
    assert view.target.device == "cpu" and view.target.threads == 1  # threads: for sessions, never keyed
    assert view.resolve("x.npz") == recipe.resolve("x.npz")  # base_dir is KEYED
    for read in (lambda: view.accuracy.metric, lambda: view.benchmark, lambda: view.passes,
                 lambda: view.model_dump(), lambda: view.model_copy()):
        with pytest.raises(UndeclaredRead):
            read()
    assert getattr(view.accuracy, "no_such_field", None) is None  # getattr with a default still works
    with pytest.raises(AttributeError):
        view.accuracy = None  # type: ignore[misc]
    copy = pickle.loads(pickle.dumps(view))  # ctx.map's workers get the same view
    assert copy.accuracy.min == 0.99
    with pytest.raises(UndeclaredRead):
        _ = copy.benchmark
    assert restricted(recipe, ("target",)).target is recipe.target  # a whole section declared


def test_timing_needs_its_settings_declared(tmp_path: Path) -> None:
    """ctx.time reads benchmark and target.threads: a pass that times must declare them (its choice holds for
    them); target.threads alone is readable by any pass, for the sessions it opens, but does not count."""
    recipe = _recipe(tmp_path)
    with pytest.raises(UndeclaredRead, match="ctx.time.*target.threads, benchmark"):
        require(restricted(recipe, ()), ("target.threads", "benchmark"), "ctx.time")
    require(restricted(recipe, ("target", "benchmark")), ("target.threads", "benchmark"), "ctx.time")
    require(recipe, ("benchmark",), "ctx.time")  # an unrestricted recipe (tests' own contexts): no check


def test_key_part_holds_declared_values_and_leaves_keyed_ones_to_the_key(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)
    assert key_part(recipe, ()) == {}
    assert key_part(recipe, ("accuracy.min", "target.device")) == {"accuracy.min": 0.99}
    assert "target.device" in KEYED


def test_keys_of_passes_that_read_nothing_new_are_as_before(tmp_path: Path) -> None:
    """Caches stay valid: a pass that declares nothing adds nothing to its key; fuse's kernel choice keys on
    the same {"target", "benchmark"} sections its old key_extras (timing_key) gave."""
    from optimizer.core.registry import PASSES, pass_class

    recipe = _recipe(tmp_path)
    keyed = restricted(recipe, ())
    reading = {}
    for name in PASSES:
        cls = pass_class(name)
        try:
            instance = cls(cls.Config())
        except Exception:  # a pass whose config has required fields (substitute's path)
            continue
        reading[name] = instance.recipe_reads(keyed)
    assert len(reading) >= 10 and not any(reading.values()), reading
    from passes.fuse import FuseConfig, FusePass

    measured = FusePass(FuseConfig(measure=["skip_layernorm"])).recipe_reads(keyed)
    assert key_part(recipe, measured) == {"target": recipe.target.model_dump(mode="json"),
                                          "benchmark": recipe.benchmark.model_dump(mode="json")}


def test_hybrid_and_nncf_declare_the_budget(tmp_path: Path) -> None:
    from passes.nncf_int8 import NncfInt8Config, NncfInt8Pass
    from passes.quantize.config import QuantizeConfig
    from passes.quantize.quantize_pass import QuantizePass

    keyed = restricted(_recipe(tmp_path), ())
    hybrid = QuantizePass(QuantizeConfig(mode="hybrid")).recipe_reads(keyed)
    assert {"accuracy.min", "accuracy.metric", "accuracy.output", "target", "benchmark"} == set(hybrid)
    fixed = QuantizePass(QuantizeConfig(mode="hybrid", hybrid={"min_cosine": 0.98})).recipe_reads(keyed)
    assert "accuracy.min" not in fixed
    assert QuantizePass(QuantizeConfig(mode="int8_dynamic")).recipe_reads(keyed) == ()
    assert set(NncfInt8Pass(NncfInt8Config(accuracy_control=True)).recipe_reads(keyed)) == {
        "accuracy.min", "accuracy.metric"}
