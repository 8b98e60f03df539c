"""Cross-runtime check with Polygraphy's comparator: the same feeds through two runtimes (ONNX Runtime on the
graph an engine was built from, and the TensorRT engine), elementwise errors per output.

It answers "does the deployed engine compute what its graph computes", in the form Polygraphy users know
(max absolute and relative difference, pass at atol/rtol). It does not judge the accuracy budget: that stays with
optimizer.measure.accuracy, measured by the harness on every stage alike. Polygraphy is used rather than our own loop so
the same check can be repeated with `polygraphy run` outside this tool.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


@contextlib.contextmanager
def quiet_polygraphy(log_path: Path | None = None) -> Iterator[None]:
    """Polygraphy's logger quiet while we call it. With `log_path`, errors are kept and written there too (the
    parser's errors, to be quoted in our one-line error); without, only critical ones show (a comparison's
    verdict is ours to report)."""
    from polygraphy.logger import G_LOGGER

    from optimizer.core.quiet import silence_polygraphy

    silence_polygraphy()  # what it goes back to afterwards
    old_severity, old_file = G_LOGGER.module_severity, G_LOGGER.log_file
    G_LOGGER.module_severity = G_LOGGER.ERROR if log_path is not None else G_LOGGER.CRITICAL
    if log_path is not None:
        G_LOGGER.log_file = str(log_path)
    try:
        yield
    finally:
        G_LOGGER.module_severity = old_severity
        G_LOGGER.log_file = old_file


def logged_errors(log_path: Path) -> list[str]:
    """The `[E]` lines of a Polygraphy log, without the prefix."""
    if not log_path.is_file():
        return []
    return [line.split("[E]", 1)[1].strip() for line in log_path.read_text(errors="replace").splitlines()
            if "[E]" in line]


def onnxruntime_runner(path: Path, name: str = "onnxruntime-cpu") -> Any:
    """Polygraphy's ONNX Runtime runner on the CPU provider: the reference a GPU runtime is checked against."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    return OnnxrtRunner(SessionFromOnnx(str(path), providers=["CPUExecutionProvider"]), name=name)


def tensorrt_runner(engine_path: Path, name: str = "tensorrt") -> Any:
    from polygraphy.backend.trt import EngineFromPath, TrtRunner

    return TrtRunner(EngineFromPath(str(engine_path)), name=name)


def cross_check(
    reference: Any,
    candidate: Any,
    feeds: list[dict[str, np.ndarray]],
    atol: float,
    rtol: float,
) -> dict[str, Any]:
    """Run both runners on `feeds` and compare every output of every feed. Returns the worst errors per output
    and whether all passed."""
    from polygraphy.comparator import Comparator, CompareFunc

    with quiet_polygraphy(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CompareFunc.simple: the name every 0.4x/0.5x has
        results = Comparator.run([reference, candidate], data_loader=feeds)
        compare = CompareFunc.simple(atol=atol, rtol=rtol, check_shapes=True)
        accuracy = Comparator.compare_accuracy(results, compare_func=compare)
    outputs: dict[str, dict[str, Any]] = {}
    # 0.53 returns a list of results (one per compare function); earlier versions the one result itself.
    groups = [accuracy] if hasattr(accuracy, "items") else list(accuracy)
    for iterations in (its for group in groups for its in group.values()):
        for iteration in iterations:
            for name, result in iteration.items():
                row = outputs.setdefault(name, {"max_absdiff": 0.0, "max_reldiff": 0.0, "passed": True})
                row["max_absdiff"] = max(row["max_absdiff"], float(result.max_absdiff))
                row["max_reldiff"] = max(row["max_reldiff"], float(result.max_reldiff))
                row["passed"] = row["passed"] and bool(result)
    return {
        "reference": reference.name,
        "candidate": candidate.name,
        "feeds": len(feeds),
        "atol": atol,
        "rtol": rtol,
        "passed": bool(accuracy) and all(r["passed"] for r in outputs.values()),
        "outputs": outputs,
    }
