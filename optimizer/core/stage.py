"""One stage: StageRecord while the pipeline runs it, StageReport as report.json holds it.

Two accounts of a stage, kept apart: `notes` is the pass's own (what it fused, quantized, declined: open-ended,
each pass's keys), while what the pipeline says about the stage (why it failed, its cache, when the pass held the
bench slot) are typed fields. Reports up to schema_version 2 and the stage.json of stages built then kept the
pipeline's keys in `notes` too; their readers move them to the fields (`split_legacy_notes`).

StageReport lives in core (not beside the run report) because measure.best, which sits below the report, chooses
among stages by the same fields the report shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    WithJsonSchema,
    field_validator,
)

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import ScenarioMetrics, StageMetrics, TimedWindow

# "pending": not reached yet, in a report written while the run is going (one that was killed stays so).
Status = Literal["ran", "cached", "unchanged", "skipped", "failed", "interrupted", "not run", "pending"]
# "input": the recipe's inputs do not fit the model, a usage error (exit code 2, as validate's).
ErrorKind = Literal["input"]
# The notes keys the pipeline wrote before they were fields (reports up to schema_version 2, stage.json files of
# cached stages), and the field each is now.
LEGACY_NOTES_KEYS = {
    "error_kind": "error_kind",
    "traceback": "traceback",
    "cache": "cache_note",
    "timed_windows": "pass_timed_windows",
}


def split_legacy_notes(notes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the pass's notes, {field: value}) from notes that may hold the pipeline's own keys (LEGACY_NOTES_KEYS)."""
    own = {k: v for k, v in notes.items() if k not in LEGACY_NOTES_KEYS}
    return own, {LEGACY_NOTES_KEYS[k]: v for k, v in notes.items() if k in LEGACY_NOTES_KEYS}


@dataclass
class StageRecord:
    index: int
    name: str
    type: str
    parent: str | None  # the stage it starts from, as the recipe says
    status: Status = "not run"
    reason: str | None = None
    key: str | None = None
    folder: str | None = None
    artifact: Artifact | None = None
    # The stage whose artifact is in effect here: itself when it ran, else its parent's (skipped/failed
    # stages pass their input through). Attribution of a child is always against this stage's numbers.
    measured_against: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)  # the pass's own (PassResult.notes)
    error_kind: ErrorKind | None = None
    traceback: str | None = None  # a failed stage's
    cache_note: str | None = None  # why a cached folder or metrics.json was not used (rebuilt, measured again)
    pass_timed_windows: list[TimedWindow] | None = None  # when the pass itself held the bench slot (its ctx.time)
    # As measure returns them and metrics.json caches them: StageMetrics.to_json() ({} until measured).
    metrics: dict[str, Any] = field(default_factory=dict)
    pass_seconds: float | None = None
    bench_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("ran", "cached")

    def to_json(self) -> dict[str, Any]:
        """Every field; the pipeline's optional ones only when set, so that a stage without them reads as before."""
        pipeline = {
            "error_kind": self.error_kind,
            "traceback": self.traceback,
            "cache_note": self.cache_note,
            "pass_timed_windows": [w.to_json() for w in self.pass_timed_windows] if self.pass_timed_windows else None,
        }
        return {
            "index": self.index,
            "name": self.name,
            "type": self.type,
            "parent": self.parent,
            "status": self.status,
            "reason": self.reason,
            "key": self.key,
            "folder": self.folder,
            "artifact": self.artifact.to_json() if self.artifact else None,
            "measured_against": self.measured_against,
            "notes": self.notes,
            **{k: v for k, v in pipeline.items() if v is not None},
            "metrics": self.metrics,
            "pass_seconds": self.pass_seconds,
            "bench_seconds": self.bench_seconds,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> StageRecord:
        """The record `to_json` wrote (a stage worker's result, read back by the pipeline)."""
        windows = d.get("pass_timed_windows")
        return StageRecord(
            index=d["index"], name=d["name"], type=d["type"], parent=d.get("parent"), status=d["status"],
            reason=d.get("reason"), key=d.get("key"), folder=d.get("folder"),
            artifact=Artifact.from_json(d["artifact"]) if d.get("artifact") else None,
            measured_against=d.get("measured_against"), notes=dict(d.get("notes") or {}),
            error_kind=d.get("error_kind"), traceback=d.get("traceback"), cache_note=d.get("cache_note"),
            pass_timed_windows=[TimedWindow.model_validate(w) for w in windows] if windows else None,
            metrics=dict(d.get("metrics") or {}), pass_seconds=d.get("pass_seconds"),
            bench_seconds=d.get("bench_seconds"),
        )

    def to_report(self) -> StageReport:
        """The stage as the report holds it (its metrics validated); chained speedups are the report's to add."""
        return StageReport.model_validate({**self.to_json(), "artifact": self.artifact})


def _artifact(value: Any) -> Artifact:
    if isinstance(value, Artifact):
        return value
    try:
        return Artifact.from_json(value)
    except (KeyError, TypeError, AttributeError) as e:  # pydantic reports ValueErrors with the field's path
        raise ValueError(f"not an artifact ({type(e).__name__}: {e})") from None


# The artifact as core.artifact writes it (Artifact.to_json / from_json own its layout).
ArtifactJson = Annotated[
    Artifact,
    PlainValidator(_artifact),
    PlainSerializer(lambda a: a.to_json()),
    # Its fields, from the dataclass; in version 1 reports the facts were free-form under `meta` (still read).
    WithJsonSchema(TypeAdapter(Artifact).json_schema()),
]


class StageReport(BaseModel):
    """A stage in report.json. Extra fields are refused: every key a stage has ever had is modelled here, and a
    new one comes with a new schema_version (the metrics inside allow extras: see core.metrics)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    index: int
    name: str
    type: str  # the pass type ("source" for stage 0)
    parent: str | None = None
    status: Status
    reason: str | None = None
    key: str | None = None  # cache key (content hash)
    folder: str | None = None  # NN-name, inside the run folder
    artifact: ArtifactJson | None = None
    measured_against: str | None = None  # the stage whose artifact is in effect here (see StageRecord)
    notes: dict[str, Any] = {}  # the pass's own account (what it fused, quantized, declined...): each pass's keys
    error_kind: ErrorKind | None = None  # a failed stage: "input" when the recipe's inputs do not fit the model
    traceback: str | None = None  # a failed stage's (shown by --debug)
    cache_note: str | None = None  # why a cached folder or metrics.json was not used (rebuilt, measured again)
    pass_timed_windows: list[TimedWindow] | None = None  # when the pass itself held the bench slot (its ctx.time)
    metrics: StageMetrics | None = None  # None: not measured
    pass_seconds: float | None = None
    bench_seconds: float | None = None
    vs_source: dict[str, float] = {}  # scenario -> speedup against stage 0 (chained interleaved ratios)
    throughput_vs_source: dict[str, float] = {}  # scenario -> the same for mean times (throughput)

    @field_validator("metrics", mode="before")
    @classmethod
    def _empty_is_unmeasured(cls, value: Any) -> Any:
        return None if isinstance(value, dict) and not value else value  # v1 and StageRecord write {}

    @property
    def ok(self) -> bool:
        return self.status in ("ran", "cached")

    def scenario(self, name: str) -> ScenarioMetrics | None:
        return self.metrics.scenarios.get(name) if self.metrics is not None else None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)
