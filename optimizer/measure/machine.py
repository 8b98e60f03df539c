"""How busy the machine was while we timed: named once per run, so noise is blamed on the machine, not a stage.

Two measurements:
  load during each timed window: CPU time used by other processes (all CPU busy time minus this process's,
    in cores), the hypervisor's steal time, and the 1-minute load average;
  a fixed calibration workload (a float64 matrix product, median of 15 runs) timed when the run starts and
    when it ends: if the same work took longer at the end, the machine changed under the run.

Only the first is evidence that the machine was busy. The calibration is a few milliseconds of work: on a quiet
machine (others' CPU 0.0 cores, no steal) it was seen to move 10-35% between the start and the end of a run (CPU
frequency, caches), so its drift alone called 8 of 30 quiet runs busy. It is said beside a busy window, and alone
only when it moved beyond anything a quiet machine showed (then as a slowdown, not as other processes' load).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import psutil

# A window is busy when others used this much of the machine (other processes' CPU, in cores; the hypervisor's
# steal share).
BUSY_OTHER_CORES = 0.25
BUSY_STEAL = 0.05
# The calibration's change said beside a busy window; alone, only beyond what quiet runs showed (up to +35%).
BUSY_CALIBRATION_CHANGE = 0.10
SLOWDOWN_CALIBRATION_CHANGE = 0.75


def _busy(t: Any) -> float:
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


class LoadSampler:
    """Context manager: other processes' CPU (cores), steal share and load average over the window."""

    def __enter__(self) -> LoadSampler:
        self._proc = psutil.Process()
        self._t0 = time.perf_counter()
        self._sys0 = psutil.cpu_times()
        self._own0 = self._proc.cpu_times()
        self._load0 = os.getloadavg()[0]
        self.result: dict[str, float] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        if self.result:  # closed already: the window ends at the first exit
            return
        wall = max(time.perf_counter() - self._t0, 1e-9)
        sys1, own1 = psutil.cpu_times(), self._proc.cpu_times()
        busy = _busy(sys1) - _busy(self._sys0)
        own = (own1.user + own1.system) - (self._own0.user + self._own0.system)
        total = sum(sys1) - sum(self._sys0)
        steal = getattr(sys1, "steal", 0.0) - getattr(self._sys0, "steal", 0.0)
        self.result = {
            "seconds": round(wall, 2),
            "other_cpu_cores": round(max(busy - own, 0.0) / wall, 3),
            "own_cpu_cores": round(own / wall, 3),
            "steal_share": round(steal / total, 4) if total > 0 else 0.0,
            "load_avg_1m": round(max(self._load0, os.getloadavg()[0]), 2),
            "cores": psutil.cpu_count() or 1,
        }


def window_busy(load: dict[str, Any] | None) -> bool:
    return bool(load) and (
        load.get("other_cpu_cores", 0.0) >= BUSY_OTHER_CORES or load.get("steal_share", 0.0) >= BUSY_STEAL
    )


def calibration_ms(reps: int = 15) -> float:
    """Median time (ms) of a fixed float64 matrix product (about 5 ms on one core of the test machine), after
    three untimed runs that start the BLAS threads: the same work on a quiet machine takes the same time."""
    a = np.random.default_rng(0).random((512, 512))
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter_ns()
        a @ a
        if i >= 3:
            times.append((time.perf_counter_ns() - t0) / 1e6)
    return float(np.median(times))


def busy_summary(stages: list[dict[str, Any]], calibration: dict[str, Any] | None) -> dict[str, Any] | None:
    """The one statement about the machine for a report, or None when it was quiet."""
    busy = [st for st in stages if window_busy((st.get("metrics") or {}).get("machine_load"))]
    change = None
    if calibration and calibration.get("before_ms") and calibration.get("after_ms"):
        change = calibration["after_ms"] / calibration["before_ms"] - 1
    # A drift needs load seen in a timed window to be called busy; alone, it must be far beyond a quiet run's.
    slowed = change is not None and abs(change) >= SLOWDOWN_CALIBRATION_CHANGE
    if not busy and not slowed:
        return None
    if change is not None and abs(change) < BUSY_CALIBRATION_CHANGE:
        change = None  # within what a quiet machine shows: not said
    loads = [(st["metrics"]["machine_load"], st["name"]) for st in busy]
    return {
        "stages": [name for _, name in loads],
        "max_other_cpu_cores": max((x["other_cpu_cores"] for x, _ in loads), default=0.0),
        "max_steal_share": max((x["steal_share"] for x, _ in loads), default=0.0),
        "max_load_avg_1m": max((x["load_avg_1m"] for x, _ in loads), default=0.0),
        "cores": next((x["cores"] for x, _ in loads), psutil.cpu_count() or 1),
        "calibration": calibration,
        "calibration_change": change,
    }


def busy_sentence(b: dict[str, Any]) -> str:
    parts = []
    if b["stages"]:
        parts.append(
            f"other processes kept the CPUs busy while {', '.join(b['stages'])} "
            f"{'was' if len(b['stages']) == 1 else 'were'} timed ({b['max_other_cpu_cores']:.2f} cores' worth at "
            f"most, on {b['cores']} cores; load average up to {b['max_load_avg_1m']:.1f}"
            + (f", steal {b['max_steal_share']:.0%}" if b["max_steal_share"] >= BUSY_STEAL else "")
            + ")"
        )
    cal = b.get("calibration") or {}
    if b.get("calibration_change") is not None:
        parts.append(
            f"a fixed workload took {cal['before_ms']:.2f} ms when the run started and {cal['after_ms']:.2f} ms when "
            f"it ended ({b['calibration_change']:+.0%})"
        )
    if not b["stages"]:  # the calibration alone, far beyond a quiet run's drift: no other load was seen
        return (
            "The machine's speed changed during this run: " + "; ".join(parts) + ", though no other process's load "
            "was seen while stages were timed (CPU frequency or thermal limits, or a neighbour this machine's "
            "counters do not show). Timings taken at different times may differ by that much; the interleaved "
            "ratios are the most robust figures. Re-run to confirm."
        )
    return (
        "The machine was busy during this run: "
        + "; ".join(parts)
        + ". Timings taken then carry that load (their spread and unstable-timing flags are the machine's, not the "
        "model's); the interleaved ratios are the most robust figures. Re-run on a quiet machine to confirm."
    )
