"""Our decoder stages against llama.cpp on the same weights, interleaved in one process: the yardstick for LLM
decoding on the CPU (issue 44).

    bash scripts/setup_llamacpp.sh          # once: builds llama-cpp-python from source (minutes on 2 cores)
    python scripts/compare_llamacpp.py runs/qwen05b-cpu [--stage S ...] [--types Q4_0 Q8_0 Q4_K_M F16]
        [--scenario 128+8 --scenario 128+64 --scenario 1024+32] [--rounds 6] [--prompts 2] [--work FOLDER]

llama.cpp's side: the run's model (its recipe and seed: the weights the run built) written as an FP32 GGUF
(optimizer/runtime/gguf_writer.py, llama.cpp's tensor layout), then quantized by llama.cpp's own quantizer to each
type, into `--work` (default: <run>/llamacpp-compare). Each runs through llama-cpp-python's Llama (the run's
threads for prompt and generation, n_batch 2048 / n_ubatch 512 as llama-bench), greedy by argmax of the last
logits, exactly N new tokens, each token read back, as our loop does.

Ours: the named stages (default: the fastest FP32 generation stage and the fastest quantized one, as
compare_genai picks them), each through our own loop with the stage's session settings.

Rounds visit every side in a rotated order, each timed generation after a settle (a pause and a short untimed
generation on the same side); ratios are ours / llama.cpp type (task time, TTFT, TPOT) with 95% bootstrap
intervals (optimizer.measure.stats). Accuracy, untimed, against our FP32 export (the judge for every side):
token agreement over the new tokens and the logits' cosine before the first divergent token. The FP32 GGUF is
checked first against the FP32 export: identical tokens, or the comparison stops (the conversion would be wrong).
The roofline: the bytes of weights a decode step reads (each side's file), this machine's streaming read
bandwidth (one numpy pass over 1 GiB), and the TPOT that bound allows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from compare_genai import (  # noqa: E402  the same stage choice, loop and interval as the GenAI yardstick
    OurSide,
    artifact_of,
    cosine_before_divergence,
    interval,
    pick,
)

SCENARIOS = ("128+8", "128+64", "1024+32")
TYPES = ("Q4_0", "Q8_0", "Q4_K_M")


class LlamaCppSide:
    """llama.cpp through llama-cpp-python, token ids in, greedy by argmax, one eval a new token."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.path = path
        self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=2048,
                         n_ubatch=512, logits_all=False, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        """The last evaluated token's logits, read from llama.cpp's own buffer (llama-cpp-python 0.3 no longer
        copies them into Llama.scores unless logits_all, which would compute every prompt position's)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))

    def generate(self, prompt: np.ndarray, new: int, keep_logits: bool = False) -> dict[str, Any]:
        llm = self.llm
        start = time.perf_counter()
        llm.reset()
        llm.eval([int(t) for t in prompt.reshape(-1)])
        logits = self._last_logits()
        tokens, kept = [int(np.argmax(logits))], [np.array(logits, dtype=np.float32)] if keep_logits else []
        ttft = (time.perf_counter() - start) * 1000
        tpot = []
        for _ in range(new - 1):
            t0 = time.perf_counter()
            llm.eval([tokens[-1]])
            logits = self._last_logits()
            tokens.append(int(np.argmax(logits)))
            tpot.append((time.perf_counter() - t0) * 1000)
            if keep_logits:
                kept.append(np.array(logits, dtype=np.float32))
        e2e = (time.perf_counter() - start) * 1000
        return {"tokens": np.array(tokens), "e2e": e2e, "ttft": ttft, "tpot": tpot, "logits": kept}


def gguf_files(recipe: Any, work: Path, types: list[str], threads: int) -> dict[str, Path]:
    """The FP32 GGUF of the run's weights and llama.cpp's quantizations of it (kept in `work`)."""
    from optimizer.runtime.gguf_writer import quantize_gguf, write_llama_gguf
    from optimizer.runtime.models import load_module

    base = work / "model-f32.gguf"
    if not base.is_file():
        print(f"writing the run's weights as GGUF: {base}", flush=True)
        write_llama_gguf(load_module(recipe), base)
    out = {"F32": base}
    for kind in types:
        path = work / f"model-{kind.lower()}.gguf"
        if not path.is_file():
            print(f"llama.cpp quantizing to {kind}: {path}", flush=True)
            quantize_gguf(base, path, kind, threads)
        out[kind] = path
    return out


def bandwidth_gb_s(size: int = 1 << 30) -> float:
    """One core's streaming read, GB/s: the median of 5 sums over a 1 GiB array (the bound on a decode step)."""
    a = np.ones(size // 8, dtype=np.float64)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return size / float(np.median(times)) / 1e9


def weights_read(side: Any) -> int:
    """Bytes of weights a decode step reads: the GGUF file, or our stage's files (graphs are negligible)."""
    if isinstance(side, LlamaCppSide):
        return side.path.stat().st_size
    return sum(f.stat().st_size for f in side.artifact.files() if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a compiled generation run folder of a llama-architecture model")
    ap.add_argument("--stage", action="append", help="our stages (default: fastest FP32 and fastest quantized)")
    ap.add_argument("--reference", help="our FP32 stage every side is judged against (default: export)")
    ap.add_argument("--types", nargs="+", default=list(TYPES), help="llama.cpp quantization types")
    ap.add_argument("--scenario", action="append", help=f"PROMPT+NEW (default: {', '.join(SCENARIOS)})")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per round (random ids, fixed seeds)")
    ap.add_argument("--settle-ms", type=float, default=50.0)
    ap.add_argument("--work", type=Path, help="where the GGUF files go (default: <run>/llamacpp-compare)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    from optimizer.recipe.loading import parse_recipe

    report = json.loads((args.run / "report.json").read_text())
    recipe = parse_recipe(report["recipe"], str(args.run / "report.json"))
    threads = int(recipe.target.threads or 2)
    vocab = int(recipe.model.config.get("vocab_size", 8000))
    scenarios = [tuple(int(x) for x in s.split("+")) for s in (args.scenario or SCENARIOS)]
    n_ctx = max(s + n for s, n in scenarios) + 8
    ours = [pick(report, n, False) for n in args.stage] if args.stage else [pick(report, None, False),
                                                                             pick(report, None, True)]
    ref_stage = next(s for s in report["stages"] if s["name"] == (args.reference or "export"))
    work = args.work or args.run / "llamacpp-compare"
    work.mkdir(parents=True, exist_ok=True)
    files = gguf_files(recipe, work, args.types, threads)

    sides: dict[str, Any] = {}
    for s in ours:
        side = OurSide(artifact_of(args.run, s), recipe)
        side.artifact = artifact_of(args.run, s)
        sides[f"ours {s['name']}"] = side
    for kind, path in files.items():
        sides[f"llama.cpp {kind}"] = LlamaCppSide(path, threads, n_ctx)
    reference = OurSide(artifact_of(args.run, ref_stage), recipe)
    names = list(sides)
    gbs = bandwidth_gb_s()
    results: dict[str, Any] = {"threads": threads, "bandwidth_gb_s": gbs, "reference": ref_stage["name"],
                               "weights_bytes": {n: weights_read(s) for n, s in sides.items()}, "rows": []}
    print(f"run {args.run}; {threads} threads; streaming read {gbs:.1f} GB/s; judge: {ref_stage['name']}")
    for seq, new in scenarios:
        prompts = [np.random.default_rng(i).integers(3, vocab, (1, seq)) for i in range(args.prompts)]
        ref = [reference.generate(p, new, keep_logits=True) for p in prompts]
        acc: dict[str, dict[str, float]] = {}
        for n in names:
            got = [sides[n].generate(p, new, keep_logits=True) for p in prompts]
            agree = float(np.mean([np.mean(a["tokens"] == b["tokens"]) for a, b in zip(got, ref, strict=True)]))
            cos = min(cosine_before_divergence(b, a)[0] for a, b in zip(got, ref, strict=True))
            acc[n] = {"token_agreement": agree, "cosine_before_divergence": cos}
        if acc["llama.cpp F32"]["token_agreement"] < 1.0:
            raise SystemExit(f"llama.cpp's FP32 GGUF disagrees with {ref_stage['name']} ({acc['llama.cpp F32']}): "
                             "the conversion is wrong; nothing is compared")
        timed = {n: {"e2e": [], "ttft": [], "tpot": []} for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            got: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for p in prompts:
                for n in order:
                    time.sleep(args.settle_ms / 1000)
                    sides[n].generate(p[:, :8], 2)
                    got[n].append(sides[n].generate(p, new))
            for n in names:
                for m in ("e2e", "ttft"):
                    timed[n][m].append([x[m] for x in got[n]])
                timed[n]["tpot"].append([float(np.median(x["tpot"])) for x in got[n]])
        used = [0] * args.rounds
        print(f"\n{seq}+{new}: task ms, TTFT ms, TPOT ms (P50); agreement with {ref_stage['name']}")
        for n in names:
            p50 = {m: float(np.median(np.concatenate(timed[n][m]))) for m in ("e2e", "ttft", "tpot")}
            bound = results["weights_bytes"][n] / (gbs * 1e9) * 1000
            print(f"  {n:28s} {p50['e2e']:9.1f} {p50['ttft']:8.1f} {p50['tpot']:7.2f}   tokens "
                  f"{acc[n]['token_agreement']:.2f} cos {acc[n]['cosine_before_divergence']:.4f}   roofline TPOT "
                  f"{bound:.1f} ms ({bound / p50['tpot']:.0%} of it reached)")
            results["rows"].append({"scenario": f"{seq}+{new}", "side": n, **p50, **acc[n], "roofline_tpot": bound})
        print("  ours / llama.cpp (95%):")
        for o in (n for n in names if n.startswith("ours")):
            for t in (n for n in names if n.startswith("llama.cpp") and n != "llama.cpp F32"):
                parts = []
                for m in ("e2e", "ttft", "tpot"):
                    ratio, low, high = interval(timed[o][m], timed[t][m], used, used)
                    parts.append(f"{m} {ratio:.2f}x ({low:.2f}-{high:.2f})")
                    results["rows"].append({"scenario": f"{seq}+{new}", "ours": o, "theirs": t, "metric": m,
                                            "ratio": ratio, "low": low, "high": high})
                print(f"    {o} / {t}: " + ", ".join(parts), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
