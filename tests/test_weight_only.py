"""Weight-only quantization (quantize mode weight_only: MatMulNBits) and the decoder runtime settings that
ort_session sets (intra-op spinning, intra-op threads). Nothing here is timed: the pipelines run unmeasured and
numbers come from the graphs, the files and greedy generations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import mlp_recipe, write_recipe
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError
from test_generation import recipe_data

from optimizer.core.errors import PassError
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.accuracy import generation_agreement
from optimizer.recipe.loading import load_recipe
from optimizer.runtime import onnx_io
from optimizer.runtime.runners.gen_runner import ort_generator
from optimizer.runtime.sessions import session_options
from passes.quantize import weight_only as wo
from passes.quantize.config import QuantizeConfig

SPIN = "session.intra_op.allow_spinning"
NBITS = "com.microsoft.MatMulNBits"
# The tiny GPT-2 (2 layers of 4 weight MatMuls, exported as Gemm, and a tied LM head read through a Transpose).
PACKED_PER_GRAPH = 9
# Token agreement with the FP32 export on the first scenario's prompts (2 x 10 tokens), a budget per bit width.
# INT8 weights move the logits by ~3e-5 (cosine): no token flips. INT4 moves them by ~1e-2 and this random-weight
# model's logits are nearly flat, so a greedy token flips after a few steps (0.75 measured here) and the rest of
# that row follows another path; the budget leaves room for one more early flip on another CPU's kernels. A
# broken packing (wrong layout or scales) scores near 0 and its logits cosine falls far below 0.99.
BUDGET = {8: 1.0, 4: 0.5}


@pytest.fixture(scope="module")
def gen_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("weight_only")
    passes = [
        {"type": "export"},
        {"type": "quantize", "name": "w4", "config": {"mode": "weight_only"}},
        {
            "type": "quantize",
            "name": "w8",
            "from": "export",
            "config": {"mode": "weight_only", "weight_only": {"bits": 8, "block_size": 16, "symmetric": True}},
        },
        {"type": "ort_session", "name": "no_spin", "from": "export", "config": {"allow_spinning": False}},
        {"type": "ort_session", "name": "after_no_spin", "config": {"intra_op_threads": 1}},
    ]
    recipe = load_recipe(write_recipe(tmp, recipe_data(passes)))
    records = Pipeline(recipe, tmp / "out", measure=False).execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    return recipe, {r.name: r for r in records}


def weights_file(rec: Any) -> int:
    return (rec.artifact.path.parent / "weights.bin").stat().st_size


@pytest.mark.slow
def test_weight_only_packs_every_weight_matmul_of_both_graphs(gen_run: tuple[Any, dict[str, Any]]) -> None:
    _, stages = gen_run
    for name, bits in (("w4", 4), ("w8", 8)):
        rec = stages[name]
        for graph, part in ((rec.artifact.path, "prefill"), (rec.artifact.decode_path(), "decode")):
            hist = onnx_io.op_histogram(graph)
            assert hist[NBITS] == PACKED_PER_GRAPH and "Gemm" not in hist, hist
            assert hist["MatMul"] == 4  # attention: scores and values, two activations each, kept float
            notes = rec.notes[part]
            assert notes["bits"] == bits and len(notes["matmul_nbits"]) == PACKED_PER_GRAPH
            assert notes["rewritten"] == {"gemm_to_matmul": 8, "transpose_folded": 1}
            assert len(notes["kept_float"]) == 4 and "Transpose" in onnx_io.op_histogram(graph)  # attention's own
            model = onnx_io.load(graph, with_weights=False)
            sizes = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node}
            lm_head = sizes[[n for n in sizes if n.startswith("node_linear")][0]]
            assert (lm_head["K"], lm_head["N"], lm_head["bits"]) == (64, 300, bits)
    w4, w8 = stages["w4"].notes["prefill"], stages["w8"].notes["prefill"]
    assert w4["block_size"] == 32 and w8["block_size"] == 16 and w8["symmetric"] is True
    # 4 bits: 9 float weight matrices (0.43 MB of the 0.54 MB) to an eighth plus scales; the embeddings stay float.
    assert 0.35 < w4["weight_bytes"]["ratio"] < 0.45 and w4["weight_bytes"]["ratio"] < w8["weight_bytes"]["ratio"] < 0.6


@pytest.mark.slow
def test_weight_only_weights_file_shrinks_and_stays_shared(gen_run: tuple[Any, dict[str, Any]]) -> None:
    _, stages = gen_run
    export, w4, w8 = (weights_file(stages[n]) for n in ("export", "w4", "w8"))
    assert w4 < 0.5 * export and w4 < w8 < 0.6 * export, (export, w4, w8)
    for name in ("w4", "w8"):
        rec = stages[name]
        assert rec.artifact.external_data == ["weights.bin"] and rec.artifact.decode == "decode.onnx"
        offsets = []
        for graph in (rec.artifact.path, rec.artifact.decode_path()):
            model = onnx.load(str(graph), load_external_data=False)
            offsets.append(
                {
                    int({e.key: e.value for e in t.external_data}["offset"])
                    for t in model.graph.initializer
                    if t.data_location == TensorProto.EXTERNAL
                }
            )
        assert len(offsets[0] & offsets[1]) >= PACKED_PER_GRAPH  # the packed weights written once, read by both


@pytest.mark.slow
@pytest.mark.parametrize("name,bits", [("w4", 4), ("w8", 8)])
def test_weight_only_token_agreement_with_the_fp32_export(
    gen_run: tuple[Any, dict[str, Any]], name: str, bits: int
) -> None:
    recipe, stages = gen_run
    check = stages[name].notes["check"]
    assert check["against"] == "the input graphs (float weights)" and check["scenario"] == "s"
    assert check["token_agreement"] >= BUDGET[bits], check
    assert check["logits_cosine_before_divergence"] > (0.9999 if bits == 8 else 0.99), check
    # The figure reported is the loop's: the export and the stage generating the same prompt, compared here.
    prompt = np.random.default_rng(0).integers(1, 300, (2, 12))
    fp32 = ort_generator(stages["export"].artifact, recipe).generate(prompt, 10)
    packed = ort_generator(stages[name].artifact, recipe).generate(prompt, 10)
    agreement = generation_agreement(fp32, packed)
    assert agreement["token_agreement"] >= BUDGET[bits], agreement


@pytest.mark.slow
def test_weight_only_on_a_forward_graph(tmp_path: Path) -> None:
    passes = [{"type": "export"}, {"type": "quantize", "config": {"mode": "weight_only", "weight_only": {"bits": 8}}}]
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(passes=passes)))
    records = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    stage = records[2]
    assert onnx_io.op_histogram(stage.artifact.path)[NBITS] == 2
    assert [n["K"] for n in stage.notes["matmul_nbits"]] == [16, 32]
    assert min(stage.notes["check"]["cosine"].values()) > 0.9999


def gemm_graph(trans_b: int, alpha: float, beta: float) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 64) if trans_b else (64, 40)).astype(np.float32)
    c = rng.standard_normal(40).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="g", transB=trans_b, alpha=alpha, beta=beta)
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 40])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run_graph(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("trans_b,alpha,beta", [(0, 1.0, 1.0), (1, 0.5, 2.0)])
def test_gemm_becomes_matmul_and_add_with_the_same_outputs(
    tmp_path: Path, trans_b: int, alpha: float, beta: float
) -> None:
    model = gemm_graph(trans_b, alpha, beta)
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    expected = run_graph(model, x)
    rewritten = onnx.ModelProto.FromString(model.SerializeToString())
    rewrites, kept = wo.prepare(rewritten)
    assert rewrites["gemm_to_matmul"] == 1 and kept == {}
    assert [n.op_type for n in rewritten.graph.node] == ["MatMul", "Add"]
    np.testing.assert_allclose(run_graph(rewritten, x), expected, rtol=1e-5, atol=1e-5)
    onnx.save(model, str(tmp_path / "g.onnx"))
    notes = wo.quantize(tmp_path / "g.onnx", tmp_path / "q.onnx", wo.WeightOnlySettings(bits=8), [])
    assert [n["node"] for n in notes["matmul_nbits"]] == ["g"]
    got = run_graph(onnx.load(str(tmp_path / "q.onnx")), x)
    cosine = float((got * expected).sum() / np.linalg.norm(got) / np.linalg.norm(expected))
    assert cosine > 0.9999


def test_weight_only_that_packs_nothing_says_so(tmp_path: Path) -> None:
    node = helper.make_node("MatMul", ["a", "b"], ["y"], name="scores")
    graph = helper.make_graph(
        [node],
        "activations",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    with pytest.raises(PassError, match="weight_only quantized nothing"):
        wo.quantize(tmp_path / "m.onnx", tmp_path / "q.onnx", wo.WeightOnlySettings(), [])


def test_weight_only_settings_are_checked() -> None:
    assert QuantizeConfig.model_validate({"mode": "weight_only"}).weight_only.bits == 4
    for bad in ({"block_size": 48}, {"block_size": 8}, {"bits": 3}, {"accuracy_level": 5}):
        with pytest.raises(ValidationError):
            QuantizeConfig.model_validate({"mode": "weight_only", "weight_only": bad})


def test_session_options_spinning_and_threads() -> None:
    assert session_options({"allow_spinning": False}, 2).get_session_config_entry(SPIN) == "0"
    assert session_options({"allow_spinning": True}, 2).get_session_config_entry(SPIN) == "1"
    default = session_options({}, 2)
    with pytest.raises(RuntimeError, match="does not have configuration"):  # unset: ORT's own default
        default.get_session_config_entry(SPIN)
    assert default.intra_op_num_threads == 2
    assert session_options({"intra_op_threads": 1}, 2).intra_op_num_threads == 1


@pytest.mark.slow
def test_no_spin_stage_reaches_both_generation_sessions(gen_run: tuple[Any, dict[str, Any]]) -> None:
    recipe, stages = gen_run
    no_spin, later, export = stages["no_spin"], stages["after_no_spin"], stages["export"]
    assert no_spin.artifact.runtime["allow_spinning"] is False and "intra_op_threads" not in no_spin.artifact.runtime
    folder = no_spin.artifact.path.parent
    assert sorted(p.name for p in no_spin.artifact.files()) == ["decode.onnx", "model.onnx", "weights.bin"]
    assert (folder / "ort_optimized_decode.onnx").is_file()
    # The decode graph, the one run per token, is optimized and counted too (ORT's fusions: fewer nodes).
    decode_nodes = sum(onnx_io.op_histogram(export.artifact.decode_path()).values())
    assert no_spin.notes["ort_optimized_decode_graph"]["nodes"] < decode_nodes
    gen = ort_generator(no_spin.artifact, recipe)
    for session in (gen.prefill, gen.decode):
        assert session.get_session_options().get_session_config_entry(SPIN) == "0"
    # A later ort_session that does not name spinning keeps the earlier choice and adds its own.
    assert later.artifact.runtime["allow_spinning"] is False and later.artifact.runtime["intra_op_threads"] == 1
    gen = ort_generator(later.artifact, recipe)
    for session in (gen.prefill, gen.decode):
        options = session.get_session_options()
        assert options.get_session_config_entry(SPIN) == "0" and options.intra_op_num_threads == 1
    # Session options change no number: the same tokens as the export.
    prompt = np.random.default_rng(2).integers(1, 300, (1, 16))
    ref = ort_generator(export.artifact, recipe).generate(prompt, 8)
    assert generation_agreement(ref, gen.generate(prompt, 8))["token_agreement"] == 1.0
