"""A run in MLflow (`optimizer compile --mlflow URI`): one parent run per compile, one nested run per stage.

The run history (SQLite, report/history.py) stays the default record; this is for teams whose runs already live in
MLflow. Parent: the recipe, the model, the target and the environment as params, the history id and the best stage
as tags, report.html/json/md and the recipe as artifacts. Each stage: its pass type and config as params; P50/P99,
the ratio against its parent and against stage 0 per scenario, the budget's figure, memory and size as metrics;
status and verdict as tags. Logged with MlflowClient in batches, so nothing touches mlflow's global active run.

URIs: `file:` paths (MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is set; naming one here is
that consent, for this call only), `sqlite:///path.db` (artifacts beside the database, never in the working
folder) and a tracking server's http(s) address.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.core.errors import OptimizerError, install_hint
from optimizer.core.stage import StageReport

if TYPE_CHECKING:
    from collections.abc import Iterator

    from optimizer.report.schema import RunReport

INSTALL = install_hint("mlflow")
ARTIFACTS = ("report.html", "report.json", "report.md")
RECIPE_FILE = "recipe.yaml"  # written beside the report by `compile --model` (cli/auto_compile.py)
MAX_PARAM = 500  # MLflow limits a param's value (6000 chars in 2.x+); a config this long is read in report.json
# MLflow's HTTP client retries 7 times with backoff (~4 min against a server that is down): bounded for our calls.
CHECK_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
SCHEMES = ("file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")
LOG_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b": "value"}; lists as JSON (a param is one string)."""
    if isinstance(data, dict):  # an empty config adds no param
        out: dict[str, str] = {}
        for k, v in data.items():
            out |= flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if not prefix:
        return {}
    text = json.dumps(data) if isinstance(data, list | dict) else str(data)
    return {prefix: text[:MAX_PARAM]}


def _finite(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def stage_metrics(report: RunReport, st: StageReport) -> dict[str, float]:
    """The numbers of one stage, by MLflow key (scenario/what)."""
    out: dict[str, float | None] = {"pass_seconds": st.pass_seconds, "bench_seconds": st.bench_seconds}
    for scen, ratio in st.vs_source.items():
        out[f"{scen}/vs_source"] = ratio
    m = st.metrics
    if m is not None:
        for scen, sm in m.scenarios.items():
            out |= {f"{scen}/p50_ms": sm.latency.p50_ms, f"{scen}/p99_ms": sm.latency.p99_ms,
                    f"{scen}/samples_per_s": sm.throughput.samples_per_s,
                    f"{scen}/tokens_per_s": sm.throughput.tokens_per_s}
            if sm.vs_parent is not None:
                out |= {f"{scen}/vs_parent": sm.vs_parent.ratio, f"{scen}/vs_parent_low": sm.vs_parent.low,
                        f"{scen}/vs_parent_high": sm.vs_parent.high}
            if sm.ttft is not None:
                out[f"{scen}/ttft_p50_ms"] = sm.ttft.p50_ms
            if sm.tpot is not None:
                out |= {f"{scen}/tpot_p50_ms": sm.tpot.p50_ms, f"{scen}/tpot_p99_ms": sm.tpot.p99_ms}
        metric = report.settings.accuracy_metric or "cosine"
        output = report.settings.accuracy.get("output") or next(iter(m.accuracy), None)
        acc = m.accuracy.get(output) if output is not None else None
        if acc is not None:
            out[f"accuracy/{metric}"] = acc.figure(metric)
            out["accuracy/cosine"] = acc.cosine
        out |= {"within_budget": float(m.within_budget), "memory_mb": m.memory_mb, "gpu_memory_mb": m.gpu_memory_mb,
                "size_mb": m.size_bytes / 2**20 if m.size_bytes is not None else None}
    return {k: f for k, v in out.items() if (f := _finite(v)) is not None}


def _verdict(st: StageReport) -> str:
    """The stage in one word: what the budget said, or why there is no number."""
    if not st.ok:
        return st.status
    if st.metrics is None:
        return "not measured"
    return "within budget" if st.metrics.within_budget else "rejected"


def _stage_tags(st: StageReport) -> dict[str, str]:
    tags = {"status": st.status, "verdict": _verdict(st), "stage": st.name, "pass": st.type}
    if st.parent:
        tags["parent_stage"] = st.parent
    if st.reason:
        tags["reason"] = st.reason[:MAX_PARAM]
    for scen, sm in (st.metrics.scenarios.items() if st.metrics is not None else []):
        if sm.vs_parent is not None:
            tags[f"speed/{scen}"] = sm.vs_parent.verdict
    return tags


def _stage_params(report: RunReport, st: StageReport) -> dict[str, str]:
    if st.index == 0:
        return {"pass": "source", **flatten(report.recipe.model, "model")}
    passes = (report.recipe.model_extra or {}).get("passes") or []
    spec = next((p for p in passes if (p.get("name") or p.get("type")) == st.name), {})
    return {"pass": st.type, "from": st.parent or "-", **flatten(spec.get("config") or {}, "config")}


def _run_params(report: RunReport) -> dict[str, str]:
    target = (report.recipe.model_extra or {}).get("target") or {}
    params = {"recipe": report.recipe.name, "workload": report.recipe.workload, "device": report.settings.device,
              "threads": str(report.settings.threads), "accuracy_metric": report.settings.accuracy_metric or "-"}
    params |= flatten(report.recipe.model, "model") | flatten(target, "target")
    params |= {f"package.{k}": v for k, v in report.environment.packages.items()}
    return params


@contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set: a `file:` URI given here asks for one."""
    key = "MLFLOW_ALLOW_FILE_STORE"
    local = uri.startswith("file:") or ("://" not in uri and not uri.startswith(("sqlite:", "databricks")))
    before = os.environ.get(key)
    if local and before is None:
        os.environ[key] = "true"
    try:
        yield
    finally:
        if local and before is None:
            os.environ.pop(key, None)


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """These environment variables for the call only; one the user set is theirs and kept."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _one_line(uri: str, e: BaseException) -> OptimizerError:
    text = str(getattr(e, "message", None) or e).strip() or type(e).__name__
    return OptimizerError(f"--mlflow {uri}: {text.splitlines()[0][:300]}")


def check_uri(uri: str) -> None:
    """Before a compile: mlflow installed, the URI's store one MLflow knows and answering (one cheap query, a
    few seconds at most). A problem is one OptimizerError line, so nothing is built for a run that cannot log."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise OptimizerError(f"--mlflow: mlflow is not installed: {INSTALL}") from None
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower()  # postgresql+psycopg2://: the driver's
    if "://" in uri and scheme not in SCHEMES:
        raise OptimizerError(f"--mlflow {uri}: unknown scheme {scheme!r}; one of file:, sqlite:///, http(s)://, "
                             "postgresql://, mysql://, databricks (or a folder path)")
    try:
        with _file_store_allowed(uri), _env(CHECK_HTTP):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as e:  # an unknown scheme, a server that is down, a database driver missing: all one line
        raise _one_line(uri, e) from None


def _experiment(client: Any, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    location = None
    if uri.startswith("sqlite:///"):  # else MLflow puts artifacts in ./mlruns, wherever the command ran
        db = Path(uri.removeprefix("sqlite:///"))
        location = (db.parent / "mlartifacts").resolve().as_uri()
    return str(client.create_experiment(name, artifact_location=location))


def _batch(client: Any, run_id: str, params: dict[str, str], metrics: dict[str, float], tags: dict[str, str],
           step_ms: int) -> None:
    """In MLflow's batch limits (100 params, 100 tags, 1000 metrics per call)."""
    from mlflow.entities import Metric, Param, RunTag

    p = [Param(k, v) for k, v in params.items()]
    m = [Metric(k, v, step_ms, 0) for k, v in metrics.items()]
    t = [RunTag(k, v) for k, v in tags.items()]
    while p or m or t:
        client.log_batch(run_id, metrics=m[:1000], params=p[:100], tags=t[:100])
        p, m, t = p[100:], m[1000:], t[100:]


def _created_ms(report: RunReport) -> int:
    try:
        return int(datetime.fromisoformat(report.created.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        return int(datetime.now().timestamp() * 1000)


def log_run(report: RunReport, run_dir: Path, uri: str, experiment: str | None = None) -> str:
    """Log a compile to MLflow at `uri` (experiment: the recipe's name unless given); returns the parent run id.
    A missing mlflow, an unreachable store or one MLflow refuses is one OptimizerError line."""
    try:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException
    except ImportError:
        raise OptimizerError(f"--mlflow: mlflow is not installed: {INSTALL}") from None
    try:
        with _file_store_allowed(uri), _env(LOG_HTTP):
            client = MlflowClient(tracking_uri=uri)
            return _log(client, report, run_dir, uri, experiment or report.recipe.name)
    except MlflowException as e:
        raise _one_line(uri, e) from None
    except OSError as e:
        raise OptimizerError(f"--mlflow {uri}: {e.strerror or e}") from None


def _log(client: Any, report: RunReport, run_dir: Path, uri: str, experiment: str) -> str:
    eid = _experiment(client, experiment, uri)
    start = _created_ms(report)
    end = start + int(report.wall_seconds * 1000)
    status = "FINISHED" if report.outcome == "ok" else "KILLED" if report.outcome == "interrupted" else "FAILED"
    tags = {"outcome": report.outcome, "run_dir": str(run_dir.resolve())}
    if report.history_id is not None:
        tags["history_id"] = str(report.history_id)
    if report.best is not None:
        tags["best_stage"] = report.best.stage or "-"
    parent = client.create_run(eid, start_time=start, run_name=report.recipe.name, tags=tags)
    pid = parent.info.run_id
    try:
        best = report.stage(report.best.stage) if report.best and report.best.stage else None
        top = {"wall_seconds": report.wall_seconds, "stages_failed": float(len(report.failed_stages))}
        top |= {f"best/{k}": v for k, v in (stage_metrics(report, best) if best else {}).items()}
        _batch(client, pid, _run_params(report), {k: f for k, v in top.items() if (f := _finite(v)) is not None},
               {}, start)
        for st in report.stages:
            child = client.create_run(eid, start_time=start, run_name=f"{st.index:02d}-{st.name}",
                                      tags={"mlflow.parentRunId": pid, **_stage_tags(st)})
            cid = child.info.run_id
            _batch(client, cid, _stage_params(report, st), stage_metrics(report, st), {}, start)
            client.set_terminated(cid, status="FAILED" if st.status == "failed" else "FINISHED", end_time=end)
        _artifacts(client, pid, report, run_dir)
    except BaseException:
        client.set_terminated(pid, status="FAILED", end_time=end)
        raise
    client.set_terminated(pid, status=status, end_time=end)
    return str(pid)


def _artifacts(client: Any, run_id: str, report: RunReport, run_dir: Path) -> None:
    for name in ARTIFACTS:
        if (run_dir / name).is_file():
            client.log_artifact(run_id, str(run_dir / name))
    if (run_dir / RECIPE_FILE).is_file():
        client.log_artifact(run_id, str(run_dir / RECIPE_FILE))
        return
    with tempfile.TemporaryDirectory() as tmp:  # a hand-written recipe: the report's copy of what ran
        path = Path(tmp) / "recipe.json"
        path.write_text(json.dumps(report.recipe.model_dump(mode="json"), indent=2, default=str))
        client.log_artifact(run_id, str(path))
