#!/usr/bin/env bash
# The GPU check: one prepared command for a GPU machine that answers, in OUT/summary.json (scripts/gpu_decisive.py
# says every field), (a) CUDA-graph replay vs eager static-cache decode of a small decoder at batch 1: TPOT ratio
# with its interval, tokens identical; (b) per runtime that ran, the runner's CUDA-event span vs host time vs
# kernel busy time (CUPTI); (c) every captured graph fed calls 0, 1, 0 equal to eager. Then, full mode only, the
# gpu-marked tests. Every field is a figure or "not run: <reason>".
#
#   bash scripts/gpu_check.sh OUT             full: (a) (b) (c) + the gpu-marked tests, under 5 minutes
#   bash scripts/gpu_check.sh --quick OUT     (a) and (c) only, under 2 minutes
#   bash scripts/gpu_check.sh --dry-run OUT   tiny sizes, every code path once (no GPU: every device field says why)
#
# What comes back from the GPU machine is at most 8 files, two folders deep: OUT holds summary.json, log.txt
# (the checks' output, last 64 KiB) and, full mode, gpu-tests.txt; nothing else (no run folders, no history).
# The machine we can borrow has PyTorch 2.11 (CUDA 13), transformers, onnx, a CPU-only onnxruntime 1.30 and numpy,
# no network, and no TensorRT, Polygraphy or onnxruntime-gpu (only small wheels, tens of MB, can be carried there:
# onnxruntime-gpu ~300 MB and TensorRT > 1 GB cannot). So only the PyTorch CUDA rows run there; the ORT CUDA and
# TensorRT rows say "not run: <why>" and the verdict covers only what ran (--dry-run prints which rows are which).
# The gpu-marked tests need the project's other dependencies (pydantic ...): `bash scripts/gpu_wheelhouse.sh`
# here first and carry `.whl`; without it they say why in summary.json's gpu_tests.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=full out=
for arg in "$@"; do
  case $arg in
    --quick) mode=quick ;;
    --dry-run) mode=dry-run ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
out=${out:-gpu-check}
mkdir -p "$out"
rm -f "$out/summary.json" "$out/log.txt" "$out/gpu-tests.txt"
: > "$out/log.txt"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export PYTHONUNBUFFERED=1 OPTIMIZER_HISTORY="$scratch/history.sqlite"  # nothing but the summary files in OUT
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# seconds: the checks' own budget (they stop starting work past it), the hard limit, the tests' limit
case $mode in
  full) budget=170 limit=200 tests=60 ;;
  quick) budget=85 limit=105 tests=0 ;;
  dry-run) budget=60 limit=90 tests=0 ;;
esac
skip="--$mode (the gpu-marked tests are part of the full run)"
[ "$mode" = full ] && skip="they run after the checks"
flag=(); [ "$mode" = full ] || flag=("--$mode")
# log.txt is written in OUT from the first line: a run the machine cuts off at its limit still brings it back
# (trimmed to its last 64 KiB at the end)
timeout -k 5 "$limit" "$PY" scripts/gpu_decisive.py "$out" "${flag[@]}" --budget "$budget" \
  --tests-skipped "$skip" 2>&1 | tee "$out/log.txt"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "gpu_check.sh: the checks stopped at the ${limit} s limit" | tee -a "$out/log.txt"
if [ ! -f "$out/summary.json" ]; then  # python itself did not start (gpu_decisive.py writes its skeleton first)
  echo "{\"schema\": \"gpu_check/1\", \"verdict\": \"fail: scripts/gpu_decisive.py did not start (rc $rc, see log.txt)\"}" \
    > "$out/summary.json"
fi

if [ "$mode" = full ]; then
  # only the wheels whose package the machine lacks: a carried copy of one it has (scipy, pytest, pyyaml ...)
  # would shadow the image's own, PYTHONPATH coming before site-packages
  mapfile -t wheels < <(ls .whl/*.whl 2>/dev/null | xargs -r "$PY" scripts/gpu_decisive.py "$out" --missing-wheels)
  if [ "${#wheels[@]}" -gt 0 ] && [ -n "${wheels[0]}" ]; then
    echo "gpu_check.sh: unpacking ${#wheels[@]} wheels the machine lacks: ${wheels[*]##*/}" | tee -a "$out/log.txt"
    # a wheel is a zip: unpacked where pip is missing (no pip on the machine is no reason to skip the tests)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$scratch/site" "${wheels[@]}" \
      2>/dev/null || "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
      "$scratch/site" "${wheels[@]}"
    export PYTHONPATH="$PYTHONPATH:$scratch/site"
  fi
  if missing=$("$PY" -c "import pytest, pydantic, yaml, platformdirs, scipy, psutil" 2>&1); then
    # only the files that hold gpu-marked tests: collecting the whole suite would import what this machine lacks
    mapfile -t gpu_tests < <(grep -l "mark.gpu" tests/test_*.py)
    timeout -k 5 "$tests" "$PY" -m pytest -q -m gpu "${gpu_tests[@]}" -p no:cacheprovider 2>&1 | tail -c 32768 \
      > "$out/gpu-tests.txt"
    trc=${PIPESTATUS[0]}
    "$PY" scripts/gpu_decisive.py "$out" --record-tests "$out/gpu-tests.txt" "$trc"
  else
    "$PY" scripts/gpu_decisive.py "$out" --tests-not-run \
      "$(echo "$missing" | tail -1) (bash scripts/gpu_wheelhouse.sh here, then carry .whl)"
  fi
fi
tail -c 65536 "$out/log.txt" > "$scratch/log.txt" && cat "$scratch/log.txt" > "$out/log.txt"
files=$(find "$out" -type f | wc -l)
bytes=$(du -sb "$out" | cut -f1)
echo "gpu_check.sh: $files files, $bytes bytes in $out (limit: 8 files, two folders deep)"
"$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('verdict:', d.get('verdict'))" "$out/summary.json"
