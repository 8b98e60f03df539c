"""The measured numbers of one stage, typed: what measure produces, metrics.json caches and report.json holds.

They live in core because both sides need them: the producers (optimizer.measure, the engine's batch sweep) sit
below the readers (optimizer.report, optimizer.deploy, measure.best), and each layer may import only downwards.

Extra fields are allowed on every model here, and kept: these are data a newer measure may add to (a GPU counter,
a runtime option), and a report from a run must never fail to load because one of them was not modelled. The
envelope around them (optimizer.core.stage.StageReport, optimizer.report.schema.RunReport) forbids extras: its
keys are this tool's own, and a newer layout there bumps schema_version.

Fields that a run can leave out are Optional with a default, and serialization writes only the fields that were
given (`to_json`): a key missing from an older report stays missing, so "not measured by that version" is never
turned into a measured None (a P99 interval absent means not computed; present and None means not resolved).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Facts(BaseModel):
    """Base of the metrics models: extra fields kept, assignments validated, JSON of what was given."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    def to_json(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """The fields that were set (given, or assigned since), with the extra ones; Python values, so that an
        infinite float stays a float in memory (the writer, core.jsonio, puts null in the file)."""
        return self.model_dump(exclude_unset=True, exclude=exclude)


class ClosedFacts(Facts):
    """Facts with a closed set of keys (extras refused), as the commands' summaries (compare.json, diff's JSON)
    hold them: `to_json` writes the fields that were given, so a key a summary leaves out stays out."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Latency(Facts):
    """Timed calls of one side in milliseconds (measure.stats.latency_stats)."""

    n: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    std_ms: float
    min_ms: float
    cv: float  # std / mean
    # 95% intervals from order statistics. Present and None: too few calls to bound it ("n.r."); absent: the
    # version that measured it did not compute intervals.
    p90_ci: tuple[float, float] | None = None
    p99_ci: tuple[float, float] | None = None

    def resolved(self, key: str = "p99") -> bool:
        """False only when the quantile's interval was computed and could not be bounded by the calls taken."""
        name = f"{key}_ci"
        return name not in self.model_fields_set or getattr(self, name, None) is not None


class Throughput(Facts):
    samples_per_s: float
    tokens_per_s: float | None = None  # batch x seq per second (forward), generated tokens per second (generation)


# A ratio's interval against 1: above it, below it, or straddling it.
SpeedVerdict = Literal["faster", "slower", "within noise"]


class Speedup(Facts):
    """Parent P50 / stage P50 from the interleaved session, with its 95% bootstrap interval over rounds, widened by
    the spread between sessions of one artifact when each side ran several (measure.instances)."""

    ratio: float  # > 1: the stage is faster than its input
    low: float
    high: float
    verdict: SpeedVerdict
    in_run_low: float | None = None  # the interval over rounds alone, for these sessions
    in_run_high: float | None = None
    instance_sd: float | None = None  # log sd of one session's own speed (pooled over the run), in low-high


class TimedComparison(Speedup):
    """What a pass's `ctx.time` answers (measure.services): the candidate against the reference, timed interleaved
    by the harness; `ratio` is reference P50 / candidate P50 (> 1: the candidate is faster), `low`-`high` its 95%
    interval, widened by this comparison's own spread between sessions when each side ran several (`in_run_low`,
    `in_run_high`: the interval over rounds alone)."""

    p50_ms: float  # the candidate's
    input_p50_ms: float  # the reference's
    rounds: int
    calls: int  # the candidate's timed calls


class InputsMix(Facts):
    """The inputs a scenario's latency was taken over (runtime.inputs.FeedSet.lengths)."""

    samples: int
    padding: str | None = None  # "max_length" | "longest"
    seq_min: int | None = None
    seq_median: float | None = None
    seq_max: int | None = None
    padded_share: float | None = None


class CudaKernels(Facts):
    """Per call, from the CUDA profiler: kernels run on the device and the launch calls the host made for them;
    or only `reason` when the profiler could not trace CUDA here."""

    kernels: float | None = None
    launches: float | None = None
    graph_launches: float | None = None
    memcpy: float | None = None
    busy_ms: float | None = None  # GPU busy time: while at least one kernel ran (CUPTI), no launch gaps
    calls: int | None = None
    reason: str | None = None

    @property
    def counted(self) -> bool:
        return self.kernels is not None and self.launches is not None


class Transfers(Facts):
    h2d_ms: float
    d2h_ms: float


class NvmlSummary(Facts):
    """GPU utilisation, memory and power sampled while the stage was timed; or only `reason`."""

    samples: int | None = None
    gpu_util_mean_pct: float | None = None
    gpu_util_max_pct: float | None = None
    memory_used_max_mb: float | None = None
    power_mean_w: float | None = None
    power_max_w: float | None = None
    reason: str | None = None


class NodeTimes(Facts):
    """ONNX Runtime's kernel ms per node and call (median over the profiled runs): the slowest nodes by name and
    totals over every node, so that metrics stay small; `digests` says which nodes ran at all (new/gone)."""

    top: list[tuple[str, str, float]] = []  # (node, op type, ms per call): the slowest (ort_runner.TOP_NODES) first
    nodes: int = 0  # distinct nodes that ran
    total_ms: float = 0.0  # every node's ms per call
    digests: list[str] = []  # every node that ran: 8 hex digits of blake2b(name), sorted (membership only)


class ScenarioProfile(Facts):
    """The runtime's own profile on one scenario's timing input (report.explain): per call (generation: per decode
    step) and per prefill; the fields mean what StageMetrics' same-named ones mean for the first scenario."""

    source: str | None = None  # "onnxruntime" | "torch"; None: only CUDA kernels were profiled
    op_time_ms: dict[str, float] = {}
    prefill_op_time_ms: dict[str, float] = {}
    kernel_time_ms: dict[str, float] = {}
    prefill_kernel_time_ms: dict[str, float] = {}
    node_time: NodeTimes | None = None  # ONNX Runtime: per node, per call (generation: per decode step)
    prefill_node_time: NodeTimes | None = None
    nodes_executed: int | None = None


class ScenarioMetrics(Facts):
    """One stage in one scenario."""

    latency: Latency  # one call (forward) or one whole generation (generation)
    throughput: Throughput
    iterations: int | None = None  # timed calls (or generations) of the stage
    rounds: int | None = None
    median_ci_halfwidth: float | None = Field(
        default=None,
        description="relative half-width of the median's 95% interval; null (in memory: infinite) when the calls "
        "taken cannot bound it (fewer than 6, or a zero median)",
    )
    inputs: InputsMix | None = None
    samples_ms: list[float] | None = None  # every timed call, kept for diff's between-run bootstrap
    parent_latency: Latency | None = None  # the input's calls in the same interleaved session
    vs_parent: Speedup | None = None
    # The spread between sessions of one artifact as this stage's rounds read it (measure.stats.InstanceSpread:
    # log variance, unclipped; its contrasts; the share the ratio carries); the run pools it (measure.instances)
    instance_variance: float | None = None
    instance_df: int | None = None
    instance_factor: float | None = None
    tpot_instance_variance: float | None = None  # generation: the same reading for tpot_vs_parent
    tpot_instance_df: int | None = None
    # CUDA stages: the CUDA event span of each call on its compute stream (kernels and the gaps between their
    # launches; no host setup or sync inside it). GPU busy time is cuda_kernels.busy_ms.
    gpu_latency: Latency | None = None
    transfers: Transfers | None = None
    nvml: NvmlSummary | None = None
    cuda_kernels: CudaKernels | None = None
    ttft: Latency | None = None  # generation: time to first token
    tpot: Latency | None = None  # generation: time per output token, every decode step
    parent_ttft: Latency | None = None  # generation: the input's, same interleaved session
    parent_tpot: Latency | None = None
    prompt_tokens: int | None = None
    new_tokens: int | None = None
    profile: ScenarioProfile | None = None  # op types and nodes on this scenario's input (every scenario)
    tpot_vs_parent: Speedup | None = None  # generation: parent TPOT P50 / stage's, interleaved, with its interval
    # CPU ONNX stages: the stage's P50 / the same artifact's with denormals flushed, in a short interleaved probe
    # (measure.denormal_probe); > 1: flushing them would make it faster
    denormal_probe: Speedup | None = None


class OutputAccuracy(Facts):
    """One output against stage 0's (measure.accuracy), or the whole generation's agreement for generation."""

    cosine: float  # the lowest per-sample cosine on kept positions (generation: logits before divergence)
    cosine_mean: float | None = None
    max_abs: float | None = Field(default=None, description="null: infinite, NaN/inf where the reference is finite")
    max_rel: float | None = Field(default=None, description="null: infinite, NaN/inf where the reference is finite")
    top1: float | None = None
    positions: str | None = None  # "kept by the attention mask" | "all"
    samples: int | None = None
    nonfinite: int | None = None  # NaN/inf where the reference is finite
    cosine_all_positions: float | None = None
    pooled_cosine: float | None = None
    pooled_cosine_mean: float | None = None
    # [low, high, p]: a 90% interval of the metric's p-quantile, p = 1/(n+1) (measure.accuracy, the budget's edge)
    cosine_bound: list[float] | None = None
    pooled_cosine_bound: list[float] | None = None
    token_agreement: float | None = None  # generation
    logits_cosine_min: float | None = None  # generation

    def figure(self, metric: str) -> float | None:
        """The value of a metric by its budget name (cosine, pooled_cosine, top1, token_agreement...), or None."""
        value = getattr(self, metric, None)  # a declared field or an extra one
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class Memory(Facts):
    """How the stage's host memory was measured (measure.forward.stage_memory)."""

    method: Literal["process", "inline"]
    inline_mb: float | None = None  # growth of the compile process while the stage loaded
    peak_mb: float | None = None  # "process": peak resident set of serving it in a fresh process
    steady_mb: float | None = None
    runtime_mb: float | None = None  # the libraries and inputs, the same for every stage
    reason: str | None = None  # why the fresh-process probe could not run
    note: str | None = None


class MachineLoad(Facts):
    """Other processes' CPU, steal time and load average while the stage was timed (measure.machine)."""

    seconds: float
    other_cpu_cores: float
    own_cpu_cores: float
    steal_share: float
    load_avg_1m: float
    cores: int


class GraphFacts(Facts):
    """The saved graph of an ONNX stage; empty ({}) for an artifact without one (the PyTorch source)."""

    nodes: int | None = None
    op_types: dict[str, int] = {}  # op type (with its domain when not the standard one) -> count

    @property
    def present(self) -> bool:
        return self.nodes is not None


class TimedWindow(Facts):
    """When a timed measurement held its host's bench slot (measure.bench_slot): wall-clock epoch seconds."""

    host: str
    start: float
    end: float
    pid: int
    what: str  # the stage and what was timed: "fused measure", "hybrid_int8 hybrid timing", "calibration"...


class StageMetrics(Facts):
    """Everything measured about one stage: per scenario, plus accuracy, memory and graph facts."""

    workload: Literal["forward", "generation"] = "forward"
    runtime: dict[str, Any] = {}  # what the runner says it ran with (its keys depend on the runtime)
    memory_mb: float | None = None  # the memory figure: `memory.peak_mb`, or the in-process growth
    memory: Memory | None = None
    gpu_memory_mb: float | None = None  # device memory the stage's runtime took (runtime.gpu.memory), any runtime
    gpu_memory_method: str | None = None  # how it was read: NVML per-process, or cudaMemGetInfo
    accuracy: dict[str, OutputAccuracy]  # per output, in the model's output order
    within_budget: bool
    budget: str  # the sentence that says why
    budget_edge: bool = False  # the budget metric's interval straddles the line: at the edge, not resolved
    # seconds each step of measuring this stage took (load, accuracy, time, profile, memory): where a compile's
    # wall time goes (scripts/compile_phases.py); {} in metrics measured before it was recorded
    phase_seconds: dict[str, float] = {}
    scenarios: dict[str, ScenarioMetrics]
    machine_load: MachineLoad | None = None
    op_time_ms: dict[str, float] = {}  # per call (generation: per decode step), from op_time_source's profiler
    # "onnxruntime" (ORT's node times; absent in reports from before it was recorded) or "torch" (the PyTorch
    # profiler's outermost aten ops, e.g. aten::linear): names from two runtimes are not the same op types.
    op_time_source: str | None = None
    prefill_op_time_ms: dict[str, float] = {}  # generation: one prefill call, same profiler
    # CUDA stages: device ms per kernel name (without template arguments) per call (generation: per decode step),
    # from CUPTI through the PyTorch profiler; the same names whichever runtime launched them
    kernel_time_ms: dict[str, float] = {}
    prefill_kernel_time_ms: dict[str, float] = {}
    nodes_executed: int | None = None  # kernels ORT ran per call, after its own fusions
    nonfinite_reference: int | None = None  # stage 0 only: NaN/inf in the reference outputs
    # the peak resident memory of the worker process the stage ran in (its pass and its measuring together:
    # engine.stage_worker), which is what a stage costs the machine at a real size; None inline or cached
    worker_peak_mb: float | None = None
    instance_note: str | None = None  # why the stage ran one session a side though benchmark.instances asked more
    graph: GraphFacts | None = None  # the graph as saved ({} for the PyTorch source)
    size_bytes: int | None = None  # bytes on disk (parameter bytes for the PyTorch source)
    own_bytes: int | None = None  # of those, the bytes no earlier stage of the run has (hard links count once)
    timed_windows: list[TimedWindow] | None = None  # when and where this measurement held the bench slot

    @field_validator("machine_load", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, dict) and not value else value  # a load window that never closed

    @property
    def first_accuracy(self) -> OutputAccuracy | None:
        """The first output's accuracy: what tables show (the budget judges `accuracy.output`, by default it)."""
        return next(iter(self.accuracy.values()), None)


class SweepRow(Facts):
    batch: int
    p50_ms: float
    p99_ms: float
    samples_per_s: float
    memory_growth_mb: float


class SweepSkip(Facts):
    """A batch the sweep did not time: its inputs cannot fit in memory (engine.sweep)."""

    batch: int
    reason: str


class BatchSweep(Facts):
    """One stage across batch sizes and the batching to deploy (engine.sweep); only `why` when nothing was swept."""

    stage: str | None = None
    seq: int | None = None
    rows: list[SweepRow] = []
    skipped: list[SweepSkip] | None = None  # batches not timed, with the reason; the rows are those that fit
    latency_budget_ms: float | None = None
    memory_budget_mb: float | None = None
    max_batch: int | None = None
    preferred_batch: int | None = None
    why: str
    timed_windows: list[TimedWindow] | None = None  # when and where the sweep held the bench slot


class ScenarioWinner(Facts):
    """One scenario's fastest stage within the budget, stage 0 included, against stage 0 (measure.scenario_best)."""

    stage: str
    ratio: float  # > 1: faster than stage 0 (chained interleaved ratios)
    low: float
    high: float
    keep_source: bool  # the winner is stage 0: no deployable stage is faster there
    why: str


class ScenarioLoss(Facts):
    """The overall best against a scenario's winner in that scenario, where it is slower beyond noise."""

    scenario: str
    winner: str
    ratio: float  # overall best / winner: < 1
    low: float
    high: float
    keep_source: bool
    winner_label: str | None = None  # how the winner reads: `stage`, or "PyTorch (stage 0)"

    def sentence(self) -> str:
        who = self.winner_label or f"`{self.winner}`"
        return f"on {self.scenario} it is {self.ratio:.2f}x {who} ({self.low:.2f}-{self.high:.2f})"
