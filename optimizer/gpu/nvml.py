"""GPU utilization, memory and power sampled through NVML while a GPU stage is benchmarked."""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any


class NvmlSampler:
    """Context manager: samples device 0 every `interval` seconds on a thread; `summary()` after exit.

    Without nvidia-ml-py or a device it samples nothing and `summary()` says why.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []  # (gpu util %, memory used MB, power W)
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: Any = None

    def __enter__(self) -> NvmlSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as e:  # ImportError, or NVML's own errors (no driver, no device)
            self.reason = f"NVML unavailable ({type(e).__name__}: {e})"
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import pynvml

        while not self._stop.is_set():
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
                mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
                power = pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
                self.samples.append((float(util.gpu), mem.used / 2**20, power))
            except Exception as e:
                self.reason = f"NVML sampling stopped ({e})"
                return
            time.sleep(self.interval)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"reason": self.reason or "no samples"}
        util, mem, power = zip(*self.samples, strict=True)
        return {
            "samples": len(self.samples),
            "gpu_util_mean_pct": sum(util) / len(util),
            "gpu_util_max_pct": max(util),
            "memory_used_max_mb": max(mem),
            "power_mean_w": sum(power) / len(power),
            "power_max_w": max(power),
        }
