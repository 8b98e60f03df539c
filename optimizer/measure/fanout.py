"""ctx.map over worker processes: the hybrid search's per-node sensitivities (and any pass's independent
evaluations) spread over `optimizer compile --workers N` processes.

Workers start by "spawn" (no forked ONNX Runtime or torch thread pools) and each gets, once, the function and a copy
of the pass's context whose sessions run on threads // N intra-op threads, so N workers use the cores one
process would. Timings a function makes (ctx.time) still take the host's bench slot, but their windows stay in the
worker: fan out evaluations, not timings.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from optimizer.core.pass_base import PassContext
from optimizer.recipe.reads import rewrap, unwrap
from optimizer.runtime.childpath import child_sys_path
from optimizer.runtime.threads import target_threads

_task: tuple[Callable[[PassContext, Any], Any], PassContext] | None = None  # in a worker: what it runs


@contextmanager
def _our_packages_first() -> Iterator[None]:
    """A spawned worker imports with this process's sys.path, where onnxruntime.transformers (once imported, e.g.
    by fuse) has appended its own folder, which holds an optimizer.py: the worker would import that as our
    `optimizer`. While the workers start, sys.path is the one every child gets (runtime/childpath.py)."""
    saved = list(sys.path)
    sys.path[:] = child_sys_path(saved)
    try:
        yield
    finally:
        sys.path[:] = saved


def _init(fn: Callable[[PassContext, Any], Any], services: Callable[[], Any], recipe: Any, stage_name: str,
          stage_dir: Path, feeds: Any, done: tuple[str, ...], threads: int) -> None:
    global _task
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver stops us
    whole = unwrap(recipe)  # the worker's copy answers what the pass declared, as the driver's does
    recipe = rewrap(recipe, whole.model_copy(update={"target": whole.target.model_copy(update={"threads": threads})}))
    _task = (fn, PassContext(recipe, stage_name, stage_dir, feeds, services(), done))


def _call(item: Any) -> Any:
    assert _task is not None
    fn, ctx = _task
    return fn(ctx, item)


def fan_out(fn: Callable[[PassContext, Any], Any], items: Sequence[Any], ctx: PassContext, workers: int,
            services: Callable[[], Any], what: str = "") -> list[Any]:
    """[fn(ctx', item) for item in items] on `workers` spawned processes, in the items' order; ctx' has
    services() (a picklable factory: measure.services.MeasureServices, serial there). The first error (raised in
    a worker, or an interrupt here) stops the others and is raised here."""
    context = multiprocessing.get_context("spawn")
    threads = max(1, target_threads(ctx.recipe) // workers)
    initargs = (fn, services, ctx.recipe, ctx.stage_name, ctx.stage_dir, ctx.feeds, ctx.done, threads)
    results: list[Any] = [None] * len(items)
    pool = cf.ProcessPoolExecutor(workers, mp_context=context, initializer=_init, initargs=initargs)
    try:
        with _our_packages_first():  # a worker starts at each submit, until there are `workers`
            futures = {pool.submit(_call, item): i for i, item in enumerate(items)}
        for n, future in enumerate(cf.as_completed(futures), start=1):
            results[futures[future]] = future.result()
            if what:
                ctx.progress(what, n, len(items))
    except BaseException:
        for process in list((getattr(pool, "_processes", None) or {}).values()):  # no public handle on the workers
            if process.is_alive():
                process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results
