"""Our generation loop against Hugging Face Optimum's ORTModelForCausalLM: same architecture, same weights, same
prompts, interleaved in one process, the same thread count.

Runs in its own venv (optimum-onnx pins transformers below 4.58; the project's .venv has transformers 5):

    bash scripts/optimum_venv.sh
    .venv-optimum/bin/python scripts/compare_optimum.py runs/gpt2-cpu [--stage NAME] [--rounds 10] [--prompts 3]

Ours: a stage of a compiled generation run (default: the run's best), its prefill and decode ONNX files through
our greedy loop (optimizer.runtime.generation, sessions from optimizer.runtime.sessions with the stage's runtime
settings). Optimum: the same model, saved once with save_pretrained by the project's .venv (the run's recipe,
its seed: the weights the run exported), exported by Optimum (export=True, use_cache=True) and run with
generate(max_new_tokens, min_new_tokens, do_sample=False). Rounds alternate which side goes first, and each side
runs `--instances` loops (default 2) in turn, because two loads of one model differ in speed: the interval is
widened by that spread (optimizer.measure.stats.widened), as the harness does for stages. Printed per
side: task time (prompt + new tokens), time to first token, time per output token (P50s), and ours/Optimum with a
95% interval (bootstrap over rounds, optimizer.measure.stats); the tokens are checked identical (FP32 stages) or
their agreement given (quantized stages). The target: ours at most 0.6x Optimum's task time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # our package, without installing it in this venv (light deps only)
QUANTIZED_OPS = ("MatMulNBits", "MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "DynamicQuantizeMatMul")


def save_model(run: Path, out: Path) -> None:
    """In the project's .venv: the run's model (its recipe, its seed), saved with save_pretrained."""
    from optimizer.recipe.loading import parse_recipe
    from optimizer.runtime.models import load_module

    report = json.loads((run / "report.json").read_text())
    load_module(parse_recipe(report["recipe"], str(run / "report.json"))).save_pretrained(out)


def generation_stage_json(report: dict[str, Any], name: str | None) -> dict[str, Any]:
    name = name or (report.get("best") or {}).get("stage")
    if not name:
        raise SystemExit("report.json: no best stage; name one with --stage")
    stage = next((s for s in report["stages"] if s["name"] == name), None)
    if stage is None or not stage.get("artifact") or not stage["artifact"].get("decode"):
        raise SystemExit(f"report.json: stage {name!r} has no generation artifact (prefill + decode ONNX)")
    return stage


def quantized(stage: dict[str, Any]) -> bool:
    ops = ((stage.get("metrics") or {}).get("graph") or {}).get("op_types") or {}
    return stage["type"] == "quantize" or any(op.split(".")[-1] in QUANTIZED_OPS for op in ops)


def ours(run: Path, stage: dict[str, Any], threads: int) -> Any:
    from optimizer.runtime.generation import OrtGenerator
    from optimizer.runtime.sessions import ort_session

    art = stage["artifact"]
    prefill = Path(art["path"]) if Path(art["path"]).is_absolute() else run / stage["folder"] / Path(art["path"]).name
    paths = [prefill, prefill.parent / art["decode"]]
    sessions = [ort_session(p, dict(art.get("runtime") or {}), threads) for p in paths]
    return OrtGenerator(sessions[0], sessions[1], int(art["layers"]))


def optimum(model_dir: Path, threads: int) -> Any:
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads  # the same count as ours; everything else as Optimum sets it
    return ORTModelForCausalLM.from_pretrained(
        model_dir, export=True, use_cache=True, provider="CPUExecutionProvider", session_options=so
    )


class Clock:
    """A transformers streamer that stamps each put: the first is the prompt, each later one a new token."""

    def __init__(self) -> None:
        self.stamps: list[int] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter_ns())

    def end(self) -> None:
        pass


def run_optimum(model: Any, prompt: np.ndarray, new: int) -> dict[str, Any]:
    import torch

    ids = torch.from_numpy(prompt)
    clock = Clock()
    start = time.perf_counter_ns()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        streamer=clock,
    )
    e2e = (time.perf_counter_ns() - start) / 1e6
    tokens = clock.stamps[1:]  # [0]: the prompt, put before any token is made
    return {
        "tokens": out[:, prompt.shape[1] :].numpy(),
        "e2e": e2e,
        "ttft": (tokens[0] - start) / 1e6,
        "tpot": list(np.diff(tokens) / 1e6),
    }


def run_ours(gen: Any, prompt: np.ndarray, new: int) -> dict[str, Any]:
    g = gen.generate(prompt, new, keep_logits=False)
    return {"tokens": g.tokens, "e2e": g.e2e_ms, "ttft": g.ttft_ms, "tpot": list(g.tpot_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a compiled generation run folder (report.json inside)")
    ap.add_argument("--stage", help="default: the run's best stage")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per round (random ids, fixed seed)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, help="default: the run's target.threads")
    ap.add_argument("--instances", type=int, default=2, help="loops a side, taken in turn by pairs of rounds: "
                    "two loads of one model differ in speed, and the interval is widened by that spread")
    ap.add_argument("--save-model", type=Path, help=argparse.SUPPRESS)  # internal: run in the project's .venv
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the project's venv python")
    args = ap.parse_args()
    if args.save_model:
        save_model(args.run, args.save_model)
        return

    from optimizer.measure.harness import instance_for
    from optimizer.measure.stats import instance_variance, speedup, speedup_with_spread

    report = json.loads((args.run / "report.json").read_text())
    stage = generation_stage_json(report, args.stage)
    threads = args.threads or int(report["recipe"].get("target", {}).get("threads") or 2)
    vocab = int(report["recipe"]["model"]["config"].get("vocab_size", 8000))
    with tempfile.TemporaryDirectory(prefix="optimum-cmp-") as tmp:
        model_dir = Path(tmp) / "model"
        cmd = [args.python, __file__, str(args.run), "--save-model", str(model_dir)]
        subprocess.run(cmd, check=True)
        k = max(1, args.instances) if args.rounds >= 4 else 1
        sides = {
            "ours": [ours(args.run, stage, threads) for _ in range(k)],
            "optimum": [optimum(model_dir, threads) for _ in range(k)],
        }
        run = {"ours": run_ours, "optimum": run_optimum}
        prompts = [np.random.default_rng(i).integers(1, vocab, (1, args.prompt_len)) for i in range(args.prompts)]
        for name, gens in sides.items():  # warm-up: first-call allocations, ORT's lazy initialization
            for gen in gens:
                run[name](gen, prompts[0], args.new)
        rounds: dict[str, dict[str, list[list[float]]]] = {s: {"e2e": [], "ttft": [], "tpot": []} for s in sides}
        used: dict[str, list[int]] = {s: [] for s in sides}  # the instance each side ran in each round
        tokens: dict[str, list[np.ndarray]] = {s: [] for s in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]  # alternate who goes first
            pick = {"ours": instance_for(r, False, k, k), "optimum": instance_for(r, True, k, k)}
            got: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
            for prompt in prompts:
                for name in order:
                    got[name].append(run[name](sides[name][pick[name]], prompt, args.new))
            for name in sides:
                used[name].append(pick[name])
            for name, results in got.items():
                rounds[name]["e2e"].append([x["e2e"] for x in results])
                rounds[name]["ttft"].append([x["ttft"] for x in results])
                rounds[name]["tpot"].append([t for x in results for t in x["tpot"]])
                if r == 0:
                    tokens[name] = [x["tokens"] for x in results]
    same = [np.array_equal(a, b) for a, b in zip(tokens["ours"], tokens["optimum"], strict=True)]
    agree = float(np.mean([np.mean(a == b) for a, b in zip(tokens["ours"], tokens["optimum"], strict=True)]))
    print(
        f"stage {stage['name']} ({'quantized' if quantized(stage) else 'FP32'}) of {args.run}; {threads} threads; "
        f"{args.prompts} prompts x {args.rounds} rounds; prompt {args.prompt_len} + {args.new} new tokens; "
        f"{k} loop(s) a side"
    )
    print(f"{'metric':<22}{'ours p50 ms':>12}{'optimum p50 ms':>16}{'ours/optimum':>14}  95% interval")
    result: dict[str, Any] = {"stage": stage["name"], "threads": threads, "rounds": args.rounds}
    for metric, label in (("e2e", "task time"), ("ttft", "time to first token"), ("tpot", "time per output token")):
        a, b = rounds["ours"][metric], rounds["optimum"][metric]
        s = speedup(a, b)  # parent/child medians: here ours/optimum
        # widened by the spread between the loops of one side, as the harness widens a stage's ratio
        widened = speedup_with_spread({"ours": a, "optimum": b}, used, "ours", "optimum")
        low, high = widened.low, widened.high
        spread = instance_variance(a, b, used["ours"], used["optimum"])
        spread_sd = float(np.sqrt(max(spread.variance, 0.0))) if spread is not None else 0.0
        pa, pb = float(np.median(np.concatenate(a))), float(np.median(np.concatenate(b)))
        print(f"{label:<22}{pa:>12.2f}{pb:>16.2f}{s.ratio:>13.2f}x  [{low:.2f}, {high:.2f}]  "
              f"(in-run {s.low:.2f}-{s.high:.2f}; loops' spread sd {spread_sd:.1%})")
        result[metric] = {"ours_p50_ms": pa, "optimum_p50_ms": pb, "ratio": s.ratio, "low": low, "high": high,
                          "in_run_low": s.low, "in_run_high": s.high, "instance_sd": spread_sd}
    if quantized(stage):
        print(f"tokens: agreement {agree:.3f} with Optimum's FP32 model (a quantized stage)")
    else:
        print(
            f"tokens: {'identical' if all(same) else 'DIFFERENT'} on {sum(same)}/{len(same)} prompts "
            f"(agreement {agree:.3f})"
        )
    e2e = result["e2e"]
    target = e2e["high"] <= 0.6  # the whole interval: a point estimate under 0.6 is not enough
    print(f"target ours <= 0.6x Optimum's task time at 95% confidence: {'met' if target else 'not met'} "
          f"({e2e['ratio']:.2f}x, {e2e['low']:.2f}-{e2e['high']:.2f})")
    result.update(tokens_identical=all(same), token_agreement=agree, target_met=target)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
