"""Bug triage: whether an exception raised during a stage is a bug of ours (it should fail loudly under tests and
`--debug`) or a refusal by the model, a model library or the machine (it fails the stage alone, as it does for
users). Reads only the exception and its traceback's file names; never raises."""

from __future__ import annotations

import os
from pathlib import Path

from optimizer.core.errors import OptimizerError

_ROOT = Path(__file__).resolve().parents[2]
_OUR_PACKAGES = (str(_ROOT / "optimizer") + os.sep, str(_ROOT / "passes") + os.sep)
# Libraries that refuse models: an exception raised inside one is about the model (or the library), not a bug of
# ours. Anything else (the standard library, pydantic, numpy) raises because of how our code called it.
MODEL_LIBRARIES = frozenset(
    {"onnxruntime", "torch", "onnx", "onnxscript", "onnx_ir", "transformers", "tokenizers", "safetensors",
     "tensorrt", "polygraphy", "onnx_graphsurgeon", "openvino", "nncf"}
)


def _owner(filename: str) -> str | None:
    """"ours", "library" (a model library) or None (anything else) for a frame's file."""
    path = str(Path(filename).resolve())
    if path.startswith(_OUR_PACKAGES):
        return "ours"
    parts = Path(filename).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages") and parts[i + 1].removesuffix(".py") in MODEL_LIBRARIES:
            return "library"
    return None


def is_our_bug(error: BaseException) -> bool:
    """Whether an exception is a bug of ours: not one of our errors (OptimizerError and its kinds say what is
    wrong on purpose, but one raised `from` a bug of ours is followed to it), not the machine's (OSError,
    MemoryError), and of the frames that are ours or a model library's, the innermost is ours (a KeyError in
    optimizer/, a TypeError pydantic raises on our call)."""
    if isinstance(error, OptimizerError):
        return error.__cause__ is not None and is_our_bug(error.__cause__)
    if isinstance(error, (OSError, MemoryError)):
        return False  # the machine (a full disk, a permission, memory), wherever it surfaced
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    owners = [o for o in map(_owner, reversed(frames)) if o is not None]
    return bool(owners) and owners[0] == "ours"


def debug_from_env() -> bool:
    """OPTIMIZER_DEBUG=1: the test suite sets it (`optimizer --debug` passes debug=True instead)."""
    return os.environ.get("OPTIMIZER_DEBUG", "") not in ("", "0")
