"""Our decoder stages against ONNX Runtime GenAI's runtime on GenAI's own builds of the same weights, interleaved
in one process: the yardstick for decoders on the CPU.

    python scripts/compare_genai.py runs/llama-cpu [--fp32 STAGE] [--int4 STAGE] [--rounds 8] [--prompts 2]
        [--scenario 128+8 --scenario 128+64 --scenario 2048+32] [--work FOLDER]

GenAI's side: the run's model (its recipe, its seed: the weights the run built) saved with save_pretrained and
built by GenAI's model builder with its defaults for the CPU (fp32; int4: block 32, accuracy level 4), into
`--work` (default: <run>/genai-compare). GenAI runs each build twice over: with its default session options and
with intra_op_num_threads set to the run's threads; a short pilot picks the faster as the yardstick (both printed).
Its loop: Generator, append_tokens(prompt), then generate_next_token until `new` tokens, each token read back.

Before each timed generation: a `--settle-ms` pause and a short untimed generation on the same side, as the
harness settles a switch between stages (without it the side timed next pays for the last one's spinning pool).

Ours: two stages of the run (default: the fastest FP32 generation stage and the fastest quantized one by their
ratio to stage 0), each through our own loop (optimizer.runtime.runners.gen_runner) with the stage's session
settings. Every side runs `--instances` loops taken in turn by pairs of rounds, and rounds rotate who goes first;
ratios are ours / GenAI's median (task time: prompt + all new tokens, generator creation included on both
sides), with a 95% bootstrap interval widened by the loops' spread (optimizer.measure.stats), as compare_optimum.

Accuracy, in an untimed pass: FP32 tokens must be identical on both sides; each int4 side's token agreement with
the FP32 tokens, and its logits' cosine with the FP32 logits at every step before its first divergent token.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

QUANTIZED_OPS = ("MatMulNBits", "MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "DynamicQuantizeMatMul")
SCENARIOS = ("128+8", "128+64", "2048+32")


def quantized(stage: dict[str, Any]) -> bool:
    ops = ((stage.get("metrics") or {}).get("graph") or {}).get("op_types") or {}
    return any(op.split(".")[-1] in QUANTIZED_OPS for op in ops)


def pick(report: dict[str, Any], name: str | None, want_quantized: bool) -> dict[str, Any]:
    """The named stage, or the run's fastest ONNX generation stage of that kind (geometric mean vs stage 0)."""
    def generation(s: dict[str, Any]) -> bool:
        art = s.get("artifact") or {}
        return s.get("status") in ("ran", "cached") and art.get("kind") == "onnx" and bool(
            art.get("decode") or art.get("genai_files"))

    stages = [s for s in report["stages"] if generation(s)]
    if name:
        found = next((s for s in stages if s["name"] == name), None)
        if found is None:
            raise SystemExit(f"report.json: no generation ONNX stage named {name!r}")
        return found
    kind = [s for s in stages if quantized(s) == want_quantized and s.get("vs_source")]
    if not kind:
        raise SystemExit(f"report.json: no {'quantized' if want_quantized else 'FP32'} generation stage; name one")
    return max(kind, key=lambda s: float(np.exp(np.mean(np.log(list(s["vs_source"].values()))))))


def artifact_of(run: Path, stage: dict[str, Any]) -> Any:
    """The stage's artifact, its files read from the stage folder inside `run` (wherever the run now is)."""
    from optimizer.core.artifact import Artifact

    art = Artifact.from_json(stage["artifact"])
    return art.derive(path=run / stage["folder"] / Path(str(art.path)).name)


def genai_builds(recipe: Any, work: Path) -> dict[str, Path]:
    """GenAI's fp32 and int4 builds of the run's weights, with the builder's CPU defaults (kept in `work`)."""
    from optimizer.runtime.genai_builder import run_builder, write_source_folder
    from optimizer.runtime.models import load_module

    out = {"fp32": work / "genai-fp32", "int4": work / "genai-int4"}
    if all((p / "genai_config.json").exists() for p in out.values()):
        return out
    source = work / "hf_source"
    shutil.rmtree(source, ignore_errors=True)
    write_source_folder(load_module(recipe), source)
    for precision, folder in out.items():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"building GenAI's {precision} model in {folder}", flush=True)
        run_builder(source, folder, precision, {}, work)
    shutil.rmtree(source, ignore_errors=True)
    return out


def threaded_copy(folder: Path, threads: int) -> Path:
    """The same build with intra_op_num_threads set (GenAI's config key), beside it: the weights linked, not copied."""
    copy = folder.with_name(folder.name + f"-t{threads}")
    copy.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.name != "genai_config.json" and not (copy / f.name).exists():
            (copy / f.name).symlink_to(f.resolve())
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    (copy / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return copy


class GenaiSide:
    """GenAI's own loop over one of its builds."""

    def __init__(self, folder: Path) -> None:
        import onnxruntime_genai as og

        self.model = og.Model(str(folder))

    def generate(self, prompt: np.ndarray, new: int, keep_logits: bool = False) -> dict[str, Any]:
        from optimizer.runtime.genai_runtime import genai_generate

        g = genai_generate(self.model, prompt, new, keep_logits)
        return {"tokens": g.tokens, "e2e": g.e2e_ms, "ttft": g.ttft_ms, "tpot": g.tpot_ms, "logits": g.logits}


class OurSide:
    def __init__(self, artifact: Any, recipe: Any) -> None:
        from optimizer.runtime.runners.gen_runner import generator_for

        self.gen = generator_for(artifact, recipe)

    def generate(self, prompt: np.ndarray, new: int, keep_logits: bool = False) -> dict[str, Any]:
        g = self.gen.generate(prompt.astype(np.int64), new, keep_logits=keep_logits)
        return {"tokens": g.tokens[0], "e2e": g.e2e_ms, "ttft": g.ttft_ms, "tpot": list(g.tpot_ms),
                "logits": [x.reshape(-1) for x in g.step_logits]}


def cosine_before_divergence(ref: dict[str, Any], got: dict[str, Any]) -> tuple[float, int]:
    """(lowest logits cosine over the steps before the first token that differs, that step count)."""
    same = int(np.argmax(ref["tokens"] != got["tokens"])) if np.any(ref["tokens"] != got["tokens"]) else len(
        ref["tokens"])
    steps = max(same, 1)  # the first step's logits come from the same prompt on both sides
    cos = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
           for a, b in zip(ref["logits"][:steps], got["logits"][:steps], strict=False)]
    return (min(cos) if cos else float("nan")), steps


def pilot(folder: Path, threads: int, prompt: np.ndarray, new: int) -> tuple[Path, dict[str, float]]:
    """GenAI's default session options against intra_op_num_threads = threads: the faster is the yardstick."""
    times: dict[str, float] = {}
    options = {"default": folder, f"{threads} threads": threaded_copy(folder, threads)}
    sides = {k: GenaiSide(p) for k, p in options.items()}
    for _ in range(2):
        for side in sides.values():
            side.generate(prompt, new)
    for label, side in sides.items():
        times[label] = float(np.median([side.generate(prompt, new)["e2e"] for _ in range(5)]))
    best = min(times, key=lambda k: times[k])
    return options[best], times


def interval(a: list[list[float]], b: list[list[float]], ua: list[int], ub: list[int]) -> tuple[float, ...]:
    """ours/GenAI median with its 95% interval, widened by the spread between loops of one side (as the harness
    widens a stage's ratio: optimizer.measure.stats.speedup_with_spread)."""
    from optimizer.measure.stats import speedup_with_spread

    s = speedup_with_spread({"ours": a, "genai": b}, {"ours": ua, "genai": ub}, "ours", "genai")
    return s.ratio, s.low, s.high


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a compiled generation run folder (report.json inside)")
    ap.add_argument("--fp32", help="our FP32 stage (default: the run's fastest FP32 generation stage)")
    ap.add_argument("--int4", help="our quantized stage (default: the run's fastest quantized one)")
    ap.add_argument("--scenario", action="append", help=f"PROMPT+NEW (default: {', '.join(SCENARIOS)})")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per round (random ids, fixed seeds)")
    ap.add_argument("--instances", type=int, default=2, help="loops a side, taken in turn by pairs of rounds")
    ap.add_argument("--settle-ms", type=float, default=50.0, help="pause before each timed generation")
    ap.add_argument("--work", type=Path, help="where GenAI's builds go (default: <run>/genai-compare)")
    args = ap.parse_args()

    from optimizer.measure.harness import instance_for
    from optimizer.recipe.loading import parse_recipe

    report = json.loads((args.run / "report.json").read_text())
    recipe = parse_recipe(report["recipe"], str(args.run / "report.json"))
    threads = int(recipe.target.threads or 2)
    vocab = int(recipe.model.config.get("vocab_size", 8000)) if hasattr(recipe.model, "config") else 8000
    stages = {"fp32": pick(report, args.fp32, False), "int4": pick(report, args.int4, True)}
    work = args.work or args.run / "genai-compare"
    work.mkdir(parents=True, exist_ok=True)
    builds = genai_builds(recipe, work)
    k = max(1, args.instances)
    scenarios = [tuple(int(x) for x in s.split("+")) for s in (args.scenario or SCENARIOS)]
    seq0, new0 = scenarios[0]
    probe = np.random.default_rng(99).integers(1, vocab, (1, seq0))
    yard: dict[str, Path] = {}
    print(f"run {args.run}; {threads} threads; ours: fp32 = {stages['fp32']['name']}, int4 = {stages['int4']['name']}")
    for precision, folder in builds.items():
        yard[precision], times = pilot(folder, threads, probe, new0)
        listed = ", ".join(f"{k_}: {v:.2f}" for k_, v in times.items())
        print(f"GenAI {precision} pilot ({seq0}+{new0} task ms): {listed} -> yardstick: {yard[precision].name}")
    sides: dict[str, list[Any]] = {}
    for precision in ("fp32", "int4"):
        sides[f"ours {precision}"] = [OurSide(artifact_of(args.run, stages[precision]), recipe) for _ in range(k)]
        sides[f"genai {precision}"] = [GenaiSide(yard[precision]) for _ in range(k)]
    names = list(sides)
    results: dict[str, Any] = {"threads": threads, "stages": {p: s["name"] for p, s in stages.items()}, "rows": []}
    print("\n| scenario | pair | ours task ms | GenAI task ms | ours/GenAI task (95%) | TTFT ours/GenAI | "
          "TPOT ms ours / GenAI | tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for seq, new in scenarios:
        prompts = [np.random.default_rng(i).integers(1, vocab, (1, seq)) for i in range(args.prompts)]
        # Accuracy first, untimed: tokens and logits per side, FP32 GenAI as the reference.
        acc = {n: [sides[n][0].generate(p, new, keep_logits=True) for p in prompts] for n in names}
        for gens in sides.values():  # warm-up at this length
            for g in gens:
                g.generate(prompts[0], new)
        timed: dict[str, dict[str, list[list[float]]]] = {n: {"e2e": [], "ttft": [], "tpot": []} for n in names}
        used: dict[str, list[int]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            got: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for p in prompts:
                for n in order:
                    i = instance_for(r, n.startswith("genai"), k, k)
                    # Settled as the harness settles a switch: the last side's pool threads stop spinning, then
                    # a short untimed generation brings this side's weights back into cache.
                    time.sleep(args.settle_ms / 1000)
                    sides[n][i].generate(p[:, :8], 2)
                    got[n].append(sides[n][i].generate(p, new))
            for n in names:
                used[n].append(instance_for(r, n.startswith("genai"), k, k))
                for m in ("e2e", "ttft", "tpot"):
                    timed[n][m].append([t for x in got[n] for t in (x[m] if m == "tpot" else [x[m]])])
        for precision in ("fp32", "int4"):
            o, g = f"ours {precision}", f"genai {precision}"
            ratio, low, high = interval(timed[o]["e2e"], timed[g]["e2e"], used[o], used[g])
            ttft, _, _ = interval(timed[o]["ttft"], timed[g]["ttft"], used[o], used[g])
            p50 = {n: float(np.median(np.concatenate(timed[n]["e2e"]))) for n in (o, g)}
            tpot = {n: float(np.median(np.concatenate(timed[n]["tpot"]))) for n in (o, g)}
            ref = acc["genai fp32"]
            if precision == "fp32":
                same = sum(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(acc[o], ref, strict=True))
                tokens = f"{'identical' if same == len(prompts) else 'DIFFERENT'} ({same}/{len(prompts)} prompts)"
                extra: dict[str, Any] = {"identical_prompts": same}
            else:
                extra = {}
                parts = []
                for n in (o, g):
                    agree = float(np.mean([np.mean(a["tokens"] == b["tokens"]) for a, b in zip(acc[n], ref,
                                                                                              strict=True)]))
                    cos = [cosine_before_divergence(b, a) for a, b in zip(acc[n], ref, strict=True)]
                    worst = min(c for c, _ in cos)
                    parts.append(f"{n.split()[0]} {agree:.2f} (cos {worst:.4f} over {min(s for _, s in cos)} steps)")
                    extra[n] = {"token_agreement": agree, "cosine_before_divergence": worst}
                tokens = "agreement with fp32: " + "; ".join(parts)
            print(f"| {seq}+{new} | {precision}: {stages[precision]['name']} vs GenAI | {p50[o]:.2f} | {p50[g]:.2f} | "
                  f"{ratio:.2f}x ({low:.2f}-{high:.2f}) | {ttft:.2f}x | {tpot[o]:.3f} / {tpot[g]:.3f} | {tokens} |",
                  flush=True)
            results["rows"].append({"scenario": f"{seq}+{new}", "precision": precision, "ours_ms": p50[o],
                                    "genai_ms": p50[g], "ratio": ratio, "low": low, "high": high, "ttft_ratio": ttft,
                                    "tpot_ours_ms": tpot[o], "tpot_genai_ms": tpot[g], **extra})
    met = all(r["high"] <= 1.0 for r in results["rows"])
    print(f"\ntarget ours <= 1.0x GenAI's task time (interval's upper end) in every row: {'met' if met else 'not met'}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
