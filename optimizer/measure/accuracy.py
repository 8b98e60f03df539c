"""Accuracy of a stage: its outputs against stage 0's on the same inputs. The one implementation: the harness,
the budget, the hybrid search and every pass that checks numerics (export, fuse, bundles) compare through it.

Which positions count: when the inputs carry a 2-D attention mask and an output's leading dims match it
([batch, seq, ...]), only the positions the mask keeps are compared. Padded positions are not served: mean
pooling weighs them by the mask, token tasks ignore them, so an error there says nothing about the model (the
issue that started this: MiniLM's int8_dynamic scored 0.86 over all positions and ~0.99 on its real tokens).
The all-positions cosine stays as a detail (`cosine_all_positions`), never as the verdict.

Per output, over all samples of all scenarios (a "sample" is one batch row when a mask applies, else one call):
  cosine         the lowest per-sample cosine similarity on kept positions (float64); `cosine_mean` its mean;
  max_abs        the largest absolute difference on kept positions;
  max_rel        max_abs divided by the largest reference magnitude (element-wise relative error explodes on
                 values near zero, which says nothing about the model);
  top1           for outputs named like logits: the share of kept positions whose argmax over the last axis agrees;
  pooled_cosine  for [batch, seq, hidden] outputs with a mask: the lowest cosine of the mask-weighted mean over the
                 sequence (a sentence embedding), per row; `pooled_cosine_mean` its mean;
  nonfinite      elements that are NaN/inf where the reference's are finite: any fails the budget.

The worst of n samples is an unstable figure (two sets of 40 sentences gave 0.9912 and 0.98999), so cosine and
pooled_cosine also carry `<metric>_bound`: a 90% interval of the 1/(n+1) quantile (where the worst of another n
samples typically falls; measure.stats.low_quantile_bound). A stage whose interval straddles the budget is "at the
edge, not resolved" (Verdict.edge): within or not by its worst sample, but not known to be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from optimizer.core.errors import OptimizerError
from optimizer.core.metrics import OutputAccuracy
from optimizer.core.pass_base import GenerationAgreement
from optimizer.measure.stats import low_quantile_bound
from optimizer.recipe.schema import AccuracyBudget, Recipe, budget_metric
from optimizer.runtime.generation import Generation


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / denom) if denom > 0 else float(np.array_equal(a, b))


def _rows(ref: np.ndarray, got: np.ndarray, mask: np.ndarray | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(reference, output) flattened per sample: one pair per batch row on its kept positions when the mask
    applies to this output, else the whole output as one pair."""
    if mask is not None and ref.ndim >= 2 and mask.ndim == 2 and ref.shape[:2] == mask.shape:
        keep = mask.astype(bool)
        return [(ref[i][keep[i]].ravel(), got[i][keep[i]].ravel()) for i in range(ref.shape[0])]
    return [(ref.ravel(), got.ravel())]


@dataclass
class OutputMeter:
    """One output's accuracy accumulated over many calls; `to_json` gives the report's OutputAccuracy fields
    (core.metrics.OutputAccuracy), computed from what was added."""

    cosine: float = 1.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    top1: float | None = None
    pooled_cosine: float | None = None
    masked: bool = False
    nonfinite: int = 0
    _cosines: list[float] = field(default_factory=list, repr=False)
    _all_positions: float = field(default=1.0, repr=False)
    _pooled: list[float] = field(default_factory=list, repr=False)
    _top1_hits: int = field(default=0, repr=False)
    _top1_total: int = field(default=0, repr=False)

    def add(self, ref: np.ndarray, got: np.ndarray, logits: bool, mask: np.ndarray | None = None) -> None:
        if ref.shape != got.shape:
            raise OptimizerError(f"an output of shape {got.shape} differs from the reference's {ref.shape}")
        ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
        # Counted over every position: a NaN at a padded position still poisons a masked mean (NaN * 0 = NaN).
        self.nonfinite += int(np.sum(~np.isfinite(got64) & np.isfinite(ref64)))
        rows = _rows(ref64, got64, mask)
        self.masked = self.masked or len(rows) > 1 or (mask is not None and rows[0][0].size != ref.size)
        for r, g in rows:
            self._add_row(r, g)
        self._all_positions = min(self._all_positions, _finite_cos(ref64.ravel(), got64.ravel()))
        if logits and ref.ndim >= 1 and ref.shape[-1] > 1:
            agree = ref.argmax(-1) == got.argmax(-1)
            if mask is not None and agree.shape == mask.shape:
                agree = agree[mask.astype(bool)]
            self._top1_hits += int(np.sum(agree))
            self._top1_total += int(agree.size)
            self.top1 = self._top1_hits / max(self._top1_total, 1)
        if mask is not None and ref.ndim == 3 and mask.shape == ref.shape[:2]:
            w = mask.astype(np.float64)[..., None]
            pr = (ref64 * w).sum(1) / np.maximum(w.sum(1), 1)
            pg = (got64 * w).sum(1) / np.maximum(w.sum(1), 1)
            self._pooled += [_finite_cos(a, b) for a, b in zip(pr, pg, strict=True)]
            self.pooled_cosine = min(self._pooled)

    def _add_row(self, r: np.ndarray, g: np.ndarray) -> None:
        # NaN/inf where the reference has them too is agreement (sqrt of a negative input, say); elsewhere not.
        r_bad, g_bad = ~np.isfinite(r), ~np.isfinite(g)
        if r_bad.any() or g_bad.any():
            same = np.array_equal(r_bad, g_bad) and np.array_equal(r[r_bad], g[g_bad], equal_nan=True)
            if not same:
                self._cosines.append(0.0)
                self.cosine, self.max_abs, self.max_rel = 0.0, float("inf"), float("inf")
                return
            r, g = r[~r_bad], g[~g_bad]
        cos = _cos(r, g)
        self._cosines.append(cos)
        diff = float(np.max(np.abs(r - g))) if r.size else 0.0
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        self.cosine = min(self.cosine, cos)
        self.max_abs = max(self.max_abs, diff)
        self.max_rel = max(self.max_rel, diff / scale if scale > 0 else diff)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "cosine": self.cosine,
            **_bound("cosine", self._cosines),
            "cosine_mean": float(np.mean(self._cosines)) if self._cosines else 1.0,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "top1": self.top1,
            "positions": "kept by the attention mask" if self.masked else "all",
            "samples": len(self._cosines),
            "nonfinite": self.nonfinite,
        }
        if self.masked:
            d["cosine_all_positions"] = self._all_positions  # a detail: padded positions are not served
        if self.pooled_cosine is not None:
            d["pooled_cosine"] = self.pooled_cosine
            d["pooled_cosine_mean"] = float(np.mean(self._pooled))
            d |= _bound("pooled_cosine", self._pooled)
        return d


def _bound(metric: str, values: list[float]) -> dict[str, Any]:
    """`<metric>_bound`: [low, high, p] of the metric's p-quantile (p = 1/(n+1)), or nothing below 3 samples."""
    bound = low_quantile_bound(values)
    return {} if bound is None else {f"{metric}_bound": [round(bound[1], 8), round(bound[2], 8), round(bound[0], 6)]}


def _finite_cos(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if not ok.all() and not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return 0.0
    return _cos(a[ok], b[ok])


def is_logits(name: str) -> bool:
    return "logits" in name.lower()


class AccuracyMeter:
    """Accumulates per-output accuracy over many (reference, outputs) pairs."""

    def __init__(self, output_names: list[str]) -> None:
        self.names = output_names
        self.per_output = {n: OutputMeter() for n in output_names}

    def add(self, reference: list[np.ndarray], outputs: list[np.ndarray], mask: np.ndarray | None = None) -> None:
        if len(reference) != len(outputs):
            raise OptimizerError(f"{len(outputs)} outputs, the reference has {len(reference)}")
        for name, ref, got in zip(self.names, reference, outputs, strict=True):
            self.per_output[name].add(ref, got, is_logits(name), mask)

    def worst_cosine(self) -> float:
        return min((a.cosine for a in self.per_output.values()), default=1.0)

    def to_json(self) -> dict[str, Any]:
        return {n: a.to_json() for n, a in self.per_output.items()}

    def accuracy(self) -> dict[str, OutputAccuracy]:
        """Per output, typed (core.metrics.OutputAccuracy: the fields to_json writes)."""
        return {n: OutputAccuracy(**a.to_json()) for n, a in self.per_output.items()}


def compare(
    reference: list[np.ndarray], outputs: list[np.ndarray], names: list[str], mask: np.ndarray | None = None
) -> AccuracyMeter:
    """One comparison of a call's outputs with the reference's (a meter holding just that pair)."""
    meter = AccuracyMeter(names)
    meter.add(reference, outputs, mask)
    return meter


class Verdict(NamedTuple):
    """A stage's accuracy against the budget: within it by the point figure (the worst sample), the sentence that
    says why, and whether the figure's interval straddles the line (at the edge: not resolved either way)."""

    within: bool
    why: str
    edge: bool = False


def budget_verdict(
    accuracy: dict[str, Any], budget: AccuracyBudget, task: str | None = None, workload: str = "forward"
) -> Verdict:
    """The verdict on one stage's accuracy dict (measure.accuracy's JSON per output)."""
    if not accuracy:
        return Verdict(True, "no outputs to compare")
    name = budget.output or next(iter(accuracy))
    if name not in accuracy:
        return Verdict(False, f"accuracy.output {name!r} is not an output (outputs: {', '.join(accuracy)})")
    bad = {n: a.get("nonfinite", 0) for n, a in accuracy.items() if a.get("nonfinite")}
    if bad:
        where = ", ".join(f"{n}: {k}" for n, k in bad.items())
        return Verdict(False, f"NaN/inf where the reference is finite ({where} elements)")
    metric = budget_metric(budget, task, workload)
    value = accuracy[name].get(metric)
    where = " on kept positions" if accuracy[name].get("positions", "").startswith("kept") else ""
    if value is None:
        return Verdict(True, f"{metric} not defined for {name}")
    figure = f"{name} {metric}{where} {value:.6g}"
    if budget.min is not None and value < budget.min:
        within, why = False, f"{figure} < {budget.min}"
    elif budget.max is not None and value > budget.max:
        within, why = False, f"{figure} > {budget.max}"
    else:
        within, why = True, figure
    bound = accuracy[name].get(f"{metric}_bound")
    if bound is None or budget.min is None:
        return Verdict(within, why)
    low, high, p = bound
    edge = low < budget.min <= high
    side = "straddles" if edge else ("is above" if low >= budget.min else "is below")
    why += (f" (worst of {round(1 / p) - 1}); its {100 * p:.3g}% quantile "
            f"{low:.6g}-{high:.6g} (90%) {side} {budget.min}" + (": at the edge, not resolved" if edge else ""))
    return Verdict(within, why, edge)


def recipe_verdict(accuracy: dict[str, Any], recipe: Recipe) -> Verdict:
    """budget_verdict with the recipe's task and workload choosing the default metric."""
    return budget_verdict(accuracy, recipe.accuracy, getattr(recipe.model, "task", None), recipe.workload)


def mask_of(feed: dict[str, np.ndarray]) -> np.ndarray | None:
    """The attention mask among a feed's inputs, if any: the positions a consumer of the outputs keeps."""
    name = next((n for n in feed if n == "attention_mask"), None) or next((n for n in feed if "mask" in n), None)
    return feed[name] if name is not None and feed[name].ndim == 2 else None


def generation_agreement(reference: Generation, got: Generation) -> GenerationAgreement:
    """Greedy token agreement over the generated sequence, and the logits cosine step by step (the lowest, and
    the lowest before the first disagreement, after which the two runs see different contexts)."""
    same = reference.tokens == got.tokens
    first_diff = int(np.argmin(same.all(0))) if not same.all() else same.shape[1]
    cos = []
    for a, b in zip(reference.step_logits, got.step_logits, strict=True):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        num = (a64 * b64).sum(-1)
        den = np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1) + 1e-30
        cos.append(float((num / den).min()))
    return GenerationAgreement(
        token_agreement=float(same.mean()),
        first_disagreement=first_diff,
        logits_cosine_min=min(cos),
        logits_cosine_before_divergence=min(cos[: max(first_diff, 1)]),
    )
