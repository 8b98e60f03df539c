"""The fuse pass on ONNX files from other exporters (issue 33, item 6): a BERT exported with the TorchScript
exporter (opset 17, dynamic batch and sequence, no value_info for its intermediate tensors) gets the same fused
graph as the dynamo export of the same model, eager and SDPA attention alike, and its outputs do not change."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from conftest import FAST_BENCH, write_recipe
from fusion_helpers import fuse, ops, run
from onnx import helper
from test_fusion_models import TINY  # the same tiny BERT the folder-compiled fusion tests use

from passes.fuse import RULES_BY_NAME, apply_rules
from passes.fuse.context import RuleContext
from passes.fuse.graph import name_nodes
from passes.fuse.probe import add_contrib_opset, probe_values

LAYERS = TINY["num_hidden_layers"]
NAMES = ["input_ids", "attention_mask", "token_type_ids"]
CPU_RULES = [r.name for r in RULES_BY_NAME.values() if r.runs_on("cpu") and not r.generation]


def export_bert(path: Path, attn: str, exporter: str) -> Any:
    """BertModel with random weights -> ONNX (opset 17, dynamic batch and seq) as a user would export it."""
    import torch
    import transformers

    class LastHidden(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state

    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY)
    module = LastHidden(transformers.BertModel._from_config(config, attn_implementation=attn).eval())
    args = (torch.randint(0, 200, (2, 16)), torch.ones(2, 16, dtype=torch.int64), torch.zeros(2, 16, dtype=torch.int64))
    if exporter == "dynamo":
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
        kw: dict[str, Any] = {"dynamo": True, "dynamic_shapes": (dims, dims, dims)}
    else:
        kw = {"dynamo": False, "dynamic_axes": {n: {0: "batch", 1: "seq"} for n in NAMES}}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=NAMES, output_names=["last_hidden_state"],
                          opset_version=17, external_data=False, **kw)
    return onnx.load(str(path))


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    folder = tmp_path_factory.mktemp("exports")
    paths = {}
    for attn in ("eager", "sdpa"):
        for exporter in ("torchscript", "dynamo"):
            paths[attn, exporter] = folder / f"bert_{attn}_{exporter}.onnx"
            export_bert(paths[attn, exporter], attn, exporter)
    return paths


def padded_feed(batch: int = 2, seq: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feed = {
        "input_ids": rng.integers(0, 200, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }
    feed["attention_mask"][1, -3:] = 0
    return feed


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def fuse_unchecked(m: Any, feed: dict[str, np.ndarray], rules: list[str]) -> tuple[Any, dict]:
    """fusion_helpers.fuse without its per-rule op check: with a block left unfused, the mask's int32 Cast that
    Attention needs is one Cast more than the graph had."""
    graph = gs.import_onnx(m)
    name_nodes(graph)
    reports = apply_rules(graph, rules, RuleContext("cpu", 17, feed, probe_values(graph, feed)))
    out = gs.export_onnx(graph)
    add_contrib_opset(out)
    return out, reports


def fused_ops(m: Any) -> Counter[str]:
    return Counter({op: n for op, n in ops(m).items() if any(op in r.emits for r in RULES_BY_NAME.values())})


@pytest.mark.slow
def test_torchscript_export_has_no_types_for_its_intermediates(exports: dict) -> None:
    """The premise: a TorchScript export carries no value_info, so the probe must type the graph itself."""
    m = onnx.load(str(exports["eager", "torchscript"]))
    assert len(m.graph.value_info) == 0


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_torchscript_export_fuses_like_dynamo(exports: dict, attn: str) -> None:
    feed = padded_feed()
    fused = {}
    for exporter in ("torchscript", "dynamo"):
        m = onnx.load(str(exports[attn, exporter]))
        out, reports = fuse(m, feed, CPU_RULES)
        fused[exporter] = (fused_ops(out), reports)
        # nothing of the attention blocks is left, their per-block shape arithmetic included
        assert not {"Softmax", "Transpose", "Reshape", "Concat"} & set(ops(out)), (exporter, ops(out))
        # the fused graph computes what its input did, on a padded batch and on another shape
        for f in (feed, padded_feed(3, 11)):
            (a,), (b,) = run(m, f), run(out, f)
            assert cosine(a, b) > 0.99999 and float(np.abs(a - b).max()) < 1e-4, (exporter, attn)
    (ts, ts_reports), (dyn, dyn_reports) = fused["torchscript"], fused["dynamo"]
    assert ts["Attention"] == dyn["Attention"] == LAYERS, ts_reports["attention"].to_json()
    assert not ts_reports["attention"].misses
    assert all("mask padding" in d for d in ts_reports["attention"].details)
    misses = {k: (r.misses, dyn_reports[k].misses) for k, r in ts_reports.items() if r.misses or dyn_reports[k].misses}
    assert ts == dyn, (ts, dyn, misses)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_torchscript_export_fuses_causal_attention(tmp_path: Path, attn: str) -> None:
    """GPT-2 through TorchScript: K and V pass a one-input Concat (the cache, empty), P a Cast to float, and the
    output Reshape's target is computed from Shape(P V): every block still fuses, causal + padding."""
    import torch
    import transformers

    class LastHidden(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=ids, attention_mask=mask).last_hidden_state

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=200, bos_token_id=0,
                                     eos_token_id=0)
    module = LastHidden(transformers.GPT2Model._from_config(config, attn_implementation=attn).eval())
    names = ["input_ids", "attention_mask"]
    path = tmp_path / "gpt2.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randint(0, 200, (2, 16)), torch.ones(2, 16, dtype=torch.int64)), str(path),
                          input_names=names, output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "seq"} for n in names})
    m = onnx.load(str(path))
    feed = {k: v for k, v in padded_feed().items() if k in names}
    out, reports = fuse(m, feed, CPU_RULES)
    assert ops(out)["Attention"] == LAYERS, reports["attention"].misses
    assert all("mask causal+padding" in d for d in reports["attention"].details)
    for f in (feed, {k: v for k, v in padded_feed(3, 11).items() if k in names}):
        (a,), (b,) = run(m, f), run(out, f)
        assert cosine(a, b) > 0.99999 and float(np.abs(a - b).max()) < 1e-4


@pytest.mark.slow
def test_pv_reshape_that_is_not_the_identity_declines(exports: dict) -> None:
    """TorchScript's SDPA writes Reshape(P V) to the same [B, H, S, D] before the Transpose back; the rule skips it
    only when the probe shows it changes no shape. A Reshape that regroups the heads is a different graph."""
    m = onnx.load(str(exports["sdpa", "torchscript"]))
    # Point the first block's Reshape at a constant [B, S, H, D] regrouping: same element count, other meaning.
    target = next(n for n in m.graph.node if n.op_type == "Reshape" and n.input[0].endswith("MatMul_1_output_0"))
    shape = helper.make_tensor("regroup_shape", onnx.TensorProto.INT64, [4], [0, -1, 4, 16])
    m.graph.initializer.append(shape)
    target.input[1] = "regroup_shape"
    feed = padded_feed()
    out, reports = fuse_unchecked(m, feed, ["constant_folding", "attention"])
    assert reports["attention"].fused == LAYERS - 1
    assert any("not the identity" in r for r in reports["attention"].misses), reports["attention"].misses
    (a,), (b,) = run(m, feed), run(out, feed)
    assert float(np.abs(a - b).max()) < 1e-4


@pytest.mark.slow
def test_block_whose_tensor_is_used_elsewhere_declines(exports: dict) -> None:
    """Shape nodes reading P V are allowed because the Reshape they feed goes with the block; one that feeds a graph
    output would keep the whole unfused block computed next to Attention, so that block is left alone."""
    m = onnx.load(str(exports["sdpa", "torchscript"]))
    pv = next(n.output[0] for n in m.graph.node if n.op_type == "MatMul" and n.output[0].endswith("MatMul_1_output_0"))
    m.graph.node.append(helper.make_node("Shape", [pv], ["pv_shape"], name="pv_shape"))
    m.graph.output.append(helper.make_tensor_value_info("pv_shape", onnx.TensorProto.INT64, [4]))
    reports = fuse_unchecked(m, padded_feed(), ["constant_folding", "attention"])[1]
    assert reports["attention"].fused == LAYERS - 1
    assert any("is also used by pv_shape" in r for r in reports["attention"].misses), reports["attention"].misses


@pytest.mark.slow
def test_fuse_stage_on_a_torchscript_onnx_file(exports: dict, tmp_path: Path) -> None:
    """Through the pipeline, as a user brings the file: an `onnx` source with three tokenizer inputs."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe

    data = {
        "name": "torchscript-bert",
        "model": {"source": "onnx", "path": str(exports["sdpa", "torchscript"])},
        "inputs": [
            {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 200]},
            {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "fill": "ones"},
            {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "seq"], "fill": "zeros"},
        ],
        "outputs": ["last_hidden_state"],
        "scenarios": [{"name": "b2-s16", "batch": 2, "seq": 16}],
        "target": {"threads": 1},
        "benchmark": FAST_BENCH,
        "accuracy": {"samples": 2},
        "passes": [{"type": "fuse"}],
    }
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = {r.name: r for r in Pipeline(recipe, tmp_path / "out", measure=False).execute()}
    fuse_rec = records["fuse"]
    assert fuse_rec.ok, fuse_rec.reason
    assert fuse_rec.notes["fused_ops"]["Attention"] == LAYERS, fuse_rec.notes["rules"]["attention"]
    assert fuse_rec.notes["fused_ops"]["SkipLayerNormalization"] == 2 * LAYERS, fuse_rec.notes["rules"]
    assert fuse_rec.notes["check_vs_input"]["last_hidden_state"]["cosine"] > 0.99999
