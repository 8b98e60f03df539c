"""Diff two runs pass by pass: stages aligned by name, latency both sides, ratio, noise, accuracy change.

Across runs there is no interleaving to lean on, so "beyond noise" comes from each side's own timing samples:
a bootstrap of median(A) / median(B), resampling each side independently; the change is real when the 95%
interval excludes 1.0. Runs recorded before samples were kept fall back to the standard error of the median
(1.2533 * std / sqrt(n)) on each side.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _verdict(a: dict[str, Any], b: dict[str, Any], seed: int = 0) -> tuple[float, float, str]:
    """(low, high) of the A/B ratio's 95% interval, and whether B is faster, slower or within noise."""
    sa, sb = a.get("samples_ms"), b.get("samples_ms")
    if sa and sb:
        rng = np.random.default_rng(seed)
        xa, xb = np.asarray(sa), np.asarray(sb)
        ra = np.median(xa[rng.integers(0, len(xa), (1000, len(xa)))], axis=1)
        rb = np.median(xb[rng.integers(0, len(xb), (1000, len(xb)))], axis=1)
        low, high = (float(v) for v in np.quantile(ra / rb, [0.025, 0.975]))
    else:
        la, lb = a["latency"], b["latency"]
        se_a = 1.2533 * la["std_ms"] / math.sqrt(max(la["n"], 1))
        se_b = 1.2533 * lb["std_ms"] / math.sqrt(max(lb["n"], 1))
        ratio = la["p50_ms"] / lb["p50_ms"]
        rel = math.sqrt((se_a / la["p50_ms"]) ** 2 + (se_b / lb["p50_ms"]) ** 2)
        low, high = ratio * (1 - 1.96 * rel), ratio * (1 + 1.96 * rel)
    verdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"
    return low, high, verdict


def _stages(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in report["stages"]}


def diff_reports(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    sa, sb = _stages(a), _stages(b)
    names = [n for n in sb if n in sa]
    scenarios = [s["name"] for s in b["scenarios"] if s["name"] in {x["name"] for x in a["scenarios"]}]
    rows = []
    for scen in scenarios:
        for name in names:
            ma, mb = (sa[name].get("metrics") or {}), (sb[name].get("metrics") or {})
            ea, eb = (ma.get("scenarios") or {}).get(scen), (mb.get("scenarios") or {}).get(scen)
            row: dict[str, Any] = {
                "scenario": scen,
                "stage": name,
                "type": sb[name]["type"],
                "status_a": sa[name]["status"],
                "status_b": sb[name]["status"],
            }
            if ea and eb:
                low, high, verdict = _verdict(ea, eb)
                row.update(
                    p50_a=ea["latency"]["p50_ms"],
                    p50_b=eb["latency"]["p50_ms"],
                    ratio=ea["latency"]["p50_ms"] / eb["latency"]["p50_ms"],
                    low=low,
                    high=high,
                    verdict=verdict,
                    vs_parent_a=(ea.get("vs_parent") or {}).get("ratio"),
                    vs_parent_b=(eb.get("vs_parent") or {}).get("ratio"),
                )
                row.update(cosine_a=_accuracy(ma), cosine_b=_accuracy(mb))
            rows.append(row)
    final = next(
        (n for n in reversed(names) if sa[n]["status"] in ("ran", "cached") and sb[n]["status"] in ("ran", "cached")),
        None,
    )
    totals = [r for r in rows if r["stage"] == final and "ratio" in r]
    return {
        "a": {"run_dir": a.get("run_dir"), "created": a.get("created"), "recipe": a["recipe"]["name"]},
        "b": {"run_dir": b.get("run_dir"), "created": b.get("created"), "recipe": b["recipe"]["name"]},
        "only_in_a": [n for n in sa if n not in sb],
        "only_in_b": [n for n in sb if n not in sa],
        "rows": rows,
        "final_stage": final,
        "totals": totals,
    }


def regressions(d: dict[str, Any], pct: float) -> list[str]:
    """Stages (and the final one) where B is slower than A by more than pct percent, beyond noise."""
    out = []
    for r in d["rows"]:
        if r.get("verdict") == "slower" and (1 / r["ratio"] - 1) * 100 > pct:
            out.append(
                f"{r['stage']} on {r['scenario']}: {100 * (1 / r['ratio'] - 1):.1f}% slower "
                f"({r['p50_a']:.2f} -> {r['p50_b']:.2f} ms)"
            )
    return out


def _cell(r: dict[str, Any]) -> dict[str, str]:
    if "ratio" not in r:
        return {
            "scenario": r["scenario"],
            "stage": r["stage"],
            "A ms": "-",
            "B ms": "-",
            "A/B": "-",
            "verdict": f"{r['status_a']} / {r['status_b']}",
            "vs parent A -> B": "-",
            "accuracy A -> B": "-",
        }
    vp = (
        "-"
        if r["vs_parent_a"] is None or r["vs_parent_b"] is None
        else f"{r['vs_parent_a']:.2f}x -> {r['vs_parent_b']:.2f}x"
    )
    cos = "-" if r["cosine_a"] is None or r["cosine_b"] is None else f"{r['cosine_a']:.5f} -> {r['cosine_b']:.5f}"
    word = {"faster": "B faster", "slower": "B SLOWER", "within noise": "within noise"}[r["verdict"]]
    return {
        "scenario": r["scenario"],
        "stage": r["stage"],
        "A ms": f"{r['p50_a']:.2f}",
        "B ms": f"{r['p50_b']:.2f}",
        "A/B": f"{r['ratio']:.2f}x",
        "verdict": f"{word} ({r['low']:.2f}-{r['high']:.2f})",
        "vs parent A -> B": vp,
        "accuracy A -> B": cos,
    }


def _accuracy(metrics: dict[str, Any]) -> float | None:
    """The accuracy figure a reader compares: greedy token agreement for generation (the logits cosine before
    the first divergence can stay high while the tokens differ), the cosine otherwise."""
    first = next(iter((metrics.get("accuracy") or {}).values()), {})
    return first.get("token_agreement", first.get("cosine"))


def to_markdown(d: dict[str, Any]) -> str:
    cols = ["scenario", "stage", "A ms", "B ms", "A/B", "verdict", "vs parent A -> B", "accuracy A -> B"]
    lines = [
        f"**A**: `{d['a']['run_dir']}` ({d['a']['created']}) vs **B**: `{d['b']['run_dir']}` ({d['b']['created']})",
        "",
        "P50 latency; A/B > 1 means B is faster; the interval is a 95% bootstrap of the ratio.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in d["rows"]:
        c = _cell(r)
        lines.append("| " + " | ".join(c[k] for k in cols) + " |")
    if d["totals"]:
        lines += [
            "",
            f"**Final stage `{d['final_stage']}`**: "
            + "; ".join(
                f"{r['scenario']} {r['p50_a']:.2f} -> {r['p50_b']:.2f} ms ({r['ratio']:.2f}x, {r['verdict']})"
                for r in d["totals"]
            ),
        ]
    for key, label in (("only_in_a", "only in A"), ("only_in_b", "only in B")):
        if d[key]:
            lines.append(f"\nStages {label}: {', '.join(d[key])}")
    return "\n".join(lines)


def table_rows(d: dict[str, Any]) -> list[dict[str, str]]:
    return [_cell(r) for r in d["rows"]]
