"""Loading a recipe: YAML read with bounds (size, alias expansion, depth), validated by the schema, then the
cross-field checks and every pass's own config, so a typo in the last pass fails in a second, not after a
ten-minute export. Every error names the file and the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from optimizer.core.errors import RecipeError
from optimizer.recipe.packages import package_dir
from optimizer.recipe.schema import (
    GENERATION_TASKS,
    MAX_INPUT_ELEMENTS,
    SOURCE_STAGE,
    HFConfigSource,
    HFFolderSource,
    OnnxSource,
    Recipe,
)


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _check_files(recipe: Recipe, path: str) -> None:
    """The files the recipe names, when they exist, are regular files (core.files): a FIFO would hang compile."""
    from optimizer.core.files import not_regular

    named = [("data_file", recipe.data_file), ("model.path", getattr(recipe.model, "path", None)
                                                if recipe.model.source == "onnx" else None)]
    for field, value in named:
        if not value:
            continue
        what = not_regular(recipe.resolve(value))
        if what is not None:
            raise RecipeError(path, field, f"{recipe.resolve(value)} is {what}, not a regular file")


def _check_structure(recipe: Recipe, path: str) -> None:
    """Cross-field checks pydantic cannot express on one field."""
    seen: set[str] = {SOURCE_STAGE}
    for i, spec in enumerate(recipe.passes):
        name = spec.stage_name
        if name in seen:
            raise RecipeError(path, f"passes[{i}].name", f"stage name {name!r} is used twice; give it a `name`")
        if spec.from_ is not None and spec.from_ not in seen:
            known = ", ".join(sorted(seen))
            raise RecipeError(path, f"passes[{i}].from", f"no earlier stage named {spec.from_!r} (known: {known})")
        seen.add(name)
    names = [s.name for s in recipe.scenarios]
    for i, scen in enumerate(recipe.scenarios):
        if scen.padding == "longest" and recipe.text is None:
            raise RecipeError(path, f"scenarios[{i}].padding", "longest needs real text (`text`) to take lengths from")
    if len(set(names)) != len(names):
        raise RecipeError(path, "scenarios", "scenario names must be unique")
    for i, inp in enumerate(recipe.inputs):
        for dim in inp.shape:
            if isinstance(dim, str):
                for scen in recipe.scenarios:
                    if dim not in scen.bindings():
                        raise RecipeError(
                            path, f"inputs[{i}].shape", f"dim {dim!r} is not bound by scenario {scen.name!r}"
                        )
    if recipe.text and recipe.text.file and not recipe.resolve(recipe.text.file).is_file():
        raise RecipeError(path, "text.file", f"no such file: {recipe.resolve(recipe.text.file)}")
    model = recipe.model
    if recipe.workload == "generation" and getattr(model, "task", None) not in GENERATION_TASKS:
        raise RecipeError(path, "workload", "generation needs a causal LM or an encoder-decoder: set model.task: "
                          f"{' or '.join(GENERATION_TASKS)}")
    if isinstance(model, OnnxSource) and not recipe.resolve(model.path).is_file():
        raise RecipeError(path, "model.path", f"no such file: {recipe.resolve(model.path)}")
    if isinstance(model, HFFolderSource):
        base = package_dir(model.package) if model.package is not None else None
        if model.package is not None and base is None:
            raise RecipeError(path, "model.package", f"package {model.package!r} is not installed")
        if base is not None and not (base / model.path).is_dir():
            raise RecipeError(path, "model.path", f"no folder {model.path!r} inside package {model.package!r}")
        if model.package is None and not recipe.resolve(model.path).is_dir():
            raise RecipeError(path, "model.path", f"no such folder: {recipe.resolve(model.path)}")


# An hf_config's sizes that count something (layers, heads, widths, tokens): transformers builds a model from any
# integer, and -1 layers builds one with none. The vocabulary bounds the ids drawn for the inputs that index it.
HF_COUNTS = ("num_hidden_layers", "n_layer", "num_attention_heads", "n_head", "num_key_value_heads", "hidden_size",
             "n_embd", "intermediate_size", "n_inner", "vocab_size", "max_position_embeddings", "n_positions",
             "type_vocab_size", "head_dim")
HF_VOCAB = {"gpt2": 50257, "llama": 32000, "bert": 30522}  # transformers' default vocab_size per architecture
ID_INPUTS = ("input_ids", "decoder_input_ids")
DEFAULT_INT_RANGE = (0, 1000)  # what runtime.inputs draws an integer input from when it has no range


def _check_hf_config(recipe: Recipe, path: str) -> None:
    """An hf_config's counts are integers >= 1, and an id input's generated values (its range, or the default
    [0, 1000)) lie inside the vocabulary (an id past it is an IndexError in the embedding)."""
    model = recipe.model
    if not isinstance(model, HFConfigSource):
        return
    for key in HF_COUNTS:
        value = model.config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RecipeError(path, f"model.config.{key}", f"{value!r} is not a count: it must be an integer >= 1")
    vocab = model.config.get("vocab_size", HF_VOCAB[model.architecture])
    for i, spec in enumerate(recipe.inputs):
        if spec.name not in ID_INPUTS or spec.fill != "random":
            continue
        low, high = spec.range or DEFAULT_INT_RANGE
        if low < 0 or math.ceil(high) > vocab:
            drawn = "its range" if spec.range else "the default range"
            raise RecipeError(path, f"inputs[{i}].range",
                              f"{spec.name!r} is drawn from [{low:g}, {high:g}) ({drawn}), outside the model's "
                              f"vocabulary (model.config.vocab_size {vocab}): give range: [0, {vocab}]")


def _check_unique(names: list[str], field: str, path: str) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise RecipeError(path, f"{field}[{i}]" + (".name" if field == "inputs" else ""),
                              f"{name!r} is used twice; each {field[:-1]} needs its own name")
        seen.add(name)


def _onnx_outputs(path: Path, where: str) -> list[str]:
    """The graph outputs of an ONNX file, read without its weights."""
    import onnx

    try:
        return [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]
    except Exception as e:  # onnx raises DecodeError, OSError, ValueError... for broken files
        raise RecipeError(where, "model.path", f"{path}: not a readable ONNX model ({type(e).__name__})") from None


def _check_outputs(recipe: Recipe, path: str) -> None:
    """Names must be unique, and accuracy.output must name an output where the outputs are known at load: the
    recipe's `outputs`, or an ONNX source's graph. A PyTorch model's outputs are known once it runs: stage 0
    checks them (engine.source.check_budget_output)."""
    _check_unique([s.name for s in recipe.inputs], "inputs", path)
    _check_unique(recipe.outputs or [], "outputs", path)
    wanted = recipe.accuracy.output
    if wanted is None:
        return
    known = recipe.outputs
    if known is None and isinstance(recipe.model, OnnxSource):
        known = _onnx_outputs(recipe.resolve(recipe.model.path), path)
    if known is not None and wanted not in known:
        names = ", ".join(map(repr, known))
        raise RecipeError(path, "accuracy.output", f"{wanted!r} is not an output (outputs: {names})")


def _too_big(elements: int) -> str:
    return (f"{elements:,} elements in one input tensor, more than the {MAX_INPUT_ELEMENTS:,} (2**31) one input may "
            "have (8 GiB of float32 per sample, past the int32 indexing many kernels use)")


def _check_sizes(recipe: Recipe, path: str) -> None:
    """Refuse inputs no machine can hold, before anything runs: each tensor of every scenario and sweep batch is
    at most MAX_INPUT_ELEMENTS (the fixed cap the schema explains); what fits this machine is a run-time check."""
    for i, scen in enumerate(recipe.scenarios):
        _check_scenario_size(recipe, scen.bindings(), path, lambda dim, i=i: f"scenarios[{i}].{_dim_field(dim)}")
    if recipe.batch_sweep and recipe.scenarios:
        first = recipe.scenarios[0]
        for k, batch in enumerate(recipe.batch_sweep.batches):
            bind = {**first.bindings(), "batch": batch}
            _check_scenario_size(recipe, bind, path, lambda dim, k=k: f"batch_sweep.batches[{k}]")


def _dim_field(dim: str) -> str:
    return dim if dim in ("batch", "seq") else f"dims.{dim}"


def _check_scenario_size(recipe: Recipe, bind: dict[str, int], path: str, field_of: Any) -> None:
    shapes = [(f"inputs[{j}].shape", spec.shape) for j, spec in enumerate(recipe.inputs)]
    if recipe.text is not None:  # the tokenizer's outputs: [batch, at most seq]
        shapes.append(("", ["batch", "seq"]))
    for field, shape in shapes:
        fixed = math.prod(d for d in shape if isinstance(d, int))
        if fixed > MAX_INPUT_ELEMENTS:
            raise RecipeError(path, field, _too_big(fixed))
        named = [d for d in shape if isinstance(d, str) and d in bind]
        elements = fixed * math.prod(bind[d] for d in named)
        if elements > MAX_INPUT_ELEMENTS:
            largest = max(named, key=lambda d: bind[d])
            raise RecipeError(path, field_of(largest), _too_big(elements))


def _validate_pass_configs(recipe: Recipe, path: str) -> None:
    from optimizer.core.registry import UnknownPass, pass_class

    for i, spec in enumerate(recipe.passes):
        try:
            cls = pass_class(spec.type)
        except UnknownPass as e:
            raise RecipeError(path, f"passes[{i}].type", str(e)) from None
        try:
            config = cls.Config.model_validate(spec.config)
        except ValidationError as e:
            err = e.errors()[0]
            field = _field_path((f"passes[{i}]", "config", *err["loc"]))
            raise RecipeError(path, field, err["msg"]) from None
        reason = cls.recipe_reason(config, recipe)
        if reason is not None:
            raise RecipeError(path, f"passes[{i}].config.{reason[0]}", reason[1])


def parse_recipe(data: Any, path: str = "<recipe>", base_dir: Path | None = None) -> Recipe:
    """Validate a recipe already read into Python objects."""
    if not isinstance(data, dict):
        raise RecipeError(path, None, "the recipe must be a YAML mapping")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # Drop the discriminated-union tag pydantic puts in the location (e.g. model.hf_folder.path).
        # and the member tags of plain unions (a shape entry is `int | str`).
        # and the `[key]` tag of a dict key's own error (scenarios[0].dims.batch.[key]).
        tags = {"hf_folder", "hf_config", "factory", "onnx", "constrained-int", "int", "str", "[key]"}
        loc = tuple(p for p in err["loc"] if p not in tags)
        raise RecipeError(path, _field_path(loc) or None, err["msg"]) from None
    recipe.base_dir = base_dir or Path(".")
    _check_files(recipe, path)
    _check_structure(recipe, path)
    _check_hf_config(recipe, path)
    _check_outputs(recipe, path)
    _check_sizes(recipe, path)
    _validate_pass_configs(recipe, path)
    return recipe


MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000  # values once aliases are expanded: a real recipe has a few hundred
MAX_YAML_CHARS = 2 * MAX_RECIPE_BYTES  # characters once aliases are expanded: a file without aliases is at most 1 MB


def _bounded_yaml(text: str, where: str) -> Any:
    """yaml.safe_load, but strict and bounded, checked on the composed node graph before anything is built: a
    mapping that gives a key twice is refused (YAML would keep the last silently), and so is a document whose
    aliases expand to more than MAX_YAML_VALUES values or MAX_YAML_CHARS characters (an alias bomb: a few lines,
    or one long string, that become gigabytes when anything walks or copies them)."""
    loader = yaml.SafeLoader(text)
    try:
        sizes: dict[int, tuple[int, int]] = {}
        cap = (MAX_YAML_VALUES + 1, MAX_YAML_CHARS + 1)

        def expanded(n: yaml.Node) -> tuple[int, int]:  # (values, characters), memoized: an alias is a shared node
            if id(n) not in sizes:
                sizes[id(n)] = (0, 0)  # a recursive alias counts once
                children: list[Any] = []
                if isinstance(n, yaml.SequenceNode):
                    children = n.value
                elif isinstance(n, yaml.MappingNode):
                    children = [x for pair in n.value for x in pair]
                    _refuse_twice(n, where)
                parts = [expanded(c) for c in children]
                own = len(n.value) if isinstance(n, yaml.ScalarNode) else 0
                sizes[id(n)] = (min(1 + sum(v for v, _ in parts), cap[0]), min(own + sum(c for _, c in parts), cap[1]))
            return sizes[id(n)]

        try:  # composing and counting both recurse with the nesting
            node = loader.get_single_node()
            values, chars = expanded(node) if node is not None else (0, 0)
        except RecursionError:
            raise RecipeError(where, None, "its YAML is nested too deeply to be a recipe") from None
        if node is None:
            return None
        if values > MAX_YAML_VALUES:
            raise RecipeError(where, None, f"its YAML aliases expand to more than {MAX_YAML_VALUES} values")
        if chars > MAX_YAML_CHARS:
            raise RecipeError(where, None, f"its YAML aliases expand to more than {MAX_YAML_CHARS >> 20} MB of text")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_twice(node: yaml.MappingNode, where: str) -> None:
    seen: dict[str, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.value == "<<":  # merge keys may repeat a key: YAML's rule
            continue
        line = key.start_mark.line + 1
        if key.value in seen:
            raise RecipeError(where, f"line {line}", f"{key.value!r} given twice (first on line {seen[key.value]}); "
                              "YAML would keep the last silently")
        seen[key.value] = line


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file; raises RecipeError naming the file and field."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(str(p), None, "no such recipe file")
    size = p.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise RecipeError(str(p), None, f"{size / 2**20:.1f} MB is not a recipe (at most {MAX_RECIPE_BYTES >> 20} MB)")
    try:
        data = _bounded_yaml(p.read_bytes().decode("utf-8"), str(p))
    except UnicodeDecodeError as e:
        raise RecipeError(str(p), f"byte {e.start}", f"not UTF-8 text (0x{e.object[e.start]:02x}); save the "
                          "recipe as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else None
        raise RecipeError(str(p), where, f"not valid YAML ({getattr(e, 'problem', e)})") from None
    return parse_recipe(data, str(p), p.parent.resolve())
