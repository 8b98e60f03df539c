"""`optimizer compare A B` as a recipe: A is stage 0 (an `onnx` source), B substitutes it (the `substitute` pass),
so B is timed interleaved with A by the one harness, judged against A's outputs, and explained by op type like
any stage against its parent; no parallel implementation of any of it.

Fairness: stage 0 of an ONNX source runs with ORT's graph optimizations off. For any other level an
`ort_session` stage "a" (A with that level) comes first and B inherits its session options, so A and B always
run with the same graph optimization level, threads and spinning. The level is part of the output.

Inputs come from the graph, inferred as `compile --model` does (names, dtypes, index ranges, dims renamed to
batch / seq; symbolic dims bound by `--scenario batch=1,seq=128`, by either name) or from a
recipe (its inputs, scenarios, accuracy, benchmark and target). Real text needs the tokenizer of a model folder,
which an ONNX file has not: such a recipe's inputs are generated from its specs instead, and the notes say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.recipe.loading import parse_recipe
from optimizer.recipe.schema import SAFE_NAME, BenchmarkSettings, Recipe, recipe_dict

LEVELS = ("disable_all", "basic", "extended", "all")
A_STAGE, B_STAGE = "a", "b"  # stage names in the generated recipe ("source" is A when the level is disable_all)
DEFAULT_SEQ = 128
GENERATED_DTYPES = {"int64", "int32", "float32", "float16", "bool"}  # what recipe InputSpecs can generate


@dataclass(frozen=True)
class CompareSide:
    """One model of the comparison: an ONNX file as given, or a stage of a run (`RUN:stage`)."""

    label: str  # "A" or "B"
    path: Path
    origin: str  # what the user named
    runtime: dict[str, Any] = field(default_factory=dict)  # session options the stage had in its run
    recipe: dict[str, Any] | None = None  # the run's recipe (RUN:stage), for inputs when no --recipe is given
    recipe_dir: Path | None = None

    @property
    def short(self) -> str:
        """A name-safe label for folder names: the file stem, or run-stage."""
        if self.recipe is not None:
            return f"{self.recipe.get('name', 'run')}-{self.origin.rsplit(':', 1)[-1]}"
        return self.path.stem


def file_side(label: str, spec: str) -> CompareSide:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise OptimizerError(f"{label}: no such file: {spec} (give an ONNX file, or RUN:stage with a run folder or id)")
    return CompareSide(label, path.resolve(), spec)


def safe(text: str, limit: int = 64) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._") or "x"
    name = name[:limit].rstrip("-._") or "x"
    return name if SAFE_NAME.fullmatch(name) else "compare"


def default_name(a: CompareSide, b: CompareSide) -> str:
    return safe(f"compare-{a.short}-{b.short}")


def parse_scenario(text: str, with_seq: bool = True, renamed: dict[str, str] | None = None) -> dict[str, Any]:
    """`batch=1,seq=128[,name=b1][,other_dim=N]` -> a recipe scenario (unknown keys are symbolic dims); with_seq:
    the inputs have a sequence dim, so seq defaults to 128 and is part of the default name. renamed: the graph's
    own dim names -> the recipe's (as compile --model names them), so either name is taken."""
    where = f"--scenario {text!r}"
    renamed = renamed or {}
    out: dict[str, Any] = {"dims": {}}
    given: dict[str, tuple[str, int]] = {}  # recipe dim -> (the key the user gave it with, its value)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise OptimizerError(f"{where}: {part!r} is not key=value (e.g. batch=1,seq=128)")
        if key == "name":
            out["name"] = value.strip()
            continue
        try:
            number = int(value)
        except ValueError:
            raise OptimizerError(f"{where}: {key}={value!r} is not a whole number") from None
        if number < 1:
            raise OptimizerError(f"{where}: {key}={number} must be >= 1")
        dim = renamed.get(key, key)
        if dim in given and given[dim][1] != number:
            raise OptimizerError(
                f"{where}: {given[dim][0]!r} and {key!r} are both `{dim}` (the graph's dims as compile --model names "
                f"them: {mapping_text(renamed)}); give `{dim}` one value"
            )
        given[dim] = (key, number)
        if dim in ("batch", "seq"):
            out[dim] = number
        else:
            out["dims"][dim] = number
    out.setdefault("batch", 1)
    if with_seq:
        out.setdefault("seq", DEFAULT_SEQ)
    out.setdefault("name", f"b{out['batch']}" + (f"-s{out['seq']}" if "seq" in out else ""))
    return out


def mapping_text(renamed: dict[str, str]) -> str:
    return ", ".join(f"{k!r} -> {v}" for k, v in renamed.items())


@dataclass
class GraphInputs:
    """A's inputs as `compile --model` infers them from the graph (optimizer/recipe/auto_inputs.py)."""

    specs: list[dict[str, Any]]
    dims: dict[str, int]  # symbolic dims beyond batch and seq, with compile --model's default sizes
    renamed: dict[str, str]  # the graph's dim name -> the recipe's, where they differ
    notes: list[str]


def graph_inputs(path: Path, label: str) -> GraphInputs:
    """Recipe input specs from an ONNX file's inputs, inferred as `compile --model` does: integer inputs in the
    range of the embedding table they index, masks of ones, symbolic dims renamed to batch / seq / safe names."""
    from optimizer.recipe.auto_inputs import onnx_facts
    from passes.substitute import graph_io

    io = graph_io(path)
    for t in io.inputs:
        if t.dtype not in GENERATED_DTYPES:
            raise OptimizerError(
                f"{label} ({path.name}): input {t.name!r} is {t.dtype}, which cannot be generated "
                f"({', '.join(sorted(GENERATED_DTYPES))}); give --recipe with a data_file"
            )
    try:
        facts = onnx_facts(path, f"{label} ({path.name})")
    except OptimizerError as e:  # its messages start with compile's option name
        raise OptimizerError(str(e).removeprefix("--model ")) from None
    shapes = {spec["name"]: spec["shape"] for spec in facts.inputs}
    renamed = {
        g: r for t in io.inputs for g, r in zip(t.dims, shapes[t.name], strict=True)
        if isinstance(g, str) and g != "?" and g != r
    }
    notes = [n for n in facts.notes if not n.startswith("other symbolic dims")]
    if renamed:
        notes.append(f"the graph's dims are named as compile --model names them: {mapping_text(renamed)} "
                     f"(--scenario takes either name)")
    if facts.dims:
        notes.append(f"other symbolic dims bound to {facts.dims} unless --scenario gives them")
    return GraphInputs(facts.inputs, facts.dims, renamed, notes)


def _fill(name: str, dtype: str) -> dict[str, Any]:
    """What a tokenizer would have given: masks of ones (every position real), token types of zeros."""
    low = name.lower()
    if "mask" in low:
        return {"fill": "ones"}
    if "token_type" in low or "segment" in low:
        return {"fill": "zeros"}
    return {}


def _bind(specs: list[dict[str, Any]], scenarios: list[dict[str, Any]], given: bool) -> None:
    """Every symbolic dim other than batch and seq must be bound by every scenario, else a one-line error; given:
    the scenarios are --scenario's, whose dims must all be the inputs' own."""
    dims = {d for s in specs for d in s["shape"] if isinstance(d, str)}
    for scen in scenarios:
        unknown = sorted(set(scen.get("dims", {})) - dims) if given else []
        if unknown:
            known = ", ".join(sorted(dims)) or "none"
            raise OptimizerError(
                f"scenario {scen['name']}: {unknown[0]!r} is not a dim of the inputs (theirs: {known})"
            )
        missing = sorted(dims - {"batch", "seq"} - set(scen.get("dims", {})))
        if missing:
            owner = {d: s["name"] for s in specs for d in s["shape"] if d in missing}
            raise OptimizerError(
                f"scenario {scen['name']}: symbolic dim {missing[0]!r} of input {owner[missing[0]]!r} has no size; "
                f"give it, e.g. --scenario batch=1,{missing[0]}=64"
            )


def _from_base(base: Recipe | dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The parts of a recipe a comparison keeps: inputs, scenarios, target, benchmark, accuracy, seed, data file."""
    data = recipe_dict(base) if isinstance(base, Recipe) else dict(base)
    base_dir = base.base_dir if isinstance(base, Recipe) else Path(data.pop("_base_dir", "."))
    if data.get("workload", "forward") != "forward":
        raise OptimizerError("--recipe: compare runs forward graphs; generation workloads are not supported yet")
    keys = ("inputs", "scenarios", "target", "benchmark", "accuracy", "seed")
    kept: dict[str, Any] = {k: data[k] for k in keys if k in data}
    if data.get("data_file"):
        kept["data_file"] = str((base_dir / data["data_file"]).resolve())
    if data.get("text"):
        notes.append(
            "the recipe's inputs are real text, which needs its model folder's tokenizer: generated inputs of the "
            "same shapes are used instead (masks of ones, token types of zeros)"
        )
        kept["inputs"] = [{**spec, **_fill(spec["name"], spec.get("dtype", "int64"))}
                          if not spec.get("range") and spec.get("fill", "random") == "random" else spec
                          for spec in kept.get("inputs", [])]
        longest = [s["name"] for s in kept.get("scenarios", []) if s.get("padding") == "longest"]
        if longest:
            notes.append(f"scenarios {longest} used natural text lengths; they run padded to `seq` here")
        kept["scenarios"] = [{**s, "padding": "max_length"} for s in kept.get("scenarios", [])]
    return kept


def compare_recipe(
    a: CompareSide,
    b: CompareSide,
    *,
    base: Recipe | None = None,
    scenarios: list[str] | None = None,
    level: str = "all",
    bench: dict[str, Any] | None = None,
    threads: int | None = None,
    device: str | None = None,
    name: str | None = None,
) -> tuple[Recipe, list[str]]:
    """The recipe that runs A as stage 0 and B as a `substitute` stage, and notes for the user. A one-line
    OptimizerError when A and B do not take the same inputs or give as many outputs."""
    from passes.substitute import graph_io, io_mismatch

    if level not in LEVELS:
        raise OptimizerError(f"--ort-level: {level!r} is not one of {', '.join(LEVELS)}")
    why = io_mismatch(graph_io(a.path), graph_io(b.path), f"A ({a.origin})", f"B ({b.origin})")
    if why:
        raise OptimizerError(why)
    notes: list[str] = []
    run_recipe = next((s.recipe for s in (a, b) if s.recipe is not None), None)
    if base is None and run_recipe is not None:  # RUN:stage: the run's own inputs and scenarios
        owner = a if a.recipe is not None else b
        base_data: dict[str, Any] | Recipe = {**run_recipe, "_base_dir": str(owner.recipe_dir or ".")}
    else:
        base_data = base  # type: ignore[assignment]
    kept = _from_base(base_data, notes) if base_data is not None else {}
    inferred = None
    if not kept.get("inputs") and not kept.get("data_file"):
        inferred = graph_inputs(a.path, "A")
        kept["inputs"] = inferred.specs
        notes.append(
            "inputs generated from A's graph as compile --model infers them (random values, integer inputs in the "
            "range of the embedding table they index, masks of ones): accuracy on real data needs --recipe with a "
            "data_file"
        )
        notes += inferred.notes
    with_seq = any("seq" in spec["shape"] for spec in kept.get("inputs", []))
    renamed = inferred.renamed if inferred is not None else {}
    if scenarios:
        kept["scenarios"] = [parse_scenario(s, with_seq, renamed) for s in scenarios]
    elif not kept.get("scenarios"):
        kept["scenarios"] = [parse_scenario("batch=1", with_seq)]
    if inferred is not None and inferred.dims:  # compile --model's sizes for the dims no scenario gives
        kept["scenarios"] = [{**s, "dims": {**inferred.dims, **s.get("dims", {})}} for s in kept["scenarios"]]
    _bind(kept.get("inputs", []), kept["scenarios"], given=bool(scenarios))
    target = dict(kept.pop("target", {}) or {})
    if threads is not None:
        target["threads"] = threads
    if device is not None:
        target["device"] = device
    benchmark = {**(kept.pop("benchmark", {}) or {}), **(bench or {})}
    passes: list[dict[str, Any]] = []
    # A side whose run disabled ORT fusions (fuse's kernel choice) is timed as it ran: both sides get the union.
    disabled = sorted({d for side in (a, b) for d in side.runtime.get("disabled_optimizers") or []})
    if level != "disable_all":
        session = {"graph_optimization_level": level, "save_optimized": False}
        if disabled:
            session["disabled_optimizers"] = disabled
            notes.append(f"both run with onnxruntime's {', '.join(disabled)} disabled, as a side ran in its run")
        passes.append({"type": "ort_session", "name": A_STAGE, "config": session})
    from optimizer.runtime import onnx_io

    # B's whole model (graph and external data) is pinned: weights replaced in place are measured again.
    substitute = {"path": str(b.path), "sha256": onnx_io.model_sha256(b.path)}
    passes.append({"type": "substitute", "name": B_STAGE, "config": substitute})
    for side in (a, b):
        ran = side.runtime.get("graph_optimization_level")
        if ran is not None and ran != level:
            notes.append(f"{side.label} ran with graph_optimization_level {ran} in its run; here both run with {level}")
    data = {
        "name": name or default_name(a, b),
        "description": f"optimizer compare: A = {a.origin}, B = {b.origin}",
        "model": {"source": "onnx", "path": str(a.path)},
        **kept,
        "target": target,
        "benchmark": benchmark,
        "passes": passes,
    }
    return parse_recipe(data, "<compare>", Path.cwd()), notes


def parse_bench(text: str | None) -> dict[str, Any]:
    """`rounds=6,iterations=5,memory=inline` -> benchmark settings (checked against the schema)."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in BenchmarkSettings.model_fields:
            known = ", ".join(BenchmarkSettings.model_fields)
            raise OptimizerError(f"--bench: {part!r} is not key=value with a benchmark setting ({known})")
        out[key] = value
    try:
        return BenchmarkSettings.model_validate(out).model_dump(include=set(out))
    except ValueError as e:  # pydantic's ValidationError: name the first field
        first = e.errors()[0] if hasattr(e, "errors") else {"loc": ("?",), "msg": str(e)}
        raise OptimizerError(f"--bench: {first['loc'][0]}: {first['msg']}") from None
