"""The services a pass gets through its PassContext (core.pass_base.PassServices): the one accuracy
implementation, the harness's interleaved timing and the one session factory. The engine hands them over, so
the passes never import this layer; tests hand over the same object."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import TimedComparison
from optimizer.core.pass_base import Check, Feed, PassContext
from optimizer.measure.accuracy import AccuracyMeter, generation_agreement, mask_of
from optimizer.measure.bench_slot import bench_slot
from optimizer.measure.harness import Timed, instances_for, measure
from optimizer.measure.stats import instance_variance, latency_stats, speedup, widened
from optimizer.recipe.reads import TIMED, require
from optimizer.runtime.generation import Generation
from optimizer.runtime.runners import runner_for
from optimizer.runtime.runners.base import Session


class MeasureServices:
    """PassServices backed by measure.accuracy, measure.harness and runtime.runners. workers: processes ctx.map
    spreads its items over (1: in this process, one after another)."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, workers)

    def map(self, fn: Callable[[PassContext, Any], Any], items: Sequence[Any], ctx: PassContext, what: str = ""
            ) -> list[Any]:
        items = list(items)
        workers = min(self.workers, len(items))
        if workers > 1:
            from optimizer.measure.fanout import fan_out

            return fan_out(fn, items, ctx, workers, MeasureServices, what)
        results = []
        for i, item in enumerate(items, start=1):
            results.append(fn(ctx, item))
            if what:
                ctx.progress(what, i, len(items))
        return results

    def session(self, artifact: Artifact, ctx: PassContext, device: str = "cpu") -> AbstractContextManager[Session]:
        return runner_for(artifact, ctx.recipe, device=device).load()

    def check(self, reference: Any, candidate: Any, ctx: PassContext, feeds: Sequence[Feed] | None) -> Any:
        if isinstance(reference, Generation) and isinstance(candidate, Generation):
            return generation_agreement(reference, candidate)  # plain floats and an int: JSON as it is
        samples = list(feeds) if feeds is not None else ctx.all_samples()
        with ExitStack() as stack:
            ref, ref_names = self._outputs(reference, ctx, stack)
            got, got_names = self._outputs(candidate, ctx, stack)
            meter: AccuracyMeter | None = None
            for i, feed in enumerate(samples):
                expected, outputs = ref(i, feed), got(i, feed)
                if meter is None:
                    names = got_names or ref_names or [f"output_{k}" for k in range(len(outputs))]
                    meter = AccuracyMeter(names)
                meter.add(expected, outputs, mask_of(feed))
        return Check(meter.accuracy() if meter is not None else {})

    def _outputs(
        self, source: Any, ctx: PassContext, stack: ExitStack
    ) -> tuple[Callable[[int, Feed], list[np.ndarray]], list[str] | None]:
        """(outputs of feed i, output names if known) for an artifact, a function of a feed, or precomputed."""
        if isinstance(source, Artifact):
            session = stack.enter_context(self.session(source, ctx))
            return (lambda _i, feed: session.to_numpy(session.run(session.prepare(feed)))), session.output_names
        if callable(source):
            return (lambda _i, feed: source(feed)), None
        return (lambda i, _feed: source[i]), None

    def time(
        self, candidate: Any, reference: Any, ctx: PassContext, feeds: Sequence[Feed] | None
    ) -> TimedComparison:
        require(ctx.recipe, TIMED, "ctx.time")  # a timed choice holds for these settings: its key must hold them
        settings = ctx.recipe.benchmark
        inputs = list(feeds) if feeds is not None else next(iter(ctx.feeds)).samples
        with ExitStack() as stack:
            sides = []
            for source in (reference, candidate):
                # More sessions a side when it is an artifact (measure.harness: sessions of one artifact differ)
                copies = instances_for(settings) if isinstance(source, Artifact) else 1
                sessions = [stack.enter_context(self._open(source, ctx)) for _ in range(copies)]
                prepared = [(x, [x.prepare(f) for f in inputs]) for x in sessions]
                sides.append(Timed(*prepared[0], twins=prepared[1:]))
            parent, child = sides
            with bench_slot(f"{ctx.stage_name} hybrid timing"):  # sessions load outside it: that is build work
                measure(child, parent, settings)
        s = speedup(parent.rounds, child.rounds, settings.confidence)
        low, high, verdict = s.low, s.high, s.verdict
        spread = (
            instance_variance(parent.rounds, child.rounds, parent.instance_rounds, child.instance_rounds)
            if parent.twins or child.twins
            else None
        )
        if spread is not None:  # this comparison's own reading, with its few contrasts (Student's t)
            low, high, verdict = widened(s.ratio, s.low, s.high, spread.variance, spread.factor, spread.df,
                                         settings.confidence)
        return TimedComparison(
            ratio=s.ratio,
            low=low,
            high=high,
            verdict=verdict,
            in_run_low=s.low,
            in_run_high=s.high,
            p50_ms=latency_stats(child.samples()).p50_ms,
            input_p50_ms=latency_stats(parent.samples()).p50_ms,
            rounds=len(child.rounds),
            calls=len(child.samples()),
        )

    @contextmanager
    def _open(self, source: Artifact | Session, ctx: PassContext) -> Iterator[Session]:
        if isinstance(source, Session):
            yield source
        else:
            with self.session(source, ctx) as session:
                yield session
