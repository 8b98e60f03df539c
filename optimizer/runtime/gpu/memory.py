"""Device memory a stage took while it loaded and warmed up, whichever runtime allocated it.

PyTorch's allocator counts PyTorch's tensors only; ONNX Runtime's CUDA arena, a TensorRT engine and its execution
contexts allocate outside it. So the figure is the growth of the process's device memory: NVML's per-process
figure where the driver gives one, else the device's memory in use from cudaMemGetInfo (which also counts other
processes on the device: fine on a dedicated machine, and said). PyTorch's cached blocks are released first, so
a tensor reusing another stage's cache still shows; the allocator's own peak is the floor (a transient peak it
freed again would not show in a reading after the warm-up).
"""

from __future__ import annotations

import os

NVML = "NVML per-process device memory (every runtime's allocations)"
MEM_GET_INFO = "device memory in use (cudaMemGetInfo: every runtime of this process, and other processes')"


def process_device_bytes() -> tuple[int, str]:
    """(bytes of device memory in use, how it was read)."""
    import torch

    try:
        import pynvml

        from optimizer.runtime.gpu.nvml import device_handle

        pynvml.nvmlInit()
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(device_handle(pynvml))
            mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None]
        finally:
            pynvml.nvmlShutdown()
        if mine:
            return int(sum(mine)), NVML
    except Exception:  # no nvidia-ml-py, or a driver/container without per-process figures
        pass
    free, total = torch.cuda.mem_get_info()
    return int(total - free), MEM_GET_INFO


class GpuMemoryProbe:
    """start() before loading, result() after the warm-up: (MB the stage took, how it was read)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.before = self.torch_before = 0

    def start(self) -> GpuMemoryProbe:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.torch_before = int(torch.cuda.memory_allocated())
            self.before = process_device_bytes()[0]
        return self

    def result(self) -> tuple[float | None, str | None]:
        if self.device != "cuda":
            return None, None
        import torch

        torch.cuda.synchronize()
        used, method = process_device_bytes()
        torch_peak = int(torch.cuda.max_memory_allocated()) - self.torch_before
        return max(used - self.before, torch_peak, 0) / 2**20, method

