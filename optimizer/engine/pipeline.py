"""The stage loop: build stage 0, run each pass of the recipe into its own stage folder, measure every stage with
one harness, and record each stage's outcome (ran, cached, skipped, unchanged, failed, not run, interrupted). A
stage's key hashes its parent's key, the pass type, version and config, and the inputs; a finished stage folder with
the same key is reused as is, and so are its measurements when the benchmark settings and the parent it was timed
against are unchanged, so editing the last pass of a recipe re-runs and re-measures only that pass. Whether what a
cache holds may be reused is engine.stage_cache's call, whether an error is a bug of ours engine.triage's."""

from __future__ import annotations

import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

from optimizer.core.artifact import Artifact, file_sha256
from optimizer.core.errors import InputError, OptimizerError, PassError
from optimizer.core.metrics import StageMetrics
from optimizer.core.pass_base import PassContext
from optimizer.core.registry import pass_class
from optimizer.core.stage import StageRecord
from optimizer.engine import memory_plan, stage_cache
from optimizer.engine import rundir as rd
from optimizer.engine.reference_files import feeds_hash, load_reference, save_reference
from optimizer.engine.triage import debug_from_env, is_our_bug
from optimizer.measure.bench_slot import bench_slot, collect_windows
from optimizer.measure.forward import MEASURE_VERSION, Reference, measure_stage
from optimizer.measure.services import MeasureServices
from optimizer.recipe.reads import key_part, restricted
from optimizer.recipe.schema import SOURCE_STAGE, Recipe, recipe_dict
from optimizer.runtime.inputs import build_feeds
from optimizer.runtime.runners import runner_reason


class Events(Protocol):
    def stage_start(self, rec: StageRecord) -> None: ...
    def stage_progress(self, rec: StageRecord, what: str, done: int, total: int) -> None: ...
    def stage_end(self, rec: StageRecord) -> None: ...


class NullEvents:
    def stage_start(self, rec: StageRecord) -> None: ...
    def stage_progress(self, rec: StageRecord, what: str, done: int, total: int) -> None: ...
    def stage_end(self, rec: StageRecord) -> None: ...


UNCHANGED_REASON = (
    "the pass left its input as it was (nothing it applies matched; its notes say why): not timed, its input's "
    "numbers stand"
)


class Pipeline:
    """debug: errors of our own code propagate with their traceback instead of becoming a failed stage (a
    library's error still fails the stage alone, as it does for users). Default: debug_from_env()."""

    def __init__(
        self,
        recipe: Recipe,
        out_dir: Path,
        events: Events | None = None,
        use_cache: bool = True,
        measure: bool = True,
        debug: bool | None = None,
        workers: int = 1,
    ) -> None:
        self.recipe = recipe
        self.debug = debug_from_env() if debug is None else debug
        self.services = MeasureServices(workers)  # workers: processes for ctx.map (the hybrid search's fan-out)
        self.measure = measure
        self.run = rd.RunDir(out_dir.resolve())  # absolute: artifact paths in the report work from anywhere
        self.events = events or NullEvents()
        self.use_cache = use_cache
        self.records: list[StageRecord] = []
        self.reference: Reference | None = None
        self.on_stage_done: list[Any] = []  # callbacks(records), e.g. writing the report after each stage

    # ------------------------------------------------------------ public
    def execute(self) -> list[StageRecord]:
        self.run.prepare()
        self.records = [StageRecord(0, SOURCE_STAGE, "source", None)]
        for i, spec in enumerate(self.recipe.passes, start=1):
            parent = spec.from_ or self.records[-1].name
            self.records.append(StageRecord(i, spec.stage_name, spec.type, parent))
        try:
            self.feeds = build_feeds(self.recipe, self.recipe.accuracy.samples)
        except BaseException:
            self.run.release()
            raise
        self.feeds_key = feeds_hash(self.feeds)
        self.isolated = memory_plan.isolate(self.recipe, memory_plan.source_bytes(self.recipe))
        self._calibrate("before_ms")
        stop_reason: str | None = None
        current: StageRecord | None = None
        try:
            for rec in self.records:
                current = rec
                if stop_reason:
                    rec.status, rec.reason = "not run", stop_reason
                    continue
                self.events.stage_start(rec)
                died = self._run_stage(rec)
                self.events.stage_end(rec)
                self._notify()
                # a worker killed for memory or crashed is the machine's limit, not the recipe's: the rest runs
                if rec.status == "failed" and (rec.index == 0 or (self.recipe.on_failure == "stop" and not died)):
                    stop_reason = f"stage {rec.name!r} failed (on_failure: {self.recipe.on_failure})"
            if not stop_reason and self.measure and self.recipe.batch_sweep and self.recipe.workload == "forward":
                self._sweep()
            self._calibrate("after_ms")
        except KeyboardInterrupt:
            if current is not None:
                current.status, current.reason = "interrupted", "interrupted (Ctrl-C or SIGTERM)"
                for rec in self.records[current.index + 1 :]:
                    rec.status, rec.reason = "not run", "the run was interrupted"
            self._notify()
            raise
        finally:
            self.run.release()
        return self.records

    def _calibrate(self, when: str) -> None:
        """Time the fixed calibration workload (optimizer/measure/machine.py) at the start and end of a measuring run:
        whether the machine changed under the run. Kept in machine.json for the report."""
        if not self.measure:
            return
        from optimizer.measure.machine import calibration_ms
        from optimizer.runtime.denormals import process_denormal_penalty

        path = self.run.root / "machine.json"
        data = (rd.read_json(path) or {}) if when == "after_ms" else {}
        with collect_windows() as windows, bench_slot(f"calibration {when.removesuffix('_ms')}"):
            data[when] = round(calibration_ms(), 4)
            if when == "before_ms":  # what arithmetic on denormals costs this CPU (runtime.denormals)
                data["denormal_penalty"] = round(process_denormal_penalty(), 2)
        data["timed_windows"] = [*data.get("timed_windows", []), *(w.to_json() for w in windows)]
        rd.write_json(path, data)

    def _sweep(self) -> None:
        """The batch sweep of the chosen stage, cached in batch_sweep.json by stage key and settings."""
        from optimizer.engine.sweep import pick_sweep_stage, run_sweep

        path = self.run.root / "batch_sweep.json"
        stage = pick_sweep_stage(self.recipe, self.records)
        if stage is None:
            which = self.recipe.batch_sweep.stage if self.recipe.batch_sweep else "best"
            why = f"batch_sweep.stage {which!r}: no such stage with an artifact (best: none measured within budget)"
            rd.write_json(path, {"key": None, "result": {"why": why}})
            return
        settings = recipe_dict(self.recipe)
        key = rd.content_hash(stage.key, settings["batch_sweep"], settings["benchmark"], settings["target"])
        cached = rd.read_json(path) if self.use_cache else None
        if cached and cached.get("key") == key:
            return
        label = StageRecord(len(self.records), f"batch sweep of {stage.name}", "sweep", stage.name)
        self.events.stage_start(label)
        with collect_windows() as windows, bench_slot(f"{stage.name} batch sweep"):
            result = run_sweep(self.recipe, stage, self._progress(label))
        result["timed_windows"] = [w.to_json() for w in windows]
        label.status = "ran"
        self.events.stage_end(label)
        rd.write_json(path, {"key": key, "result": result})

    def record(self, name: str) -> StageRecord:
        return next(r for r in self.records if r.name == name)

    # ------------------------------------------------------------ stages
    def _notify(self) -> None:
        for callback in self.on_stage_done:
            callback(self.records)

    def _progress(self, rec: StageRecord) -> Any:
        return lambda what, done, total: self.events.stage_progress(rec, what, done, total)

    def _run_stage(self, rec: StageRecord) -> bool:
        """Run the stage here, or in a worker process (engine.stage_worker) when the run is isolated. Returns
        whether its worker died (killed for memory, crashed): the stage is then failed with that cause."""
        if not getattr(self, "isolated", False):
            self._stage(rec)
            return False
        from optimizer.engine.stage_worker import WorkerDied, run_in_worker

        try:
            filled = run_in_worker(self, rec)
        except WorkerDied as e:
            rec.status, rec.reason = "failed", e.reason
            shutil.rmtree(self.run.building_dir(rec.index, rec.name), ignore_errors=True)  # never kept half-built
            if rec.index > 0:
                self._pass_through(rec)
            return True
        rec.__dict__.update(filled.__dict__)
        self.reference = None  # the worker may have written it (stage 0): read again from disk when needed
        return False

    def run_stage_here(self, rec: StageRecord) -> None:
        """The stage in this process (what a stage worker runs)."""
        self._stage(rec)

    def _pass_through(self, rec: StageRecord) -> None:
        """A stage that produced nothing passes its parent's artifact, and what it was measured against, on."""
        parent = self.record(rec.parent or SOURCE_STAGE)
        rec.artifact, rec.measured_against, rec.key = parent.artifact, parent.measured_against, parent.key

    def _stage(self, rec: StageRecord) -> None:
        try:
            if rec.index == 0:
                self._source(rec)
            else:
                self._pass(rec)
            unrunnable = runner_reason(rec.artifact, self.recipe) if rec.ok and rec.artifact else None
            # No reference without stage 0: a measuring run stops there; a build-only run (--no-bench) goes on.
            if unrunnable and rec.index == 0 and self.measure:
                rec.status, rec.reason = "failed", f"target.device {self.recipe.target.device}: {unrunnable}"
                rec.error_kind = "input"
            elif unrunnable:  # built, but this machine cannot run it on the target: keep it for later passes
                rec.reason = f"not measured: {unrunnable}"
            elif rec.ok and self.measure:
                self._measure(rec)
        except Exception as e:
            if self.debug and is_our_bug(e):
                raise  # a bug of ours: under tests and --debug it fails loudly, not as a stage
            self._failed(rec, e)
        if rec.status == "failed" and rec.index > 0:
            self._pass_through(rec)

    def _failed(self, rec: StageRecord, e: Exception) -> None:
        """Record the stage as failed with a one-line reason and its traceback (the stage's `traceback`)."""
        rec.status = "failed"
        if isinstance(e, PassError):
            e.in_stage(rec.name, tuple(r.name for r in self.records[: rec.index] if r.ok))
            rec.reason = e.message
        elif isinstance(e, InputError):
            rec.reason = str(e)
            rec.error_kind = "input"  # the recipe's inputs do not fit the model: a usage error
        elif isinstance(e, OptimizerError):
            rec.reason = str(e)
        else:  # a library (or our code) blew up in a way it does not document: keep the run, say what happened
            from optimizer.runtime.errortext import error_line  # the line naming the problem, not a banner

            rec.reason = f"{type(e).__name__}: {error_line(str(e))}"
        rec.traceback = "".join(traceback.format_exception(e))

    def _source(self, rec: StageRecord) -> None:
        from optimizer.engine.source import check_budget_output, source_artifact

        rec.key = rd.content_hash(
            "source",
            recipe_dict(self.recipe)["model"],
            self.feeds.input_names,
            self.recipe.outputs,
            self.feeds_key,
            stage_cache.input_files_digest(self.recipe),
            # the passes read the workload (recipe.reads.KEYED); left out at its default, so forward keys stay
            *(["workload", self.recipe.workload] if self.recipe.workload != "forward" else []),
        )
        folder = self.run.stage_dir(0, rec.name)
        info = rd.read_json(folder / rd.STAGE_FILE) if self.use_cache else None
        if info and info.get("key") == rec.key:
            rec.artifact, rec.status = Artifact.from_json(info["artifact"]), "cached"
        else:
            self.events.stage_progress(rec, "loading the source model", 0, 0)
            start = time.perf_counter()
            rec.artifact = source_artifact(self.recipe, self.feeds)
            rec.pass_seconds = time.perf_counter() - start
            folder.mkdir(parents=True, exist_ok=True)
            # the source's files as they were read (an ONNX source: the user's model), so that export can tell
            # whether they are still the ones this run measured
            digests = {f.name: file_sha256(f) for f in rec.artifact.files() if f.is_file()}
            rd.write_json(folder / rd.STAGE_FILE, {"key": rec.key, "status": "ran", "artifact": rec.artifact.to_json(),
                                                   "file_sha256": digests})
            rec.status = "ran"
        rec.folder, rec.measured_against = folder.name, rec.name
        check_budget_output(self.recipe, rec.artifact)  # fresh or cached: a bad accuracy.output fails stage 0

    def _pass(self, rec: StageRecord) -> None:
        """Run (or reuse) one pass. A pass that reports its output unmodified (PassResult.modified false: fuse with
        nothing fused, ort_transformers with no fusion) leaves the stage "unchanged": not timed against an
        identical model (where noise alone can read as a verdict and an explanation of a change that never
        happened), its input's artifact passed on; its folder keeps the notes that say why."""
        spec = self.recipe.passes[rec.index - 1]
        parent = self.record(rec.parent or SOURCE_STAGE)
        cls = pass_class(spec.type)
        instance = cls(cls.Config.model_validate(spec.config))
        if parent.artifact is None:
            rec.status, rec.reason = "not run", f"parent {parent.name!r} has no artifact"
            return
        done = tuple(r.name for r in self.records[: rec.index] if r.ok)
        probe = PassContext(self.recipe, rec.name, self.run.root, self.feeds, self.services, done)
        reason = instance.skip_reason(parent.artifact, probe)
        if reason:
            rec.status, rec.reason = "skipped", reason
            self._pass_through(rec)
            return
        config = instance.config.model_dump(mode="json")
        # what the pass reads of the recipe is in its key, and is all it may read (optimizer.recipe.reads)
        keyed = restricted(self.recipe, (), who=f"pass {spec.type!r}")
        reads = instance.recipe_reads(keyed)
        extras = {**key_part(self.recipe, reads), **(instance.key_extras(keyed) or {})}
        rec.key = rd.content_hash(
            parent.key, spec.type, cls.version, config, self.feeds_key, self.recipe.target.device,
            *([extras] if extras else []),
        )
        cached = self.run.find_cached(rec.key) if self.use_cache else None
        if cached is not None and not stage_cache.intact(cached):
            rec.cache_note = f"cached folder {cached.name} was incomplete or changed: rebuilt"
            shutil.rmtree(cached, ignore_errors=True)
            cached = None
        if cached is not None and cached.name in {r.folder for r in self.records[: rec.index]}:
            # An earlier stage of this run has the same key (same pass, config and parent): it keeps its folder,
            # this stage gets a copy of it.
            copy = self.run.building_dir(rec.index, rec.name)
            shutil.copytree(cached, copy, dirs_exist_ok=True)
            cached = copy
        if cached is not None:
            folder = self.run.place(cached, rec.index, rec.name)
            info = stage_cache.restore(rec, folder)
        else:
            too_big = memory_plan.pass_reason(parent.artifact, cls.memory_factor)
            if too_big:  # decided before the pass loads anything: the run goes on without this stage
                rec.status, rec.reason = "skipped", too_big
                self._pass_through(rec)
                return
            self.events.stage_progress(rec, f"running {spec.type}", 0, 0)
            building = self.run.building_dir(rec.index, rec.name)
            view = restricted(self.recipe, reads, who=f"pass {spec.type!r}")
            ctx = PassContext(view, rec.name, building, self.feeds, self.services, done, self._progress(rec))
            start = time.perf_counter()
            try:
                with collect_windows() as windows:  # the pass's own timings (ctx.time), e.g. the hybrid search
                    result = instance.run(parent.artifact, ctx)
            except BaseException:
                shutil.rmtree(building, ignore_errors=True)  # a half-built stage is never kept
                raise
            rec.pass_seconds = time.perf_counter() - start
            rec.notes = result.notes_json()
            rec.pass_timed_windows = list(windows) or None
            info = {
                "key": rec.key,
                "status": "ran",
                "type": spec.type,
                "config": config,
                "artifact": stage_cache.portable(result.artifact, building),
                "notes": rec.notes,
                **({"pass_timed_windows": [w.to_json() for w in windows]} if windows else {}),
                **({"cache_note": rec.cache_note} if rec.cache_note else {}),  # a rebuild, as the stage was built
                "pass_seconds": rec.pass_seconds,
                **stage_cache.file_records(result.artifact),  # what stage_cache.intact checks on reuse
                # nothing done: the pass says so, and the session options are its input's
                "unchanged": not result.modified and result.artifact.runtime == parent.artifact.runtime,
            }
            rd.write_json(building / rd.STAGE_FILE, info)
            folder = self.run.place(building, rec.index, rec.name)
            rec.artifact = stage_cache.relocate(Artifact.from_json(info["artifact"]), folder)
            rec.status = "ran"
        rec.folder, rec.measured_against = folder.name, rec.name
        if info.get("unchanged"):  # the pass changed nothing: its input's model and numbers stand, untimed
            rec.status, rec.reason = "unchanged", UNCHANGED_REASON
            rec.artifact, rec.measured_against = parent.artifact, parent.measured_against

    # ------------------------------------------------------------ measurement
    def _measure(self, rec: StageRecord) -> None:
        assert rec.artifact is not None and rec.folder is not None
        folder = self.run.root / rec.folder
        source = self.records[0]
        against = self.record(self.record(rec.parent).measured_against or SOURCE_STAGE) if rec.parent else None
        settings = recipe_dict(self.recipe)
        key = rd.content_hash(
            MEASURE_VERSION,
            rec.key,
            against.key if against else None,
            settings["benchmark"],
            settings["target"],
            settings["accuracy"],
            settings["scenarios"],
            self.feeds_key,
        )
        ref_path = self.run.stage_dir(0, SOURCE_STAGE) / "reference.npz"
        if self.use_cache:
            cached, stale = stage_cache.reusable_metrics(folder / rd.METRICS_FILE, key)
            if stale:
                rec.cache_note = f"{rec.folder}/metrics.json {stale}: measured again"
            elif cached is not None:
                reference = load_reference(ref_path) if rec.index == 0 else None
                if rec.index > 0 or reference is not None:
                    rec.metrics, rec.bench_seconds = cached["metrics"], cached.get("bench_seconds")
                    if rec.index == 0:
                        self.reference = reference
                    return
        if rec.index > 0 and self.reference is None:
            self.reference = load_reference(ref_path)
            if self.reference is None:
                raise OptimizerError(f"{ref_path}: stage 0's reference outputs are missing; run again with --no-cache")
        start = time.perf_counter()
        parent_artifact = against.artifact if against is not None else None
        if parent_artifact is not None and runner_reason(parent_artifact, self.recipe):
            parent_artifact = None  # the parent cannot run here: this stage is timed alone
        from optimizer.measure.harness import instances_for

        recipe = self.recipe
        plan = memory_plan.measure_plan(rec.artifact, parent_artifact, instances_for(recipe.benchmark))
        if plan.reason:  # decided before loading: built, kept, not measured on this machine
            rec.reason = plan.reason
            return
        if not plan.with_parent:
            parent_artifact = None
        if plan.instances != instances_for(recipe.benchmark):
            recipe = recipe.model_copy(update={"benchmark": recipe.benchmark.model_copy(
                update={"instances": plan.instances})})
        in_worker = getattr(self, "isolated", False) and recipe.benchmark.memory == "process"
        if in_worker:  # this process is fresh for the stage: a second one loading it again would only cost time
            recipe = recipe.model_copy(update={"benchmark": recipe.benchmark.model_copy(update={"memory": "inline"})})
        measure_fn = measure_stage
        if self.recipe.workload == "generation":
            from optimizer.measure.generation import measure_generation_stage as measure_fn
        # The measurement holds the host's bench slot while it times (its windows); loading and the accuracy run
        # may overlap other compiles' build work.
        with collect_windows() as windows:
            metrics, new_ref = measure_fn(
                rec.artifact,
                parent_artifact,
                recipe,
                self.feeds,
                self.reference if rec.index > 0 else None,
                self._progress(rec),
                label=rec.name,
            )
        rec.bench_seconds = time.perf_counter() - start
        from optimizer.runtime.onnx_io import graph_stats

        metrics["graph"] = graph_stats(rec.artifact)
        metrics["size_bytes"] = rec.artifact.size_bytes()
        if rec.artifact.path is not None:  # the disk this stage added: its files no earlier stage has (links)
            from optimizer.core.artifact import own_bytes

            earlier = [f for r in self.records[: rec.index] if r.artifact is not None for f in r.artifact.files()]
            metrics["own_bytes"] = own_bytes(rec.artifact.files(), earlier)
        metrics["timed_windows"] = [w.to_json() for w in windows]
        if plan.note:  # why it was timed with less than the recipe asked: the memory there is
            metrics["instance_note"] = plan.note
        if in_worker:
            metrics["memory"]["note"] = ("grown while loading and running the stage in its own worker process, "
                                         "fresh for this stage (no second process was started to load it again)")
        StageMetrics.model_validate(metrics)  # what the report will read: a misfit is ours, found here
        rec.metrics = metrics
        if new_ref is not None and rec is source:
            self.reference = new_ref
            save_reference(ref_path, new_ref)
        stage_cache.save_metrics(folder / rd.METRICS_FILE, key, metrics, rec.bench_seconds)
