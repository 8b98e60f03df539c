"""One recipe as a job for a worker (a local process, a Ray task): it runs the Pipeline and hands back its records.

Workers never write reports or the history: the driver does (cli.compile). A worker on another host than the
driver cannot write the driver's run folder: it works in a local temp folder and hands the folder back packed
(tar bytes), which the driver unpacks into the run folder (`receive`).
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from optimizer.core.errors import InputError, OptimizerError
from optimizer.core.stage import StageRecord
from optimizer.engine import rundir as rd
from optimizer.measure import bench_slot


@dataclass(frozen=True)
class Job:
    recipe_path: Path
    run_dir: Path  # absolute: the driver's run folder for this recipe
    use_cache: bool = True
    measure: bool = True
    debug: bool | None = None


@dataclass
class JobResult:
    job: Job
    records: list[StageRecord] = field(default_factory=list)
    wall_seconds: float = 0.0
    error: str | None = None  # the recipe could not run at all: one line
    error_code: int = 0  # the exit code the error gives a serial compile (2: ours, 1: unexpected)
    interrupted: bool = False
    host: str = ""
    workdir: str | None = None  # where the worker ran it (a temp folder on another host)
    node: str | None = None  # the Ray node it ran on
    packed: bytes | None = None  # that folder as tar bytes, for a driver on another host


@dataclass
class StagesDone:
    """A job's records after one of its stages ended (the pipeline's on_stage_done), for the driver's in-progress
    report: `optimizer report RUN` works during a pooled compile as during a serial one."""

    recipe_path: Path
    records: list[StageRecord]


class QueueEvents:
    """Pipeline events as (recipe, stage index, stage name, status, reason) tuples on a queue the driver reads;
    only stage ends, so that the driver prints one compact line per stage."""

    def __init__(self, queue: Any, label: str) -> None:
        self.queue, self.label = queue, label

    def stage_start(self, rec: StageRecord) -> None: ...
    def stage_progress(self, rec: StageRecord, what: str, done: int, total: int) -> None: ...

    def stage_end(self, rec: StageRecord) -> None:
        self.queue.put((self.label, rec.index, rec.name, rec.status, rec.reason))


def run_job(job: Job, queue: Any = None) -> JobResult:
    """The recipe's Pipeline in this process; every error becomes the result's one line (a bug of ours under
    debug too, with its traceback: the driver is another process, so it cannot re-raise it)."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe

    result = JobResult(job, host=bench_slot.hostname(), workdir=str(job.run_dir))
    start = time.perf_counter()
    pipeline = None
    try:
        recipe = load_recipe(job.recipe_path)
        events = QueueEvents(queue, recipe.name) if queue is not None else None
        pipeline = Pipeline(recipe, job.run_dir, events, use_cache=job.use_cache, measure=job.measure,
                            debug=job.debug)
        if queue is not None:
            pipeline.on_stage_done.append(lambda records: queue.put(StagesDone(job.recipe_path, records)))
        result.records = pipeline.execute()
    except KeyboardInterrupt:
        result.interrupted, result.records = True, pipeline.records if pipeline else []
    except OptimizerError as e:
        result.error, result.error_code = str(e), 2
    except Exception as e:
        result.error, result.error_code = f"{type(e).__name__}: {e}", 1
        if job.debug:
            result.error += "\n" + "".join(traceback.format_exception(e))
    result.wall_seconds = time.perf_counter() - start
    return result


def run_phase(job: Job, driver_host: str, phase: Literal["build", "measure"], workdir: str | None = None
              ) -> JobResult:
    """One phase of a job on a worker that may be on another host: "build" (the Pipeline with measure off), then
    "measure" (the Pipeline over the stages built, from their cache). On the driver's host it runs in the run
    folder; elsewhere in `workdir` (a new temp folder when None), packed into the result after its last phase."""
    local = bench_slot.hostname() == driver_host
    root = job.run_dir if local else Path(workdir or tempfile.mkdtemp(prefix="optimizer-run-"))
    measure = phase == "measure"
    result = run_job(replace(job, run_dir=root, measure=measure, use_cache=job.use_cache or measure))
    if phase == "build" and not job.use_cache and job.measure:  # --no-cache: the measure phase measures anew
        for stale in [*root.glob(f"*/{rd.METRICS_FILE}"), root / "batch_sweep.json"]:
            stale.unlink(missing_ok=True)
    result.job, result.workdir = job, str(root)
    last = measure or not job.measure or result.error is not None or result.interrupted
    if not local and last:
        result.packed = pack(root)
        shutil.rmtree(root, ignore_errors=True)
    return result


def merge_phases(build: JobResult, measured: JobResult) -> JobResult:
    """The measure phase's records, with the build phase's account of the stages it built ("ran", not the
    "cached" the measure phase found them as, and how long the pass took)."""
    for built, rec in zip(build.records, measured.records, strict=False):
        if built.status == "ran" and rec.status == "cached" and built.key == rec.key:
            rec.status, rec.pass_seconds = "ran", built.pass_seconds
    measured.wall_seconds += build.wall_seconds
    return measured


def pack(folder: Path) -> bytes:
    """The run folder as tar bytes (without its lock file)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            if path.name != ".lock":
                tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buffer.getvalue()


def receive(result: JobResult) -> JobResult:
    """A result from another host, placed: its folder unpacked into the run folder and its records' artifact
    paths moved there. A result from this host is returned as it is."""
    if result.packed is None or result.workdir is None:
        return result
    run_dir = result.job.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(result.packed), mode="r") as tar:
        for member in tar.getmembers():  # stage folders are replaced whole, as a local run would leave them
            target = run_dir / member.name
            if member.isdir() and "/" not in member.name and target.is_dir():
                shutil.rmtree(target)
        tar.extractall(run_dir, filter="data")  # "data": no absolute paths, links or devices from the worker
    remote = Path(result.workdir)
    for rec in result.records:
        path = rec.artifact.path if rec.artifact is not None else None
        if path is not None and path.is_relative_to(remote):
            rec.artifact = rec.artifact.derive(path=run_dir / path.relative_to(remote))  # type: ignore[union-attr]
    result.packed, result.workdir = None, str(run_dir)
    return result


def failed_to_start(job: Job, error: BaseException) -> JobResult:
    """A job whose worker died or could not be reached: one line, exit code 1 (2 for an input error)."""
    code = 2 if isinstance(error, InputError) else 1
    return JobResult(job, error=f"{type(error).__name__}: {error}", error_code=code)
