"""Denormal (subnormal) floats flushed to zero for one ONNX Runtime session, on every thread that runs it.

ONNX Runtime's `session.set_denormal_as_zero` sets flush-to-zero and denormals-are-zero (FTZ/DAZ, the x86 MXCSR
bits) on the session's own intra-op pool threads, but on the calling thread only for the first session a process
creates (`std::call_once` in InferenceSession::Initialize), and then for every later session too. With two
intra-op threads the calling thread does half the work, so in a process that opens several sessions (the harness
times a stage against its parent in turn) ORT's setting alone would be wrong both ways: a flushing stage opened
second runs half unflushed, and a flushing stage opened first flushes its parent too.

So this module owns the calling thread's mode: the process keeps IEEE denormals (the default), a flushing
session switches FTZ/DAZ on around each of its calls and back off after (`FlushingSession`), and whatever ORT's
call_once did at creation is undone (`settle_after_create`). The switch is `torch.set_flush_denormal` (torch is a
dependency of this project; it sets both bits on the calling thread, and returns False on a CPU without them).
"""

from __future__ import annotations

import functools
from typing import Any

# ORT's session config key (onnxruntime_session_options_config_keys.h: kOrtSessionOptionsConfigSetDenormalAsZero).
ORT_CONFIG_KEY = "session.set_denormal_as_zero"


def set_caller_flush(on: bool) -> bool:
    """FTZ/DAZ on (or off) for the calling thread; False when this CPU cannot flush (nothing changed)."""
    import torch

    return bool(torch.set_flush_denormal(on))


def caller_flush_supported() -> bool:
    """Whether this CPU can flush denormals on the calling thread (leaves the thread as the process keeps it: off)."""
    supported = set_caller_flush(True)
    set_caller_flush(False)
    return supported


def settle_after_create() -> None:
    """Undo what ORT's first-session call_once may have done to the calling thread: back to IEEE denormals."""
    set_caller_flush(False)


class FlushingSession:
    """An onnxruntime.InferenceSession whose calls run with denormals flushed on the calling thread too (its pool
    threads are flushed by ORT itself). Every other attribute is the session's own."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return _flushed(self._session.run, *args, **kwargs)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        return _flushed(self._session.run_with_iobinding, *args, **kwargs)


def _flushed(call: Any, *args: Any, **kwargs: Any) -> Any:
    """call(*args, **kwargs) with FTZ/DAZ on the calling thread, back to IEEE denormals after."""
    set_caller_flush(True)
    try:
        return call(*args, **kwargs)
    finally:
        set_caller_flush(False)


def denormal_penalty(size: int = 1 << 18, repeats: int = 15) -> float:
    """How many times slower this CPU multiplies denormal floats than normal ones (best of `repeats` numpy
    multiplies each, with the process's IEEE mode): about 1 on cores that handle denormals in hardware (AMD Zen 4
    measured 1.0x here), many times more on cores that take a microcode assist for them (Intel)."""
    import time

    import numpy as np

    normal = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    tiny = (normal * np.float32(1e-39)).astype(np.float32)  # denormal inputs and outputs
    half = np.float32(0.5)

    def best(a: np.ndarray) -> float:
        out = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.multiply(a, half)
            out = min(out, time.perf_counter() - t0)
        return out

    best(normal)  # page the arrays in
    return best(tiny) / best(normal)


@functools.lru_cache(maxsize=1)
def process_denormal_penalty() -> float:
    """denormal_penalty, measured once per process."""
    return denormal_penalty()


def denormal_settings(runtime: dict[str, Any]) -> dict[str, Any]:
    """What a session of this runtime runs with, as a stage records it: flushed or not, on which threads, and on a
    CPU that cannot flush, that the request had no effect."""
    if not runtime.get("denormal_as_zero"):
        return {"denormal_as_zero": False}
    if not caller_flush_supported():
        return {"denormal_as_zero": False, "requested": True, "reason": "this CPU cannot flush denormals (no FTZ/DAZ)"}
    if runtime.get("shared_thread_pool"):  # Python cannot set the global pool's flag (SetGlobalDenormalAsZero)
        return {"denormal_as_zero": True, "flushed_threads": "calling thread only (the shared pool keeps denormals)"}
    return {"denormal_as_zero": True, "flushed_threads": "intra-op pool (onnxruntime) and calling thread"}
