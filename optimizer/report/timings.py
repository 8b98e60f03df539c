"""The timings that `diff` and `select` divide by and take logs of, checked once before they do.

A report this tool writes has positive, finite times; an edited one, or another tool's, may have zeros, negatives
or nulls, which became ZeroDivisionError or a math domain error deep in a ratio. Here they are one OptimizerError
naming the report, the stage, the scenario and the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from optimizer.core.errors import OptimizerError
from optimizer.report.schema import RunReport


def _positive(value: float | None) -> bool:
    return value is None or (math.isfinite(value) and value > 0)


def _timings(report: RunReport) -> Iterator[tuple[str, float | None]]:
    """(where, value) of every time, throughput and ratio a diff or a score computes with (None: not measured)."""
    calibration = report.machine.calibration if report.machine is not None else None
    if calibration is not None:
        yield "machine.calibration.before_ms", calibration.before_ms
        yield "machine.calibration.after_ms", calibration.after_ms
    for st in report.stages:
        for scen, value in st.vs_source.items():
            yield f"stage {st.name!r}: vs_source.{scen}", value
        for scen, value in st.throughput_vs_source.items():
            yield f"stage {st.name!r}: throughput_vs_source.{scen}", value
        for scen, e in (st.metrics.scenarios if st.metrics is not None else {}).items():
            where = f"stage {st.name!r}, scenario {scen!r}:"
            yield f"{where} latency.p50_ms", e.latency.p50_ms
            yield f"{where} latency.mean_ms", e.latency.mean_ms
            yield f"{where} throughput.samples_per_s", e.throughput.samples_per_s
            yield f"{where} throughput.tokens_per_s", e.throughput.tokens_per_s
            yield f"{where} samples_ms", min(e.samples_ms) if e.samples_ms else None
            if e.vs_parent is not None:
                for key in ("ratio", "low", "high"):
                    yield f"{where} vs_parent.{key}", getattr(e.vs_parent, key)


def require_timings(report: RunReport, label: str) -> None:
    """Refuse a report whose times or ratios are not positive and finite, naming the first such field."""
    for where, value in _timings(report):
        if not _positive(value):
            raise OptimizerError(
                f"{label} ({report.run_dir}): {where} is {value}, not a measured time or ratio (they are positive); "
                "was the report edited?"
            )
