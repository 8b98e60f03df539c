"""Adversarial cases of issue 47, classes 5 and 9 (data_file): a data file's arrays are checked against what the
recipe declares before anything runs (runtime.inputs.data_problem), and an hf_config's counts and vocabulary
bound what is built and drawn (recipe.loading._check_hf_config)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import yaml

from optimizer.core.errors import InputError, RecipeError

from .adversarial import Shared, _refused

KIND5 = "R4.5 data that hangs"
KIND9 = "R4.9 still open from round 3"


def add_cases(r: Shared) -> None:
    from optimizer.recipe.loading import load_recipe, parse_recipe
    from optimizer.runtime.inputs import build_feeds

    r.work.mkdir(parents=True, exist_ok=True)
    add_cases_9(r)
    spec = r.base["inputs"][0]
    width = spec["shape"][1]

    def data(label: str, array: np.ndarray) -> bool | str:
        np.savez(r.work / f"{label}.npz", **{spec["name"]: array})
        d = {**copy.deepcopy(r.base), "data_file": f"{label}.npz", "scenarios": [{"name": "b1", "batch": 1, "seq": 1}]}
        recipe = parse_recipe(d, f"{label}.yaml", r.work)
        return _refused(lambda: build_feeds(recipe, 2), InputError)

    nan = np.ones((1, width), np.float32)
    nan[0, 0] = np.nan
    inf = np.ones((1, width), np.float32)
    inf[0, -1] = -np.inf
    r.out.add(KIND5, "data_file of batch 0", lambda: data("b0", np.zeros((0, width), np.float32)))
    r.out.add(KIND5, "data_file batch 8 under a batch-1 scenario", lambda: data("b8", np.ones((8, width), np.float32)))
    r.out.add(KIND5, "NaN in data_file", lambda: data("nan", nan))
    r.out.add(KIND5, "-inf in data_file", lambda: data("inf", inf))
    r.out.add(KIND9, "data_file of the wrong dtype", lambda: data("f64", np.ones((1, width), np.float64)))
    r.out.add(KIND9, "data_file of int ids for a float input", lambda: data("i64", np.ones((1, width), np.int64)))

    gpt2: dict[str, Any] = {"source": "hf_config", "architecture": "gpt2", "task": "causal-lm",
                            "config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}}
    ids = {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}

    def hf(label: str, config: dict[str, Any], inp: dict[str, Any]) -> bool | str:
        d = {**copy.deepcopy(r.base), "model": {**gpt2, "config": {**gpt2["config"], **config}}, "inputs": [inp],
             "scenarios": [{"name": "s", "batch": 1, "seq": 8}]}
        path = r.work / f"{label}.yaml"
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        return _refused(lambda: load_recipe(path), RecipeError)

    r.out.add(KIND5, "vocab_size 5, ids drawn by default", lambda: hf("vocab", {"vocab_size": 5}, ids))
    r.out.add(KIND5, "vocab_size 5, range [0, 50]", lambda: hf("vocab-range", {"vocab_size": 5},
                                                                {**ids, "range": [0, 50]}))
    r.out.add(KIND5, "num_hidden_layers -1", lambda: hf("layers", {"num_hidden_layers": -1}, {**ids, "range": [0, 9]}))
    r.out.add(KIND5, "n_head 0", lambda: hf("heads", {"n_head": 0}, {**ids, "range": [0, 9]}))


def add_cases_9(r: Shared) -> None:
    """Round 3's open cases that today's code holds (not reproduced in round 4): kept here so they stay held."""
    import onnx

    from .console import _cli

    r.work.mkdir(parents=True, exist_ok=True)

    def bracket_out() -> bool | str:
        out = r.work / "b[1]]x[" / "[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]"
        code, text = _cli("export", str(r.run), "--stage", "ort_session", "--out", str(out))
        if code != 0 or not (out / "manifest.json").is_file():
            return f"export: exit {code}: {text[-200:]!r}"
        code, text = _cli("bench", str(out))
        return True if code == 0 else f"bench: exit {code}: {text[-200:]!r}"

    def missing_external() -> bool | str:
        model = onnx.load(str(r.bundle / "model.onnx"))
        folder = r.work / "ext"
        folder.mkdir()
        onnx.save_model(model, str(folder / "m.onnx"), save_as_external_data=True, location="m.data",
                        size_threshold=0)
        (folder / "m.data").unlink()
        code, text = _cli("compare", str(folder / "m.onnx"), str(r.bundle / "model.onnx"))
        line = text.strip().splitlines()[-1] if text.strip() else ""
        ok = code == 2 and str(folder / "m.onnx") in line and "m.data" in line and "[/data]" not in text
        return True if ok else f"exit {code}: {text[-200:]!r}"

    r.out.add(KIND9, "--out holding [ and ] (export, then bench)", bracket_out)
    r.out.add(KIND9, "stage 0's external weights missing", missing_external)
