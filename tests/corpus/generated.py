"""Adversarial cases of issue 47, class 1: files we generate from a model take no dictation (core.markup)."""

from __future__ import annotations

import yaml

from .adversarial import Shared
from .handover import one_matmul_model

KIND = "R4.1 generated files that take dictation"
NAMES = {"newline adds keys": "x\nseed: 7\nbatch_sweep: {batches: [1], latency_budget_ms: 5}",
         "ESC in a name": "x\x1b[2J", "line separator": "x\u2028seed: 3", "CR LF": "x\r\nseed: 3"}


def add_cases(r: Shared) -> None:
    from optimizer.cli.auto_compile import edited, prepare_model_recipe

    r.work.mkdir(parents=True, exist_ok=True)
    for i, (label, name) in enumerate(NAMES.items()):
        def case(i: int = i, name: str = name) -> bool | str:
            one_matmul_model(r.work / f"m{i}.onnx", name)
            text = prepare_model_recipe(str(r.work / f"m{i}.onnx"), "cpu", r.work / f"run{i}").read_text()
            data = yaml.safe_load(text)
            if "seed" in data or "batch_sweep" in data:
                return "a key was added"
            return True if [x["name"] for x in data["inputs"]] == [name] and not edited(text) else "name changed"

        r.out.add(KIND, f"input name: {label}", case)

    def md_case() -> bool | str:
        from optimizer.core.markup import md_inline

        cell = md_inline("a | b\n## heading <script>")
        return True if "\n" not in cell and "<script" not in cell and " | " not in cell else repr(cell)

    r.out.add(KIND, "markdown cell", md_case)
