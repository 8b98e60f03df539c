"""A local process pool: one recipe per worker process. Builds run in parallel; timings take turns through the
host's bench slot (measure.bench_slot). Workers hand back their records; the driver writes reports and history.

Workers start by "spawn" (a fresh interpreter: no forked torch or ONNX Runtime thread pools, no inherited locks).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import queue as queue_mod
import signal
from collections.abc import Callable
from typing import Any

from optimizer.core.stage import StageRecord
from optimizer.engine.jobs import Job, JobResult, StagesDone, failed_to_start, run_job

StageLine = Callable[[str, int, str, str, str | None], None]  # recipe, index, stage, status, reason
Done = Callable[[JobResult], None]
Records = Callable[[Job, list[StageRecord]], None]  # a job's records so far, e.g. for its in-progress report


_busy = False  # in a worker: running a job (an interrupt then stops its pipeline, which keeps what it finished)


def _stop_job(*_: Any) -> None:
    """SIGTERM from the driver, SIGINT from a terminal's Ctrl-C: the job stops as a serial run does. An idle
    worker ignores it (raised there it would kill the worker and break the pool: the other recipes' results,
    still on their way back, would be lost); the driver's shutdown ends it."""
    if _busy:
        raise KeyboardInterrupt


def _worker_init() -> None:
    from optimizer.core.quiet import silence_libraries

    silence_libraries()
    signal.signal(signal.SIGTERM, _stop_job)
    signal.signal(signal.SIGINT, _stop_job)


def _run(job: Job, events: Any) -> JobResult:
    global _busy
    _busy = True
    try:
        return run_job(job, events)
    finally:
        _busy = False


def run_pool(jobs: list[Job], workers: int, on_stage: StageLine | None = None, on_done: Done | None = None,
             on_records: Records | None = None) -> list[JobResult]:
    """Every job's result, in the jobs' order; on_stage and on_records are called (in this process) at each
    stage's end, all before run_pool returns, on_done as each recipe finishes. An interrupt (Ctrl-C, SIGTERM)
    stops the workers, which keep what they finished."""
    context = multiprocessing.get_context("spawn")
    results: dict[int, JobResult] = {}
    by_path = {job.recipe_path: job for job in jobs}
    with context.Manager() as manager:
        events = manager.Queue()
        pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init)
        # At most `workers` submitted at once: the executor pre-queues extra calls into its workers, where
        # cancel_futures cannot reach them, so an interrupt would still start a queued recipe.
        queued = list(range(len(jobs)))
        futures: dict[cf.Future[JobResult], int] = {}
        pending: set[cf.Future[JobResult]] = set()

        def submit() -> None:
            while queued and len(pending) < workers:
                i = queued.pop(0)
                future = pool.submit(_run, jobs[i], events)
                futures[future] = i
                pending.add(future)

        def drain() -> None:
            while True:
                try:
                    item = events.get_nowait()
                except (queue_mod.Empty, OSError, EOFError):
                    return
                if isinstance(item, StagesDone):
                    if on_records is not None:
                        on_records(by_path[item.recipe_path], item.records)
                elif on_stage is not None:
                    on_stage(*item)

        def collect(done: set[cf.Future[JobResult]], stopping: bool = False) -> None:
            for future in done:
                i = futures[future]
                try:
                    results[i] = future.result()
                except BaseException as e:  # the worker died (killed, out of memory): this recipe alone fails
                    results[i] = JobResult(jobs[i], interrupted=True) if stopping else failed_to_start(jobs[i], e)
                if on_done is not None:
                    on_done(results[i])

        try:
            submit()
            while pending:
                done, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
                drain()
                collect(done)
                submit()
            pool.shutdown(wait=True)  # (an interrupt here, every result in: reported as interrupted all the same)
            drain()
        except KeyboardInterrupt:
            for i in queued:  # never started: nothing to wait for
                results[i] = JobResult(jobs[i], interrupted=True)
            queued.clear()
            processes = list((getattr(pool, "_processes", None) or {}).values())  # no public handle on them
            pool.shutdown(wait=False, cancel_futures=True)  # (shutdown forgets the processes)
            for process in processes:
                if process.is_alive():
                    process.terminate()  # SIGTERM: the worker's pipeline marks the stage interrupted and returns
            done, _ = cf.wait([f for f, i in futures.items() if i not in results], timeout=30)
            collect(done, stopping=True)
            for i in range(len(jobs)):  # still running after 30 s
                results.setdefault(i, JobResult(jobs[i], interrupted=True))
            raise Interrupted([results[i] for i in range(len(jobs))]) from None
    return [results[i] for i in range(len(jobs))]


class Interrupted(KeyboardInterrupt):
    """Interrupted, with what every job had finished."""

    def __init__(self, results: list[JobResult]) -> None:
        super().__init__("interrupted")
        self.results = results

