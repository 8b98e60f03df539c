"""The decoder rebuilt in ONNX Runtime GenAI's layout, as a stage of its own (a generation recipe, from the source).

ONNX Runtime GenAI's model builder writes the decoder from its weights as one graph for prefill and decode:
GroupQueryAttention with the rotary embedding inside, one QKV MatMul per layer, SkipSimplifiedLayerNormalization,
and a KV cache that is one buffer per tensor, preallocated and written in place (runtime.generation_shared runs
it). Its options are the stage's measured options: precision (fp32, or int4/int8 weights as MatMulNBits), the
MatMulNBits accuracy level (4: int8 activations, the CPU's VNNI/AMX path; 1: fp32), the block size, whether the LM
head is quantized, and whether prefill computes the LM head for the last position only (prune_lm_head).

Checked before anything is timed, against the PyTorch loop on the recipe's prompt: an fp32 build must give the
same tokens (and close logits); a quantized build records its agreement, which the accuracy budget then judges.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError, PassError
from optimizer.core.pass_base import GenerationAgreement, Pass, PassConfig, PassContext, PassResult
from optimizer.recipe.genai_support import builder_architectures
from optimizer.recipe.schema import HFConfigSource, HFFolderSource

MIN_FP32_COSINE = 0.999
# transformers class per (architecture, task) of a recipe's hf_config source
CONFIG_CLASSES = {("llama", "causal-lm"): "LlamaForCausalLM", ("gpt2", "causal-lm"): "GPT2LMHeadModel"}


class GenaiBuildConfig(PassConfig):
    precision: Literal["fp32", "int4", "int8"] = Field(
        default="fp32", description="fp32, or int4/int8 weights (MatMulNBits; activations per accuracy_level)"
    )
    accuracy_level: Literal[1, 2, 3, 4] | None = Field(
        default=None,
        description="MatMulNBits compute: 4 int8 activations (VNNI/AMX), 3 bf16, 2 fp16, 1 fp32; none: the "
        "builder's default (4 on the CPU)",
    )
    block_size: Literal[16, 32, 64, 128, 256] = Field(default=32, description="weights per quantization block")
    quantize_lm_head: bool = Field(default=True, description="int4/int8: quantize the LM head too")
    prune_lm_head: bool = Field(
        default=False, description="prefill computes logits for the last position only (what generation reads)"
    )

    @model_validator(mode="after")
    def _quantized_options(self) -> GenaiBuildConfig:
        if self.precision == "fp32":
            given = [k for k in ("accuracy_level",) if getattr(self, k) is not None]
            given += ["quantize_lm_head"] if not self.quantize_lm_head else []
            if given:
                raise ValueError(f"{', '.join(given)} applies to int4/int8 weights; precision is fp32")
        return self

    def builder_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"prune_lm_head": self.prune_lm_head or None}
        if self.precision != "fp32":
            options |= {"accuracy_level": self.accuracy_level, "block_size": self.block_size}
            if not self.quantize_lm_head:
                options["nodes_to_exclude"] = "/lm_head/MatMul"
        return options


def source_architecture(ctx: PassContext) -> str | None:
    """The transformers class the recipe's source loads as, where the recipe says it without building the model."""
    source = ctx.recipe.model
    if isinstance(source, HFConfigSource):
        return CONFIG_CLASSES.get((source.architecture, source.task))
    if isinstance(source, HFFolderSource):
        from optimizer.runtime.models import hf_folder

        try:
            archs = json.loads((hf_folder(source, ctx.recipe) / "config.json").read_text()).get("architectures")
        except (OSError, ValueError, OptimizerError):
            return None
        return archs[0] if isinstance(archs, list) and archs else None
    return None


class GenaiBuildPass(Pass[GenaiBuildConfig]):
    name = "genai_build"
    summary = "the decoder rebuilt by ONNX Runtime GenAI's model builder: GroupQueryAttention, in-place KV cache, int4"
    Config = GenaiBuildConfig
    # From the source; or from a GenAI-layout stage, rebuilt from the source with other options and timed against
    # that stage (what one option buys: prune_lm_head, int4, the accuracy level, the LM head's precision).
    consumes = frozenset({"torch", "onnx"})
    handles_genai_layout = True
    requires = ("onnxruntime_genai",)
    handles_generation = True
    version = 1

    @classmethod
    def environment_reason(cls) -> str | None:
        from optimizer.runtime.genai_builder import genai_reason

        return genai_reason()

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        reason = super().skip_reason(artifact, ctx)
        if reason:
            return reason
        if artifact.kind == "onnx" and not artifact.genai_files:
            return "builds from the source model or a GenAI-layout stage, not from another ONNX graph"
        if ctx.recipe.workload != "generation":
            return "GenAI's layout is a decoder's; this recipe's workload is forward"
        if ctx.recipe.target.device != "cpu":
            return "target.device is cuda: GenAI-layout stages are built and run for the CPU here"
        arch = source_architecture(ctx)
        if arch is not None and arch not in builder_architectures():
            return f"onnxruntime-genai's model builder does not support {arch}"
        return None

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        from optimizer.runtime.genai_builder import GENAI_SIDE_FILES, run_builder, write_source_folder
        from optimizer.runtime.models import hf_folder, load_module

        cfg = self.config
        model = load_module(ctx.recipe)
        scratch = ctx.stage_dir / "scratch"
        scratch.mkdir(exist_ok=True)
        try:
            source = ctx.recipe.model
            placeholder = False
            if isinstance(source, HFFolderSource) and _has_tokenizer(folder := hf_folder(source, ctx.recipe)):
                src = folder
            else:
                src = scratch / "hf_source"
                placeholder = write_source_folder(model, src)
            arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
            if arch not in builder_architectures():
                raise PassError(f"onnxruntime-genai's model builder does not support {arch}")
            log = run_builder(src, ctx.stage_dir, cfg.precision, cfg.builder_options(), scratch)
        except OptimizerError as e:
            raise PassError(str(e)) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        graph = ctx.stage_dir / "model.onnx"
        side = [f for f in GENAI_SIDE_FILES if (ctx.stage_dir / f).exists()]
        data = [p.name for p in sorted(ctx.stage_dir.glob("model.onnx*.data"))]
        out = artifact.derive(
            kind="onnx",
            path=graph,
            # ORT's full optimizations, as GenAI's runtime opens its sessions; rebuilt from a GenAI-layout stage, its
            # session options (threads, spinning, ...) are kept: a build option and a session option are separate
            runtime={**(artifact.runtime if artifact.genai_files else {}), "graph_optimization_level": "all"},
            external_data=data,
            genai_files=side,
            layers=int(model.config.num_hidden_layers),
            exporter="onnxruntime-genai model builder",
            output_names=["generation"],
            decode=None,
            decode_external_data=[],
            module=None,
            param_bytes=None,
        )
        check = self._check(model, out, ctx)
        from optimizer.runtime import onnx_io

        hist = onnx_io.op_histogram(graph)
        notes = {
            "precision": cfg.precision,
            "builder_options": {k: v for k, v in cfg.builder_options().items() if v is not None},
            "architecture": arch,
            "placeholder_tokenizer": placeholder,
            "check": check,
            "nodes": sum(hist.values()),
            "op_types": hist,
            "log": log[-4000:],
        }
        return PassResult(out, modified=True, notes=notes)

    def _check(self, model: Any, out: Artifact, ctx: PassContext) -> GenerationAgreement:
        from optimizer.runtime.generation import TorchGenerator
        from optimizer.runtime.runners.gen_runner import genai_generator

        cfg = self.config
        prompt = next(iter(ctx.feeds)).timing["input_ids"]
        expected = TorchGenerator(model, 1).generate(prompt, 8)
        got = genai_generator(out, ctx.recipe).generate(prompt, 8)
        check = ctx.check(expected, got)
        if cfg.precision == "fp32" and (
            check["token_agreement"] < 1.0 or check["logits_cosine_min"] < MIN_FP32_COSINE
        ):
            raise PassError(f"the GenAI-layout graph disagrees with PyTorch: {check}")
        return check


def _has_tokenizer(folder: Path) -> bool:
    from optimizer.runtime.genai_builder import TOKENIZER_FILES

    return any((folder / name).exists() for name in TOKENIZER_FILES)
