"""Adversarial cases of issue 47, classes 5 and 6: recipe files read strictly and bounded, and files that are not
files (a FIFO) refused at load (recipe.loading, core.files)."""

from __future__ import annotations

import os

import yaml

from optimizer.core.errors import RecipeError

from .adversarial import Shared, _refused

KIND5 = "R4.5 data that hangs"
KIND6 = "R4.6 recipe files"


def add_cases(r: Shared) -> None:
    from optimizer.recipe.loading import load_recipe

    r.work.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({**r.base, "description": "café"}, sort_keys=False, allow_unicode=True)

    def write(name: str, body: bytes) -> object:
        path = r.work / name
        path.write_bytes(body)
        return lambda: load_recipe(path)

    big = ["big: &big " + "x" * 900_000, "l0: &l0 [" + ", ".join(["*big"] * 10) + "]"]
    big += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 4)]
    cases = {
        "Latin-1 text": text.encode("latin-1"),
        "passes given twice": (text + "passes: []\n").encode(),
        "a nested key given twice": text.replace("  threads: 1\n", "  threads: 1\n  threads: 2\n").encode(),
        "0.9 MB whose aliases expand to GB": ("\n".join(big) + "\n" + text).encode(),
    }
    for label, body in cases.items():
        r.out.add(KIND6, label, lambda b=body, n=label: _refused(write(f"{n}.yaml", b)))  # type: ignore[arg-type]

    def fifo(field: str) -> bool | str:
        os.mkfifo(r.work / f"{field}.fifo")
        data = dict(r.base)
        if field == "data_file":
            data["data_file"] = f"{field}.fifo"
        else:
            data["model"] = {"source": "onnx", "path": f"{field}.fifo"}
        path = r.work / f"{field}-fifo.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return _refused(lambda: load_recipe(path), RecipeError)

    r.out.add(KIND5, "FIFO as data_file", lambda: fifo("data_file"))
    r.out.add(KIND5, "FIFO as the ONNX model", lambda: fifo("model"))
