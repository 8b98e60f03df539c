"""Decoders in ONNX Runtime GenAI's layout: the genai_build pass (GenAI's model builder), our loop over its
graph with the KV cache written in place, the bundle GenAI's runtime serves, and the settled generation timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import write_recipe
from test_generation import LLAMA, recipe_data

from optimizer.core.pass_base import PassContext
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.generation import timed_generation_rounds
from optimizer.recipe.loading import load_recipe
from optimizer.recipe.schema import BenchmarkSettings
from optimizer.report.build import write_report
from optimizer.runtime.genai_builder import last_error
from optimizer.runtime.generation import Generation, TorchGenerator
from optimizer.runtime.models import load_module
from optimizer.runtime.runners.gen_runner import generator_for

genai = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai not installed (pip install -e '.[genai]', or scripts/setup.sh)"
)
ROOT = Path(__file__).resolve().parents[1]


def test_the_builder_architectures_come_from_the_installed_builder() -> None:
    from optimizer.recipe.genai_support import builder_architectures

    archs = builder_architectures()
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"} <= archs
    assert "GPT2LMHeadModel" not in archs


def test_quantized_options_are_refused_on_fp32_and_mapped_for_int4() -> None:
    from passes.genai_build import GenaiBuildConfig

    with pytest.raises(ValueError, match="accuracy_level applies to int4/int8"):
        GenaiBuildConfig(precision="fp32", accuracy_level=4)
    with pytest.raises(ValueError, match="quantize_lm_head"):
        GenaiBuildConfig(quantize_lm_head=False)
    assert GenaiBuildConfig().builder_options() == {"prune_lm_head": None}
    opts = GenaiBuildConfig(precision="int4", accuracy_level=1, quantize_lm_head=False, prune_lm_head=True)
    assert opts.builder_options() == {
        "prune_lm_head": True, "accuracy_level": 1, "block_size": 32, "nodes_to_exclude": "/lm_head/MatMul"}


def test_the_builders_failure_is_its_own_last_error_line() -> None:
    log = "Extra options: {}\nTraceback (most recent call last):\n  File \"x.py\", line 3\n" \
          "ValueError: Couldn't instantiate the backend tokenizer from one of: \n(1) a serialization file"
    assert last_error(log) == "ValueError: Couldn't instantiate the backend tokenizer from one of:"
    assert last_error("just a line\n") == "just a line"


@pytest.fixture(scope="module")
def genai_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    tmp = tmp_path_factory.mktemp("genai")
    passes = [
        {"type": "genai_build", "name": "genai_fp32", "from": "source"},
        {"type": "genai_build", "name": "genai_pruned", "from": "genai_fp32", "config": {"prune_lm_head": True}},
        {"type": "genai_build", "name": "genai_int4", "from": "genai_pruned",
         "config": {"precision": "int4", "prune_lm_head": True, "accuracy_level": 4, "block_size": 16}},
        {"type": "quantize", "name": "int8_on_genai", "from": "genai_fp32", "config": {"mode": "int8_dynamic"}},
        {"type": "ort_session", "name": "genai_session", "from": "genai_fp32", "config": {"allow_spinning": True}},
    ]
    data = recipe_data(passes, LLAMA)
    data["accuracy"]["min"] = 0.0  # int4 on random weights diverges; its agreement is reported, not gated here
    data["on_failure"] = "continue"
    recipe = load_recipe(write_recipe(tmp, data))
    records = Pipeline(recipe, tmp / "out").execute()
    write_report(recipe, records, tmp / "out", 0.0)
    return records, tmp


def _by_name(records: list) -> dict[str, Any]:
    return {r.name: r for r in records}


@pytest.mark.slow
def test_the_genai_graph_generates_what_pytorch_generates(genai_run: tuple[list, Path]) -> None:
    """The fp32 build gives stage 0's tokens exactly (the pass checks it before timing; the harness again on
    every scenario, batch 2 included), and its graph is GenAI's: GroupQueryAttention with rotary inside."""
    by = _by_name(genai_run[0])
    fp32 = by["genai_fp32"]
    assert fp32.status == "ran", fp32.reason
    assert fp32.metrics["accuracy"]["generation"]["token_agreement"] == 1.0
    assert fp32.metrics["accuracy"]["generation"]["logits_cosine_min"] > 0.9999
    ops = fp32.metrics["graph"]["op_types"]
    assert ops["com.microsoft.GroupQueryAttention"] == 2 and "com.microsoft.SkipSimplifiedLayerNormalization" in ops
    assert fp32.notes["check"]["token_agreement"] == 1.0 and fp32.notes["placeholder_tokenizer"] is True
    assert set(fp32.artifact.genai_files) >= {"genai_config.json", "tokenizer.json"}
    assert not list(fp32.artifact.path.parent.glob("scratch*"))  # the builder's scratch folder is gone
    # Every scenario timed against its parent, the decode step profiled from the one session.
    assert set(fp32.metrics["scenarios"]) == {"s", "low_latency_inference"}
    assert fp32.metrics["nodes_executed"] and "GroupQueryAttention" in fp32.metrics["op_time_ms"]
    recipe = load_recipe(genai_run[1] / "recipe.yaml")
    prompt = np.random.default_rng(5).integers(1, 300, (2, 12))
    expected = TorchGenerator(load_module(recipe), 1).generate(prompt, 6)
    got = generator_for(fp32.artifact, recipe).generate(prompt, 6)
    assert np.array_equal(expected.tokens, got.tokens)


@pytest.mark.slow
def test_the_batch1_decode_step_takes_the_raw_binding_and_generates_the_same(
    genai_run: tuple[list, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 1 rebinds the mask and runs through ONNX Runtime's C-level calls (no per-step Python wrapper work);
    its tokens and logits equal those of the public IOBinding calls (the fallback) and of PyTorch."""
    import optimizer.runtime.generation_shared as shared

    fp32 = _by_name(genai_run[0])["genai_fp32"]
    recipe = load_recipe(genai_run[1] / "recipe.yaml")
    prompt = np.random.default_rng(9).integers(1, 300, (1, 12))
    used: list[str] = []
    real = shared._fast_calls

    def spy(session: Any, binding: Any) -> tuple[Any, Any]:
        calls = real(session, binding)
        used.append(getattr(calls[1], "__name__", ""))
        return calls

    monkeypatch.setattr(shared, "_fast_calls", spy)
    fast = generator_for(fp32.artifact, recipe).generate(prompt, 6)
    assert used == ["run"]  # the raw path (the fallback is a lambda)

    class Wrapped:  # a session without `_sess`: the public calls serve
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            if name == "_sess":
                raise AttributeError(name)
            return getattr(self.inner, name)

    gen = generator_for(fp32.artifact, recipe)
    gen.session = Wrapped(gen.session)
    public = gen.generate(prompt, 6)
    assert used[-1] == "<lambda>"
    expected = TorchGenerator(load_module(recipe), 1).generate(prompt, 6)
    assert np.array_equal(fast.tokens, public.tokens) and np.array_equal(fast.tokens, expected.tokens)
    assert np.allclose(np.stack(fast.step_logits), np.stack(public.step_logits), atol=1e-5)


@pytest.mark.slow
def test_the_cache_is_one_buffer_written_in_place(genai_run: tuple[list, Path]) -> None:
    """The buffers the loop allocates (prompt + new tokens long) are where GroupQueryAttention writes: after a
    generation they hold every position but the last token's, and nothing after."""
    fp32 = _by_name(genai_run[0])["genai_fp32"]
    gen = generator_for(fp32.artifact, load_recipe(genai_run[1] / "recipe.yaml"))
    gen.generate(np.random.default_rng(1).integers(1, 300, (1, 12)), 6, keep_logits=False)
    for buffer in gen.cache:
        keys = buffer.numpy()
        assert keys.shape[2] == 18
        filled = np.abs(keys).sum(axis=(0, 1, 3))
        assert (filled[:17] > 0).all() and (filled[17:] == 0).all()


@pytest.mark.slow
def test_prune_lm_head_computes_the_last_position_only(genai_run: tuple[list, Path]) -> None:
    import onnxruntime as ort

    by = _by_name(genai_run[0])
    shapes = {}
    for name in ("genai_fp32", "genai_pruned"):
        session = ort.InferenceSession(str(by[name].artifact.path))
        feed = {"input_ids": np.ones((1, 12), np.int64), "attention_mask": np.ones((1, 12), np.int64)}
        for i in session.get_inputs()[2:]:
            feed[i.name] = np.zeros((1, 2, 12, 16), np.float32)
        shapes[name] = session.run(["logits"], feed)[0].shape
    assert shapes == {"genai_fp32": (1, 12, 300), "genai_pruned": (1, 1, 300)}
    assert by["genai_pruned"].parent == "genai_fp32" and by["genai_pruned"].metrics["accuracy"]["generation"][
        "token_agreement"] == 1.0


@pytest.mark.slow
def test_int4_packs_the_weights_and_reports_its_agreement(genai_run: tuple[list, Path]) -> None:
    int4 = _by_name(genai_run[0])["genai_int4"]
    assert int4.status == "ran", int4.reason
    assert int4.metrics["graph"]["op_types"]["com.microsoft.MatMulNBits"] >= 9  # 4 per layer + the LM head
    assert int4.notes["builder_options"] == {"prune_lm_head": True, "accuracy_level": 4, "block_size": 16}
    assert 0.0 <= int4.notes["check"]["token_agreement"] <= 1.0
    assert int4.metrics["size_bytes"] < 0.6 * _by_name(genai_run[0])["genai_fp32"].metrics["size_bytes"]


@pytest.mark.slow
def test_passes_that_would_break_the_layout_decline_it(genai_run: tuple[list, Path]) -> None:
    by = _by_name(genai_run[0])
    assert by["int8_on_genai"].status == "skipped"
    assert "GenAI's layout" in by["int8_on_genai"].reason
    session = by["genai_session"]  # ort_session keeps the layout: same files, its session options
    assert session.status == "ran" and session.artifact.genai_files == by["genai_fp32"].artifact.genai_files
    assert (session.artifact.path.parent / "genai_config.json").is_file()


def test_genai_build_declines_what_it_cannot_build(tmp_path: Path) -> None:
    from optimizer.core.artifact import Artifact
    from passes.genai_build import GenaiBuildConfig, GenaiBuildPass

    def ctx(data: dict) -> PassContext:
        return PassContext(load_recipe(write_recipe(tmp_path, data)), "g", tmp_path, None, None)  # type: ignore[arg-type]

    p = GenaiBuildPass(GenaiBuildConfig())
    source = Artifact(kind="torch", path=None)
    assert "does not support GPT2LMHeadModel" in (p.skip_reason(source, ctx(recipe_data([]))) or "")
    forward = {**recipe_data([], LLAMA), "workload": "forward"}
    assert "workload is forward" in (p.skip_reason(source, ctx(forward)) or "")
    onnx = Artifact(kind="onnx", path=tmp_path / "m.onnx")
    assert "not from another ONNX graph" in (p.skip_reason(onnx, ctx(recipe_data([], LLAMA))) or "")
    assert p.skip_reason(source, ctx(recipe_data([], LLAMA))) is None


@pytest.mark.slow
def test_the_bundle_is_served_by_genais_runtime(genai_run: tuple[list, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`export --format genai` (auto for these stages) writes GenAI's folder; verify reruns our loop and GenAI's
    own runtime on it, and each catches tokens that differ."""
    from optimizer.deploy import genai_bundle
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import verify_bundle
    from optimizer.report.history import load_report

    report = load_report(str(genai_run[1] / "out"))
    for stage in ("genai_pruned", "genai_int4"):
        root = export_bundle(report, stage, "auto", tmp_path / stage)
        manifest = json.loads((root / "manifest.json").read_text())
        assert manifest["format"] == "genai" and manifest["cache"]["kind"] == "genai_shared_buffer"
        config = json.loads((root / "genai_config.json").read_text())
        assert config["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 1
        assert verify_bundle(root) == []
    real = genai_bundle.genai_runtime_tokens
    monkeypatch.setattr(genai_bundle, "genai_runtime_tokens", lambda *a: real(*a) + 1)
    problems = verify_bundle(tmp_path / "genai_pruned")
    assert problems and all("GenAI's runtime gives other tokens" in p for p in problems)
    with pytest.raises(Exception, match="--format triton"):
        export_bundle(report, "genai_pruned", "triton", tmp_path / "triton")


@pytest.mark.slow
def test_the_genai_comparison_script_runs(genai_run: tuple[list, Path], tmp_path: Path) -> None:
    """scripts/compare_genai.py on a compiled run: GenAI's own builds of the run's weights, one interleaved round,
    FP32 tokens identical on both sides."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_genai.py"), str(genai_run[1] / "out"), "--fp32",
         "genai_pruned", "--int4", "genai_int4", "--rounds", "2", "--prompts", "1", "--instances", "1",
         "--scenario", "16+4", "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["precision"]: r for r in result["rows"]}
    assert rows["fp32"]["identical_prompts"] == 1 and rows["fp32"]["ours_ms"] > 0 and rows["fp32"]["genai_ms"] > 0
    assert 0.0 <= rows["int4"]["genai int4"]["token_agreement"] <= 1.0


class _FakeGen:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def generate(self, prompt: np.ndarray, new: int, keep_logits: bool = True) -> Generation:
        self.log.append((self.name, prompt.shape[1], new))
        return Generation(np.zeros((1, new), np.int64), e2e_ms=1.0, ttft_ms=0.5, tpot_ms=[0.1] * (new - 1))


def test_each_switch_between_sides_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation timing settles every switch as forward timing does: asleep for settle_ms, then a short
    untimed generation on the generator about to be timed. Without it two identical graphs read as different."""
    from optimizer.measure import harness

    log: list = []
    monkeypatch.setattr(harness.time, "sleep", lambda s: log.append(("sleep", s)))
    sides = [("child", [_FakeGen("c0", log)]), ("parent", [_FakeGen("p0", log)])]
    settings = BenchmarkSettings(rounds=2, iterations=1, settle_ms=40)
    prompts = [np.ones((1, 30), np.int64)]
    runs, used, rounds = timed_generation_rounds(sides, prompts, 5, settings)
    assert rounds == 2 and len(runs["child"]) == len(runs["parent"]) == 2
    assert log == [
        ("sleep", 0.04), ("c0", 8, 2), ("c0", 30, 5), ("sleep", 0.04), ("p0", 8, 2), ("p0", 30, 5),
        ("sleep", 0.04), ("p0", 8, 2), ("p0", 30, 5), ("sleep", 0.04), ("c0", 8, 2), ("c0", 30, 5),
    ]
