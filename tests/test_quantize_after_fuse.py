"""int8_dynamic after `fuse` on a torchscript-exported BERT: a MatMul fed by a fused contrib op (BiasGelu) has an
output ONNX shape inference cannot type; ORT's quantizer then stopped with "Unable to find data type for
weight_name=...". Our graphs are FP32 before INT8, so the quantizer is told the default tensor type."""

from __future__ import annotations

from pathlib import Path

import yaml

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import parse_recipe

RECIPE = """
name: tiny-bert-fuse-int8
model:
  source: hf_config
  architecture: bert
  config: {num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64,
           vocab_size: 100, max_position_embeddings: 64}
inputs:
  - {name: input_ids, dtype: int64, shape: [batch, seq], range: [0, 100]}
  - {name: attention_mask, dtype: int64, shape: [batch, seq], fill: ones}
outputs: [last_hidden_state]
scenarios: [{name: b1-s16, batch: 1, seq: 16}]
target: {device: cpu, threads: 1}
accuracy: {metric: cosine, min: 0.9, samples: 1}
passes:
  - {type: export, config: {exporter: torchscript}}
  - type: fuse
  - {type: quantize, name: int8_dynamic, config: {mode: int8_dynamic, per_channel: true}}
"""


def test_int8_dynamic_after_fuse_on_a_torchscript_bert(tmp_path: Path) -> None:
    recipe = parse_recipe(yaml.safe_load(RECIPE), str(tmp_path / "r.yaml"), tmp_path)
    records = Pipeline(recipe, tmp_path / "run", measure=False).execute()
    quantized = records[-1]
    assert quantized.status == "ran", quantized.reason
    import onnx

    ops = {n.op_type for n in onnx.load(str(quantized.artifact.path)).graph.node}
    assert ops & {"DynamicQuantizeMatMul", "MatMulInteger", "QAttention"}, ops
