"""GPU utilization, memory and power sampled through NVML while a GPU stage is benchmarked."""

from __future__ import annotations

from types import TracebackType
from typing import Any


def device_handle(pynvml: Any) -> Any:
    """NVML's handle for the device torch computes on. NVML numbers every GPU of the machine and ignores
    CUDA_VISIBLE_DEVICES, so index 0 can be another process's GPU: the device is found by its UUID (torch's
    properties carry it), else by the first entry of CUDA_VISIBLE_DEVICES when that is a plain index."""
    import os

    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # older torch without .uuid, or NVML that does not know it: fall back
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.startswith("GPU-"):
        return pynvml.nvmlDeviceGetHandleByUUID(visible)
    return pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)


class NvmlSampler:
    """Context manager over NVML for the device torch computes on: `sample()` takes one reading, the harness calls
    it between timed rounds; `summary()` after exit; NVML is shut down on exit. No sampling thread: one running
    beside the timed calls contends for the GIL and widens the tails of launch-bound calls. NVML's utilization
    is the share of its own recent period (1/6 s to 1 s) a kernel ran, so a reading after a round covers it.

    Without nvidia-ml-py or a device it samples nothing and `summary()` says why.
    """

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (gpu util %, memory used MB, power W)
        self.reason: str | None = None
        self._handle: Any = None

    def __enter__(self) -> NvmlSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._initialized = True
            self._handle = device_handle(pynvml)
        except Exception as e:  # ImportError, or NVML's own errors (no driver, no device)
            self.reason = f"NVML unavailable ({type(e).__name__}: {e})"
        return self

    def sample(self) -> None:
        """One reading (between timed rounds); after an NVML error, none more, with the reason kept."""
        if self._handle is None:
            return
        import pynvml

        try:
            util = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            power = pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            self.samples.append((float(util.gpu), mem.used / 2**20, power))
        except Exception as e:
            self.reason, self._handle = f"NVML sampling stopped ({e})", None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._handle = None
        if getattr(self, "_initialized", False):
            import pynvml

            pynvml.nvmlShutdown()
            self._initialized = False

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
