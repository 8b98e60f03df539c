"""Fused kernels chosen by measurement: a fusion whose kernel is slower on the target than the ops it replaces is
left out, and ONNX Runtime is told not to make it again at load (runtime.disabled_optimizers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from fusion_helpers import float_input, model
from onnx import helper, numpy_helper
from test_fusion_models import BERT_INPUTS, TINY, compile_stages

from optimizer.core.metrics import TimedComparison
from optimizer.measure import services
from optimizer.runtime import onnx_io
from optimizer.runtime.sessions import ort_session
from passes.fuse import RULES_BY_NAME

H = 16


def unfused_graph(rule: str) -> onnx.ModelProto:
    """The pattern ONNX Runtime itself fuses at load into the op `rule` emits."""
    x = [float_input("a", [1, 4, H]), float_input("skip", [1, 4, H])]
    if rule == "skip_layernorm":
        nodes = [
            helper.make_node("Add", ["a", "skip"], ["sum"]),
            helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5),
        ]
        return model(nodes, x, ["y"], {"gamma": np.ones(H, np.float32), "beta": np.zeros(H, np.float32)})
    nodes = [
        helper.make_node("Add", ["a", "bias"], ["biased"]),
        helper.make_node("Gelu", ["biased"], ["y"], domain="com.microsoft"),
    ]
    graph = helper.make_graph(
        nodes,
        "bias_gelu",
        x[:1],
        [float_input("y", [1, 4, H])],
        [numpy_helper.from_array(np.ones(H, np.float32), "bias")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


FUSED_BY_ORT = {"skip_layernorm": "com.microsoft.SkipLayerNormalization", "bias_gelu": "com.microsoft.BiasGelu"}


def optimized_ops(tmp_path: Path, rule: str, runtime: dict[str, Any]) -> set[str]:
    src, out = tmp_path / f"{rule}.onnx", tmp_path / f"{rule}-opt{len(runtime)}.onnx"
    onnx.save(unfused_graph(rule), src)
    ort_session(src, {"graph_optimization_level": "all", **runtime}, 1, optimized_path=str(out))
    return set(onnx_io.op_histogram(out))


@pytest.mark.parametrize("rule", sorted(FUSED_BY_ORT))
def test_each_declared_ort_fusion_name_stops_that_fusion(tmp_path: Path, rule: str) -> None:
    """ORT accepts unknown optimizer names silently, so each name a rule declares is checked to take effect."""
    fused = FUSED_BY_ORT[rule]
    assert fused in optimized_ops(tmp_path, rule, {})  # ORT fuses the pattern itself at level all
    disabled = list(RULES_BY_NAME[rule].ort_fusions)
    assert disabled and fused not in optimized_ops(tmp_path, rule, {"disabled_optimizers": disabled})


def test_every_rule_with_ort_fusions_is_checked_above() -> None:
    assert {name for name, r in RULES_BY_NAME.items() if r.ort_fusions} == set(FUSED_BY_ORT)


def fake_time(slow_rule: str) -> Any:
    """ctx.time where only the graph without `slow_rule` is faster: the rule's kernel is the slow one; without any
    other rule the graph is 1% faster, a tie that keeps the fused graph."""

    def time(self: Any, candidate: Any, reference: Any, ctx: Any, feeds: Any) -> TimedComparison:
        faster = f"without_{slow_rule}" in str(candidate.path)
        ratio = 1.2 if faster else 1.01
        return TimedComparison(ratio=ratio, low=ratio - 0.05, high=ratio + 0.05, verdict="faster" if faster else
                               "within noise", p50_ms=1.0 / ratio, input_p50_ms=1.0, rounds=4, calls=12)

    return time


NODE_MS = {"SkipLayerNormalization": 0.1, "LayerNormalization": 0.02, "Add": 0.01, "BiasGelu": 0.05, "Gelu": 0.045}


def fake_profile(artifact: Any, recipe: Any, feed: Any, runs: int = 10) -> tuple[dict[str, float], int]:
    """ORT's profile as a fixed cost per node: a SkipLayerNormalization costs more than the Add + LayerNormalization
    it replaces; a BiasGelu about what Add + Gelu cost (within the 10% margin)."""
    hist = onnx_io.op_histogram(artifact.path)
    ops: dict[str, float] = {}
    for key, n in hist.items():
        op = key.split(".")[-1]
        ops[op] = ops.get(op, 0.0) + n * NODE_MS.get(op, 0.001)
    return ops, sum(hist.values())


@pytest.mark.slow
def test_a_fusion_measured_slower_is_left_out_and_onnxruntime_told_not_to_make_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from optimizer.runtime.runners import ort_runner

    monkeypatch.setattr(services.MeasureServices, "time", fake_time("skip_layernorm"))
    monkeypatch.setattr(ort_runner, "op_time_breakdown", fake_profile)
    model_src = {"source": "hf_config", "architecture": "bert", "config": TINY}
    stages = compile_stages(
        tmp_path,
        model_src,
        BERT_INPUTS,
        extra_passes=[{"type": "quantize", "name": "int8", "config": {"mode": "int8_dynamic"}}],
        fuse_config={"measure": ["skip_layernorm", "bias_gelu"]},
        ort_session=True,
    )
    fuse = stages["fuse"]
    choice = fuse.notes["kernel_choice"]
    assert choice["skip_layernorm"]["kept"] is False and choice["skip_layernorm"]["fused"] == 4
    assert choice["skip_layernorm"]["ort_fusions_disabled"] == ["SkipLayerNormFusion"]
    assert choice["skip_layernorm"]["kernel_op_types"] == ["Add", "LayerNormalization", "SkipLayerNormalization"]
    assert choice["skip_layernorm"]["kernel_ms_with"] == pytest.approx(4 * 0.1 + 1 * 0.02 + 0.01 * 2, rel=0.5)
    assert choice["bias_gelu"]["kept"] is True and choice["bias_gelu"]["verdict"] == "within noise"
    assert "left out" in fuse.notes["rules"]["skip_layernorm"]["skipped"]
    assert "SkipLayerNormalization" not in fuse.notes["fused_ops"] and fuse.notes["fused_ops"]["BiasGelu"] == 2
    assert fuse.artifact.runtime["disabled_optimizers"] == ["SkipLayerNormFusion"]
    assert not (fuse.artifact.path.parent / "kernel_choice").exists()  # the trial graphs are not left behind
    # The stage's graph as ORT runs it, and every stage built on it, keep the residual Add + LayerNormalization.
    opt = tmp_path / "fuse-as-run.onnx"
    ort_session(fuse.artifact.path, fuse.artifact.runtime, 1, optimized_path=str(opt))
    assert "com.microsoft.SkipLayerNormalization" not in onnx_io.op_histogram(opt)
    assert stages["int8"].artifact.runtime["disabled_optimizers"] == ["SkipLayerNormFusion"]


@pytest.mark.slow
def test_without_measure_the_fuse_stage_is_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timing(*a: Any, **k: Any) -> None:
        raise AssertionError("fuse timed a graph without `measure`")

    monkeypatch.setattr(services.MeasureServices, "time", no_timing)
    bert = {"source": "hf_config", "architecture": "bert", "config": TINY}
    fuse = compile_stages(tmp_path, bert, BERT_INPUTS)["fuse"]
    assert "kernel_choice" not in fuse.notes and "disabled_optimizers" not in fuse.artifact.runtime
    assert fuse.notes["fused_ops"]["SkipLayerNormalization"] == 4


def test_a_fusion_left_out_is_a_finding_of_the_run() -> None:
    from test_report_schema import report_of
    from test_user_findings_measure import _st

    from optimizer.report.findings import findings

    fuse = _st(1, "fuse", "source", None, 9000)
    line = "skip_layernorm: left out; the graph without its 12 fusions ran 1.13x (1.08-1.18) faster"
    fuse["notes"] = {"kernel_choice": {
        "skip_layernorm": {"kept": False, "line": line},
        "bias_gelu": {"kept": True, "line": "bias_gelu: kept; ..."},
    }}
    said = [f for f in findings(report_of([_st(0, "source", None, None, 9000), fuse])) if "left out" in f]
    why = "its kernel measured slower on this target than the ops it replaces"
    assert said == [f"fuse (x): a fusion left out ({why}): {line}"]


def test_triton_config_says_which_fusions_it_cannot_disable() -> None:
    """Triton's onnxruntime backend has no setting for disabled_optimizers: the config says so where it is read."""
    from google.protobuf import text_format
    from test_gpu_injected import _model_config_pb2, _report

    from optimizer.deploy.triton import triton_config

    io = [{"name": "x", "dtype": "float32", "onnx_type": "FLOAT", "shape": ["batch", 4]}]
    runtime = {"graph_optimization_level": "all", "disabled_optimizers": ["SkipLayerNormFusion"]}
    text = triton_config("m", io, io, _report("cpu", 2), runtime)
    assert "# measured with onnxruntime's SkipLayerNormFusion disabled" in text
    text_format.Parse(text, _model_config_pb2().ModelConfig())  # still a valid config
    assert "disabled" not in triton_config("m", io, io, _report("cpu", 2), {"graph_optimization_level": "all"})


@pytest.mark.slow
def test_an_ort_session_stage_can_disable_onnxruntime_fusions(tmp_path: Path) -> None:
    """For graphs the fuse pass does not rewrite (a generation artifact's prefill and decode graphs), the same
    choice is an ort_session stage: ORT's fusion off, timed against its parent like any setting."""
    no_skip = {"type": "ort_session", "name": "no_skip_ln", "from": "ort_session",
               "config": {"disabled_optimizers": ["SkipLayerNormFusion"]}}
    bert = {"source": "hf_config", "architecture": "bert", "config": TINY}
    records = compile_stages(tmp_path, bert, BERT_INPUTS, extra_passes=[no_skip], ort_session=True)
    assert "com.microsoft.SkipLayerNormalization" in records["ort_session"].notes["ort_optimized_graph"]["op_types"]
    stage = records["no_skip_ln"]
    assert stage.artifact.runtime["disabled_optimizers"] == ["SkipLayerNormFusion"]
    assert "com.microsoft.SkipLayerNormalization" not in stage.notes["ort_optimized_graph"]["op_types"]


class FakeCtx:
    def __init__(self, verdict: str, ratio: float) -> None:
        self.timing = TimedComparison(ratio=ratio, low=ratio - 0.1, high=ratio + 0.1, verdict=verdict,
                                      p50_ms=1.0, input_p50_ms=ratio, rounds=4, calls=12)

    def time(self, candidate: Any, reference: Any) -> TimedComparison:
        return self.timing

    def progress(self, what: str, done: int, total: int) -> None:
        pass


@pytest.mark.parametrize(
    ("kernels", "verdict", "ratio", "kept"),
    [
        ((1.0, 0.4), "within noise", 1.01, False),  # the profile decides a whole-graph tie
        ((1.0, 0.4), "slower", 0.9, True),  # ... unless the whole graph is slower without the rule
        ((1.0, 0.95), "faster", 1.2, True),  # kernels within the 10% margin: the fused graph stays
        (None, "within noise", 1.05, False),  # no profile: the point estimate, 2% margin
        (None, "within noise", 1.01, True),
    ],
)
def test_the_rule_of_choice(
    monkeypatch: pytest.MonkeyPatch, kernels: tuple[float, float] | None, verdict: str, ratio: float, kept: bool
) -> None:
    from optimizer.core.artifact import Artifact
    from passes.fuse import kernel_choice

    cost = None if kernels is None else kernel_choice.KernelCost(["Add", "SkipLayerNormalization"], *kernels)
    monkeypatch.setattr(kernel_choice, "kernel_cost", lambda a, b, ctx: cost)
    built = Artifact("onnx", Path("with.onnx"))
    rules = ["layernorm", "skip_layernorm"]
    chosen, choices = kernel_choice.choose_kernels(
        rules, ["skip_layernorm"], {"skip_layernorm": 3}, built, lambda r, name: Artifact("onnx", Path(name)),
        FakeCtx(verdict, ratio),  # type: ignore[arg-type]
    )
    assert choices[0].kept is kept and (chosen is built) is kept
    assert chosen.path == (Path("with.onnx") if kept else Path("without_skip_layernorm"))
    if not kept:
        assert chosen.runtime["disabled_optimizers"] == ["SkipLayerNormFusion"]


class RaisingCtx(FakeCtx):
    def time(self, candidate: Any, reference: Any) -> dict[str, Any]:
        from optimizer.core.errors import OptimizerError

        raise OptimizerError("without.onnx: onnxruntime cannot load it: bad graph")


def test_two_rules_left_out_accumulate_and_a_rule_that_cannot_be_timed_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from optimizer.core.artifact import Artifact
    from passes.fuse import kernel_choice

    cheaper = kernel_choice.KernelCost(["X"], 1.0, 0.5)
    monkeypatch.setattr(kernel_choice, "kernel_cost", lambda a, b, ctx: cheaper)
    rules = ["skip_layernorm", "bias_gelu"]
    fused = {"skip_layernorm": 2, "bias_gelu": 2}

    asked: list[list[str]] = []

    def build(r: list[str], name: str) -> Artifact:
        asked.append(r)
        return Artifact("onnx", Path(name))

    chosen, _ = kernel_choice.choose_kernels(
        rules, rules, fused, Artifact("onnx", Path("w.onnx")), build, FakeCtx("within noise", 1.05)  # type: ignore[arg-type]
    )
    assert asked == [["bias_gelu"], []]  # the second trial starts from the graph the first left
    assert chosen.path == Path("without_bias_gelu")
    assert chosen.runtime["disabled_optimizers"] == ["SkipLayerNormFusion", "BiasGeluFusion"]
    built = Artifact("onnx", Path("w.onnx"))
    chosen, choices = kernel_choice.choose_kernels(
        rules, ["skip_layernorm"], fused, built, build, RaisingCtx("faster", 2.0)  # type: ignore[arg-type]
    )
    assert chosen is built and choices[0].kept
    assert choices[0].note().line == "skip_layernorm: kept; not measured: without.onnx: onnxruntime cannot " \
        "load it: bad graph"


def test_measure_takes_only_rules_whose_onnxruntime_fusion_can_be_stopped() -> None:
    from pydantic import ValidationError

    from passes.fuse import FuseConfig

    with pytest.raises(ValidationError, match="'layernorm' cannot be measured"):
        FuseConfig(measure=["layernorm"])
    with pytest.raises(ValidationError, match="'bias_gelu' is not in rules"):
        FuseConfig(rules=["layernorm", "skip_layernorm"], measure=["bias_gelu"])


def test_timed_choices_are_cached_per_thread_count(tmp_path: Path) -> None:
    """Fuse's kernel choice and the CPU hybrid's ladder are timed: a cached choice holds for its thread count and
    benchmark settings only. Passes that time nothing keep the key as before."""
    from conftest import mlp_recipe, write_recipe

    from optimizer.recipe.loading import load_recipe
    from passes.fuse import FuseConfig, FusePass
    from passes.quantize.config import QuantizeConfig
    from passes.quantize.quantize_pass import QuantizePass

    def recipe(threads: int) -> Any:
        return load_recipe(write_recipe(tmp_path, mlp_recipe(target={"threads": threads})))

    fuse, plain = FusePass(FuseConfig(measure=["skip_layernorm"])), FusePass(FuseConfig())
    hybrid, dynamic = QuantizePass(QuantizeConfig(mode="hybrid")), QuantizePass(QuantizeConfig(mode="int8_dynamic"))
    from optimizer.recipe.reads import key_part
    from optimizer.runtime.cpu_features import int8_reduce_range

    def part(p: Any, r: Any) -> dict[str, Any]:
        return key_part(r, p.recipe_reads(r))

    # int8_dynamic times nothing; its key carries only the CPU fact that changes its weights (7-bit without VNNI)
    assert part(plain, recipe(1)) == {} and plain.key_extras(recipe(1)) is None
    assert part(dynamic, recipe(1)) == {}
    assert dynamic.key_extras(recipe(1)) == ({"int8_reduce_range": True} if int8_reduce_range()[0] else None)
    assert part(fuse, recipe(1)) != part(fuse, recipe(2))
    assert part(hybrid, recipe(1)) != part(hybrid, recipe(2))


@pytest.mark.slow
def test_later_ort_session_adds_to_the_fusions_fuse_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.runtime.runners import ort_runner

    monkeypatch.setattr(services.MeasureServices, "time", fake_time("skip_layernorm"))
    monkeypatch.setattr(ort_runner, "op_time_breakdown", fake_profile)
    stages = compile_stages(
        tmp_path,
        {"source": "hf_config", "architecture": "bert", "config": TINY},
        BERT_INPUTS,
        extra_passes=[{"type": "ort_session", "name": "more", "config": {"disabled_optimizers": ["BiasGeluFusion"]}}],
        fuse_config={"measure": ["skip_layernorm"]},
    )
    assert stages["more"].artifact.runtime["disabled_optimizers"] == ["SkipLayerNormFusion", "BiasGeluFusion"]


def test_compare_times_a_stage_with_the_fusions_its_run_disabled(tmp_path: Path) -> None:
    from test_compare import tiny

    from optimizer.engine.compare import CompareSide, compare_recipe

    a, b = tiny(tmp_path / "a.onnx"), tiny(tmp_path / "b.onnx", pairs=8)
    side_b = CompareSide("B", b, "RUN:fuse", runtime={"graph_optimization_level": "all",
                                               "disabled_optimizers": ["SkipLayerNormFusion"]})
    recipe, notes = compare_recipe(CompareSide("A", a, str(a)), side_b)
    session = recipe.passes[0]
    assert session.type == "ort_session" and session.config["disabled_optimizers"] == ["SkipLayerNormFusion"]
    assert any("SkipLayerNormFusion disabled" in n for n in notes)


def test_kernel_cost_reads_onnxruntimes_own_profile(tmp_path: Path) -> None:
    """The real profile: op types named as ORT's profile names them (no domain), counted where the two graphs
    differ, and a time for each side."""
    from types import SimpleNamespace

    from conftest import mlp_recipe, write_recipe
    from fusion_helpers import fuse

    from optimizer.core.artifact import Artifact
    from optimizer.recipe.loading import load_recipe
    from passes.fuse.kernel_choice import kernel_cost

    plain = unfused_graph("skip_layernorm")
    feed = {"a": np.ones((1, 4, H), np.float32), "skip": np.ones((1, 4, H), np.float32)}
    fused, _ = fuse(plain, feed, ["skip_layernorm"])
    onnx.save(plain, tmp_path / "without.onnx")
    onnx.save(fused, tmp_path / "with.onnx")
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(target={"threads": 1})))
    ctx = SimpleNamespace(feeds=[SimpleNamespace(timing=feed)], recipe=recipe)
    level = {"graph_optimization_level": "all"}
    cost = kernel_cost(
        Artifact("onnx", tmp_path / "with.onnx", runtime=level),
        Artifact("onnx", tmp_path / "without.onnx", runtime={**level, "disabled_optimizers": ["SkipLayerNormFusion"]}),
        ctx,  # type: ignore[arg-type]
    )
    assert cost is not None and cost.op_types == ["Add", "LayerNormalization", "SkipLayerNormalization"]
    assert cost.with_rule_ms > 0 and cost.without_rule_ms > 0
