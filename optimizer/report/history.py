"""Run history: every compile is recorded in an embedded SQLite database, so runs can be listed and diffed
by id after their folders are gone.

The whole report is stored with a few columns to filter on. Each run is written in one transaction (WAL
journal), so a process killed while writing leaves the database as it was before that run, never half a run.
Default path: the user's data dir (platformdirs); `OPTIMIZER_HISTORY` or `--history` override it.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, TypedDict

from optimizer.core.errors import OptimizerError
from optimizer.core.jsonio import strict_json_dumps
from optimizer.engine.rundir import content_hash
from optimizer.report.schema import RunReport, parse_report, read_report

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created TEXT NOT NULL,
    recipe TEXT NOT NULL,
    recipe_hash TEXT NOT NULL,
    model TEXT NOT NULL,
    device TEXT NOT NULL,
    outcome TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    versions TEXT NOT NULL,
    report TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS stage_metrics (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    stage TEXT NOT NULL,
    scenario TEXT NOT NULL,
    status TEXT NOT NULL,
    p50_ms REAL, p99_ms REAL, vs_parent REAL, vs_source REAL, cosine REAL
);
CREATE INDEX IF NOT EXISTS stage_metrics_run ON stage_metrics(run_id);
"""


def default_path() -> Path:
    env = os.environ.get("OPTIMIZER_HISTORY")
    if env:
        if Path(env).is_dir():
            raise OptimizerError(f"OPTIMIZER_HISTORY: {env} is a folder; name the history's file (e.g. "
                                 f"{Path(env) / 'history.sqlite'}), or unset it for the default")
        return Path(env)
    from platformdirs import user_data_dir

    return Path(user_data_dir("optimizer")) / "history.sqlite"


def _damaged(path: Path, e: Exception) -> OptimizerError:
    return OptimizerError(
        f"{path}: the run history is damaged ({e}); move it aside (a new one is then started) or restore a copy"
    )


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """SQLite's errors on a damaged file (a corrupt page, not a database at all) as one line naming the file."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        raise _damaged(path, e) from None


def _connect(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA busy_timeout=30000")  # concurrent compiles wait for each other's write
        conn.executescript(SCHEMA)
    except sqlite3.DatabaseError as e:
        raise _damaged(path, e) from None
    except (sqlite3.Error, OSError) as e:
        raise OptimizerError(f"{path}: cannot open the run history ({e})") from None
    return conn


def record(report: RunReport, path: Path | None = None) -> int:
    """Store a finished run; returns its id."""
    path = path or default_path()
    model = report.recipe.model
    label = model.get("package") or model.get("path") or model.get("architecture") or model.get("target") or "?"
    recipe = report.recipe.to_json()
    with _reading(path), closing(_connect(path)) as conn, conn:
        cur = conn.execute(
            "INSERT INTO runs (created, recipe, recipe_hash, model, device, outcome, run_dir, versions, report) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                report.created,
                report.recipe.name,
                content_hash(recipe),
                f"{model['source']}:{label}",
                report.settings.device,
                report.outcome,
                report.run_dir,
                json.dumps(report.environment.packages),
                strict_json_dumps(report.to_json()),  # `runs --json` prints it: strict JSON
            ),
        )
        run_id = int(cur.lastrowid or 0)
        rows = []
        for st in report.stages:
            if st.metrics is None:
                continue
            acc = st.metrics.first_accuracy
            for scen, sm in st.metrics.scenarios.items():
                rows.append(
                    (
                        run_id,
                        st.name,
                        scen,
                        st.status,
                        sm.latency.p50_ms,
                        sm.latency.p99_ms,
                        sm.vs_parent.ratio if sm.vs_parent is not None else None,
                        st.vs_source.get(scen),
                        acc.cosine if acc is not None else None,
                    )
                )
        conn.executemany("INSERT INTO stage_metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return run_id


class RunRow(TypedDict):
    """One run as the history lists it (the `runs` table less the report and the recipe hash)."""

    id: int
    created: str  # ISO 8601, UTC
    recipe: str
    model: str
    device: str
    outcome: str
    run_dir: str
    versions: str  # JSON: the libraries that decide the numbers


def list_runs(path: Path | None = None, recipe: str | None = None, limit: int = 20) -> list[RunRow]:
    """The newest runs first (of one recipe, when named), at most `limit`; none when there is no history yet."""
    path = path or default_path()
    if not path.exists():
        return []
    query = "SELECT id, created, recipe, model, device, outcome, run_dir, versions FROM runs"
    args: tuple[Any, ...] = ()
    if recipe:
        query += " WHERE recipe = ?"
        args = (recipe,)
    query += " ORDER BY id DESC LIMIT ?"
    with _reading(path), closing(_connect(path)) as conn:
        return [
            RunRow(id=i, created=created, recipe=name, model=model, device=device, outcome=outcome, run_dir=run_dir,
                   versions=versions)
            for i, created, name, model, device, outcome, run_dir, versions in conn.execute(query, (*args, limit))
        ]


def load_report(ref: str, path: Path | None = None) -> RunReport:
    """A report from a run folder, a report.json path, or a history id; any schema_version this optimizer knows
    (report.schema.parse_report is the one reader: it upgrades version 1 and refuses versions it does not know).
    Read from a folder, its run_dir is that folder; from the history, the folder it was compiled into."""
    p = Path(ref)
    if p.is_dir():
        p = p / "report.json"
        if not p.is_file():
            raise OptimizerError(f"{ref}: no report.json in this folder (is it a run folder of a finished compile?)")
    if p.is_file():  # the run is the folder it was read from, wherever it was compiled (a copy, a move):
        # its stage folders are read there, never where report.json's run_dir says it once was
        return read_report(p).model_copy(update={"run_dir": str(p.parent)})
    if ref.isdigit():
        db = path or default_path()
        if db.exists():
            with _reading(db), closing(_connect(db)) as conn:
                row = conn.execute("SELECT report FROM runs WHERE id = ?", (int(ref),)).fetchone()
            if row:
                try:
                    data = json.loads(row[0])
                except ValueError as e:
                    raise OptimizerError(f"run {ref} in {db}: not a readable report ({e})") from None
                return parse_report(data, f"run {ref} in {db}")
        raise OptimizerError(f"run {ref}: no such id in the run history {db}")
    raise OptimizerError(f"{ref}: neither a run folder, a report.json nor a run id")
