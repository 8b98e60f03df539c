"""`fuse` on a generation artifact: the rules that handle KV-cache graphs, on the prefill and the decode graph.

Both graphs are rewritten by the same rules and saved over one shared weights file, as export wrote them. The
fused pair is then checked end to end against its input where it matters, in generation: greedy tokens and
logits on the recipe's first scenario's prompt. Any token that differs, or a logits cosine below the config's
min_cosine, fails the stage rather than passing a wrong graph on (the pipeline keeps what ran before it).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from optimizer.core.errors import PassError
from optimizer.core.pass_base import PassResult
from passes.fuse.rule import RULES_BY_NAME, RuleReport

if TYPE_CHECKING:
    from optimizer.core.artifact import Artifact
    from optimizer.core.pass_base import PassContext

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
    check = check_generation(artifact, out, ctx)
    if check["token_agreement"] < 1.0 or check["logits_cosine_min"] < min_cosine:
        raise PassError(
            f"fused generation graphs disagree with their input on {check['scenario']}: token agreement "
            f"{check['token_agreement']:.3f}, logits cosine {check['logits_cosine_min']:.7f} (min {min_cosine})"
        )
    rules = {r: totals[r].to_json() if r in totals else _not_run(r) for r in rules}
    notes: dict[str, Any] = {
        "target": target,
        "generation": per_graph,
        "fused_ops": dict(sum((Counter(g["fused_ops"]) for g in per_graph.values()), Counter())),
        "rules": rules,
        "nodes_before": per_graph["decode"]["nodes_before"],  # the graph run per token
        "nodes_after": per_graph["decode"]["nodes_after"],
        "check_vs_input": check,
    }
    return PassResult(out, modified=any(t.fused for t in totals.values()), notes=notes)


def _not_run(rule: str) -> dict[str, Any]:
    return RuleReport(skipped=NOT_FOR_GENERATION.format(name=rule)).to_json()


def check_generation(before: Artifact, after: Artifact, ctx: PassContext) -> dict[str, Any]:
    """Greedy tokens and logits of the fused pair against the input pair, on the first scenario's prompt."""
    from optimizer.runtime.runners.gen_runner import ort_generator

    first = next(iter(ctx.feeds))
    prompt, new = first.timing["input_ids"], first.scenario.new_tokens
    reference = ort_generator(before, ctx.recipe, device="cpu").generate(prompt, new)
    candidate = ort_generator(after, ctx.recipe, device="cpu").generate(prompt, new)
    agreement = ctx.check(reference, candidate)
    return {"against": "the input graphs", "scenario": first.scenario.name, **agreement}
