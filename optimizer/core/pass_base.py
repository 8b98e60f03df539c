"""Pass base class. A pass is a small class with one job: artifact in, new artifact (in its own folder) out.

"Cannot run here" is a reason (skip_reason returns it), not an exception: it becomes a `skipped` stage.
A real failure raises PassError; the pipeline records the stage as failed and keeps everything measured so far.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from optimizer.core.artifact import Artifact

if TYPE_CHECKING:
    from optimizer.recipe.schema import Recipe
    from optimizer.runtime.inputs import FeedSet


class PassConfig(BaseModel):
    """Base for every pass's Config: unknown fields are an error, so typos are caught at validate time."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class PassContext:
    """What a pass may use: its own output folder, the recipe, and sample inputs for numeric checks."""

    recipe: Recipe
    stage_name: str
    stage_dir: Path
    feeds: FeedSet
    done: tuple[str, ...] = ()
    # progress(what, done, total): long passes (calibration, searches) report through it.
    progress: Callable[[str, int, int], None] = field(default=lambda what, done, total: None)


@dataclass(frozen=True)
class PassResult:
    artifact: Artifact
    modified: bool
    notes: Mapping[str, Any] = field(default_factory=dict)


class Pass(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    Config: ClassVar[type[PassConfig]] = PassConfig
    consumes: ClassVar[frozenset[str]] = frozenset({"onnx"})
    # Bump when the pass's output changes for the same input and config: it invalidates cached stages.
    version: ClassVar[int] = 1

    def __init__(self, config: PassConfig) -> None:
        self.config = config

    # Python modules the pass needs; a missing one makes the pass unavailable here, with that reason.
    requires: ClassVar[tuple[str, ...]] = ()
    # Whether the pass handles generation artifacts (a prefill graph plus a decode graph). A pass that does not
    # would silently transform the prefill graph alone, so it declines them.
    handles_generation: ClassVar[bool] = False

    @classmethod
    def environment_reason(cls) -> str | None:
        """Why this pass cannot run on this machine at all (missing library, no GPU), or None."""
        import importlib.util

        missing = [m for m in cls.requires if importlib.util.find_spec(m) is None]
        return f"{', '.join(missing)} not installed" if missing else None

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        """Why this pass cannot run on this artifact here, or None."""
        if artifact.kind not in self.consumes:
            return f"takes {'/'.join(sorted(self.consumes))} artifacts, got {artifact.kind}"
        if artifact.meta.get("decode") and not self.handles_generation:
            return f"{self.name} does not handle generation graphs (prefill + decode with a KV cache) yet"
        return self.environment_reason()

    @abstractmethod
    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult: ...
