"""Generation: our greedy KV-cache loop against transformers' own generate, in PyTorch and in ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_recipe

from optimizer.generation import TorchGenerator, agreement
from optimizer.models import load_module
from optimizer.pipeline import Pipeline
from optimizer.recipe import SCENARIO_PRESETS, load_recipe, parse_recipe
from optimizer.runners.gen_runner import ort_generator

GPT2 = {
    "source": "hf_config",
    "architecture": "gpt2",
    "task": "causal-lm",
    "config": {
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "n_positions": 256,
        "vocab_size": 300,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
}


def recipe_data(passes: list[dict]) -> dict:
    return {
        "name": "tiny-gen",
        "workload": "generation",
        "model": GPT2,
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [1, 300]}],
        "scenarios": [
            {"name": "s", "batch": 2, "seq": 12, "new_tokens": 10},
            {"preset": "low_latency_inference", "seq": 16},
        ],
        "target": {"threads": 1},
        "benchmark": {"warmup": 1, "rounds": 2, "iterations": 1},
        "accuracy": {"metric": "token_agreement", "min": 1.0, "samples": 1},
        "passes": passes,
    }


def hf_greedy(model, prompt: np.ndarray, new: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    ids = torch.from_numpy(prompt)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, prompt.shape[1] :].numpy()


def test_presets_expand_with_overrides() -> None:
    r = parse_recipe(recipe_data([]))
    low = r.scenarios[1]
    assert low.name == "low_latency_inference" and low.seq == 16
    assert low.new_tokens == SCENARIO_PRESETS["low_latency_inference"]["new_tokens"]


def test_torch_and_onnx_loops_match_transformers_generate(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, recipe_data([{"type": "export"}])))
    records = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    model = load_module(recipe)
    prompt = np.random.default_rng(1).integers(1, 300, (2, 12))
    expected = hf_greedy(model, prompt, 10)
    ours = TorchGenerator(model, 1).generate(prompt, 10)
    onnx = ort_generator(records[1].artifact, recipe).generate(prompt, 10)
    np.testing.assert_array_equal(ours.tokens, expected)
    np.testing.assert_array_equal(onnx.tokens, expected)
    a = agreement(ours, onnx)
    assert a["token_agreement"] == 1.0 and a["logits_cosine_min"] > 0.99999
    assert records[1].notes["check"]["token_agreement"] == 1.0


@pytest.fixture(scope="module")
def gen_run(tmp_path_factory: pytest.TempPathFactory) -> list:
    tmp = tmp_path_factory.mktemp("gen")
    passes = [
        {"type": "export"},
        {"type": "ort_session"},
        {"type": "quantize", "name": "int8", "config": {"mode": "int8_dynamic"}},
        {"type": "fuse"},
    ]
    return Pipeline(load_recipe(write_recipe(tmp, recipe_data(passes))), tmp / "out").execute()


def test_generation_metrics_per_scenario(gen_run: list) -> None:
    source, export, ort_stage = gen_run[0], gen_run[1], gen_run[2]
    for rec in (source, export, ort_stage):
        for scen, new in (("s", 10), ("low_latency_inference", 8)):
            m = rec.metrics["scenarios"][scen]
            assert m["new_tokens"] == new and m["iterations"] == 2
            assert 0 < m["ttft"]["p50_ms"] < m["latency"]["p50_ms"]
            assert m["tpot"]["n"] == 2 * (new - 1)
            batch = 2 if scen == "s" else 1
            assert m["throughput"]["tokens_per_s"] == pytest.approx(batch * new * 1000 / m["latency"]["mean_ms"])
    assert export.metrics["accuracy"]["generation"]["token_agreement"] == 1.0
    assert "vs_parent" in export.metrics["scenarios"]["s"]


def test_quantized_generation_and_declines(gen_run: list) -> None:
    int8, fuse = gen_run[3], gen_run[4]
    assert int8.status == "ran" and (int8.artifact.path.parent / "decode.onnx").is_file()
    assert "DynamicQuantizeLinear" in int8.metrics["graph"]["op_types"]
    acc = int8.metrics["accuracy"]["generation"]
    assert 0 <= acc["token_agreement"] <= 1 and acc["cosine"] > 0.9
    assert int8.metrics["within_budget"] == (acc["token_agreement"] >= 1.0)
    assert fuse.status == "skipped" and "fuse does not handle generation graphs" in fuse.reason


def test_generation_on_cuda_is_refused_up_front(tmp_path: Path) -> None:
    from optimizer.errors import RecipeError

    data = recipe_data([{"type": "export"}])
    data["target"] = {"device": "cuda"}
    with pytest.raises(RecipeError, match="target.device: generation workloads run on the CPU only"):
        load_recipe(write_recipe(tmp_path, data))


@pytest.mark.parametrize("name", ["fuse", "ort_transformers", "tensorrt", "cuda_graph"])
def test_passes_that_would_touch_only_the_prefill_graph_decline(name: str) -> None:
    from optimizer.artifact import Artifact
    from optimizer.registry import pass_class

    cls = pass_class(name)
    gen = Artifact("onnx", Path("prefill.onnx"), {}, {"decode": "decode.onnx", "layers": 2})
    reason = cls(cls.Config()).skip_reason(gen, None)  # type: ignore[arg-type]
    assert reason == f"{name} does not handle generation graphs (prefill + decode with a KV cache) yet"
