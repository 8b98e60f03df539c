"""Seconds per step of measuring a stage (load, accuracy, time, profile, memory), so a compile's wall time can be
attributed to what bought it (scripts/compile_phases.py reads them from report.json)."""

from __future__ import annotations

import time


class PhaseClock:
    """Laps of one stage's measurement: `lap(name)` books the time since the last lap (or the start) to name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now
