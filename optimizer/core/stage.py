"""StageRecord: everything known about one stage, as it goes into report.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from optimizer.core.artifact import Artifact

# "pending": not reached yet, in a report written while the run is going (one that was killed stays so).
Status = Literal["ran", "cached", "skipped", "failed", "interrupted", "not run", "pending"]


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
    notes: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # per scenario, plus accuracy/memory/graph
    pass_seconds: float | None = None
    bench_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("ran", "cached")

    def to_json(self) -> dict[str, Any]:
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
            "metrics": self.metrics,
            "pass_seconds": self.pass_seconds,
            "bench_seconds": self.bench_seconds,
        }
