"""Model sources other than the factory: a transformers architecture built from a config."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FAST_BENCH, write_recipe

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe


@pytest.mark.slow
def test_bert_from_config_exports_and_matches(tmp_path: Path) -> None:
    data = {
        "name": "tiny-bert",
        "model": {
            "source": "hf_config",
            "architecture": "bert",
            "config": {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 100,
            },
        },
        "inputs": [
            {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 100]},
            {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "fill": "ones"},
        ],
        "outputs": ["last_hidden_state"],
        "scenarios": [{"name": "b2-s16", "batch": 2, "seq": 16}, {"name": "b1-s32", "batch": 1, "seq": 32}],
        "target": {"threads": 1},
        "benchmark": FAST_BENCH,
        "accuracy": {"samples": 2},
        "passes": [{"type": "export"}],
    }
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = Pipeline(recipe, tmp_path / "out").execute()
    assert [r.status for r in records] == ["ran", "ran"]
    export = records[1]
    acc = export.metrics["accuracy"]["last_hidden_state"]
    assert acc["cosine"] > 0.99999 and acc["max_abs"] < 1e-4
    # One graph with dynamic axes serves both scenarios, under the recipe's dim names.
    assert export.notes["dynamic_axes"] == {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "seq"},
    }
    assert set(export.metrics["scenarios"]) == {"b2-s16", "b1-s32"}
    assert "Attention" not in export.metrics["graph"]["op_types"]  # plain export: nothing fused yet
