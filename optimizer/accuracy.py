"""Accuracy of a stage: its outputs against stage 0's on the same inputs.

Per output, over all samples of all scenarios:
  cosine   the lowest cosine similarity of a sample's flattened output with the reference's (float64);
  max_abs  the largest absolute difference;
  max_rel  max_abs divided by the largest reference magnitude (element-wise relative error explodes on
           values near zero, which says nothing about the model);
  top1     for outputs named like logits: the share of positions whose argmax over the last axis agrees;
  pooled_cosine  for [batch, seq, hidden] outputs when the inputs have an attention mask: the lowest cosine of
           the mask-weighted mean over the sequence (a sentence embedding), per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimizer.recipe import AccuracyBudget


@dataclass
class OutputAccuracy:
    cosine: float = 1.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    top1: float | None = None
    pooled_cosine: float | None = None
    _top1_hits: int = field(default=0, repr=False)
    _top1_total: int = field(default=0, repr=False)

    def add(self, ref: np.ndarray, got: np.ndarray, logits: bool, mask: np.ndarray | None = None) -> None:
        if ref.shape != got.shape:
            raise ValueError(f"shape {got.shape} differs from the reference's {ref.shape}")
        r = ref.astype(np.float64).ravel()
        g = got.astype(np.float64).ravel()
        # NaN/inf where the reference has them too is agreement (sqrt of a negative input, say); elsewhere not.
        r_bad, g_bad = ~np.isfinite(r), ~np.isfinite(g)
        if r_bad.any() or g_bad.any():
            same = np.array_equal(r_bad, g_bad) and np.array_equal(r[r_bad], g[g_bad], equal_nan=True)
            if not same:
                self.cosine, self.max_abs, self.max_rel = 0.0, float("inf"), float("inf")
                return
            r, g = r[~r_bad], g[~g_bad]
        denom = float(np.linalg.norm(r) * np.linalg.norm(g))
        cos = float(r @ g / denom) if denom > 0 else float(np.array_equal(r, g))
        diff = float(np.max(np.abs(r - g))) if r.size else 0.0
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        self.cosine = min(self.cosine, cos)
        self.max_abs = max(self.max_abs, diff)
        self.max_rel = max(self.max_rel, diff / scale if scale > 0 else diff)
        if logits and ref.ndim >= 1 and ref.shape[-1] > 1:
            self._top1_hits += int(np.sum(ref.argmax(-1) == got.argmax(-1)))
            self._top1_total += int(np.prod(ref.shape[:-1]))
            self.top1 = self._top1_hits / self._top1_total
        if mask is not None and ref.ndim == 3 and mask.shape == ref.shape[:2]:
            w = mask.astype(np.float64)[..., None]
            pr = (ref * w).sum(1) / np.maximum(w.sum(1), 1)
            pg = (got * w).sum(1) / np.maximum(w.sum(1), 1)
            cos_rows = (pr * pg).sum(1) / (np.linalg.norm(pr, axis=1) * np.linalg.norm(pg, axis=1) + 1e-30)
            self.pooled_cosine = min(self.pooled_cosine or 1.0, float(cos_rows.min()))

    def to_json(self) -> dict[str, Any]:
        d = {"cosine": self.cosine, "max_abs": self.max_abs, "max_rel": self.max_rel, "top1": self.top1}
        if self.pooled_cosine is not None:
            d["pooled_cosine"] = self.pooled_cosine
        return d


def is_logits(name: str) -> bool:
    return "logits" in name.lower()


class AccuracyMeter:
    """Accumulates per-output accuracy over many (reference, outputs) pairs."""

    def __init__(self, output_names: list[str]) -> None:
        self.names = output_names
        self.per_output = {n: OutputAccuracy() for n in output_names}

    def add(self, reference: list[np.ndarray], outputs: list[np.ndarray], mask: np.ndarray | None = None) -> None:
        if len(reference) != len(outputs):
            raise ValueError(f"{len(outputs)} outputs, the reference has {len(reference)}")
        for name, ref, got in zip(self.names, reference, outputs, strict=True):
            self.per_output[name].add(ref, got, is_logits(name), mask)

    def to_json(self) -> dict[str, Any]:
        return {n: a.to_json() for n, a in self.per_output.items()}


def budget_verdict(accuracy: dict[str, Any], budget: AccuracyBudget) -> tuple[bool, str]:
    """(within budget, the sentence that says why) for one stage's accuracy dict."""
    if not accuracy:
        return True, "no outputs to compare"
    name = budget.output or next(iter(accuracy))
    if name not in accuracy:
        return False, f"accuracy.output {name!r} is not an output (outputs: {', '.join(accuracy)})"
    value = accuracy[name].get(budget.metric)
    if value is None:
        return True, f"{budget.metric} not defined for {name}"
    if budget.min is not None and value < budget.min:
        return False, f"{name} {budget.metric} {value:.6g} < {budget.min}"
    if budget.max is not None and value > budget.max:
        return False, f"{name} {budget.metric} {value:.6g} > {budget.max}"
    return True, f"{name} {budget.metric} {value:.6g}"


def mask_of(feed: dict[str, np.ndarray]) -> np.ndarray | None:
    """The attention mask among a feed's inputs, if any (used for the pooled-embedding cosine)."""
    name = next((n for n in feed if n == "attention_mask"), None) or next((n for n in feed if "mask" in n), None)
    return feed[name] if name is not None and feed[name].ndim == 2 else None
