"""fuse's kv_attention rule on generation graphs: attention over the KV cache -> MultiHeadAttention (past/present)
in the prefill and decode graphs of a tiny GPT-2, checked end to end against the unfused graphs. Nothing here is
timed: the pipelines run unmeasured; numbers come from the graphs and greedy generations."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from conftest import write_recipe
from test_generation import GPT2, LLAMA, recipe_data

from optimizer.core.artifact import Artifact
from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.runtime import onnx_io
from optimizer.runtime.runners.gen_runner import ort_generator
from passes.fuse import FuseConfig, FusePass, apply_rules
from passes.fuse.context import RuleContext
from passes.fuse.graph import name_nodes

LAYERS = GPT2["config"]["n_layer"]
MHA = "com.microsoft.MultiHeadAttention"


def run(tmp: Path, passes: list[dict[str, Any]], model: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    data = recipe_data(passes, model)
    recipe = load_recipe(write_recipe(tmp, data))
    records = Pipeline(recipe, tmp / "out", measure=False).execute()
    return recipe, {r.name: r for r in records}


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kv_attention")
    return run(tmp, [{"type": "export"}, {"type": "fuse", "name": "kv", "config": {"rules": ["kv_attention"]}}])


@pytest.mark.slow
def test_every_layer_of_both_graphs_becomes_one_multihead_attention(fused: tuple[Any, dict[str, Any]]) -> None:
    _, stages = fused
    kv, export = stages["kv"], stages["export"]
    assert kv.status == "ran", kv.reason
    for graph in (kv.artifact.path, kv.artifact.decode_path()):
        hist = onnx_io.op_histogram(graph)
        assert hist[MHA] == LAYERS and not {"Softmax", "Where", "IsNaN"} & set(hist), hist  # mask, NaN guard gone
    decode_hist = onnx_io.op_histogram(kv.artifact.decode_path())
    assert decode_hist.get("Concat", 0) < onnx_io.op_histogram(export.artifact.decode_path())["Concat"] - LAYERS
    notes = kv.notes
    assert notes["rules"]["kv_attention"]["fused"] == 2 * LAYERS
    assert notes["fused_ops"] == {"MultiHeadAttention": 2 * LAYERS}  # both graphs
    decode = notes["generation"]["decode"]
    assert decode["nodes_after"] < 0.6 * decode["nodes_before"], decode
    details = notes["rules"]["kv_attention"]["details"]
    assert any(d.startswith("decode: layer 0: 4 heads, scale 0.25, cache past + new keys") for d in details)
    # One weights file for both graphs, as export wrote them.
    assert kv.artifact.external_data == ["weights.bin"] and kv.artifact.decode == "decode.onnx"


@pytest.mark.slow
def test_fused_generation_matches_the_unfused_one(fused: tuple[Any, dict[str, Any]]) -> None:
    recipe, stages = fused
    check = stages["kv"].notes["check_vs_input"]
    assert check["token_agreement"] == 1.0 and check["logits_cosine_min"] > 0.99999, check
    assert check["padded_logits_cosine_min"] > 0.99999, check
    prompt = np.random.default_rng(3).integers(1, 300, (2, 20)).astype(np.int64)
    a = ort_generator(stages["export"].artifact, recipe, device="cpu").generate(prompt, 12)
    b = ort_generator(stages["kv"].artifact, recipe, device="cpu").generate(prompt, 12)
    assert np.array_equal(a.tokens, b.tokens)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a.step_logits, b.step_logits, strict=True)) < 1e-4


@pytest.mark.slow
def test_padding_in_the_attention_mask_is_honoured(fused: tuple[Any, dict[str, Any]]) -> None:
    """The rule keeps the attention_mask as MultiHeadAttention's key_padding_mask: a left-padded row's logits are
    the unfused graph's (and differ from the same row unpadded, so the mask is not ignored)."""
    _, stages = fused
    sessions = [
        ort.InferenceSession(str(s.artifact.path), providers=["CPUExecutionProvider"])
        for s in (stages["export"], stages["kv"])
    ]
    ids = np.random.default_rng(4).integers(1, 300, (2, 10)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    ref, got = (s.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0] for s in sessions)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    unpadded = sessions[1].run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    assert np.abs(unpadded[1] - got[1]).max() > 1e-3


@pytest.mark.slow
def test_a_layer_that_does_not_match_is_left_with_the_reason(fused: tuple[Any, dict[str, Any]]) -> None:
    """present.0.key written as Concat(new, past): not the cache layout MultiHeadAttention appends to."""
    _, stages = fused
    model = onnx_io.load(stages["export"].artifact.decode_path())
    concat = next(n for n in model.graph.node if n.op_type == "Concat" and n.output[0] == "present.0.key")
    concat.input[0], concat.input[1] = concat.input[1], concat.input[0]
    assert _decline(model) == ["kv attention of layer 0: present.0.key is not Concat(past.0.key, new, axis=-2)"]


def _decline(model: Any) -> list[str]:
    graph = gs.import_onnx(model)
    name_nodes(graph)
    report = apply_rules(graph, ["kv_attention"], RuleContext("cpu", int(graph.opset), {}, {}))["kv_attention"]
    assert report.fused == LAYERS - 1
    return report.misses


def _scores_add(model: Any) -> Any:
    """Layer 0's Add of the mask to the scores (the Add feeding the first Softmax)."""
    made = {o: n for n in model.graph.node for o in n.output}
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    return made[softmax.input[0]]


@pytest.mark.slow
def test_a_mask_that_reads_other_inputs_or_no_mask_is_left(fused: tuple[Any, dict[str, Any]]) -> None:
    """What the rewrite drops must be a causal + padding mask: one that reads another input by value (here the
    token ids), or none at all (not causal), keeps its layer unfused."""
    _, stages = fused
    model = onnx_io.load(stages["export"].artifact.decode_path())
    add = _scores_add(model)
    model.graph.node.append(onnx.helper.make_node("Cast", ["input_ids"], ["ids_as_bias"], to=1))
    add.input[1] = "ids_as_bias"  # Add(Q K^T, mask)
    assert _decline(model) == [
        "kv attention of layer 0: the mask reads input_ids by value (not only a 2-D attention_mask)"
    ]
    model = onnx_io.load(stages["export"].artifact.decode_path())
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    softmax.input[0] = _scores_add(model).input[0]  # softmax(scale Q K^T), the Add left dangling
    assert _decline(model) == ["kv attention of layer 0: no additive mask on the scores: not causal attention"]


@pytest.mark.slow
def test_a_wrong_rewrite_fails_the_stage_and_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end-to-end check is the gate: a rewrite with the wrong scale changes the tokens and the stage fails
    with the numbers, while the stages before it stay."""
    from passes.fuse import kv_attention

    real = kv_attention.rewrite

    def wrong_scale(graph: gs.Graph, block: Any, producers: Any, mask: Any) -> None:
        block.scale *= 4.0
        real(graph, block, producers, mask)

    monkeypatch.setattr(kv_attention, "rewrite", wrong_scale)
    _, stages = run(tmp_path, [{"type": "export"}, {"type": "fuse", "config": {"rules": ["kv_attention"]}}])
    assert stages["export"].status == "ran"
    fuse = stages["fuse"]
    assert fuse.status == "failed"
    assert "fused generation graphs disagree with their input on s: token agreement" in fuse.reason


def test_other_targets_and_rules_say_why_they_do_not_run(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, recipe_data([{"type": "export"}])))
    ctx: Any = type("Ctx", (), {"recipe": recipe})()
    gen = Artifact("onnx", tmp_path / "model.onnx", decode="decode.onnx", layers=LAYERS)
    cuda = FusePass(FuseConfig(target="cuda"))
    assert cuda.skip_reason(gen, ctx) == (
        "no rule in rules fuses generation graphs on target cuda; those that do: kv_attention (cpu)"
    )
    assert FusePass(FuseConfig(rules=["layernorm"])).skip_reason(gen, ctx) is not None
    assert FusePass(FuseConfig()).skip_reason(gen, ctx) is None


@pytest.mark.slow
def test_default_rules_on_a_generation_artifact_report_which_did_not_run(tmp_path: Path) -> None:
    _, stages = run(tmp_path, [{"type": "export"}, {"type": "fuse"}])
    rules = stages["fuse"].notes["rules"]
    assert rules["kv_attention"]["fused"] == 2 * LAYERS
    assert rules["layernorm"]["skipped"] == (
        "layernorm: not applied to generation graphs yet (it needs a probe run, which has no KV-cache inputs)"
    )
    model = onnx.load(str(stages["fuse"].artifact.decode_path()), load_external_data=False)
    assert any(o.domain == "com.microsoft" for o in model.opset_import)


@pytest.mark.slow
def test_llama_rotary_keys_are_left_with_the_reason(tmp_path: Path) -> None:
    """Llama rotates its keys after the head split (and shares KV heads): not this rule's pattern."""
    _, stages = run(tmp_path, [{"type": "export"}, {"type": "fuse", "config": {"rules": ["kv_attention"]}}], LLAMA)
    fuse = stages["fuse"]
    assert fuse.status == "unchanged" and fuse.notes["rules"]["kv_attention"]["fused"] == 0  # not timed
    misses = fuse.notes["rules"]["kv_attention"]["not_fused"]
    assert len(misses) == 2 * LLAMA["config"]["num_hidden_layers"]
    assert misses[0] == "prefill: kv attention of layer 0: present.0.key is not Transpose(0,2,1,3) of the heads"
    assert "MultiHeadAttention" not in onnx_io.op_histogram(fuse.artifact.decode_path())


@pytest.mark.slow
def test_a_rewrite_that_drops_the_padding_fails_on_the_padded_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens on an unpadded prompt cannot see the padding mask; the left-padded batch can."""
    from passes.fuse import kv_attention

    real = kv_attention.rewrite
    monkeypatch.setattr(kv_attention, "rewrite", lambda graph, block, made, mask: real(graph, block, made, None))
    _, stages = run(tmp_path, [{"type": "export"}, {"type": "fuse", "config": {"rules": ["kv_attention"]}}])
    reason = stages["fuse"].reason or ""
    assert stages["fuse"].status == "failed"
    assert re.search(r"token agreement 1\.000, logits cosine 1\.0+, on a left-padded batch 0\.\d+ ", reason), reason
