"""ORT session options as a stage of its own.

ONNX Runtime optimizes every graph it loads (constant folding, its own fusions, layout changes) unless told
not to. If that happened silently in every ONNX stage, ORT's work would be credited to whatever pass came
first. So the export stage is measured with optimizations off, and this stage switches them on: the graph is
the same file, only the session options differ, and the difference in latency is ORT's own.

The same holds for the thread pools: whether idle intra-op threads spin (`allow_spinning`), how many there
are (`intra_op_threads`) and whether the sessions share ONNX Runtime's one process-wide pool instead of keeping
one each (`shared_thread_pool`) are session options the stage sets, so a stage such as
`{type: ort_session, name: no_spin, config: {allow_spinning: false}}` is timed against its parent like any pass.
`denormal_as_zero` flushes denormal floats to zero (runtime.denormals): padded inputs' masked attention computes
on denormals, which x86 cores run many times slower, so it is a stage too (`flush_denormals` in the main job).
A generation artifact's two sessions (prefill and decode) both get them; the stage records what they run with
(notes.threads: pool, intra-op threads, spinning).

The graph ORT produces is also saved (ort_optimized.onnx; for a generation artifact also
ort_optimized_decode.onnx, the graph run per token) so its node count shows what ORT fused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError, PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult
from optimizer.runtime.denormals import denormal_settings
from optimizer.runtime.sessions import thread_settings
from optimizer.runtime.threads import target_threads


class OrtSessionConfig(PassConfig):
    graph_optimization_level: Literal["disable_all", "basic", "extended", "all"] = "all"
    execution_mode: Literal["sequential", "parallel"] = "sequential"
    inter_op_threads: int = 1
    allow_spinning: bool | None = Field(
        default=None,
        description="whether idle intra-op threads spin waiting for work (session.intra_op.allow_spinning); "
        "none: as the input stage has it (ONNX Runtime's default, on, unless an earlier stage set it)",
    )
    intra_op_threads: int | None = Field(
        default=None,
        ge=1,
        description="intra-op threads of each session this stage opens (a generation loop opens two); none: as "
        "the input stage has it (target.threads unless an earlier stage set it)",
    )
    shared_thread_pool: bool | None = Field(
        default=None,
        description="run every session on ONNX Runtime's process-wide pool (use_per_session_threads off; the pool "
        "is sized once per process from intra_op_threads and, from Python, always spins) instead of a pool per "
        "session; none: as the input stage has it (a pool per session unless an earlier stage set it)",
    )
    disabled_optimizers: list[str] | None = Field(
        default=None,
        description="ONNX Runtime graph transformers to leave out by name (e.g. SkipLayerNormFusion, whose CPU "
        "kernel measured slower than the Add + LayerNormalization it replaces): the same choice the fuse pass's "
        "kernel choice makes, for graphs it does not rewrite; added to those the input stage disabled",
    )
    denormal_as_zero: bool | None = Field(
        default=None,
        description="flush denormal floats to zero (onnxruntime's session.set_denormal_as_zero, on every thread "
        "that runs the session): arithmetic on denormals, e.g. masked attention over padded positions, runs up "
        "to 2x slower on x86; values below 1.2e-38 become 0; none: as the input stage has it (off unless an "
        "earlier stage set it)",
    )
    dynamic_block_base: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="onnxruntime's session.dynamic_block_base: parallel loops hand out work in shrinking blocks "
        "(block = remaining / (threads x base)) instead of fixed shares, which evens out the small ops of a decode "
        "step; none: as the input stage has it (off unless an earlier stage set it)",
    )
    save_optimized: bool = True


# Why a shared pool is not a stage (measured with onnxruntime 1.32): Python can create ORT's process-wide pools
# (set_global_thread_pool_sizes, once per process), but from then on ORT refuses every session that keeps its own
# pool ("use_per_session_threads must be false when using a global thread pool", onnxruntime_pybind_state.cc),
# so a shared-pool stage and its per-session parent cannot be timed interleaved in one process; and the pool's
# spinning cannot be switched off from Python (the C API's SetGlobalSpinControl is not bound).
SHARED_POOL_REASON = (
    "shared_thread_pool cannot be timed against its parent: once onnxruntime's process-wide pool exists (Python: "
    "set_global_thread_pool_sizes) it refuses every session with a pool of its own, so parent and child cannot "
    "be interleaved in one process; a deployment whose every session uses it can (runtime.shared_thread_pool)"
)


class OrtSessionPass(Pass[OrtSessionConfig]):
    name = "ort_session"
    summary = "ONNX Runtime's own graph optimizations and thread-pool settings, switched on as a stage of their own"
    Config = OrtSessionConfig
    consumes = frozenset({"onnx"})
    # 2: a generation artifact's decode graph optimized and saved too; 3: shared_thread_pool, notes; 4: disabled
    # optimizers; 5: denormal_as_zero; 6: dynamic_block_base; 7: a large input referred to, not copied (hard links,
    # which version 6 made for a few hours, onnx refuses to read)
    version = 7
    requires = ("onnxruntime",)
    handles_generation = True
    handles_genai_layout = True  # same files, new session options (genai_config.json is copied with the graph)

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        cfg = self.config
        if cfg.shared_thread_pool:
            return SHARED_POOL_REASON
        return super().skip_reason(artifact, ctx)

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        cfg = self.config
        assert artifact.path is not None
        # Same graphs, new session options. When the input is a stage of this run, this stage refers to its files
        # (a 2.4 GB weights file is not copied for a change of options; every stage's stage.json keeps the
        # files' sha256, so a file changed since is found, never trusted; deploy bundles copy them). A user's own
        # file (an ONNX source) is copied into the stage folder, so that editing it in place cannot reach the
        # run. (Hard links were tried: onnx refuses external data with several links, a "hardlink attack".)
        # Below REFER_FROM_BYTES the copy is cheap and the stage folder stays a complete model of its own.
        in_run = ctx.stage_dir.resolve().parent in artifact.path.resolve().parents
        refer = in_run and (artifact.size_bytes() or 0) >= REFER_FROM_BYTES
        model_path = artifact.path if refer else artifact.copy_to(ctx.stage_dir, "model.onnx").path
        assert model_path is not None
        runtime = session_runtime(cfg)
        if "disabled_optimizers" in runtime:  # added to what an earlier stage disabled (fuse's kernel choice)
            inherited = list(artifact.runtime.get("disabled_optimizers") or [])
            added = [d for d in runtime["disabled_optimizers"] if d not in inherited]
            runtime["disabled_optimizers"] = inherited + added
        out = artifact.derive(path=model_path, runtime={**artifact.runtime, **runtime})
        notes: dict[str, object] = {
            "session_options": runtime,
            "threads": thread_settings(out.runtime, target_threads(ctx.recipe)),
            "denormals": denormal_settings(out.runtime),
        }
        if cfg.save_optimized:
            notes["ort_optimized_graph"] = self._optimized(model_path, "ort_optimized.onnx", out, ctx)
            decode = out.decode_path()
            if decode is not None:  # the graph a generation runs per token: where ORT's work counts most
                notes["ort_optimized_decode_graph"] = self._optimized(decode, "ort_optimized_decode.onnx", out, ctx)
        changed = out.runtime != artifact.runtime
        return PassResult(out, modified=changed or cfg.graph_optimization_level != "disable_all", notes=notes)

    def _optimized(self, src: Path, name: str, out: Artifact, ctx: PassContext) -> dict[str, Any]:
        """The graph as ORT runs it under these options, saved beside the stage, and its op histogram."""
        from optimizer.runtime import onnx_io
        from optimizer.runtime.sessions import ort_session

        optimized = ctx.stage_dir / name
        weights = sum(f.stat().st_size for f in out.files() if f.suffix != ".onnx" and f.is_file())
        large = weights >= KEEP_OPTIMIZED_BELOW
        # Past protobuf's 2 GB the optimized graph can only be written with its weights in a side file; past
        # KEEP_OPTIMIZED_BELOW it is read for its op histogram and removed: a copy of the weights in another
        # layout, for a histogram, is not worth gigabytes of disk.
        config = {"session.optimized_model_external_initializers_file_name": name + ".data",
                  "session.optimized_model_external_initializers_min_size_in_bytes": "1024"} if large else None
        try:
            session = ort_session(src, out.runtime, target_threads(ctx.recipe), optimized_path=str(optimized),
                                  config=config)
            del session  # its weights freed before the next graph's session loads
        except OptimizerError as e:
            raise PassError(f"onnxruntime could not optimize the graph: {e}") from e
        hist = onnx_io.op_histogram(optimized)
        if not large:
            return {"file": optimized.name, "nodes": sum(hist.values()), "op_types": hist}
        for f in (optimized, ctx.stage_dir / (name + ".data")):
            f.unlink(missing_ok=True)
        return {"file": None, "nodes": sum(hist.values()), "op_types": hist,
                "not_kept": f"weights of {weights / 2**30:.1f} GiB: the optimized graph was read and removed"}


REFER_FROM_BYTES = 64 * 2**20  # an input this large is referred to, not copied (a stage of this run)
KEEP_OPTIMIZED_BELOW = 512 * 2**20  # weights bytes past which ORT's optimized graph is not kept in the stage


def session_runtime(cfg: OrtSessionConfig) -> dict[str, Any]:
    """The runtime keys this stage sets; the thread-pool options only when given, so a later ort_session stage
    that does not name them keeps what an earlier one chose."""
    runtime: dict[str, Any] = {
        "graph_optimization_level": cfg.graph_optimization_level,
        "execution_mode": cfg.execution_mode,
        "inter_op_threads": cfg.inter_op_threads,
    }
    if cfg.allow_spinning is not None:
        runtime["allow_spinning"] = cfg.allow_spinning
    if cfg.intra_op_threads is not None:
        runtime["intra_op_threads"] = cfg.intra_op_threads
    if cfg.shared_thread_pool is not None:
        runtime["shared_thread_pool"] = cfg.shared_thread_pool
    if cfg.disabled_optimizers is not None:
        runtime["disabled_optimizers"] = list(cfg.disabled_optimizers)
    if cfg.denormal_as_zero is not None:
        runtime["denormal_as_zero"] = cfg.denormal_as_zero
    if cfg.dynamic_block_base is not None:
        runtime["dynamic_block_base"] = cfg.dynamic_block_base
    return runtime
