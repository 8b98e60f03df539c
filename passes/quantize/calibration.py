"""Calibration and search inputs, kept apart from the inputs accuracy is judged on.

The pipeline's accuracy samples take sentences from the front of the recipe's text; calibration takes them
from the back, so a stage is never judged on the sentences it was calibrated on (the stage notes say how
many were shared when the text is too short to keep them apart). Without text, inputs are generated from
the recipe's specs with another seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from optimizer.recipe.schema import Recipe
from optimizer.runtime.inputs import Feed, _generate, _tokenizer, read_sentences


def calibration_feeds(
    recipe: Recipe, count: int, progress: Any = None, all_scenarios: bool = True
) -> tuple[list[Feed], dict[str, Any]]:
    """`count` inputs, taking the recipe's scenarios in turn: calibrate on the shapes that will be served (padding
    at seq 512 is not padding at seq 128, and the error it causes is not either). ORT's histogram calibrators
    (Entropy, Percentile) need one shape, so static calibration takes the first scenario only."""
    scenarios = recipe.scenarios if all_scenarios else recipe.scenarios[:1]
    names = [s.name for s in recipe.inputs]
    feeds: list[Feed] = []
    info: dict[str, Any] = {"samples": count, "scenarios": [s.name for s in scenarios]}
    if recipe.text:
        sentences = read_sentences(recipe)
        tokenizer = _tokenizer(recipe)
        held_out = sum(sf.batch * (sf.samples or recipe.accuracy.samples) for sf in recipe.scenarios)
        pool = sentences[::-1]
        used = sum(scenarios[i % len(scenarios)].batch for i in range(count))
        info["source"] = "text (from the end of the file)"
        info["overlap_with_accuracy_sentences"] = max(0, min(used, len(pool)) + held_out - len(pool))
        cursor = 0
        for i in range(count):
            scenario = scenarios[i % len(scenarios)]
            batch = [pool[(cursor + j) % len(pool)] for j in range(scenario.batch)]
            cursor += scenario.batch
            enc = tokenizer(
                batch, padding=scenario.padding, truncation=True, max_length=scenario.seq, return_tensors="np"
            )
            wanted = names or list(enc.keys())
            feed = {n: np.asarray(enc[n]).astype(np.int64) for n in wanted if n in enc}
            for spec in recipe.inputs:
                feed.setdefault(spec.name, _generate(spec, scenario, np.random.default_rng(recipe.seed + 1000 + i)))
            feeds.append(feed)
            if progress:
                progress("calibration inputs", i + 1, count)
    else:
        info["source"] = "generated from the input specs (seed + 1000)"
        rng = np.random.default_rng(recipe.seed + 1000)
        for i in range(count):
            scenario = scenarios[i % len(scenarios)]
            feeds.append({s.name: _generate(s, scenario, rng) for s in recipe.inputs})
            if progress:
                progress("calibration inputs", i + 1, count)
    return feeds, info


class FeedReader:
    """onnxruntime.quantization's CalibrationDataReader protocol over a list of feeds."""

    def __init__(self, feeds: list[Feed], input_names: list[str]) -> None:
        self._it: Iterator[Feed] = iter([{n: f[n] for n in input_names} for f in feeds])

    def get_next(self) -> Feed | None:
        return next(self._it, None)

    def rewind(self) -> None:  # pragma: no cover - part of the protocol, not used by ORT's calibrators here
        pass
