"""Adversarial cases of issue 47, class 3: what a manifest says is checked against the model (deploy.verify)."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from .adversarial import Shared

KIND = "R4.3 a manifest that lies"
LIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "input dtype": lambda m: m["inputs"][0].update(dtype="float16"),
    "input shape": lambda m: m["inputs"][0].update(shape=["batch", 99]),
    "output shape": lambda m: m["outputs"][0].update(shape=[7]),
    "input the model lacks": lambda m: m["inputs"].append({**m["inputs"][0], "name": "ghost"}),
    "precision int8 on FP32": lambda m: m.setdefault("precision", {}).update(mode="int8"),
}


def add_cases(r: Shared) -> None:
    from optimizer.core.artifact import file_sha256
    from optimizer.deploy.verify import verify_bundle

    r.work.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((r.bundle / "manifest.json").read_text())

    for i, (label, lie) in enumerate(LIES.items()):
        def case(i: int = i, lie: Callable[[dict[str, Any]], None] = lie) -> bool | str:
            root = r.work / f"b{i}"
            shutil.copytree(r.bundle, root)
            m = copy.deepcopy(manifest)
            lie(m)
            (root / "manifest.json").write_text(json.dumps(m))
            problems = verify_bundle(root)
            return True if any("manifest.json" in p for p in problems) else f"problems: {problems}"

        r.out.add(KIND, label, case)

    def pickled() -> bool | str:
        root = r.work / "pickled"
        shutil.copytree(r.bundle, root)
        with np.load(root / "reference.npz") as ref:
            arrays = {k: ref[k] for k in ref.files}
        arrays[next(iter(arrays))] = np.array([{"a": 1}], dtype=object)
        np.savez(root / "reference.npz", **arrays)
        m = copy.deepcopy(manifest)
        m["files"]["reference.npz"] = file_sha256(root / "reference.npz")
        (root / "manifest.json").write_text(json.dumps(m))
        problems = verify_bundle(root)
        return True if len(problems) == 1 and "pickled" in problems[0] else f"problems: {problems}"

    r.out.add(KIND, "pickled reference.npz", pickled)
