"""The timed windows of runs (measure.bench_slot), read from their reports: whether any two on one host overlapped.

Every timed measurement records when it held its host's bench slot: each stage's measurement (metrics), the timings
a pass made while it built (the hybrid search's ctx.time: the stage's pass_timed_windows), the calibration workload
and the batch sweep. Two windows on one host that overlap mean two timings disturbed each other.
"""

from __future__ import annotations

from collections.abc import Iterable

from optimizer.core.metrics import TimedWindow
from optimizer.report.schema import RunReport


def report_windows(report: RunReport) -> list[TimedWindow]:
    """Every timed window a report records, in start order."""
    found: list[TimedWindow] = []
    for stage in report.stages:
        if stage.metrics is not None and stage.metrics.timed_windows:
            found += stage.metrics.timed_windows
        found += stage.pass_timed_windows or []
    calibration = report.machine.calibration if report.machine is not None else None
    if calibration is not None and calibration.timed_windows:
        found += calibration.timed_windows
    if report.batch_sweep is not None and report.batch_sweep.timed_windows:
        found += report.batch_sweep.timed_windows
    return sorted(found, key=lambda w: w.start)


def overlapping_windows(reports: Iterable[RunReport]) -> list[tuple[TimedWindow, TimedWindow]]:
    """Pairs of windows, across all the reports, that ran on the same host at the same time (none: the bench slot
    kept every timing to itself). A window recorded twice (one cached stage in two reports) is counted once."""
    unique = {(w.host, w.pid, w.start, w.end, w.what): w for r in reports for w in report_windows(r)}
    by_host: dict[str, list[TimedWindow]] = {}
    for w in unique.values():
        by_host.setdefault(w.host, []).append(w)
    pairs = []
    for windows in by_host.values():
        windows.sort(key=lambda w: w.start)
        for i, a in enumerate(windows):
            for b in windows[i + 1 :]:
                if b.start >= a.end:
                    break
                pairs.append((a, b))
    return pairs
