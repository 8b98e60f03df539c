"""`fuse` on a generation artifact: the rules that handle KV-cache graphs, on the prefill and the decode graph.

Both graphs are rewritten by the same rules and saved over one shared weights file, as export wrote them. The
fused pair is then checked end to end against its input where it matters, in generation: greedy tokens and
logits on the recipe's first scenario's prompt, and logits on a left-padded batch through prefill and a few
decode steps (the attention mask reaches every fused attention). Any token that differs, or a logits cosine
below the config's min_cosine, fails the stage rather than passing a wrong graph on (the pipeline keeps what
ran before it).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from optimizer.core.errors import PassError
from optimizer.core.pass_base import PassResult
from passes.fuse.rule import RULES_BY_NAME, RuleReport

if TYPE_CHECKING:
    from optimizer.core.artifact import Artifact
    from optimizer.core.pass_base import PassContext

PADDED_STEPS = 3  # decode steps of the padded check after its prefill
NOT_FOR_GENERATION = "{name}: not applied to generation graphs yet (it needs a probe run, which has no KV-cache inputs)"


def fuse_generation(
    artifact: Artifact, ctx: PassContext, rules: list[str], min_cosine: float, target: str
) -> PassResult:
    import onnx_graphsurgeon as gs

    from optimizer.runtime import onnx_io
    from passes.fuse.apply import apply_rules, count_fused
    from passes.fuse.context import RuleContext
    from passes.fuse.graph import name_nodes
    from passes.fuse.probe import add_contrib_opset

    decode = artifact.decode_path()
    assert artifact.path is not None and decode is not None
    runnable = [r for r in rules if RULES_BY_NAME[r].generation]
    models: dict[str, Any] = {}
    per_graph: dict[str, dict[str, Any]] = {}
    totals: dict[str, RuleReport] = {r: RuleReport() for r in runnable}
    for role, path, name in (("prefill", artifact.path, "model.onnx"), ("decode", decode, "decode.onnx")):
        source = onnx_io.load(path)
        graph = gs.import_onnx(source)
        name_nodes(graph)
        before = Counter(n.op for n in graph.nodes)
        reports = apply_rules(graph, runnable, RuleContext(target, int(graph.opset), {}, {}))  # type: ignore[arg-type]
        model = gs.export_onnx(graph)
        add_contrib_opset(model)
        onnx_io.carry_metadata(source, model)
        models[name] = model
        after = Counter(n.op for n in graph.nodes)
        per_graph[role] = {
            "fused_ops": count_fused(before, after),
            "nodes_before": sum(before.values()),
            "nodes_after": sum(after.values()),
        }
        for rule, rep in reports.items():
            total = totals[rule]
            total.fused += rep.fused
            total.misses += [f"{role}: {m}" for m in rep.misses]
            total.details += [f"{role}: {d}" for d in rep.details]
            total.skipped = total.skipped or rep.skipped
    shared = onnx_io.save_shared(models, ctx.stage_dir)
    out = artifact.derive(
        path=ctx.stage_dir / "model.onnx", external_data=shared, decode="decode.onnx", decode_external_data=[]
    )
    fused = any(t.fused for t in totals.values())
    check: dict[str, Any] = {"skipped": "nothing fused: the graphs are their input's"}
    if fused:
        check = check_generation(artifact, out, ctx)
        worst = min(check["logits_cosine_min"], check["padded_logits_cosine_min"])
        if check["token_agreement"] < 1.0 or worst < min_cosine:
            raise PassError(
                f"fused generation graphs disagree with their input on {check['scenario']}: token agreement "
                f"{check['token_agreement']:.3f}, logits cosine {check['logits_cosine_min']:.7f}, on a left-padded "
                f"batch {check['padded_logits_cosine_min']:.7f} (min {min_cosine})"
            )
    notes: dict[str, Any] = {
        "target": target,
        "generation": per_graph,
        "fused_ops": dict(sum((Counter(g["fused_ops"]) for g in per_graph.values()), Counter())),  # both graphs
        "rules": {r: totals[r].to_json() if r in totals else _not_run(r) for r in rules},
        "nodes_before": per_graph["decode"]["nodes_before"],  # the decode graph: the one run per token
        "nodes_after": per_graph["decode"]["nodes_after"],
        "check_vs_input": check,
    }
    return PassResult(out, modified=fused, notes=notes)


def _not_run(rule: str) -> dict[str, Any]:
    return RuleReport(skipped=NOT_FOR_GENERATION.format(name=rule)).to_json()


def check_generation(before: Artifact, after: Artifact, ctx: PassContext) -> dict[str, Any]:
    """The fused pair against its input: greedy tokens and logits on the first scenario's prompt, then a
    left-padded batch of two (its first row, the second with a quarter of it padded) through prefill and
    PADDED_STEPS decode steps, the lowest logits cosine of any row (the mask and the cache's padding)."""
    from optimizer.runtime.generation import Generation
    from optimizer.runtime.runners.gen_runner import ort_generator

    first = next(iter(ctx.feeds))
    prompt, new = first.timing["input_ids"], first.scenario.new_tokens
    pairs = [ort_generator(a, ctx.recipe, device="cpu") for a in (before, after)]
    reference, candidate = (g.generate(prompt, new) for g in pairs)
    agreement = ctx.check(reference, candidate)
    ids = np.repeat(prompt[:1], 2, axis=0)
    mask = np.ones_like(ids)
    mask[1, : max(1, ids.shape[1] // 4)] = 0
    caches: list[list[Any]] = [[], []]
    steps: list[list[np.ndarray]] = [[], []]  # each pair's logits per call, both fed the reference's tokens
    for _ in range(1 + PADDED_STEPS):
        for i, gen in enumerate(pairs):
            logits, caches[i] = gen.forward(ids, mask, caches[i])
            steps[i].append(logits)
        ids = steps[0][-1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    padded = [Generation(np.stack([x.argmax(-1) for x in s], 1), s) for s in steps]
    worst = ctx.check(padded[0], padded[1])["logits_cosine_min"]  # the lowest of any row at any call
    return {
        "against": "the input graphs",
        "scenario": first.scenario.name,
        **agreement,
        "padded_logits_cosine_min": worst,
    }
