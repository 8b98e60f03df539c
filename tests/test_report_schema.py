"""The typed report: version 1 reports read into the same tables, version 2 reports' pipeline notes read as the
stage's fields, version 3 round-trips, the JSON Schema is the models', and what does not fit is one line naming the
file and the field.

tests/data/report_v1_minilm.json is the main job's report.json as the code before the typed report wrote it
(schema_version 1; each scenario's samples_ms cut to 12 calls and long pass notes trimmed, which no table reads);
report_v1_minilm.md is the report.md that run wrote, report_v1_minilm.html what that code rendered from this file.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from optimizer.core.errors import OptimizerError
from optimizer.core.metrics import Latency
from optimizer.measure.best import best_stage
from optimizer.report.build import save_report
from optimizer.report.findings import findings
from optimizer.report.html import to_html
from optimizer.report.markdown import to_markdown
from optimizer.report.schema import SCHEMA_FILE, RunReport, json_schema, json_schema_text, parse_report, read_report
from optimizer.report.tables import tail_cell

DATA = Path(__file__).parent / "data"
V1 = DATA / "report_v1_minilm.json"


def v1_data() -> dict[str, Any]:
    return json.loads(V1.read_text())


def report_of(stages: list[dict[str, Any]], scenarios: list[dict[str, Any]] | None = None, **top: Any) -> RunReport:
    """A small RunReport around hand-written stages (for tests of the verdicts that read reports)."""
    data = {
        "schema_version": 2,
        "recipe": {"name": "t", "model": {"source": "factory", "target": "tiny_models:mlp"}},
        "created": "2026-01-01T00:00:00+00:00",
        "run_dir": "/nowhere",
        "environment": {"optimizer": "0", "python": "3", "platform": "p", "cpu": "c", "packages": {}},
        "settings": {"device": "cpu", "threads": 1, "benchmark": {}, "accuracy": {"metric": "cosine"}},
        "scenarios": scenarios or [{"name": "b1", "batch": 1, "seq": 1}],
        "stages": stages,
        "outcome": "ok",
        "wall_seconds": 1.0,
        **top,
    }
    return parse_report(data, "test report")


def without_explanations(text: str) -> str:
    """The markdown or HTML without what came after the old code: the op-type explanation of each stage (its
    section, its chart, the clause added to an inversion's finding). Everything else stays byte for byte."""
    text = re.sub(r"## Why: each stage against its parent, by op type\n.*?(?=## Stages)", "", text, flags=re.S)
    text = re.sub(r"<h2>Why each stage's speed changed</h2>\n<figure>.*?</figure>\n", "", text, flags=re.S)
    return re.sub(r"; by op type, [^\n<]*?ONNX Runtime profiler\)\)", "", text)


# ---------------------------------------------------------------- version 1, through the one reader
def test_a_v1_report_reads_into_the_same_markdown_and_html() -> None:
    report = read_report(V1)
    assert report.schema_version == 3  # upgraded in memory
    assert without_explanations(to_markdown(report)) == (DATA / "report_v1_minilm.md").read_text()
    assert without_explanations(to_html(report)) == (DATA / "report_v1_minilm.html").read_text()
    assert "## Why: each stage against its parent, by op type" in to_markdown(report)


def busy_reworded(text: str) -> str:
    """The v1 busy-machine sentence in today's words (same numbers): "used up to X of N cores while S were
    timed (load..." became "kept the CPUs busy while S was timed (X cores' worth at most, on N cores; load..."."""
    def new(m: re.Match[str]) -> str:
        verb = "was" if "," not in m["stages"] else "were"
        return (f"other processes kept the CPUs busy while {m['stages']} {verb} timed ({m['x']} cores' worth at most, "
                f"on {m['n']} cores; load")
    return re.sub(r"other processes used up to (?P<x>[\d.]+) of (?P<n>\d+) cores while (?P<stages>.+?) were timed "
                  r"\(load", new, text)


def test_findings_and_best_recomputed_from_a_v1_report_are_the_ones_it_holds() -> None:
    report = read_report(V1)
    assert [without_explanations(f) for f in findings(report)] == [busy_reworded(f) for f in v1_data()["findings"]]
    best, why = best_stage(report.stages, report.scenario_names)
    assert best is not None and report.best is not None
    assert (best.name, why) == (report.best.stage, report.best.why) == ("int8_dynamic", v1_data()["best"]["why"])


def test_a_v1_unmeasured_stage_reads_as_none(tmp_path: Path) -> None:
    data = v1_data()
    data["stages"][-1].update(status="not run", metrics={}, reason="stopped")
    report = parse_report(data, "v1.json")
    assert report.stages[-1].metrics is None
    assert report.to_json()["stages"][-1]["metrics"] is None


# ---------------------------------------------------------------- version 2
def test_a_v2_report_s_pipeline_notes_read_as_the_stage_s_fields(tmp_path: Path) -> None:
    """Version 2 kept the pipeline's own keys in a stage's notes; read, they are the stage's typed fields and the
    notes keep only the pass's own."""
    data = json.loads(json.dumps(read_report(V1).to_json()))
    data["schema_version"] = 2
    window = {"host": "h", "start": 1.0, "end": 2.5, "pid": 7, "what": "hybrid hybrid timing"}
    data["stages"][0]["notes"] = {"traceback": "Traceback ...\nValueError: x", "error_kind": "input"}
    data["stages"][-1]["notes"] = {"mode": "hybrid", "cache": "cached folder 05-hybrid was incomplete: rebuilt",
                                   "timed_windows": [window]}
    report = parse_report(data, "v2.json")
    first, last = report.stages[0], report.stages[-1]
    assert (first.traceback, first.error_kind, first.notes) == ("Traceback ...\nValueError: x", "input", {})
    assert last.notes == {"mode": "hybrid"}
    assert last.cache_note == "cached folder 05-hybrid was incomplete: rebuilt"
    assert last.pass_timed_windows is not None and [w.to_json() for w in last.pass_timed_windows] == [window]
    written = report.to_json()
    assert written["schema_version"] == 3 and written["stages"][-1]["pass_timed_windows"] == [window]
    assert "timed_windows" not in written["stages"][-1]["notes"]
    assert parse_report(written, "v3.json").to_json() == written


# ---------------------------------------------------------------- version 3
def test_a_v3_report_round_trips_through_its_file(tmp_path: Path) -> None:
    report = read_report(V1)
    save_report(report, tmp_path)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["schema_version"] == 3 and written["stages"][0]["metrics"]["graph"] == {}  # as measured
    again = read_report(tmp_path / "report.json")
    assert again.to_json() == report.to_json()
    assert without_explanations((tmp_path / "report.md").read_text()) == (DATA / "report_v1_minilm.md").read_text()
    # Keys a report did not have stay absent: a v1 file without `recipe_dir` does not grow one.
    del written["recipe_dir"]
    assert "recipe_dir" not in parse_report(written, "x").to_json()


def test_the_published_schema_is_the_models_and_is_written_beside_each_report(tmp_path: Path) -> None:
    assert SCHEMA_FILE.read_text() == json_schema_text(), "run: python -c 'from optimizer.report.schema import \
json_schema_text, SCHEMA_FILE; SCHEMA_FILE.write_text(json_schema_text())'"
    save_report(read_report(V1), tmp_path)
    assert (tmp_path / "report.schema.json").read_text() == SCHEMA_FILE.read_text()
    schema = json_schema()
    assert schema["additionalProperties"] is False and schema["properties"]["schema_version"]["const"] == 3
    defs = schema["$defs"]
    assert defs["StageReport"]["additionalProperties"] is False
    assert defs["StageMetrics"]["additionalProperties"] is True and defs["Latency"]["additionalProperties"] is True


# ---------------------------------------------------------------- what does not fit
def test_an_unknown_version_is_refused_naming_the_file_and_the_version() -> None:
    for version in (4, 0, "2", None):
        data = {**v1_data(), "schema_version": version}
        with pytest.raises(OptimizerError) as info:
            parse_report(data, "/runs/x/report.json")
        message = str(info.value)
        assert "\n" not in message and message.startswith("/runs/x/report.json: ")
        assert f"schema_version {version} is not one this optimizer reads (1..3)" in message


def test_an_unknown_top_level_field_is_refused_and_an_unknown_metric_is_kept() -> None:
    data = json.loads(json.dumps(read_report(V1).to_json()))
    data["stages"][1]["metrics"]["scenarios"]["b1-s128"]["l2_misses"] = 12  # a newer measure's counter
    data["stages"][1]["metrics"]["runtime"]["arena"] = "off"
    report = parse_report(data, "new.json")
    kept = report.to_json()["stages"][1]["metrics"]
    assert kept["scenarios"]["b1-s128"]["l2_misses"] == 12 and kept["runtime"]["arena"] == "off"
    with pytest.raises(OptimizerError, match=r"^new\.json: not a readable report \(surprise: Extra inputs"):
        parse_report({**data, "surprise": 1}, "new.json")
    staged = copy.deepcopy(data)
    staged["stages"][0]["colour"] = "blue"
    with pytest.raises(OptimizerError, match=r"stages\.0\.colour: Extra inputs are not permitted"):
        parse_report(staged, "new.json")


def test_a_damaged_report_is_one_line_naming_the_field(tmp_path: Path) -> None:
    data = v1_data()
    del data["stages"][2]["metrics"]["scenarios"]["b1-s512"]["latency"]["p50_ms"]
    data["stages"][3]["metrics"]["within_budget"] = "perhaps"
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    with pytest.raises(OptimizerError) as info:
        read_report(path)
    assert str(info.value) == (
        f"{path}: not a readable report (stages.2.metrics.scenarios.b1-s512.latency.p50_ms: Field required "
        "(and 1 more))"
    )
    path.write_text("{not json")
    with pytest.raises(OptimizerError, match="not a readable report"):
        read_report(path)


def test_an_absent_tail_interval_is_not_an_unresolved_one() -> None:
    stats = {"n": 100, "p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0, "mean_ms": 1.2, "std_ms": 0.1, "min_ms": 0.9}
    old = Latency.model_validate({**stats, "cv": 0.1})  # measured before tail intervals: the P99 is shown
    unresolved = Latency.model_validate({**stats, "cv": 0.1, "p99_ci": None})
    assert tail_cell(old) == "3.00" and tail_cell(unresolved) == "n.r."
    assert "p99_ci" not in old.to_json() and Latency.model_validate(unresolved.to_json()).resolved() is False
