"""Recipe schema: the YAML file names the model, its inputs, scenarios, target, benchmark settings, accuracy
budget and the ordered passes. Every field is typed (pydantic, extra fields forbidden); loading.py reads the
file and runs the checks that span fields.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

SOURCE_STAGE = "source"
# Recipe, stage and scenario names become folder and file names: one safe rule, checked when the recipe loads.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def safe_name(value: str) -> str:
    if not SAFE_NAME.fullmatch(value):
        raise ValueError(
            f"{value[:80]!r} is not a safe name: 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit (names become folder names)"
        )
    return value


class Strict(BaseModel):
    # allow_inf_nan=False: no recipe number may be inf or NaN (`.nan` compares false and turns a check off; `.inf`
    # would be echoed into report.json, which is strict JSON).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Seeds go to numpy's and torch's generators: both take 0..2**63-1, and numpy refuses a negative one.
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
# The most elements one input tensor of one sample may have, checked at load for every scenario and sweep batch.
# A fixed cap, so a recipe validates alike on every machine: 2**31 elements is 8 GiB of float32 (16 of int64)
# per sample, past the int32 indexing many kernels use; what fits this machine's memory is checked at run time.
MAX_INPUT_ELEMENTS = 2**31
INT_LIMITS = {"int64": (-(2**63), 2**63 - 1), "int32": (-(2**31), 2**31 - 1)}
FLOAT16_MAX = 65504.0


# ---------------------------------------------------------------- model sources
# Encoder-decoder generation (runtime/seq2seq.py), named as transformers' pipelines and Optimum name them: text in
# (T5: AutoModelForSeq2SeqLM), or a log-mel spectrogram in (Whisper: AutoModelForSpeechSeq2Seq); text out, greedily.
SEQ2SEQ_TASKS = ("text2text-generation", "automatic-speech-recognition")
GENERATION_TASKS = ("causal-lm", *SEQ2SEQ_TASKS)


class HFFolderSource(Strict):
    """A Hugging Face model folder: a local path, or a folder inside an installed Python package."""

    source: Literal["hf_folder"]
    path: str = Field(description="folder path; relative to the package folder when `package` is set")
    package: str | None = Field(default=None, description="installed package that ships the folder")
    task: Literal[
        "feature-extraction", "causal-lm", "sequence-classification", "image-classification", "text2text-generation",
        "automatic-speech-recognition",
    ] = "feature-extraction"
    attn_implementation: Literal["eager", "sdpa"] | None = Field(default=None, description="default: transformers'")


class HFConfigSource(Strict):
    """A transformers architecture built from a config with random weights (no download)."""

    source: Literal["hf_config"]
    architecture: Literal["gpt2", "llama", "bert"]
    config: dict[str, Any] = Field(default_factory=dict, description="overrides of the architecture's config")
    task: Literal["feature-extraction", "causal-lm", "sequence-classification", "image-classification"] = (
        "feature-extraction"
    )
    seed: Seed = 0
    attn_implementation: Literal["eager", "sdpa"] | None = Field(default=None, description="default: transformers'")


class FactorySource(Strict):
    """A Python callable `module:function` (or `path/to/file.py:function`) returning a torch.nn.Module; where it
    is looked for: optimizer.recipe.factory."""

    source: Literal["factory"]
    target: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("target")
    @classmethod
    def _module_function(cls, v: str) -> str:
        if v.count(":") != 1 or not all(v.split(":")):
            raise ValueError("must look like 'package.module:function' or 'path/to/file.py:function'")
        return v


class OnnxSource(Strict):
    """An existing ONNX file; stage 0 is then that file run by ONNX Runtime with its optimizations off."""

    source: Literal["onnx"]
    path: str


ModelSource = Annotated[HFFolderSource | HFConfigSource | FactorySource | OnnxSource, Field(discriminator="source")]


# ---------------------------------------------------------------- inputs and scenarios
class InputSpec(Strict):
    name: str
    dtype: Literal["int64", "int32", "float32", "float16", "bool"] = "int64"
    shape: list[Annotated[int, Field(ge=0)] | str] = Field(
        description="ints are fixed (0 is a legal empty dim); names are bound by each scenario"
    )
    range: tuple[float, float] | None = Field(default=None, description="[low, high) for generated values")

    fill: Literal["random", "ones", "zeros"] = "random"

    @field_validator("range")
    @classmethod
    def _ordered(cls, v: tuple[float, float] | None, info: ValidationInfo) -> tuple[float, float] | None:
        """Finite and ordered, and the values drawn from it exist in the dtype (validated before it): integers in
        [low, high), within the dtype's limits."""
        if v is None:
            return v
        low, high = v
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"{list(v)} is not a finite range with low < high")
        dtype = info.data.get("dtype")
        if dtype in INT_LIMITS:
            if math.ceil(low) >= high:
                raise ValueError(f"{list(v)} holds no integer for {dtype} (values are drawn from [low, high))")
            lo, hi = INT_LIMITS[dtype]
            if low < lo or high > hi + 1:
                raise ValueError(f"{list(v)} is outside {dtype}'s {lo}..{hi}")
        if dtype == "float16" and max(abs(low), abs(high)) > FLOAT16_MAX:
            raise ValueError(f"{list(v)} is outside float16's +/-{FLOAT16_MAX:g} (its values would be inf)")
        return v


class TextInputs(Strict):
    """Real text through the model's tokenizer; it supplies the inputs the tokenizer produces."""

    file: str | None = None
    sentences: list[str] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> TextInputs:
        if (self.file is None) == (self.sentences is None):
            raise ValueError("give exactly one of `file` or `sentences`")
        return self


# The seeds' scenarios (shared/seeds): prompt length and new tokens per task, batch 1.
SCENARIO_PRESETS: dict[str, dict[str, Any]] = {
    "short_text_generation": {"batch": 1, "seq": 128, "new_tokens": 64},
    "long_document_processing": {"batch": 1, "seq": 2048, "new_tokens": 32},
    "low_latency_inference": {"batch": 1, "seq": 128, "new_tokens": 8},
}


def _not_own_dim(name: str) -> str:
    """`dims` binds the other symbolic dims: batch and seq are the scenario's own fields, with their rules (>= 1);
    through dims they bypassed them (batch 0 ran and reported throughput for nothing)."""
    if name in ("batch", "seq"):
        raise ValueError(f"{name} is the scenario's own field: set `{name}:` on the scenario, not in dims")
    return name


class Scenario(Strict):
    name: Annotated[str, AfterValidator(safe_name)]
    batch: int = Field(default=1, ge=1)
    seq: int = Field(default=128, ge=1, description="sequence length; the prompt length for generation")
    new_tokens: int = Field(default=32, ge=1, description="generation: tokens generated per task")
    dims: dict[Annotated[str, AfterValidator(_not_own_dim)], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="extra symbolic dims (0 is a legal empty dim); not batch or seq"
    )
    padding: Literal["max_length", "longest"] = Field(
        default="max_length",
        description="text inputs: max_length pads every sample to `seq` (the worst case); longest pads each batch "
        "to its longest sentence (truncated at `seq`), as an embedding service does: the natural lengths",
    )
    samples: int | None = Field(
        default=None, ge=1, description="inputs of this scenario, timed in turn and compared; default accuracy.samples"
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        """`{preset: short_text_generation}` expands to the seeds' numbers; explicit fields override them."""
        if isinstance(data, dict) and "preset" in data:
            data = dict(data)
            name = data.pop("preset")
            if name not in SCENARIO_PRESETS:
                raise ValueError(f"unknown preset {name!r} (known: {', '.join(SCENARIO_PRESETS)})")
            data = {"name": name, **SCENARIO_PRESETS[name], **data}
        return data

    def bindings(self) -> dict[str, int]:
        return {"batch": self.batch, "seq": self.seq, **self.dims}


class Target(Strict):
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int | None = Field(default=None, ge=1, description="intra-op threads; default: all cores")


class BenchmarkSettings(Strict):
    warmup: int = Field(default=10, ge=0, description="untimed runs per stage before timing")
    rounds: int = Field(default=10, ge=2, description="alternations between a stage and its parent")
    iterations: int = Field(default=10, ge=1, description="timed runs per round")
    min_round_seconds: float = Field(default=0.0, ge=0, description="grow a round until it lasts this long")
    target_ci: float = Field(
        default=0.0,
        ge=0,
        description="keep adding rounds until the median's 95% interval is within +/- this "
        "fraction of it (0: exactly `rounds`)",
    )
    max_rounds: int = Field(default=40, ge=2, description="upper bound on rounds when target_ci or resolve_tail is set")
    resolve_tail: bool = Field(
        default=False,
        description="keep adding rounds until the P99's 95% interval is bounded by the calls taken (about 370 "
        "calls), up to max_rounds; without it a P99 from fewer calls is reported as not resolved",
    )
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
    early_stop_margin: float = Field(
        default=0.10,
        ge=0,
        description="stop a stage's rounds before `rounds` once its ratio to the parent is beyond doubt: from 6 "
        "rounds on, after each pair of rounds, when the ratio's 99% interval lies wholly above 1 + margin or "
        "below 1 / (1 + margin) (and the latency goals target_ci / resolve_tail are met); a verdict near 1 runs "
        "every round (0: always `rounds`)",
    )
    instances: int = Field(
        default=2,
        ge=1,
        le=4,
        description="sessions of each artifact timed in turn when a stage is timed against its parent: identical "
        "sessions differ in speed (5-10% for sub-millisecond ONNX Runtime calls here), and the ratio's interval "
        "includes that spread only when it was measured (1: one session a side, as before; costs load time and "
        "memory, not timing)",
    )
    settle_ms: float = Field(
        default=50.0,
        ge=0,
        description="pause before each side's round when two sessions alternate: ONNX Runtime's worker threads "
        "keep spinning after a call, and on few cores they slow the other session's next calls (2.5x for 25-40 ms "
        "measured here)",
    )
    denormal_probe: bool = Field(
        default=True,
        description="time each CPU ONNX stage once more, briefly, against itself with denormal floats flushed, and "
        "say in the findings where that would pay (padded inputs compute on denormals; measure.denormal_probe)",
    )
    memory: Literal["process", "inline"] = Field(
        default="process",
        description="process: peak resident set of serving the stage in a fresh process (comparable across "
        "stages); inline: growth inside the compile process (fast, but skewed by allocator reuse)",
    )


class AccuracyBudget(Strict):
    metric: Literal["cosine", "pooled_cosine", "max_abs", "top1", "token_agreement"] | None = Field(
        default=None,
        description="what the budget judges; default by task: token_agreement for generation, top1 for "
        "sequence-classification and image-classification, else cosine on the positions the attention mask keeps",
    )
    # allow_inf_nan=False: `min: .nan` would compare false against everything and turn the gate off.
    min: float | None = Field(
        default=None, allow_inf_nan=False, description="for cosine, top1, agreement: the lowest acceptable value"
    )
    max: float | None = Field(
        default=None, allow_inf_nan=False, description="for max_abs: the highest acceptable value"
    )
    output: str | None = Field(default=None, description="output to judge; default: the first")
    samples: int = Field(default=4, ge=1, description="inputs per scenario compared with stage 0")


class BatchSweepConfig(Strict):
    stage: str = Field(default="best", description="stage to sweep; best: the fastest within the accuracy budget")
    batches: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1)
    latency_budget_ms: float = Field(gt=0, description="the P99 a batch may take")
    memory_budget_mb: float | None = Field(default=None, gt=0, description="default: half the memory available")


class PassSpec(Strict):
    type: str
    name: Annotated[str, AfterValidator(safe_name)] | None = None
    from_: str | None = Field(default=None, alias="from")
    config: dict[str, Any] = Field(default_factory=dict)

    @property
    def stage_name(self) -> str:
        return self.name or self.type


class Recipe(Strict):
    name: Annotated[str, AfterValidator(safe_name)]
    description: str = ""
    model: ModelSource
    inputs: list[InputSpec] = Field(default_factory=list)
    text: TextInputs | None = None
    data_file: str | None = Field(default=None, description=".npz with one array per input: used as every sample")
    outputs: list[str] | None = Field(default=None, description="output names; default: all tensor outputs")
    scenarios: list[Scenario] = Field(min_length=1)
    target: Target = Field(default_factory=Target)
    benchmark: BenchmarkSettings = Field(default_factory=BenchmarkSettings)
    accuracy: AccuracyBudget = Field(default_factory=AccuracyBudget)
    workload: Literal["forward", "generation"] = Field(
        default="forward", description="generation: greedy decoding with a KV cache (causal LMs; encoder-decoders: "
        "model.task text2text-generation or automatic-speech-recognition)"
    )
    batch_sweep: BatchSweepConfig | None = None
    on_failure: Literal["stop", "continue"] = "stop"
    isolation: Literal["auto", "process", "inline"] = Field(
        default="auto",
        description="where each stage is built and measured: process (a worker process of its own, so a stage "
        "killed for memory or crashing in native code is recorded as failed and the run goes on), inline (in "
        "the compile's process), auto (process once the source model's weights reach 256 MiB)",
    )
    seed: Seed = 0
    passes: list[PassSpec] = Field(default_factory=list)

    # Set by load_recipe: the folder relative paths in the recipe are resolved against.
    base_dir: Path = Field(default=Path("."), exclude=True)

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else (self.base_dir / p)


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain data, with `from` spelled as in the file (used for hashing and the report)."""
    return recipe.model_dump(mode="json", by_alias=True, exclude={"base_dir"})


def default_metric(task: str | None, workload: str) -> str:
    """The metric a budget judges when the recipe names none: what the task's consumers use."""
    if workload == "generation":
        return "token_agreement"
    if task in ("sequence-classification", "image-classification"):
        return "top1"
    return "cosine"  # on kept positions: every token state a consumer of an encoder reads


def budget_metric(budget: AccuracyBudget, task: str | None = None, workload: str = "forward") -> str:
    return budget.metric or default_metric(task, workload)


def recipe_metric(recipe: Recipe) -> str:
    return budget_metric(recipe.accuracy, getattr(recipe.model, "task", None), recipe.workload)
