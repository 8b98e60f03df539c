"""Pass base class. A pass is a small class with one job: artifact in, new artifact (in its own folder) out.

"Cannot run here" is a reason (skip_reason returns it), not an exception: it becomes a `skipped` stage.
A real failure raises PassError with its message; the pipeline adds the stage name and what ran before it,
records the stage as failed and keeps everything measured so far.

What a pass reads of the recipe it declares (`Pass.reads`): those fields are in its stage's cache key, and its
`ctx.recipe` answers nothing else (optimizer.recipe.reads).

What a pass needs from the rest of the tool comes through its PassContext, not through imports: `ctx.check`
(the one accuracy implementation), `ctx.time` (the harness's interleaved timing) and `ctx.session` (the one
session factory). The engine hands the context its services, so passes depend on core, recipe and runtime only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypedDict, TypeVar, overload

import numpy as np
from pydantic import BaseModel, ConfigDict

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import OutputAccuracy, TimedComparison

if TYPE_CHECKING:
    from optimizer.recipe.schema import Recipe
    from optimizer.runtime.generation import Generation
    from optimizer.runtime.inputs import FeedSet
    from optimizer.runtime.runners.base import Session

Feed = dict[str, np.ndarray]
# What ctx.check compares: an artifact (run on the CPU), a function of a feed, or outputs computed before (one
# list of arrays per feed, in the order of `feeds`). Generation loops are compared as whole generations.
Outputs = Callable[[Feed], list[np.ndarray]] | Sequence[list[np.ndarray]]


@dataclass(frozen=True)
class Check:
    """Per output: cosine, max_abs, max_rel, pooled_cosine... as measure.accuracy computes them (on kept
    positions when an attention mask applies), as the report's OutputAccuracy (core.metrics)."""

    per_output: dict[str, OutputAccuracy]

    def worst(self, metric: str = "cosine", output: str | None = None, nonfinite_fails: bool = True) -> float:
        """The lowest value of `metric` (over every output, or `output`); a metric an output does not have falls
        back to its cosine. nonfinite_fails: an output with NaN/inf anywhere the reference is finite (padded
        positions too) scores 0; without it only the compared positions count (there a NaN already scores 0)."""
        def value(a: OutputAccuracy) -> float:
            if nonfinite_fails and a.nonfinite:
                return 0.0
            figure = a.figure(metric)
            return figure if figure is not None else float(a.cosine)

        return min((value(a) for name, a in self.per_output.items() if output is None or name == output), default=1.0)


class GenerationAgreement(TypedDict):
    """Two generations compared (measure.accuracy.generation_agreement): greedy token agreement over the generated
    sequence, the first step where they differ, the lowest logits cosine of any step and before that step."""

    token_agreement: float
    first_disagreement: int
    logits_cosine_min: float
    logits_cosine_before_divergence: float


class PassServices(Protocol):
    """Implemented by the measure layer (optimizer.measure.services) and handed over by the engine."""

    def check(self, reference: Any, candidate: Any, ctx: PassContext, feeds: Sequence[Feed] | None) -> Any: ...

    def time(
        self, candidate: Any, reference: Any, ctx: PassContext, feeds: Sequence[Feed] | None
    ) -> TimedComparison: ...

    def session(self, artifact: Artifact, ctx: PassContext, device: str) -> AbstractContextManager[Session]: ...

    def map(self, fn: Callable[[PassContext, Any], Any], items: Sequence[Any], ctx: PassContext, what: str
            ) -> list[Any]: ...


class PassConfig(BaseModel):
    """Base for every pass's Config: unknown fields are an error, so typos are caught at validate time."""

    model_config = ConfigDict(extra="forbid")


class PassNotes(BaseModel):
    """Base of a pass's notes (its `Notes`, declared beside its Config): the keys other code reads back (the
    report, deploy) are typed fields; the rest of the pass's account is kept as written (extra keys allowed, so a
    stage.json or report.json from another version still reads). report.json holds `to_json()`; a reader gets the
    typed view back with `Notes.model_validate(stage.notes)`."""

    model_config = ConfigDict(extra="allow")

    def to_json(self) -> dict[str, Any]:
        """The keys that were given (typed fields dumped to plain JSON values, extra ones as they are)."""
        return self.model_dump(exclude_unset=True)


@dataclass
class PassContext:
    """What a pass may use: its own output folder, the recipe, sample inputs, and the services below. In a
    pipeline `recipe` answers only the fields the pass declares (Pass.reads) and those every stage key holds
    (optimizer.recipe.reads.RecipeView): what its stage key leaves out, it cannot read."""

    recipe: Recipe
    stage_name: str
    stage_dir: Path
    feeds: FeedSet
    services: PassServices
    done: tuple[str, ...] = ()
    # progress(what, done, total): long passes (calibration, searches) report through it.
    progress: Callable[[str, int, int], None] = field(default=lambda what, done, total: None)

    @overload
    def check(self, reference: Generation, candidate: Generation, feeds: None = None) -> GenerationAgreement: ...

    @overload
    def check(
        self, reference: Artifact | Outputs, candidate: Artifact | Outputs, feeds: Sequence[Feed] | None = None
    ) -> Check: ...

    def check(
        self, reference: Any, candidate: Any, feeds: Sequence[Feed] | None = None
    ) -> Check | GenerationAgreement:
        """Candidate against reference through the one accuracy implementation. Artifacts, functions of a feed
        or precomputed outputs (see Outputs) give a Check over `feeds` (default: every sample of every
        scenario); two generations (runtime.generation.Generation) give their GenerationAgreement."""
        return self.services.check(reference, candidate, self, feeds)

    def time(self, candidate: Any, reference: Any, feeds: Sequence[Feed] | None = None) -> TimedComparison:
        """Candidate timed interleaved with reference by the harness (the recipe's benchmark settings): the ratio
        (> 1: the candidate is faster) with its interval and verdict, both P50s (core.metrics.TimedComparison).
        Artifacts (`benchmark.instances` sessions each, the interval
        widened by the spread between them), or open sessions (one each)."""
        return self.services.time(candidate, reference, self, feeds)

    def session(self, artifact: Artifact, device: str = "cpu") -> AbstractContextManager[Session]:
        """The artifact loaded by its runtime with its runtime options (CPU unless asked: checks run anywhere)."""
        return self.services.session(artifact, self, device)

    def map(self, fn: Callable[[PassContext, Any], Any], items: Sequence[Any], what: str = "") -> list[Any]:
        """[fn(ctx, item) for item in items], in order; with `optimizer compile --workers N` spread over N worker
        processes. fn must be picklable (a module-level function or a functools.partial of one, with picklable
        arguments) and a pure function of its arguments: in a worker it gets a copy of this context (its
        progress silent, its sessions on threads // N threads). what: the progress line as items finish."""
        return self.services.map(fn, items, self, what)

    def fork(self, stage_dir: Path) -> PassContext:
        """The same context writing into another folder (a pass that runs itself on a part of the artifact)."""
        return PassContext(self.recipe, self.stage_name, stage_dir, self.feeds, self.services, self.done, self.progress)

    def all_samples(self) -> list[Feed]:
        return [feed for sf in self.feeds for feed in sf.samples]


# What a pass whose choices are timed (fuse's kernel choice, the hybrid's ladder) reads: a choice holds for the
# target (threads) and benchmark settings it was timed with. In its recipe_reads; ctx.time requires them.
TIMING_READS: tuple[str, ...] = ("target", "benchmark")


@dataclass(frozen=True)
class PassResult:
    """What a pass made: the artifact, whether it changed anything, and its account (its Notes model, or a plain
    mapping for a pass whose notes nothing reads back)."""

    artifact: Artifact
    modified: bool
    notes: PassNotes | Mapping[str, Any] = field(default_factory=dict)

    def notes_json(self) -> dict[str, Any]:
        """The notes as stage.json and report.json hold them."""
        return self.notes.to_json() if isinstance(self.notes, PassNotes) else dict(self.notes)


ConfigT = TypeVar("ConfigT", bound=PassConfig)


class Pass(ABC, Generic[ConfigT]):
    """A pass over artifacts, generic in its Config: `class FusePass(Pass[FuseConfig])` declares `Config =
    FuseConfig`, and `self.config` is typed as one. Its registry key (core.registry.PASSES) is its `name`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # The class that validates the recipe's `config:` for this pass (a ClassVar cannot name ConfigT: the same class).
    Config: ClassVar[type[PassConfig]] = PassConfig
    # The model of its notes (PassResult.notes, a stage's `notes` in report.json), for the code that reads them back.
    Notes: ClassVar[type[PassNotes]] = PassNotes
    consumes: ClassVar[frozenset[str]] = frozenset({"onnx"})
    # Bump when the pass's output changes for the same input and config: it invalidates cached stages.
    version: ClassVar[int] = 1

    def __init__(self, config: ConfigT) -> None:
        self.config: ConfigT = config

    # Python modules the pass needs; a missing one makes the pass unavailable here, with that reason.
    requires: ClassVar[tuple[str, ...]] = ()
    # The most memory the pass takes while it runs, in multiples of its input's weights (its input, its output
    # and a working copy by default): a pass that would not fit the memory available is not run, with the reason,
    # before it loads anything (engine.memory_plan).
    memory_factor: ClassVar[float] = 3.0
    # Whether the pass handles generation artifacts (a prefill graph plus a decode graph). A pass that does not
    # would silently transform the prefill graph alone, so it declines them.
    handles_generation: ClassVar[bool] = False
    # Whether it handles a decoder in GenAI's layout (Artifact.genai_files): one graph whose cache is written in
    # place, with genai_config.json beside it; a pass that does not would lose the config or break the layout.
    handles_genai_layout: ClassVar[bool] = False

    @classmethod
    def environment_reason(cls) -> str | None:
        """Why this pass cannot run on this machine at all (missing library, no GPU), or None."""
        import importlib.util

        missing = [m for m in cls.requires if importlib.util.find_spec(m) is None]
        return f"{', '.join(missing)} not installed" if missing else None

    @classmethod
    def recipe_reason(cls, config: ConfigT, recipe: Recipe) -> tuple[str, str] | None:
        """(a field of the pass's config, why) when this config cannot work with the recipe: refused by validate,
        before anything runs."""
        return None

    # The recipe fields the pass reads beyond those every stage key holds (optimizer.recipe.reads.KEYED: the model,
    # inputs, scenarios, target.device...), as dotted paths ("accuracy.min", "target", "benchmark"). Their values
    # enter the stage key, and the pass's ctx.recipe answers nothing else (reads.RecipeView raises).
    reads: ClassVar[tuple[str, ...]] = ()

    def recipe_reads(self, recipe: Recipe) -> tuple[str, ...]:
        """The recipe fields this pass, with its config, reads (default: `reads`). `recipe` answers only the fields
        every key holds (target.device, workload...), for a pass whose reads depend on them."""
        return self.reads

    def key_extras(self, recipe: Recipe) -> dict[str, Any] | None:
        """What the output depends on beyond the config, the input, the feeds and the recipe fields it reads, for
        the cache key: facts of this machine (the CPU's INT8 range); None: nothing more. `recipe` answers what
        recipe_reads's does."""
        return None

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        """Why this pass cannot run on this artifact here, or None."""
        if artifact.kind not in self.consumes:
            return f"takes {'/'.join(sorted(self.consumes))} artifacts, got {artifact.kind}"
        if artifact.decode and not self.handles_generation:
            return f"{self.name} does not handle generation graphs (prefill + decode with a KV cache) yet"
        if artifact.genai_files and not self.handles_genai_layout:
            return f"{self.name} does not handle a decoder in GenAI's layout (one graph, KV cache written in place)"
        return self.environment_reason()

    @abstractmethod
    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult: ...
