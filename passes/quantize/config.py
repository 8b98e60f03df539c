"""The `quantize` pass's recipe settings and stage notes: QuantizeConfig (the mode and its options, with the
calibration, hybrid and smoothing settings, each option refused for a mode it does not apply to), QuantizeNotes
(the typed part of a quantize stage's account that other code reads back), and the one rule for symmetric
activations.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from optimizer.core.pass_base import PassConfig, PassNotes
from passes.quantize.modes import DEFAULT_OPS
from passes.quantize.weight_only import WeightOnlySettings


class CalibrationConfig(PassConfig):
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    samples: int = Field(default=16, ge=1, description="calibration inputs (text from the end of the file)")
    percentile: float = Field(default=99.999, gt=50, le=100)


class HybridSettings(PassConfig):
    min_cosine: float | None = Field(default=None, description="default: the recipe's accuracy budget (cosine)")
    margin: float = Field(default=0.003, ge=0, description="head-room kept on the search inputs")
    choose: Literal["fastest", "most_int8"] = Field(
        default="fastest",
        description="fastest: time a ladder of INT8 sets against FP32 with the harness and keep the fewest INT8 "
        "nodes within speed_tolerance of the fastest; most_int8: the largest set within budget, untimed",
    )
    speed_tolerance: float = Field(default=0.03, ge=0, lt=1, description="speed given up for fewer INT8 nodes")
    candidates: list[Literal["static", "attention_core"]] = Field(
        default_factory=list,
        description="forms of the chosen INT8 set also tried, each kept only if within budget and faster (timed "
        "head to head against the set): static = calibrated QDQ activations for its MatMuls (variants.py); "
        "attention_core = QK^T and probabilities x V in INT8 too (attention.py); each a line in hybrid_search.json",
    )


class SmoothSettings(PassConfig):
    """SmoothQuant-style activation smoothing before INT8 (smooth.py): exact in FP32, fewer outlier channels."""

    alpha: float = Field(default=0.7, ge=0, le=1, description="migration strength: s = max|X|^a / max|W|^(1-a)")
    nodes: list[str] = Field(
        default_factory=list, description="MatMul / Attention nodes to smooth; empty: every node the mode may quantize"
    )


class QuantizeConfig(PassConfig):
    mode: Literal["int8_dynamic", "int8_static", "fp16", "hybrid", "weight_only"]
    per_channel: bool = True
    symmetric_activations: bool | None = Field(
        default=None,
        description="signed INT8 activations with zero point 0; default: on for cuda targets (TensorRT takes only "
        "symmetric Q/DQ), off on the CPU (asymmetric uint8 keeps more of a ReLU's range)",
    )
    op_types: list[str] = Field(default_factory=lambda: list(DEFAULT_OPS))
    exclude_nodes: list[str] = Field(default_factory=list)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    keep_io_types: bool = True
    op_block_list: list[str] = Field(default_factory=list, description="fp16: op types kept in FP32")
    node_block_list: list[str] = Field(default_factory=list, description="fp16: nodes kept in FP32")
    hybrid: HybridSettings = Field(default_factory=HybridSettings)
    smooth: SmoothSettings | None = Field(
        default=None, description="int8_dynamic, int8_static, hybrid: smooth activations into weights first"
    )
    attention_core: Literal["fp32", "int8"] = Field(
        default="fp32",
        description="int8_dynamic: fp32 keeps ORT's fused attention (QAttention: the QKV projection in INT8); int8 "
        "writes com.microsoft Attention back as MatMuls and quantizes QK^T and probabilities x V too",
    )
    weight_only: WeightOnlySettings = Field(
        default_factory=WeightOnlySettings, description="weight_only: MatMul weights in 4 or 8 bits (MatMulNBits)"
    )

    @model_validator(mode="after")
    def _options_of_the_mode(self) -> QuantizeConfig:
        if self.smooth is not None and self.mode not in ("int8_dynamic", "int8_static", "hybrid"):
            raise ValueError(f"smooth applies to int8_dynamic, int8_static and hybrid, not {self.mode}")
        if self.attention_core == "int8" and self.mode != "int8_dynamic":
            raise ValueError(f"attention_core: int8 applies to int8_dynamic (hybrid: candidates), not {self.mode}")
        return self


class QuantizeNotes(PassNotes):
    """A quantize stage's notes. Typed: what a bundle's manifest reads back (deploy.export: the precision of the
    stage); the rest of the account (calibration, reduce_range, the hybrid search, smoothing, check...) as the mode
    wrote it. A generation artifact's are per graph (`prefill`, `decode`)."""

    mode: str | None = None  # QuantizeConfig.mode
    int8_nodes: list[str] | None = None  # hybrid: the nodes chosen for INT8
    quantization_ops: dict[str, int] | None = None  # quantization op types in the graph written, counted
    prefill: QuantizeNotes | None = None
    decode: QuantizeNotes | None = None


def symmetric_activations(cfg: QuantizeConfig, device: str) -> bool:
    """Signed, zero-point-0 activations: asked for, or by default on cuda targets (what TensorRT takes)."""
    return cfg.symmetric_activations if cfg.symmetric_activations is not None else device == "cuda"


def quantize_bias(device: str) -> bool:
    """Whether int8_static quantizes biases to int32 (ORT's QuantizeBias): on the CPU, yes (ORT's default, what
    its QLinear kernels fuse); on cuda targets no, biases stay float: TensorRT takes no int32 DequantizeLinear, and
    an int8_static graph bound for it would lose every Gemm/Conv with a bias."""
    return device != "cuda"
