"""What a stage needs in memory, decided before anything loads: whether to run it in a worker process, how many
sessions a side its timing can hold, whether its parent can be loaded beside it, or whether it cannot be measured
on this machine at all. The estimates are from file sizes (ONNX Runtime holds an artifact's weights once per
session; a decoder's prefill and decode graphs are two sessions over one weights file), so they are known without
loading anything; the reason for every step down is kept for the report.

Available memory is the kernel's MemAvailable, or OPTIMIZER_MEMORY_AVAILABLE (bytes; a test, or a user who shares
the machine with something that will grow)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from optimizer.core.artifact import Artifact
from optimizer.recipe.schema import HFConfigSource, HFFolderSource, OnnxSource, Recipe

ISOLATE_FROM_BYTES = 256 * 2**20  # isolation: auto runs stages in workers from source weights of this size
SESSION_OVERHEAD = 1.15  # a session's weights plus what ORT or PyTorch allocate around them (arenas, packing)
HEADROOM_BYTES = 512 * 2**20  # activations, the inputs, the interpreter: kept free beside the estimate
ENV_AVAILABLE = "OPTIMIZER_MEMORY_AVAILABLE"


def available_bytes() -> int:
    """Memory this process may still take: OPTIMIZER_MEMORY_AVAILABLE when set, else /proc/meminfo's MemAvailable
    (the kernel's estimate of what can be allocated without swapping)."""
    if os.environ.get(ENV_AVAILABLE):
        return int(float(os.environ[ENV_AVAILABLE]))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # no figure (not Linux): nothing is refused on a guess


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def weights_bytes(artifact: Artifact) -> int:
    """The artifact's weights: a torch source's parameters, else its files (graphs and external data)."""
    if artifact.kind == "torch":
        return int(artifact.param_bytes or 0)
    return int(artifact.size_bytes() or 0)


def sessions_of(artifact: Artifact) -> int:
    """How many copies of its weights one loaded instance holds: a prefill/decode pair opens two sessions over
    the same file; a GenAI-layout graph, a single graph, an engine or a torch module one."""
    return 2 if artifact.decode else 1


def instance_bytes(artifact: Artifact) -> int:
    """One loaded instance (what one generator or one session of the artifact holds), estimated."""
    return int(weights_bytes(artifact) * sessions_of(artifact) * SESSION_OVERHEAD)


def source_bytes(recipe: Recipe) -> int | None:
    """The source model's weights, known before it is built: an ONNX file's size with its side files, an HF
    folder's weight files, an HF config's parameter count (built on PyTorch's meta device: no memory). None for
    a factory (known only once it has run)."""
    model = recipe.model
    if isinstance(model, OnnxSource):
        path = recipe.resolve(model.path)
        return sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file()) if path.is_file() else None
    if isinstance(model, HFFolderSource):
        folder = recipe.resolve(model.path)
        if not folder.is_dir():
            return None
        return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))
    if isinstance(model, HFConfigSource):
        return _config_param_bytes(model)
    return None


def _config_param_bytes(source: HFConfigSource) -> int | None:
    from optimizer.runtime.models import config_param_bytes

    try:
        return config_param_bytes(source)
    except Exception:  # a config transformers refuses: stage 0 says so, with the reason, when it loads
        return None


def isolate(recipe: Recipe, source: int | None) -> bool:
    """Whether stages run in worker processes: `isolation`, or for auto, a source of ISOLATE_FROM_BYTES or more."""
    if recipe.isolation != "auto":
        return recipe.isolation == "process"
    return source is not None and source >= ISOLATE_FROM_BYTES


@dataclass(frozen=True)
class MeasurePlan:
    """How a stage can be timed in the memory there is: `instances` sessions a side, with its parent (or alone),
    or not at all (`reason` says why, and `note` why it steps down from what the recipe asked)."""

    instances: int
    with_parent: bool
    reason: str | None = None  # not measurable: what it would need against what is available
    note: str | None = None


def measure_plan(artifact: Artifact, parent: Artifact | None, instances: int, available: int | None = None
                 ) -> MeasurePlan:
    """The most the recipe asks for that fits: `instances` a side with the parent, then one a side, then the
    stage alone (no ratio to its parent), else not measured."""
    free = (available_bytes() if available is None else available) - HEADROOM_BYTES
    child = instance_bytes(artifact)
    pair = child + (instance_bytes(parent) if parent is not None else 0)
    if instances * pair <= free:
        return MeasurePlan(instances, parent is not None)
    if instances > 1 and pair <= free:
        return MeasurePlan(1, parent is not None, note=(
            f"benchmark.instances: {instances} sessions a side would need about {gib(instances * pair)}, "
            f"{gib(free)} available: timed with one a side, so the intervals leave out the spread between sessions"))
    if parent is not None and child <= free:
        return MeasurePlan(1, False, note=(
            f"the stage beside its parent would need about {gib(pair)}, {gib(free)} available: timed alone, "
            "without a ratio to its parent"))
    if child <= free:
        return MeasurePlan(1, False)
    return MeasurePlan(0, False, reason=(
        f"not measured: loading it needs about {gib(child)} ({sessions_of(artifact)} session(s) over "
        f"{gib(weights_bytes(artifact))} of weights), {gib(free)} available"))


PASS_MEMORY_FACTOR = 3.0  # a pass holds its input, its output and a working copy, at most, by default


def pass_reason(input_artifact: Artifact, factor: float, available: int | None = None) -> str | None:
    """Why a pass cannot run here, decided before it loads anything: `factor` x its input's weights (the pass's
    own `memory_factor`) against the memory available; None when it fits."""
    free = (available_bytes() if available is None else available) - HEADROOM_BYTES
    need = weights_bytes(input_artifact) * factor
    if need <= free:
        return None
    return (f"not run: it would need about {gib(need)} ({factor:g} x the input's {gib(weights_bytes(input_artifact))}"
            f" of weights), {gib(free)} available")


# Passes that write weights of their own (the rest link or refer to their input's): the disk a run may take.
WRITES_WEIGHTS = frozenset({"export", "quantize", "genai_build", "fuse", "openvino", "nncf_int8", "ort_transformers",
                            "substitute", "tensorrt"})


def run_plan(recipe: Recipe, available: int | None = None) -> list[str]:
    """What a compile will take, said before it starts: the source's size, where stages run, the most memory a
    stage's timing may need (and what is done when it does not fit), and the disk at most."""
    source = source_bytes(recipe)
    if source is None:
        return []
    free = (available_bytes() if available is None else available) - HEADROOM_BYTES
    passes = recipe.passes
    writers = sum(1 for p in passes if p.type in WRITES_WEIGHTS)
    pair = 2 if recipe.workload == "generation" else 1  # a decoder's export: prefill and decode sessions
    # the largest timing: two ONNX stages of the source's size a side each, `instances` a side
    from optimizer.measure.harness import instances_for

    instances = instances_for(recipe.benchmark)
    need = int(instances * 2 * pair * source * SESSION_OVERHEAD)
    where = "each stage in a worker process of its own" if isolate(recipe, source) else "stages in this process"
    fit = "fits" if need <= free else (
        f"more than the {gib(free)} available: stages that do not fit step down to one session a side, then "
        "alone, then are not measured, each with the reason")
    return [
        f"plan: {len(passes) + 1} stages over a source of {gib(source)} (FP32); {where}",
        f"memory: the largest timing needs about {gib(need)} ({instances} session(s) a side, stage and parent): "
        f"{fit}",
        f"disk: at most about {gib((writers + 1) * source)} ({writers} stages write weights; the rest link their "
        "input's)",
    ]
