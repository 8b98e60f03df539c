"""report.json, typed: RunReport, the one reader (`parse_report`, `read_report`) and the JSON Schema.

Version 2 is version 1's layout, validated: the same keys, with types (core.metrics, core.stage.StageReport);
`metrics: null` for a stage not measured (v1 wrote {}), and each artifact as core.artifact.Artifact now writes it
(its facts as fields; v1 had them under `meta`, which Artifact.from_json still reads). Version 3 takes the
pipeline's own keys out of a stage's `notes` (traceback, error_kind, cache, timed_windows) into typed fields of the
stage (core.stage.StageReport: traceback, error_kind, cache_note, pass_timed_windows), leaving `notes` the pass's.
An older report is upgraded in memory when it is read, so every reader sees one shape.

Extra fields: refused at the top level and on stages (every key any version wrote is modelled here, so an unknown
one is a file from another tool or a newer layout, which comes with a newer schema_version); kept on the metrics
and the recipe's echo (see core.metrics). The JSON Schema (report.schema.json, published beside this module and
written beside each report.json) is generated from these models; a test keeps the two in sync.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import SkipJsonSchema

from optimizer.core.errors import OptimizerError
from optimizer.core.metrics import BatchSweep, Facts, ScenarioLoss, ScenarioWinner, TimedWindow
from optimizer.core.stage import StageReport, split_legacy_notes

SCHEMA_VERSION: Literal[3] = 3  # RunReport.schema_version below says the same
SCHEMA_FILE = Path(__file__).with_name("report.schema.json")
SCHEMA_NAME = "report.schema.json"  # the copy written beside each report.json


class RecipeEcho(Facts):
    """The recipe as the run read it (optimizer.recipe.schema.Recipe, dumped); typed here where reports read it.
    Kept whole (extra allowed): a report's recipe must load even where the recipe schema has moved on since."""

    name: str
    model: dict[str, Any]  # the model source: {"source": "hf_folder", "path": ...} and so on
    workload: Literal["forward", "generation"] = "forward"


class ScenarioEcho(Facts):
    """A scenario as the recipe names it (optimizer.recipe.schema.Scenario, dumped)."""

    name: str
    batch: int
    seq: int
    new_tokens: int | None = None
    dims: dict[str, int] | None = None
    padding: str | None = None
    samples: int | None = None


class Environment(Facts):
    optimizer: str
    python: str
    platform: str
    cpu: str
    packages: dict[str, str]  # distribution -> version, for the libraries that decide the numbers


class Settings(Facts):
    device: str
    threads: int
    benchmark: dict[str, Any]  # the recipe's benchmark section as run (recipe.schema.BenchmarkSettings)
    accuracy: dict[str, Any]  # the recipe's accuracy budget (recipe.schema.AccuracyBudget)
    accuracy_metric: str | None = None  # what the budget judges (the task's default when unset)


class Calibration(Facts):
    """A fixed workload timed when the run started and ended (measure.machine.calibration_ms)."""

    before_ms: float | None = None
    after_ms: float | None = None
    timed_windows: list[TimedWindow] | None = None  # when and where each calibration held the bench slot
    # how many times slower this CPU multiplies denormal floats than normal ones (runtime.denormals)
    denormal_penalty: float | None = None


class BusySummary(Facts):
    """The one statement about a busy machine (measure.machine.busy_summary)."""

    stages: list[str]
    max_other_cpu_cores: float
    max_steal_share: float
    max_load_avg_1m: float
    cores: int
    calibration: Calibration | None = None
    calibration_change: float | None = None


class Machine(Facts):
    calibration: Calibration | None = None
    busy: BusySummary | None = None


class Best(Facts):
    stage: str | None  # None: no stage qualifies
    why: str
    # measure.scenario_best: each scenario's winner (stage 0 included), where the overall best loses, and what a
    # deployment can do when the winners differ
    per_scenario: dict[str, ScenarioWinner] = {}
    losses: list[ScenarioLoss] = []
    advice: str | None = None


class RunReport(BaseModel):
    """A run: settings, environment, every stage's numbers and what they add up to."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    schema_version: Literal[3]
    recipe: RecipeEcho
    created: str  # ISO 8601, UTC
    run_dir: str
    recipe_dir: str | None = None  # relative paths in the recipe (text files, models) resolve here
    environment: Environment
    settings: Settings
    scenarios: list[ScenarioEcho]
    stages: list[StageReport]
    outcome: Literal["ok", "failed", "interrupted", "incomplete"]
    failed_stages: list[str] = []
    wall_seconds: float
    machine: Machine | None = None
    batch_sweep: BatchSweep | None = None
    best: Best | None = None
    findings: list[str] = []  # plain sentences: failures, rejections, inversions, a busy machine
    # The run's id in the run history: known after the report is written, so never part of report.json.
    history_id: SkipJsonSchema[int | None] = Field(default=None, exclude=True)

    @property
    def scenario_names(self) -> list[str]:
        return [s.name for s in self.scenarios]

    def stage(self, name: str) -> StageReport | None:
        return next((s for s in self.stages if s.name == name), None)

    def to_json(self) -> dict[str, Any]:
        """What report.json holds: the fields that were set, so a v1 report's absent keys stay absent."""
        return self.model_dump(exclude_unset=True)


def json_schema() -> dict[str, Any]:
    schema = RunReport.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_NAME,
        **schema,
        "description": (
            f"optimizer run report (report.json), schema_version {SCHEMA_VERSION}; generated from "
            "optimizer.report.schema.RunReport. Strict JSON: a figure that is not finite (a median's interval with "
            "too few calls, an error against NaN) is written as null, with its meaning in the field's description; "
            "reports before this rule may hold Infinity."
        ),
    }


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2) + "\n"


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version 1 report as version 2 (a copy): unmeasured stages' `metrics: {}` become null; `history_id`, which
    some compiles added to the dict they printed from, is dropped. Everything else was already v2's layout."""
    out = copy.deepcopy(data)
    out["schema_version"] = 2
    out.pop("history_id", None)
    for stage in out.get("stages") or []:
        if isinstance(stage, dict) and stage.get("metrics") == {}:
            stage["metrics"] = None
    return out


def upgrade_v2(data: dict[str, Any]) -> dict[str, Any]:
    """A version 2 report as version 3 (a copy): each stage's notes keys that the pipeline wrote (traceback,
    error_kind, cache, timed_windows) move to the stage's fields (core.stage.LEGACY_NOTES_KEYS)."""
    out = copy.deepcopy(data)
    out["schema_version"] = 3
    stages = out.get("stages")
    for stage in stages if isinstance(stages, list) else []:
        if isinstance(stage, dict) and isinstance(stage.get("notes"), dict):
            stage["notes"], moved = split_legacy_notes(stage["notes"])
            stage.update({k: v for k, v in moved.items() if k not in stage})
    return out


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    # A key of a damaged file may hold anything: shown as repr unless printable, so the message stays one line.
    where = ".".join(str(p) if str(p).isprintable() else repr(p) for p in err["loc"]) or "report"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {' '.join(err['msg'].splitlines())}{more}"


def parse_report(data: Any, where: Path | str) -> RunReport:
    """The one reader: a report of any version this optimizer knows, as RunReport. A file that is not a report,
    of an unknown schema_version, or that does not fit it, is one OptimizerError naming `where`."""
    if not isinstance(data, dict) or "stages" not in data:
        raise OptimizerError(f"{where}: not a run report (no stages)")
    version = data.get("schema_version")
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise OptimizerError(
            f"{where}: report schema_version {version} is not one this optimizer reads (1..{SCHEMA_VERSION}); "
            "read it with the version that wrote it, or a newer one"
        )
    if version == 1:
        data = upgrade_v1(data)
    if version <= 2:
        data = upgrade_v2(data)
    try:
        return RunReport.model_validate(data)
    except ValidationError as e:
        raise OptimizerError(f"{where}: not a readable report ({_first_error(e)})") from None


def read_report(path: Path) -> RunReport:
    """report.json (any known version) from a file."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise OptimizerError(f"{path}: not a readable report ({e})") from None
    return parse_report(data, path)
