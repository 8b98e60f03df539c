"""How the compiler scales with the model: each model compiled end to end with the passes of the main job
(encoders: recipes/minilm-cpu.yaml) or of recipes/llama-cpu.yaml (decoders), and a table of parameters, peak
resident memory (the compile process and its stage workers together, sampled every 0.25 s), disk (the run folder,
hard links counted once), wall time, and the best stage, with the goals of issue 43 beside them: peak RSS at most
3x the FP32 weights, disk at most (stages that change weights + 1) x the weights.

    python scripts/scale.py --out /tmp/scale                     # every model (hours on 2 cores)
    python scripts/scale.py --out /tmp/scale --only qwen0.5b     # one row
    python scripts/scale.py --out /tmp/scale --markdown          # the table of the rows measured so far

Random weights at the real shapes (nothing is downloaded): speed and memory are the weights' shapes', not their
values'. MiniLM is the real model the main job compiles. Each row's recipe is written beside its run folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from optimizer.engine.memory_plan import WRITES_WEIGHTS

ROOT = Path(__file__).resolve().parent.parent

ENCODERS = {
    "bert-base": {"num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 3072,
                  "num_attention_heads": 12, "vocab_size": 30522},
    "bert-large": {"num_hidden_layers": 24, "hidden_size": 1024, "intermediate_size": 4096,
                   "num_attention_heads": 16, "vocab_size": 30522},
}
DECODERS = {
    "qwen0.5b": {"num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": False},
    "tinyllama1.1b": {"num_hidden_layers": 22, "hidden_size": 2048, "intermediate_size": 5632,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000},
}
ORDER = ["minilm", "bert-base", "bert-large", "qwen0.5b", "tinyllama1.1b"]
# Kept short at real sizes: one scenario each, few rounds (the figures here are memory, disk and time).
ENCODER_BENCH = {"warmup": 2, "rounds": 4, "iterations": 3}
DECODER_BENCH = {"warmup": 1, "rounds": 4, "iterations": 1}


def recipe_for(name: str) -> dict[str, Any]:
    if name == "minilm" or name in ENCODERS:
        data = yaml.safe_load((ROOT / "recipes" / "minilm-cpu.yaml").read_text())
        data["text"]["file"] = str(ROOT / "recipes" / data["text"]["file"])
        data["batch_sweep"] = None
        data["scenarios"] = [{"name": "b1-s128", "batch": 1, "seq": 128}]
        data["benchmark"] = ENCODER_BENCH
        if name in ENCODERS:
            data["name"] = name
            data["model"] = {"source": "hf_config", "architecture": "bert", "task": "feature-extraction",
                             "config": ENCODERS[name]}
            data.pop("text")
            vocab = ENCODERS[name]["vocab_size"]
            data["inputs"] = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, vocab]},
                              {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "range": [1, 2]},
                              {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 1]}]
            data["accuracy"] = {**data["accuracy"], "samples": 2}
        return data
    data = yaml.safe_load((ROOT / "recipes" / "llama-cpu.yaml").read_text())
    config = {**data["model"]["config"], **DECODERS[name]}
    data["name"] = name
    data["model"]["config"] = config
    data["inputs"] = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"],
                       "range": [0, config["vocab_size"]]}]
    data["scenarios"] = [{"name": "p128-n32", "batch": 1, "seq": 128, "new_tokens": 32}]
    data["benchmark"] = DECODER_BENCH
    return data


def _tree_rss_kb(root: int) -> int:
    """Resident memory of a process and all its descendants (kB), from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid = int(entry.name)
        children.setdefault(int(fields["PPid"].strip()), []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def du_bytes(folder: Path) -> int:
    """Bytes on disk under folder, each inode once (hard links shared between stages count once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def run_row(name: str, out: Path) -> dict[str, Any]:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for(name), sort_keys=False))
    run = folder / "run"
    cmd = [sys.executable, "-m", "optimizer", "compile", str(recipe), "--out", str(run), "--no-history"]
    start, peak = time.time(), 0
    with (folder / "compile.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            peak = max(peak, _tree_rss_kb(proc.pid))
            time.sleep(0.25)
    wall = time.time() - start
    report = json.loads((run / "report.json").read_text()) if (run / "report.json").is_file() else {}
    stages = report.get("stages", [])
    source = stages[0]["artifact"] if stages and stages[0].get("artifact") else {}
    weights = source.get("param_bytes") or 0
    changed = sum(1 for s in stages if s["status"] == "ran" and s["type"] in WRITES_WEIGHTS)
    row = {
        "model": name, "params_m": round(weights / 4 / 1e6, 1), "fp32_gb": round(weights / 1e9, 2),
        "peak_rss_gb": round(peak / 1e6, 2), "rss_x_weights": round(peak * 1e3 / weights, 2) if weights else None,
        "disk_gb": round(du_bytes(run) / 1e9, 2), "disk_goal_gb": round((changed + 1) * weights / 1e9, 2),
        "wall_s": round(wall), "exit": proc.returncode, "outcome": report.get("outcome"),
        "best": (report.get("best") or {}).get("stage"),
        "stages": {s["name"]: s["status"] for s in stages},
        "not_ok": {s["name"]: s.get("reason") for s in stages if s["status"] in ("failed", "skipped")},
        # each stage's worker peak (its pass and measuring): which stage sets the run's peak
        "stage_peak_gb": {s["name"]: round(s["metrics"]["worker_peak_mb"] / 1e3, 2) for s in stages
                          if (s.get("metrics") or {}).get("worker_peak_mb") is not None},
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
    }
    (folder / "row.json").write_text(json.dumps(row, indent=1))
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | params | FP32 weights | peak RSS (x weights) | disk (goal) | wall | best stage | outcome |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params_m']}M | {r['fp32_gb']} GB | {r['peak_rss_gb']} GB "
                     f"({r['rss_x_weights']}x) | {r['disk_gb']} GB ({r['disk_goal_gb']}) | "
                     f"{r['wall_s'] / 60:.1f} min | {r['best']} | {r['outcome']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", action="append", choices=ORDER)
    ap.add_argument("--markdown", action="store_true", help="print the table of the rows measured so far")
    args = ap.parse_args()
    if not args.markdown:
        for name in args.only or ORDER:
            row = run_row(name, args.out)
            print(json.dumps(row), flush=True)
    rows = [json.loads((args.out / n / "row.json").read_text()) for n in ORDER if (args.out / n / "row.json").is_file()]
    print(markdown(rows))


if __name__ == "__main__":
    main()
