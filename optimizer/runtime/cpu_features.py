"""What the CPU's instruction set means for INT8 kernels.

ONNX Runtime's x86 INT8 GEMMs multiply unsigned 8-bit activations by signed 8-bit weights (u8s8). With VNNI
(AVX512_VNNI, AVX_VNNI, or AMX) the products accumulate in 32 bits; without it (AVX2 / AVX-512 without VNNI) the
kernels use vpmaddubsw, which adds pairs of products in 16 bits and saturates, so full-range 8-bit weights lose
accuracy. ORT's quantizer offers `reduce_range` (7-bit weights) for exactly that case.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "avx_vnni_int8"})


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def int8_reduce_range(flags: frozenset[str] | None = None, machine: str | None = None) -> tuple[bool, str]:
    """Whether INT8 weights should be quantized to 7 bits on this CPU, and why: on x86 without VNNI (where the
    u8s8 kernels saturate) yes; with VNNI, on other architectures, or when the flags are unknown, no."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return False, f"{machine}: ONNX Runtime's u8s8 saturation is an x86 matter"
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return False, "the CPU's flags could not be read: full-range INT8 weights"
    if flags & VNNI_FLAGS:
        return False, f"this CPU has {', '.join(sorted(flags & VNNI_FLAGS))}: full-range INT8 weights"
    return True, ("this x86 CPU has no VNNI: ONNX Runtime's u8s8 kernels add pairs of products in 16 bits and "
                  "saturate, so weights are quantized to 7 bits (reduce_range)")
