"""Artifact: what a stage produces and the next one consumes. Passes never edit an artifact in place."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

ArtifactKind = Literal["torch", "onnx", "trt_engine"]


@dataclass(frozen=True)
class Artifact:
    """A model at one stage.

    kind: how it is run (torch module, ONNX graph, TensorRT engine).
    path: the file on disk (None for an in-memory torch source, which is rebuilt from the recipe's model).
    runtime: options the runner applies when it loads the artifact, e.g. ORT's graph_optimization_level.
      They are part of the artifact because they change what is measured: ORT's own graph optimizations
      are switched on by the `ort_session` stage, so that their effect is attributed to that stage.
    meta: free-form facts (exporter, opset, output names...).
    """

    kind: ArtifactKind
    path: Path | None
    runtime: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def files(self) -> list[Path]:
        """Every file the artifact consists of (the model and its external data)."""
        if self.path is None:
            return []
        extra = [self.path.parent / f for f in self.meta.get("external_data", [])]
        if self.meta.get("decode"):  # generation: the decode graph (and its weights) beside the prefill graph
            extra += [self.path.parent / f for f in [self.meta["decode"], *self.meta.get("decode_external_data", [])]]
        return [self.path, *extra]

    def decode_path(self) -> Path | None:
        return self.path.parent / self.meta["decode"] if self.path is not None and self.meta.get("decode") else None

    def size_bytes(self) -> int | None:
        files = self.files()
        return sum(f.stat().st_size for f in files) if files else self.meta.get("param_bytes")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Artifact:
        return Artifact(
            kind=d["kind"],
            path=Path(d["path"]) if d.get("path") else None,
            runtime=dict(d.get("runtime", {})),
            meta=dict(d.get("meta", {})),
        )

    def with_runtime(self, **options: Any) -> Artifact:
        return Artifact(self.kind, self.path, {**self.runtime, **options}, dict(self.meta))


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
