"""Generation: our greedy KV-cache loop against transformers' own generate, in PyTorch and in ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_recipe

from optimizer.core.pass_base import PassContext
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.accuracy import generation_agreement as agreement
from optimizer.measure.services import MeasureServices
from optimizer.recipe.loading import load_recipe, parse_recipe
from optimizer.recipe.schema import SCENARIO_PRESETS
from optimizer.report.build import write_report
from optimizer.runtime.generation import OrtBoundGenerator, TorchGenerator
from optimizer.runtime.generation_static import StaticCacheGenerator
from optimizer.runtime.gpu import cuda_reason
from optimizer.runtime.models import load_module
from optimizer.runtime.runners.gen_runner import ort_generator

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


LLAMA = {
    "source": "hf_config",
    "architecture": "llama",
    "task": "causal-lm",
    "config": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
        "vocab_size": 300,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
}


def recipe_data(passes: list[dict], model: dict | None = None) -> dict:
    return {
        "name": "tiny-gen",
        "workload": "generation",
        "model": model or GPT2,
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [1, 300]}],
        "scenarios": [
            {"name": "s", "batch": 2, "seq": 12, "new_tokens": 10},
            {"preset": "low_latency_inference", "seq": 16},
        ],
        "target": {"threads": 1},
        "benchmark": {"warmup": 1, "rounds": 2, "iterations": 1, "memory": "inline"},
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


@pytest.mark.slow
@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_torch_and_onnx_loops_match_transformers_generate(tmp_path: Path, model: dict) -> None:
    recipe = load_recipe(write_recipe(tmp_path, recipe_data([{"type": "export"}], model)))
    records = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    module = load_module(recipe)
    prompt = np.random.default_rng(1).integers(1, 300, (2, 12))
    expected = hf_greedy(module, prompt, 10)
    ours = TorchGenerator(module, 1).generate(prompt, 10)
    onnx = ort_generator(records[1].artifact, recipe).generate(prompt, 10)
    np.testing.assert_array_equal(ours.tokens, expected)
    np.testing.assert_array_equal(onnx.tokens, expected)
    a = agreement(ours, onnx)
    assert a["token_agreement"] == 1.0 and a["logits_cosine_min"] > 0.99999
    assert records[1].notes["check"]["token_agreement"] == 1.0
    # The IO-binding loop (what the CUDA EP uses: the cache stays as OrtValues) is the same loop: tested on the CPU.
    plain = ort_generator(records[1].artifact, recipe)
    bound = OrtBoundGenerator(plain.prefill, plain.decode, 2, "cpu").generate(prompt, 10)
    np.testing.assert_array_equal(bound.tokens, expected)
    assert agreement(onnx, bound)["logits_cosine_min"] > 0.999999


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_static_cache_loop_matches_transformers_generate(tmp_path: Path, model: dict, attn: str) -> None:
    """The capturable decode step (preallocated cache, mask and positions derived on the device) gives the same
    tokens as transformers' generate, twice in a row on the same buffers (the cache is reset in place)."""
    recipe = load_recipe(write_recipe(tmp_path, recipe_data([], {**model, "attn_implementation": attn})))
    module = load_module(recipe)
    prompt = np.random.default_rng(2).integers(1, 300, (2, 12))
    expected = hf_greedy(module, prompt, 10)
    static = StaticCacheGenerator(module, 1)
    first, second = static.generate(prompt, 10), static.generate(prompt, 10, keep_logits=False)
    np.testing.assert_array_equal(first.tokens, expected)
    np.testing.assert_array_equal(second.tokens, expected)
    assert len(first.step_logits) == 10 and second.step_logits == [] and len(second.tpot_ms) == 9
    assert agreement(TorchGenerator(module, 1).generate(prompt, 10), first)["logits_cosine_min"] > 0.99999


@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_static_decode_step_never_reads_back_to_the_host(tmp_path: Path, model: dict) -> None:
    """What CUDA graph capture needs, checked on the CPU: no op of the decode step reads a tensor's value to
    the host (int(), .item(), bool(), data-dependent shapes). A step with such a read is caught."""
    module = load_module(load_recipe(write_recipe(tmp_path, recipe_data([], model))))
    gen = StaticCacheGenerator(module, 1)
    prompt = np.random.default_rng(3).integers(1, 300, (2, 12))
    ops, reads = gen.step_host_reads(prompt)
    assert ops > 50 and reads == []
    clean_step = gen._step

    def syncing_step(buf):  # type: ignore[no-untyped-def]
        if int(buf.cache.layers[0].cumulative_length) > 10**9 or bool((buf.ids < 0).any()):
            raise AssertionError("unreachable")
        return clean_step(buf)

    gen._step = syncing_step  # type: ignore[method-assign]
    assert gen.step_host_reads(prompt)[1] == ["is_nonzero", "item"]


@pytest.fixture(scope="module")
def gen_run(tmp_path_factory: pytest.TempPathFactory) -> list:
    """The generation pipeline; report.json is written into tmp/out as compile would."""
    tmp = tmp_path_factory.mktemp("gen")
    passes = [
        {"type": "export"},
        {"type": "ort_session"},
        {"type": "quantize", "name": "int8", "config": {"mode": "int8_dynamic"}},
        {"type": "fuse", "config": {"target": "cuda"}},  # kv_attention, the one generation rule, is cpu-only
        {"type": "static_kv_cache", "from": "source"},
        {"type": "cuda_graph"},
    ]
    recipe = load_recipe(write_recipe(tmp, recipe_data(passes)))
    records = Pipeline(recipe, tmp / "out").execute()
    write_report(recipe, records, tmp / "out", 0.0)
    return records


@pytest.mark.slow
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
    # Where a decode step's time goes (ORT profiler on the decode graph): every executed node has a kernel time.
    assert source.metrics.get("nodes_executed") is None
    for rec in (export, ort_stage):
        assert rec.metrics["nodes_executed"] > 20 and "MatMul" in rec.metrics["op_time_ms"]
    assert ort_stage.metrics["nodes_executed"] < export.metrics["nodes_executed"]  # ORT's own fusions


@pytest.mark.slow
def test_prefill_and_decode_share_one_weights_file(gen_run: list) -> None:
    """Both graphs reference one page-aligned weights file, so an exported decoder is its weights once on disk
    (it was twice: 54 MB for llama-cpu's 26 MB), after export and after quantization alike."""
    import onnx

    source, export, int8 = gen_run[0], gen_run[1], gen_run[3]
    assert export.artifact.external_data == ["weights.bin"]
    weights = (export.artifact.path.parent / "weights.bin").stat().st_size  # the graphs' own protobuf aside
    assert weights < 1.05 * source.metrics["size_bytes"]
    for rec in (export, int8):
        folder = rec.artifact.path.parent
        offsets = {}
        for graph in (rec.artifact.path, folder / "decode.onnx"):
            model = onnx.load(str(graph), load_external_data=False)
            for t in model.graph.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    info = {e.key: e.value for e in t.external_data}
                    assert info["location"] == "weights.bin" and int(info["offset"]) % 4096 == 0
                    offsets.setdefault(graph.name, set()).add(int(info["offset"]))
        assert offsets["decode.onnx"] & offsets[rec.artifact.path.name]  # shared, not copied
    assert (int8.artifact.path.parent / "weights.bin").stat().st_size < 0.5 * weights


@pytest.mark.slow
def test_quantized_generation_and_declines(gen_run: list) -> None:
    int8, fuse = gen_run[3], gen_run[4]
    assert int8.status == "ran" and (int8.artifact.path.parent / "decode.onnx").is_file()
    assert "DynamicQuantizeLinear" in int8.metrics["graph"]["op_types"]
    acc = int8.metrics["accuracy"]["generation"]
    assert 0 <= acc["token_agreement"] <= 1 and acc["cosine"] > 0.9
    assert int8.metrics["within_budget"] == (acc["token_agreement"] >= 1.0)
    assert fuse.status == "skipped" and "no rule in rules fuses generation graphs on target cuda" in fuse.reason


@pytest.mark.slow
def test_static_kv_cache_stage_on_the_cpu(gen_run: list) -> None:
    static, graph = gen_run[5], gen_run[6]
    assert static.status == "ran" and static.notes["check"]["token_agreement"] == 1.0
    assert static.notes["capturable"] is True and static.notes["host_reads"] == []
    assert static.metrics["runtime"]["kv_cache"] == "static" and static.metrics["runtime"]["cuda_graph"] is False
    assert static.metrics["accuracy"]["generation"]["token_agreement"] == 1.0
    assert "vs_parent" in static.metrics["scenarios"]["s"]  # timed against stage 0, interleaved
    cpu_target = "target.device is cpu: CUDA graphs need target.device: cuda"
    assert graph.status == "skipped" and graph.reason == (cuda_reason() or cpu_target)


@pytest.mark.skipif(cuda_reason() is None, reason="this test is about a machine without CUDA")
def test_generation_on_cuda_without_a_gpu_says_why(tmp_path: Path) -> None:
    data = recipe_data([{"type": "export"}])
    data["target"] = {"device": "cuda"}
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    assert records[0].status == "failed" and records[0].reason == f"target.device cuda: {cuda_reason()}"


def test_cuda_graph_on_generation_says_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reasons past the environment check (no GPU here), with the environment check switched off."""
    from optimizer.core.artifact import Artifact
    from passes.cuda_graph import CudaGraphPass

    monkeypatch.setattr(CudaGraphPass, "environment_reason", classmethod(lambda cls: None))
    data = recipe_data([])
    data["target"] = {"device": "cuda"}
    ctx = PassContext(parse_recipe(data), "cuda_graph", tmp_path, None, MeasureServices())  # type: ignore[arg-type]
    p = CudaGraphPass(CudaGraphPass.Config())
    onnx = Artifact("onnx", Path("prefill.onnx"), decode="decode.onnx", layers=2)
    assert "grows its KV cache by one position per token" in str(p.skip_reason(onnx, ctx))
    dynamic = Artifact("torch", None)
    assert "put a static_kv_cache stage before it" in str(p.skip_reason(dynamic, ctx))
    assert p.skip_reason(dynamic.with_runtime(kv_cache="static"), ctx) is None


@pytest.mark.gpu
def test_static_cache_decode_under_a_cuda_graph(tmp_path: Path) -> None:
    """On a GPU: the captured decode step gives stage 0's tokens, and replaying it cuts host launches per task."""
    data = recipe_data([{"type": "static_kv_cache", "from": "source"}, {"type": "cuda_graph"}])
    data["target"] = {"device": "cuda"}
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    assert all(r.status == "ran" for r in records), [(r.name, r.reason) for r in records]
    static, graph = records[1], records[2]
    assert graph.notes["check"]["token_agreement"] == 1.0
    assert graph.metrics["accuracy"]["generation"]["token_agreement"] == 1.0
    assert graph.metrics["runtime"]["graphs_captured"] >= 1
    for scen in ("s", "low_latency_inference"):
        k_static = static.metrics["scenarios"][scen]["cuda_kernels"]
        k_graph = graph.metrics["scenarios"][scen]["cuda_kernels"]
        assert k_graph["graph_launches"] >= 1
        assert k_graph["launches"] < k_static["launches"] / 2, (k_static, k_graph)


@pytest.mark.parametrize("name", ["ort_transformers", "tensorrt"])
def test_passes_that_would_touch_only_the_prefill_graph_decline(name: str) -> None:
    from optimizer.core.artifact import Artifact
    from optimizer.core.registry import pass_class

    cls = pass_class(name)
    gen = Artifact("onnx", Path("prefill.onnx"), decode="decode.onnx", layers=2)
    reason = cls(cls.Config()).skip_reason(gen, None)  # type: ignore[arg-type]
    assert reason == f"{name} does not handle generation graphs (prefill + decode with a KV cache) yet"


@pytest.mark.slow
def test_generation_bundle_export_verify_bench(gen_run: list, tmp_path: Path) -> None:
    """A decoder bundle: both graphs, one whole greedy generation per scenario as the reference; verify reruns
    the loop, a changed byte or a different model is caught; Triton (one graph per call) declines it."""
    from test_recipe import run_cli

    from optimizer.core.artifact import file_sha256

    run = Path(gen_run[1].artifact.path).parent.parent  # the run folder, with report.json
    bundle = tmp_path / "bundle"
    proc = run_cli("export", str(run), "--stage", "ort_session", "--out", str(bundle))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["workload"] == "generation" and manifest["cache"]["layers"] == 2
    assert {manifest["graphs"]["prefill"], manifest["graphs"]["decode"]} <= set(manifest["files"])
    with np.load(bundle / "reference.npz") as ref:
        assert ref["s/tokens"].shape == (2, 10) and ref["s/logits"].shape == (10, 2, 300)
    assert run_cli("verify", str(bundle)).returncode == 0
    bench = run_cli("bench", str(bundle), "--rounds", "1", "--iterations", "2")
    assert bench.returncode == 0 and "TTFT P50" in bench.stdout and "TPOT P50" in bench.stdout

    decode = bundle / manifest["graphs"]["decode"]
    raw = bytearray(decode.read_bytes())
    raw[-1] ^= 0xFF
    decode.write_bytes(bytes(raw))
    bad = run_cli("verify", str(bundle))
    assert bad.returncode == 1 and f"{decode.name}: sha256 differs" in bad.stderr

    # The int8 stage's graphs under this bundle's manifest, checksums updated: only rerunning the loop can tell.
    int8_cosine = gen_run[3].metrics["accuracy"]["generation"]["logits_cosine_min"]
    assert int8_cosine < manifest["tolerance"]["min_logits_cosine"]
    other = tmp_path / "int8"
    assert run_cli("export", str(run), "--stage", "int8", "--out", str(other)).returncode == 0
    theirs = json.loads((other / "manifest.json").read_text())["graphs"]
    for part, name in manifest["graphs"].items():
        (bundle / name).write_bytes((other / theirs[part]).read_bytes())
    manifest["files"] = {k: file_sha256(bundle / k) for k in manifest["files"]}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli("verify", str(bundle))
    assert bad.returncode == 1 and "generation on s: logits cosine" in bad.stderr

    refused = run_cli("export", str(run), "--stage", "ort_session", "--format", "triton", "--out", str(tmp_path / "t"))
    assert refused.returncode == 2 and "is a generation stage" in refused.stderr
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".*partial"))


@pytest.mark.slow
def test_diff_of_generation_runs_compares_token_agreement(gen_run: list) -> None:
    from test_recipe import run_cli

    run = Path(gen_run[1].artifact.path).parent.parent
    proc = run_cli("diff", str(run), str(run), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in json.loads(proc.stdout)["rows"] if r["stage"] == "int8" and r["scenario"] == "s"]
    expected = gen_run[3].metrics["accuracy"]["generation"]["token_agreement"]
    assert rows and rows[0]["cosine_a"] == rows[0]["cosine_b"] == expected


def test_static_kv_cache_declines_forward_recipes_and_onnx(tmp_path: Path) -> None:
    from conftest import mlp_recipe

    from optimizer.core.artifact import Artifact
    from passes.static_kv_cache import StaticKVCachePass

    p = StaticKVCachePass(StaticKVCachePass.Config())
    forward = PassContext(parse_recipe(mlp_recipe()), "static_kv_cache", tmp_path, None, MeasureServices())  # type: ignore[arg-type]
    assert p.skip_reason(Artifact("torch", None), forward) == (
        "a KV cache is a generation option; this recipe's workload is forward"
    )
    generation = PassContext(parse_recipe(recipe_data([])), "static_kv_cache", tmp_path, None, MeasureServices())  # type: ignore[arg-type]
    assert p.skip_reason(Artifact("torch", None), generation) is None
    assert "takes torch artifacts, got onnx" in str(p.skip_reason(Artifact("onnx", Path("m.onnx")), generation))


@pytest.mark.slow
def test_generation_stages_run_two_loops_a_side_and_widen_both_ratios(tmp_path: Path) -> None:
    """The task-time and TPOT ratios of a decoder stage read the spread between two generation loops a side."""
    from optimizer.report.build import build_report

    data = recipe_data([{"type": "export"}])
    data["benchmark"] = {**data["benchmark"], "rounds": 4}
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = Pipeline(recipe, tmp_path / "out").execute()
    m = records[1].metrics["scenarios"]["s"]
    assert m["instance_df"] == 2 and m["tpot_instance_df"] == 2 and m["instance_factor"] == pytest.approx(1.0)
    report = build_report(recipe, records, tmp_path / "out", 1.0)
    sm = report.stages[1].metrics.scenarios["s"]  # type: ignore[union-attr]
    assert sm.vs_parent is not None and sm.vs_parent.in_run_low == m["vs_parent"]["low"]
    assert sm.tpot_vs_parent is not None and sm.tpot_vs_parent.in_run_low == m["tpot_vs_parent"]["low"]


def test_cache_keyword_follows_the_forward_signature() -> None:
    """transformers 5.24 takes the KV cache as `cache`, older versions as `past_key_values`; the wrong keyword
    falls silently into **kwargs (the model then runs without our cache), so it is read from the signature."""
    from optimizer.core.errors import OptimizerError
    from optimizer.runtime.generation import cache_keyword

    class New:
        def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> None: ...

    class Old:
        def forward(self, input_ids: Any = None, past_key_values: Any = None, **kwargs: Any) -> None: ...

    class Neither:
        def forward(self, input_ids: Any = None, **kwargs: Any) -> None: ...

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"
    with pytest.raises(OptimizerError, match="neither"):
        cache_keyword(Neither())
