"""Artifact: what a stage produces and the next one consumes. Passes never edit an artifact in place: they
derive a new one (`derive`), which keeps every fact they do not change."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from optimizer.core.errors import OptimizerError

ArtifactKind = Literal["torch", "onnx", "trt_engine", "openvino"]


@dataclass(frozen=True)
class Artifact:
    """A model at one stage.

    kind: how it is run (torch module, ONNX graph, TensorRT engine, OpenVINO IR: model.xml + model.bin).
    path: the file on disk (None for an in-memory torch source, which is rebuilt from the recipe's model).
    runtime: options the runner applies when it loads the artifact, e.g. ORT's graph_optimization_level.
      They are part of the artifact because they change what is measured: ORT's own graph optimizations
      are switched on by the `ort_session` stage, so that their effect is attributed to that stage.
    The other fields are facts about the model that later passes, runners and bundles read.
    """

    kind: ArtifactKind
    path: Path | None
    runtime: dict[str, Any] = field(default_factory=dict)
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    external_data: list[str] = field(default_factory=list)  # weight files beside `path`
    # Generation: the decode graph (a file beside the prefill graph at `path`), its weights, and the number of
    # decoder layers (two KV-cache tensors each).
    decode: str | None = None
    decode_external_data: list[str] = field(default_factory=list)
    layers: int | None = None
    # A decoder in ONNX Runtime GenAI's layout (one graph for prefill and decode, the KV cache one buffer written in
    # place: runtime.generation_shared): the files GenAI's runtime reads beside the graph, genai_config.json first.
    genai_files: list[str] = field(default_factory=list)
    param_bytes: int | None = None  # a torch source's parameters and buffers
    module: str | None = None  # a torch source's class name
    exporter: str | None = None
    opset: int | None = None
    engine: dict[str, Any] | None = None  # a TensorRT engine's build facts (engine.json)

    def derive(self, **changes: Any) -> Artifact:
        """A new artifact with these fields changed and every other fact kept."""
        return dataclasses.replace(self, **changes)

    def files(self) -> list[Path]:
        """Every file the artifact consists of (the model and its external data)."""
        if self.path is None:
            return []
        extra = [self.path.parent / f for f in self.external_data]
        if self.decode:  # generation: the decode graph (and its weights) beside the prefill graph
            extra += [self.path.parent / f for f in [self.decode, *self.decode_external_data]]
        extra += [self.path.parent / f for f in self.genai_files]
        return [self.path, *extra]

    def copy_to(self, folder: Path, name: str | None = None) -> Artifact:
        """The same artifact in `folder`: the model under `name` (default: its own), every other file under its
        path relative to the model's folder, which is how the graph names it (external data at `weights/x.bin`
        stays below the copy). A name that would land outside `folder` is refused, never copied."""
        assert self.path is not None
        target = folder / (name or self.path.name)
        plan = {self.path: target}
        for f in self.files()[1:]:
            rel = Path(os.path.relpath(f, self.path.parent))
            if rel.is_absolute() or ".." in rel.parts:
                raise OptimizerError(f"{self.path}: its file {str(f)!r} is outside the model's folder; not copied")
            plan[f] = folder / rel
        for src, dst in plan.items():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        return self.derive(path=target)

    def generates(self) -> bool:
        """A generation artifact: prefill + decode graphs, or one graph in GenAI's layout."""
        return bool(self.decode or self.genai_files)

    def genai_config_path(self) -> Path | None:
        return self.path.parent / self.genai_files[0] if self.path is not None and self.genai_files else None

    def decoder_layers(self) -> int:
        """The decoder layer count of a generation artifact (its KV cache has two tensors per layer)."""
        if self.layers is None:
            raise OptimizerError(f"{self.path}: a generation artifact without its decoder layer count")
        return self.layers

    def decode_path(self) -> Path | None:
        return self.path.parent / self.decode if self.path is not None and self.decode else None

    def size_bytes(self) -> int | None:
        files = self.files()
        return sum(f.stat().st_size for f in files) if files else self.param_bytes

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Artifact:
        """Also reads the form before these fields existed (stage.json and reports of version 1): the facts
        under `meta`; keys no field holds are dropped."""
        facts = {**dict(d.get("meta") or {}), **{k: v for k, v in d.items() if k != "meta"}}
        known = {f.name for f in dataclasses.fields(Artifact)} - {"kind", "path", "runtime"}
        return Artifact(
            kind=d["kind"],
            path=Path(d["path"]) if d.get("path") else None,
            runtime=dict(d.get("runtime") or {}),
            **{k: v for k, v in facts.items() if k in known and v is not None},
        )

    def with_runtime(self, **options: Any) -> Artifact:
        return self.derive(runtime={**self.runtime, **options})


def own_bytes(files: list[Path], others: list[Path]) -> int:
    """Bytes of `files` not shared with `others` (hard links to the same inode count once, for whoever had them
    first): the disk a stage added to its run."""
    seen = {(f.stat().st_dev, f.stat().st_ino) for f in others if f.is_file()}
    total = 0
    for f in files:
        if f.is_file():
            st = f.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
