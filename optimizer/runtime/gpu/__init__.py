"""What this machine offers for GPU work, each answer with the reason when it is "no".

Nothing here imports torch, onnxruntime or tensorrt at module import; the checks do, when asked.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path


def _torch_is_cpu_build() -> bool:
    """Whether the installed torch is a CPU build, read from its version.py without importing torch (a second
    of start-up that `optimizer passes` would pay only to learn there is no GPU)."""
    spec = importlib.util.find_spec("torch")
    for base in (spec.submodule_search_locations or []) if spec else []:
        version = Path(base) / "version.py"
        if version.is_file():
            cuda = re.search(r"^cuda\b[^=]*=\s*(.+)$", version.read_text(), re.M)
            return cuda is not None and cuda.group(1).strip() == "None"
    return False


@functools.cache
def cuda_reason() -> str | None:
    """None when a CUDA device is usable from PyTorch, else why not."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if _torch_is_cpu_build():
        return "no CUDA device (a CPU build of torch)"
    import torch

    if not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        return f"no CUDA device ({build})"
    return None


@functools.cache
def ort_cuda_reason() -> str | None:
    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime is not installed"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu in place of onnxruntime)"
    return cuda_reason()


SUPPORTED_TENSORRT = (10, 11)


@functools.cache
def tensorrt_reason() -> str | None:
    """None when TensorRT imports (its libraries load), is a supported major and a CUDA device is here."""
    if importlib.util.find_spec("tensorrt") is None:
        return "tensorrt is not installed (it comes with the gpu extra)"
    try:
        import tensorrt as trt
    except (ImportError, OSError) as e:  # the bindings are there, their libraries (libnvinfer ...) are not
        return f"tensorrt does not import: {e}"
    version = getattr(trt, "__version__", "?")
    if not version.split(".")[0].isdigit() or int(version.split(".")[0]) not in SUPPORTED_TENSORRT:
        return f"TensorRT {version} is not supported (majors 10 and 11 are)"
    return cuda_reason()


def tensorrt_major() -> int:
    import tensorrt as trt

    return int(trt.__version__.split(".")[0])


def device_summary() -> dict[str, object]:
    """GPU name, compute capability and memory, for reports and engine metadata (empty without CUDA)."""
    if cuda_reason() is not None:
        return {}
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_gb": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
    }
