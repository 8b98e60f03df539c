"""OpenVINO IR for the CPU, as a stage of its own: the engine build of the CPU path, as TensorRT is the GPU's.

Any ONNX stage is converted (`openvino.convert_model`, saved as model.xml + model.bin, weights kept at full
precision) and its compile properties are the stage's runtime options (runtime.ov_engine): inference precision
(f32, bf16, or the device's default, which is bf16 on CPUs with bf16 instructions), performance hint, streams,
OpenVINO's own denormal flushing and static shapes (a compile per input shape); threads are the target's. Given
an OpenVINO stage, only the options its config names change (a `{type: openvino, name: ov_f32, from: openvino,
config: {precision: f32}}` stage times one precision against another). The stage records what ran, read back
from the compiled model: the precision hint it settled on and its executed layers per runtime precision, so a
bf16 request on a CPU without bf16 says it ran f32.
"""

from __future__ import annotations

import shutil
from typing import Any, Literal

from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError, PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassNotes, PassResult
from optimizer.runtime.threads import target_threads

IR_WEIGHTS = "model.bin"


class OpenVinoConfig(PassConfig):
    precision: Literal["default", "f32", "bf16"] | None = Field(
        default=None,
        description="OpenVINO's inference precision hint: default (the device's choice: bf16 where the CPU has bf16 "
        "instructions, else f32), f32, or bf16 (a CPU without bf16 runs f32, and the stage says so); none: as the "
        "input stage (default if it is not OpenVINO)",
    )
    performance_hint: Literal["latency", "throughput"] | None = Field(
        default=None, description="PERFORMANCE_HINT; none: as the input stage (latency if it is not OpenVINO)")
    streams: int | None = Field(
        default=None, ge=1, le=1024, description="NUM_STREAMS; none: as the input stage (as the hint chooses if unset)")
    denormals: bool | None = Field(
        default=None,
        description="OpenVINO's CPU_DENORMALS_OPTIMIZATION (flush denormal floats to zero); none: as the input stage "
        "(OpenVINO's default if none set it)",
    )
    static_shapes: bool | None = Field(
        default=None,
        description="compile the IR reshaped to each input shape it runs (up to 8 shapes; further shapes run the "
        "dynamic-shape model), as a fixed-shape deployment does; none: as the input stage (dynamic if not OpenVINO)",
    )


class PrecisionRan(PassNotes):
    """What an OpenVINO stage asked for and what ran (runtime.ov_engine.precision_ran): the hint the compiled model
    settled on and its executed layers per runtime precision ("f32", "bf16", "i8", "u8"...)."""

    asked: str | None = None
    hint: str | None = None
    layers: dict[str, int] = {}
    note: str | None = None  # a bf16 request that ran without bf16

    def int8_layers(self) -> int:
        return sum(n for p, n in self.layers.items() if p in ("i8", "u8"))


class OpenVinoNotes(PassNotes):
    """An openvino stage's notes. Typed: what a bundle's manifest reads back (deploy.export); the rest (versions,
    compile options, IR op types) as written."""

    precision: PrecisionRan | None = None


class OpenVinoPass(Pass[OpenVinoConfig]):
    name = "openvino"
    summary = "OpenVINO IR on the CPU (convert_model), with precision, performance hint and streams as measured options"
    Config = OpenVinoConfig
    Notes = OpenVinoNotes
    consumes = frozenset({"onnx", "openvino"})
    version = 2  # precision / hint: None inherits from an OpenVINO parent
    requires = ("openvino",)

    @classmethod
    def environment_reason(cls) -> str | None:
        from optimizer.runtime.ov_engine import openvino_reason

        return openvino_reason()

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        reason = super().skip_reason(artifact, ctx)
        if reason is None and ctx.recipe.target.device != "cpu":
            return "target.device is cuda: OpenVINO stages run on the CPU here"
        return reason

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        from optimizer.runtime.ov_engine import (
            capabilities,
            compile_model,
            error_line,
            ir_op_types,
            openvino_module,
            precision_ran,
        )

        ov = openvino_module()

        cfg = self.config
        assert artifact.path is not None
        xml = ctx.stage_dir / "model.xml"
        if artifact.kind == "openvino":  # the same IR, other compile options
            for f in artifact.files():
                shutil.copyfile(f, ctx.stage_dir / f.name)
            converted = None
        else:
            ctx.progress("converting to OpenVINO IR", 0, 0)
            try:
                converted = ov.convert_model(str(artifact.path))
            except Exception as e:  # OpenVINO's frontend raises its own errors, multi-line
                raise PassError(f"OpenVINO cannot convert {artifact.path.name}: {error_line(e)}") from e
            ov.save_model(converted, str(xml), compress_to_fp16=False)
        runtime = ov_runtime(cfg, artifact)
        out = artifact.derive(kind="openvino", path=xml, external_data=[IR_WEIGHTS], runtime=runtime,
                              decode=None, decode_external_data=[])
        try:
            compiled = compile_model(xml, runtime, target_threads(ctx.recipe))
        except OptimizerError as e:
            raise PassError(str(e)) from e
        notes: dict[str, Any] = {
            "openvino": ov.__version__,
            **({"not_carried": "the input stage's denormal_as_zero (an ONNX Runtime option); set `denormals` here"}
               if artifact.runtime.get("denormal_as_zero") and cfg.denormals is None else {}),
            "converted_from": artifact.kind,
            "compile_options": runtime,
            "precision": precision_ran(compiled, runtime["ov_precision"], capabilities()),
            "ir_op_types": ir_op_types(ctx.stage_dir / "model.xml"),
        }
        # the same IR with the same options as an OpenVINO parent changes nothing: "unchanged", not timed
        return PassResult(out, modified=artifact.kind != "openvino" or runtime != artifact.runtime,
                          notes=OpenVinoNotes.model_validate(notes))


def ov_runtime(cfg: OpenVinoConfig, artifact: Artifact) -> dict[str, Any]:
    """The runtime options of the stage: the ones its config sets, on top of an OpenVINO parent's (ONNX Runtime's
    do not apply), so a stage changes only what it names."""
    runtime: dict[str, Any] = dict(artifact.runtime) if artifact.kind == "openvino" else {}
    runtime.setdefault("ov_precision", "default")
    runtime.setdefault("ov_hint", "latency")
    if cfg.precision is not None:
        runtime["ov_precision"] = cfg.precision
    if cfg.performance_hint is not None:
        runtime["ov_hint"] = cfg.performance_hint
    if cfg.streams is not None:
        runtime["ov_streams"] = cfg.streams
    if cfg.denormals is not None:
        runtime["ov_denormals"] = cfg.denormals
    if cfg.static_shapes is not None:
        runtime["ov_static_shapes"] = cfg.static_shapes
    return runtime
