"""The one reader of a bundle: manifest.json checked once, in shape and bounds, before verify, bench or export's own
check read anything it names.

A bundle is handed over: its manifest is text anyone may edit. So every file it names must lie inside the bundle
(no `..`, no absolute path, no symlink out), the tolerance and the runtime options must be there with values the
runtime takes, thread counts are bounded (and never more than this machine's CPUs: a session of 100,000 threads
takes a machine down), and reference.npz must hold every tensor the checks read. Problems are one line each,
naming manifest.json (or the file) and the field.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from optimizer.core.artifact import file_sha256
from optimizer.core.errors import OptimizerError

MANIFEST = "manifest.json"
REFERENCE = "reference.npz"
MAX_THREADS = 1024  # beyond any CPU this runs on: a larger count in a manifest is an edit, not a setting


def _machine_threads(n: int) -> int:
    """A thread count the manifest may ask for, run with no more threads than this machine has CPUs."""
    return min(n, os.cpu_count() or 1)


Threads = Annotated[int, Field(strict=True, ge=1, le=MAX_THREADS), AfterValidator(_machine_threads)]
Fraction = Annotated[float, Field(ge=-1.0, le=1.0, allow_inf_nan=False)]


def _inside(name: str, info: ValidationInfo) -> str:
    """A path the manifest names: relative, no `..`, and (with the bundle root in the context) not a symlink out."""
    if not name or "\x00" in name:
        raise ValueError("a file name is empty or holds a NUL")
    pure = PurePosixPath(name)
    root = (info.context or {}).get("root")
    escapes = pure.is_absolute() or ".." in pure.parts or Path(name).is_absolute()
    if escapes or (root is not None and not (root / name).resolve().is_relative_to(root.resolve())):
        raise ValueError(f"{name!r} is outside the bundle; a manifest may name only files inside it")
    return name


BundleFile = Annotated[str, AfterValidator(_inside)]


class Tolerance(BaseModel):
    """What verify accepts: cosine and max abs (relative to the reference's largest value) for one graph; token
    agreement and logits cosine for a generation loop. Which are required depends on the bundle (Manifest)."""

    model_config = ConfigDict(extra="forbid")
    min_cosine: Fraction | None = None
    max_abs_relative: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    against: str | None = None
    min_token_agreement: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    min_logits_cosine: Fraction | None = None


class OrtOptions(BaseModel):
    """An ONNX Runtime session's options as a stage recorded them (runtime.sessions.session_options reads them);
    other facts of the artifact (cuda_graph, kv_cache...) pass through."""

    model_config = ConfigDict(extra="allow")
    graph_optimization_level: Literal["disable_all", "basic", "extended", "all"] = "disable_all"
    execution_mode: Literal["sequential", "parallel"] | None = None
    intra_op_threads: Threads | None = None
    inter_op_threads: Threads | None = None
    allow_spinning: bool | None = None
    shared_thread_pool: bool | None = None
    denormal_as_zero: bool | None = None
    dynamic_block_base: Annotated[int, Field(strict=True, ge=0, le=MAX_THREADS)] | None = None
    disabled_optimizers: list[str] | None = None


class OvOptions(BaseModel):
    """The compile options an OpenVINO manifest may carry (runtime.ov_engine), checked before OpenVINO sees them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ov_precision: Literal["default", "f32", "bf16"] = "default"
    ov_hint: Literal["latency", "throughput"] = "latency"
    ov_streams: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    ov_denormals: bool | None = None
    ov_static_shapes: bool | None = None
    intra_op_threads: Threads | None = None


class OrtRuntime(BaseModel):
    model_config = ConfigDict(extra="allow")
    onnxruntime_session: OrtOptions
    providers: list[str] = ["CPUExecutionProvider"]
    threads: Threads


class OvRuntime(BaseModel):
    model_config = ConfigDict(extra="allow")
    openvino: OvOptions
    device: str = "CPU"
    threads: Threads


def _runtime_kind(value: Any) -> str:
    """The tag of a runtime as read (a dict) or as dumped (the model instance)."""
    openvino = isinstance(value, OvRuntime) or (isinstance(value, dict) and "openvino" in value)
    return "<openvino>" if openvino else "<onnxruntime>"


Runtime = Annotated[
    Annotated[OrtRuntime, Tag("<onnxruntime>")] | Annotated[OvRuntime, Tag("<openvino>")],
    Discriminator(_runtime_kind),
]


class Cache(BaseModel):
    model_config = ConfigDict(extra="allow")
    kind: str | None = None
    layers: Annotated[int, Field(strict=True, ge=1, le=10_000)] | None = None


class ManifestTensor(BaseModel):
    """An input or output as the manifest lists it (deploy.shared.manifest_io: name, dtype, onnx_type, shape)."""

    model_config = ConfigDict(extra="allow")
    name: str


class Manifest(BaseModel):
    """manifest.json as verify, bench and export's own check rely on it; the rest (numbers, versions, recipe) is
    information and kept as written."""

    model_config = ConfigDict(extra="allow")
    format: Literal["onnx", "triton", "tensorrt", "openvino", "genai"]
    files: dict[BundleFile, str]
    model: BundleFile | None = None
    workload: Literal["forward", "generation"] | None = None
    graphs: dict[str, BundleFile] | None = None
    cache: Cache | None = None
    inputs: list[ManifestTensor] = []
    outputs: list[ManifestTensor] = []
    tolerance: Tolerance
    runtime: Runtime | None = None
    benchmark: dict[str, Any] = {}

    @field_validator("files")
    @classmethod
    def _sha256s(cls, files: dict[str, str]) -> dict[str, str]:
        bad = [name for name, digest in files.items() if not isinstance(digest, str) or len(digest) > 128]
        if bad:
            raise ValueError(f"{bad[0]!r}: not a sha256")
        return files

    @model_validator(mode="after")
    def _what_the_kind_needs(self) -> Manifest:
        tol = self.tolerance
        if self.workload == "generation":
            genai = self.cache is not None and self.cache.kind == "genai_shared_buffer"
            parts = ("model", "genai_config") if genai else ("prefill", "decode")
            missing = [p for p in parts if p not in (self.graphs or {})]
            if missing:
                raise ValueError(f"graphs.{missing[0]} is required for a generation bundle")
            if not genai and (self.cache is None or self.cache.layers is None):
                raise ValueError("cache.layers is required for a generation bundle")
            needed = ("min_token_agreement", "min_logits_cosine")
        else:
            if self.model is None:
                raise ValueError("model is required")
            needed = ("min_cosine",) if self.format == "tensorrt" else ("min_cosine", "max_abs_relative")
        absent = [f"tolerance.{n}" for n in needed if getattr(tol, n) is None]
        if absent:
            raise ValueError(f"{absent[0]} is required")
        if self.format != "tensorrt" and self.runtime is None:
            raise ValueError("runtime is required")
        return self


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("<"))  # leave out the runtime kind's tag


def validation_line(e: ValidationError, where: str, within: tuple[str, ...] = ()) -> str:
    """A pydantic error as one line: the file, the field (below `within`) and what is wrong with it."""
    err = e.errors()[0]
    field = _where((*within, *err["loc"]))
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {field + ': ' if field else ''}{msg}"


def read_manifest(root: Path) -> dict[str, Any]:
    """manifest.json checked (see the module's docstring) and returned as a dict in which every key the checks
    read is present and in bounds (thread counts cut to this machine's CPUs); one OptimizerError otherwise."""
    import json

    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise OptimizerError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise OptimizerError(f"{path}: not a bundle manifest ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise OptimizerError(f"{path}: not a bundle manifest (not a JSON object)")
    try:
        manifest = Manifest.model_validate(data, context={"root": root})
    except ValidationError as e:
        raise OptimizerError(validation_line(e, f"{path}: not a bundle manifest")) from None
    checked = manifest.model_dump(exclude_unset=True)
    return {**data, **{k: checked[k] for k in ("runtime", "tolerance") if k in checked},
            "benchmark": manifest.benchmark}


def file_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Every file listed with its sha256, and nothing else in the bundle."""
    listed = {str(Path(rel)) for rel in manifest["files"]} | {MANIFEST}
    problems = [
        f"{p.relative_to(root)}: not in the manifest (added after export?)"
        for p in sorted(root.rglob("*"))
        if p.is_file() and str(p.relative_to(root)) not in listed
    ]
    for rel, digest in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif file_sha256(path) != digest:
            problems.append(f"{rel}: sha256 differs from the manifest (the file was changed)")
    return problems


def reference_key(scenario: str, part: str, name: str) -> str:
    """reference.npz's key for a tensor: `<scenario>/<part>/<name>`. Scenario names hold no '/', tensor names may
    (`input/ids:0`, from TensorFlow), so a key is split at its first two '/' only (split_key)."""
    return f"{scenario}/{part}/{name}"


def split_key(key: str) -> tuple[str, str, str]:
    scenario, part, name = (key.split("/", 2) + ["", ""])[:3]
    return scenario, part, name


def reference_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """reference.npz holds, for every scenario, what the checks read: the inputs and outputs the manifest names
    (one graph), or the prompt, tokens and logits (a generation loop)."""
    path = root / REFERENCE
    try:
        with zipfile.ZipFile(path) as z:
            keys = {n.removesuffix(".npy") for n in z.namelist()}
            pickled = [n.removesuffix(".npy") for n in z.namelist() if _holds_objects(z, n)]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        return [f"{REFERENCE}: not readable ({e})"]
    if pickled:  # numpy would unpickle them only if asked (it never is): refused from the header alone
        return [f"{REFERENCE}: {pickled[0]!r} holds pickled Python objects, not an array (refused, never loaded)"]
    scenarios = sorted({split_key(k)[0] for k in keys})
    if not scenarios:
        return [f"{REFERENCE}: holds no scenario"]
    if manifest.get("workload") == "generation":
        needed = [("prompt", ""), ("tokens", ""), ("logits", "")]
        want = [f"{s}/{part}" for s in scenarios for part, _ in needed]
    else:
        tensors = [("in", t["name"]) for t in manifest.get("inputs") or []]
        tensors += [("out", t["name"]) for t in manifest.get("outputs") or []]
        want = [reference_key(s, part, name) for s in scenarios for part, name in tensors]
    missing = [k for k in want if k not in keys]
    return [f"{REFERENCE}: no {missing[0]!r} (the reference lacks a tensor the manifest names)"] if missing else []


def _holds_objects(z: zipfile.ZipFile, name: str) -> bool:
    """Whether the .npy member's header declares an object dtype (its data a pickle), read without the data."""
    from numpy.lib import format as npy

    with z.open(name) as f:
        version = npy.read_magic(f)
        read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        _, _, dtype = read(f)  # the header only
    return bool(dtype.hasobject)


def load_bundle(root: Path) -> dict[str, Any]:
    """A bundle ready to run: its manifest checked, its files as exported, its reference complete; one
    OptimizerError (every problem, on one line) otherwise. bench and export's own check read bundles through
    this; verify reports the same problems as its list."""
    manifest = read_manifest(root)
    problems = file_problems(root, manifest) or reference_problems(root, manifest)
    if problems:
        raise OptimizerError(f"{root}: " + "; ".join(problems))
    return manifest
