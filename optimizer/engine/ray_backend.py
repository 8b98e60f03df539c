"""The same jobs on a Ray cluster (ray 2.x, the optional `ray` extra): `optimizer compile ... --backend ray`.

Each recipe runs in two tasks: a build task (num_cpus; the Pipeline with measure off: export, passes, the hybrid
search's own timings through the host's bench slot), then, on the same node, a measure task that also asks for the
custom resource {"bench": 1}: each node offers one, so each node times one recipe at a time, and the host's bench
slot (measure.bench_slot) still keeps that timing apart from the build tasks' own timings. A recipe whose
target.device is cuda asks for a GPU: its measure task for a whole one (nothing else on that GPU while it times),
its build task for a share (it lands on a GPU node, where its measure task must then run). A task on another host
than the driver works in a temp folder there and hands it back packed (engine.jobs.run_phase and receive).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, Literal

from optimizer.core.errors import OptimizerError, install_hint
from optimizer.engine.jobs import Job, JobResult, failed_to_start, merge_phases, receive, run_phase
from optimizer.engine.pool import Interrupted
from optimizer.measure import bench_slot

CONNECT_SECONDS = 5.0  # a head that does not answer a TCP connect in this long is down (Ray itself retries ~2 min)
STOP_SECONDS = 30.0  # after an interrupt: how long the cancelled tasks get to hand back what they finished


def _phase(job: Job, driver_host: str, phase: Literal["build", "measure"], workdir: str | None) -> JobResult:
    import ray

    from optimizer.core.quiet import silence_libraries

    silence_libraries()  # a Ray worker's output reaches the driver's terminal
    result = run_phase(job, driver_host, phase, workdir)
    result.node = ray.get_runtime_context().get_node_id()
    return result


BUILD_GPU_SHARE = 0.25  # a cuda recipe's build task: up to 4 share one GPU (engine builds, CUDA graph capture)


def recipe_device(job: Job) -> str:
    """The job's target.device ("cpu" when the recipe does not load: its task fails with that error)."""
    from optimizer.recipe.loading import load_recipe

    try:
        return load_recipe(job.recipe_path).target.device
    except OptimizerError:
        return "cpu"


def task_options(device: str, phase: Literal["build", "measure"], num_cpus: float, node: str | None = None
                 ) -> dict[str, Any]:
    """What one task asks Ray for: num_cpus; a measure task also the node's bench (and, on `node`, where its
    stage folders were built); a cuda recipe's tasks a GPU (measure) or a share of one (build)."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_retries": 0}
    if phase == "measure":
        options["resources"] = {"bench": 1}
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    if device == "cuda":
        options["num_gpus"] = 1 if phase == "measure" else BUILD_GPU_SHARE
    return options


def check_address(address: str) -> None:
    """A cluster address (host:port, or ray://host:port) whose head does not accept a connection is one error line
    at once, instead of Ray's GCS warnings for minutes. "auto" and "local" are Ray's to resolve."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise OptimizerError(f"--address {address}: expected host:port (or ray://host:port, auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        reason = "no answer" if isinstance(e, TimeoutError) else e.strerror or e
        raise OptimizerError(f"--address {address}: no Ray head there ({reason})") from None


def run_ray(jobs: list[Job], address: str | None, num_cpus: float = 1, local_cpus: int = 2,
            on_done: Callable[[JobResult], None] | None = None) -> list[JobResult]:
    """Every job's result in the jobs' order, each placed in its run folder. num_cpus: what each task asks for.
    With no address (and no Ray already started in this process) a local Ray starts here with local_cpus and one
    bench, and stops at the end; with one, the cluster there is joined."""
    try:
        import ray
    except ImportError as e:
        raise OptimizerError(f"--backend ray: ray is not installed ({e}); {install_hint('ray')}") from None

    started = not ray.is_initialized()
    if started and address:
        check_address(address)
    if started:
        local = address in (None, "local")  # "local": Ray's word for a new cluster here, which needs our bench
        kwargs: dict[str, Any] = {"num_cpus": local_cpus, "resources": {"bench": 1}} if local else {"address": address}
        ray.init(**kwargs, log_to_driver=False, include_dashboard=False)
    try:
        driver = bench_slot.hostname()
        task = ray.remote(_phase)
        devices = [recipe_device(job) for job in jobs]
        waiting = {
            task.options(**task_options(devices[i], "build", num_cpus)).remote(job, driver, "build", None): (i, "build")
            for i, job in enumerate(jobs)
        }
        built: dict[int, JobResult] = {}
        results: dict[int, JobResult] = {}
        try:
            _collect(ray, task, jobs, devices, driver, num_cpus, waiting, built, results, on_done)
        except KeyboardInterrupt:
            _stop(ray, jobs, waiting, built, results, on_done)
            raise Interrupted([results[i] for i in range(len(jobs))]) from None
        return [results[i] for i in range(len(jobs))]
    finally:
        if started:
            ray.shutdown()


def _stop(ray: Any, jobs: list[Job], waiting: dict[Any, tuple[int, str]], built: dict[int, JobResult],
          results: dict[int, JobResult], on_done: Callable[[JobResult], None] | None) -> None:
    """Ctrl-C: every task still going cancelled (a running one gets KeyboardInterrupt: its pipeline keeps the
    stages it finished, a rerun resumes from them); what still comes back in STOP_SECONDS is kept."""
    for ref in waiting:
        ray.cancel(ref)
    ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=STOP_SECONDS) if waiting else ([], [])
    for ref in ready:
        i, phase = waiting.pop(ref)
        try:
            result = ray.get(ref)
        except Exception:  # cancelled before it returned
            continue
        results[i] = receive(merge_phases(built[i], result) if phase == "measure" and not result.error else result)
        results[i].interrupted = True
        if on_done is not None:
            on_done(results[i])
    for i in range(len(jobs)):
        results.setdefault(i, JobResult(jobs[i], interrupted=True))


def _collect(ray: Any, task: Any, jobs: list[Job], devices: list[str], driver: str, num_cpus: float,
             waiting: dict[Any, tuple[int, str]], built: dict[int, JobResult], results: dict[int, JobResult],
             on_done: Callable[[JobResult], None] | None) -> None:
    """Wait for the tasks in `waiting` (a build task, once done, starts its recipe's measure task), each
    recipe's result into `results`."""
    while waiting:
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=0.5)  # a timeout: Ctrl-C is seen at once
        if not ready:
            continue
        i, phase = waiting.pop(ready[0])
        try:
            result = ray.get(ready[0])
        except Exception as e:  # the task itself died (its node went away): this recipe alone fails
            result = failed_to_start(jobs[i], e)
        if phase == "build" and jobs[i].measure and result.error is None and not result.interrupted:
            # measure where it was built: the stage folders are there
            options = task_options(devices[i], "measure", num_cpus, result.node)
            ref = task.options(**options).remote(jobs[i], driver, "measure", result.workdir)
            waiting[ref], built[i] = (i, "measure"), result
            continue
        if phase == "measure" and not result.error:
            result = merge_phases(built[i], result)
        results[i] = receive(result)
        if on_done is not None:
            on_done(results[i])
