"""INT8 for an OpenVINO stage through NNCF post-training quantization, as a stage after it.

NNCF inserts FakeQuantize nodes into the IR, calibrated on the recipe's calibration inputs (taken from the back
of its text, apart from the sentences accuracy is judged on: passes.quantize.calibration), with the transformer
model type (its attention and norm patterns kept out where INT8 would hurt them) and the mixed preset (symmetric
weights, asymmetric activations) by default. The CPU plugin then runs every quantized layer in INT8 (VNNI, AMX
where the CPU has them) and the rest at the parent's precision hint. `ignored_types` / `ignored_names` keep
layers out of INT8 (NNCF's IgnoredScope). The stage records how many layers ran in INT8 (runtime precision i8/u8
in the compiled model's execution graph) and the FakeQuantize nodes NNCF inserted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError, PassError, install_hint
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult
from optimizer.runtime.cpu_features import int8_reduce_range
from optimizer.runtime.threads import target_threads
from passes.openvino import IR_WEIGHTS, OpenVinoNotes


class NncfInt8Config(PassConfig):
    samples: int = Field(
        default=100, ge=1, le=10_000, description="calibration inputs (the recipe's scenarios in turn)")
    preset: Literal["mixed", "performance"] = Field(
        default="mixed", description="mixed: symmetric weights, asymmetric activations; performance: both symmetric"
    )
    model_type: Literal["transformer", "generic"] = Field(
        default="transformer", description="transformer: NNCF's rules for attention and normalization layers"
    )
    fast_bias_correction: bool = True
    ignored_types: list[str] = Field(default_factory=list, description="OpenVINO op types kept out of INT8")
    ignored_names: list[str] = Field(default_factory=list, description="IR node names kept out of INT8")
    accuracy_control: bool = Field(
        default=False,
        description="NNCF's accuracy-aware quantization: layers are returned to the parent's precision, most "
        "sensitive first, until the budget's metric (our accuracy implementation, against the parent, on the "
        "calibration inputs) is within the recipe's budget less `margin`",
    )
    margin: float = Field(default=0.002, ge=0, le=0.5, description="accuracy_control: headroom kept inside the budget")


class NncfInt8Notes(OpenVinoNotes):
    """An nncf_int8 stage's notes: an OpenVINO stage's (what ran, per precision), with the FakeQuantize nodes NNCF
    inserted; the rest (calibration, preset, overflow fix, accuracy control) as written."""

    fake_quantize_nodes: int | None = None


class NncfInt8Pass(Pass[NncfInt8Config]):
    name = "nncf_int8"
    summary = "INT8 post-training quantization of an OpenVINO stage with NNCF (calibrated on the recipe's inputs)"
    Config = NncfInt8Config
    Notes = NncfInt8Notes
    consumes = frozenset({"openvino"})
    version = 1

    def recipe_reads(self, recipe: Any) -> tuple[str, ...]:
        """Accuracy control lets NNCF drop down to the recipe's budget (accuracy.min on its metric)."""
        return ("accuracy.metric", "accuracy.min") if self.config.accuracy_control else ()

    def key_extras(self, recipe: Any) -> dict[str, Any] | None:
        """7-bit weights on every layer on x86 without VNNI: not the artifact a VNNI machine builds."""
        return {"overflow_fix": "enable"} if int8_reduce_range()[0] else None
    requires = ("openvino", "nncf")

    @classmethod
    def recipe_reason(cls, config: NncfInt8Config, recipe: Any) -> tuple[str, str] | None:
        from optimizer.recipe.schema import recipe_metric

        cfg = config
        if not cfg.accuracy_control:
            return None
        metric, floor = recipe_metric(recipe), recipe.accuracy.min
        if floor is None or metric == "max_abs":
            return ("accuracy_control", f"needs a minimum on a similarity metric (accuracy.min; the recipe's metric is "
                    f"{metric}, min {floor})")
        if floor + cfg.margin >= 1.0:
            return ("margin", f"accuracy.min {floor} plus margin {cfg.margin} leaves NNCF no drop to allow")
        return None

    @classmethod
    def environment_reason(cls) -> str | None:
        import importlib.util

        from optimizer.runtime.ov_engine import openvino_reason

        if importlib.util.find_spec("nncf") is None:
            return f"nncf is not installed ({install_hint('openvino')})"
        return openvino_reason()

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        from optimizer.runtime.ov_engine import (
            capabilities,
            compile_model,
            core,
            error_line,
            ir_op_types,
            nncf_module,
            openvino_module,
            port_name,
            precision_ran,
        )

        nncf, ov = nncf_module(), openvino_module()
        from passes.quantize.calibration import calibration_feeds

        cfg = self.config
        assert artifact.path is not None
        model = core().read_model(str(artifact.path))
        names = [port_name(p, ctx.recipe) for p in model.inputs]
        feeds, info = calibration_feeds(ctx.recipe, cfg.samples, ctx.progress)
        # items are (index, feed): NNCF validates on subsets, in its own order, and each needs its reference
        dataset = nncf.Dataset(list(enumerate(feeds)), lambda item: {n: item[1][n] for n in names})
        ignored = (nncf.IgnoredScope(types=cfg.ignored_types, names=cfg.ignored_names, validate=True)
                   if cfg.ignored_types or cfg.ignored_names else None)
        ctx.progress("NNCF: calibrating", 0, 0)
        # x86 without VNNI: 8-bit weights saturate the u8s8 kernels; NNCF's overflow fix (7-bit weights) is then
        # applied to every layer, not only the first as by default (runtime.cpu_features)
        reduce, _ = int8_reduce_range()
        reduce_why = ("this x86 CPU has no VNNI: OpenVINO's INT8 kernels then saturate 8-bit weights as ONNX "
                      "Runtime's do, so every layer gets 7-bit weights (NNCF's default fixes the first only)"
                      if reduce else "the CPU has VNNI (or is not x86): NNCF's default, the first layer only")
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

        overflow = OverflowFix.ENABLE if reduce else OverflowFix.FIRST_LAYER
        advanced = AdvancedQuantizationParameters(overflow_fix=overflow)
        common: dict[str, Any] = {
            "subset_size": len(feeds),
            "fast_bias_correction": cfg.fast_bias_correction,
            "preset": nncf.QuantizationPreset.MIXED if cfg.preset == "mixed" else nncf.QuantizationPreset.PERFORMANCE,
            "model_type": nncf.ModelType.TRANSFORMER if cfg.model_type == "transformer" else None,
            **({"ignored_scope": ignored} if ignored is not None else {}),
        }
        control: dict[str, Any] = {}
        try:
            if cfg.accuracy_control:
                validate, control = accuracy_validation(artifact, feeds, names, cfg.margin, ctx)
                quantized = nncf.quantize_with_accuracy_control(
                    model, dataset, dataset, validate, max_drop=control["max_drop"],
                    drop_type=nncf.DropType.ABSOLUTE, advanced_quantization_parameters=advanced, **common)
            else:
                quantized = nncf.quantize(model, dataset, advanced_parameters=advanced, **common)
        except PassError:
            raise
        except Exception as e:  # NNCF's and OpenVINO's own error types (an ignored name matching nothing, too)
            raise PassError(f"NNCF could not quantize the model: {error_line(e)}") from e
        xml = ctx.stage_dir / "model.xml"
        ov.save_model(quantized, str(xml), compress_to_fp16=False)
        out = artifact.derive(path=xml, external_data=[IR_WEIGHTS])
        try:
            compiled = compile_model(xml, out.runtime, target_threads(ctx.recipe))
        except OptimizerError as e:
            raise PassError(str(e)) from e
        precision = precision_ran(compiled, out.runtime.get("ov_precision", "default"), capabilities())
        ops = ir_op_types(xml)
        int8_layers = sum(n for p, n in precision["layers"].items() if p in ("i8", "u8"))
        if not ops.get("FakeQuantize"):
            why = ("accuracy control returned every layer to the parent's precision: no INT8 layer stays within the "
                   "budget" if cfg.accuracy_control else "NNCF inserted no FakeQuantize node")
            raise PassError(f"nothing was quantized: {why}")
        notes: dict[str, Any] = {
            "nncf": nncf.__version__,
            "calibration": info,
            "preset": cfg.preset,
            "model_type": cfg.model_type,
            "fake_quantize_nodes": ops.get("FakeQuantize", 0),
            "int8_layers": int8_layers,
            "overflow_fix": {"value": overflow.value, "why": reduce_why},
            "precision": precision,
            **({"ignored": {"types": cfg.ignored_types, "names": cfg.ignored_names}} if ignored is not None else {}),
            **({"accuracy_control": control} if control else {}),
        }
        return PassResult(out, modified=True, notes=NncfInt8Notes.model_validate(notes))


def accuracy_validation(
    artifact: Artifact, feeds: list[dict[str, Any]], names: list[str], margin: float, ctx: PassContext
) -> tuple[Any, dict[str, Any]]:
    """NNCF's validation_fn for accuracy-aware quantization, judged by the one accuracy implementation (ctx.check)
    against the parent's outputs on the calibration inputs, and the drop NNCF may allow: the parent scores 1.0
    against itself, so the budget's floor less the margin is 1 - max_drop. Returns (validate, facts)."""
    import numpy as np

    from optimizer.recipe.schema import recipe_metric

    metric = recipe_metric(ctx.recipe)
    floor = ctx.recipe.accuracy.min
    if floor is None or metric == "max_abs":
        raise PassError(f"accuracy_control needs a minimum on a similarity metric (accuracy.min; metric {metric})")
    with ctx.session(artifact) as parent:
        reference = [parent.to_numpy(parent.run(parent.prepare(f))) for f in feeds]
    facts: dict[str, Any] = {"metric": metric, "floor": floor, "margin": margin,
                             "max_drop": max(0.0, 1.0 - (floor + margin)),
                             "validated_on": f"{len(feeds)} calibration inputs, against the parent", "validations": 0}

    def validate(compiled: Any, data: Any) -> tuple[float, None]:
        request = compiled.create_infer_request()
        ports = list(compiled.inputs)  # in the model's input order, which `names` follows
        items = list(data)
        outputs = []
        for _, feed in items:
            result = request.infer(dict(zip(ports, [feed[n] for n in names], strict=True)))
            outputs.append([np.array(result[p]) for p in compiled.outputs])
        expected = [reference[i] for i, _ in items]
        score = ctx.check(expected, outputs, [feed for _, feed in items]).worst(metric)
        facts["validations"] += 1
        return score, None

    return validate, facts
