"""The one shape of a fusion rule, match -> check -> rewrite, and the check every match gets.

A rule names the places its pattern may start (anchors) and, for each one:
  match(graph, ctx, anchor) -> Match | None   None: not this pattern at all (nothing to report)
  check(graph, ctx, match)                    the rule's own conditions (target, opset, shapes)
  rewrite(graph, ctx, match) -> str | None    edits the graph; an optional detail line for the report
Between check and rewrite the driver declines any match one of whose intermediates escapes it (is a graph
output, or is read by a node outside the match): the original nodes would have to stay to compute it, so the work
would be done twice (`escapes`; onnxscript's `_valid_to_replace`, ORT's `is_safe_to_fuse_nodes`). After the
rewrite the driver disconnects every matched node that no longer produces one of the match's outputs.

match and check raise `Decline(reason)` where the place does not fuse; the driver reports "<place>: <reason>",
the place being "<label> at <anchor node>" unless the rule names its places itself. An optional step of a
pattern (a bias, a trailing activation) is taken only where the tensor before it does not escape
(`sole_consumer`), so the rest of the pattern still fuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import name_of
from passes.fuse.rule import RuleReport

A = TypeVar("A")
M = TypeVar("M", bound="Match")


class Decline(Exception):
    """A place does not match, or may not be fused; the message says why."""


@dataclass
class Match:
    """One place a pattern was found. `nodes`: every node the rewrite replaces or rewires. `outputs`: the tensors
    that are still there after the rewrite (the fused op's outputs), which may be read anywhere. Every other
    output of `nodes` is an intermediate, read by `nodes` only."""

    nodes: list[gs.Node]
    outputs: list[gs.Tensor]


def escapes(graph: gs.Graph, nodes: Iterable[gs.Node], outputs: Iterable[gs.Tensor]) -> str | None:
    """Why the match made of `nodes`, keeping `outputs`, cannot be replaced: the first intermediate (an output
    of `nodes` not in `outputs`) that is a graph output or is read by a node outside `nodes`; None when there is
    none."""
    nodes = list(nodes)
    inside = {id(n) for n in nodes}
    kept = {id(t) for t in outputs}
    graph_outputs = {id(t) for t in graph.outputs}
    for node in nodes:
        for t in node.outputs:
            if id(t) in kept:
                continue
            if id(t) in graph_outputs:
                return f"intermediate {t.name} is also a graph output"
            user = next((u for u in t.outputs if id(u) not in inside), None)
            if user is not None:
                return f"intermediate {t.name} is also used by {name_of(user)}"
    return None


def between(inputs: Iterable[gs.Tensor], outputs: Iterable[gs.Tensor]) -> list[gs.Node]:
    """The nodes that compute `outputs` from `inputs`: on a path from one of `inputs` to one of `outputs`,
    following values only (a Shape or Size node reads its input's shape, not its values, so a path does not run
    through one). Returns them in the order a walk from `inputs` reaches them."""
    stop = {id(t) for t in inputs}
    upstream: set[int] = set()  # ancestors of `outputs`, not past `inputs`
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        t = stack.pop()
        if id(t) in seen or id(t) in stop:
            continue
        seen.add(id(t))
        for node in t.inputs:
            if id(node) not in upstream and node.op not in ("Shape", "Size"):
                upstream.add(id(node))
                stack.extend(node.inputs)
    found: dict[int, gs.Node] = {}
    frontier = list(inputs)
    while frontier:
        t = frontier.pop(0)
        for node in t.outputs:
            if id(node) in upstream and id(node) not in found:
                found[id(node)] = node
                frontier.extend(node.outputs)
    return list(found.values())


def commuted(
    operands: Sequence[gs.Tensor], ok: Callable[[gs.Tensor, gs.Tensor], bool]
) -> tuple[gs.Tensor, gs.Tensor] | None:
    """Two operands of a commutative op (a node's inputs, or factors from two nodes of one product) as (a, b)
    with ok(a, b), trying both orders; None if neither holds or there are not two."""
    if len(operands) != 2:
        return None
    a, b = operands
    if ok(a, b):
        return a, b
    if ok(b, a):
        return b, a
    return None


def consumer(t: gs.Tensor, op: str | tuple[str, ...]) -> gs.Node | None:
    """The one node among t's readers whose op is `op` (other readers are the escape check's to judge); None when
    there is no such node or more than one."""
    ops = (op,) if isinstance(op, str) else op
    found = [n for n in t.outputs if n.op in ops]
    return found[0] if len(found) == 1 else None


def sole_consumer(graph: gs.Graph, t: gs.Tensor, op: str | tuple[str, ...]) -> gs.Node | None:
    """t's only reader if its op is `op` and t is not a graph output, else None: for an optional step of a
    pattern, taken only where the tensor before it does not escape."""
    ops = (op,) if isinstance(op, str) else op
    if len(t.outputs) != 1 or t.outputs[0].op not in ops or any(o is t for o in graph.outputs):
        return None
    return t.outputs[0]


def detach(*tensors: gs.Tensor) -> None:
    """Take each tensor from the node that produces it, for a fused op to produce instead."""
    for t in tensors:
        for node in list(t.inputs):
            node.outputs.remove(t)


@dataclass(frozen=True)
class Steps(Generic[A, M]):
    """A rule's steps (see the module docstring). `label` names the rule in its reports; `place`, if given,
    names an anchor instead of "<label> at <anchor node>"."""

    label: str
    match: Callable[[gs.Graph, RuleContext, A], M | None]
    rewrite: Callable[[gs.Graph, RuleContext, M], str | None]
    check: Callable[[gs.Graph, RuleContext, M], None] | None = None
    place: Callable[[A], str] | None = None


def fuse_each(
    graph: gs.Graph, ctx: RuleContext, anchors: Iterable[A], steps: Steps[A, M], report: RuleReport | None = None
) -> RuleReport:
    """Run `steps` at every anchor in turn, each on the graph as the previous rewrites left it (in place).
    Returns `report` (a new one if None) with one fusion or one decline per match; a decline reads
    "<place>: <reason>"."""
    report = report if report is not None else RuleReport()
    removed: set[int] = set()
    for anchor in anchors:
        if id(anchor) in removed:  # replaced by an earlier rewrite of this rule
            continue
        place = steps.place(anchor) if steps.place else f"{steps.label} at {name_of(anchor)}"  # type: ignore[arg-type]
        try:
            m = steps.match(graph, ctx, anchor)
            if m is None:
                continue
            if steps.check is not None:
                steps.check(graph, ctx, m)
            why = escapes(graph, m.nodes, m.outputs)
            if why is not None:
                raise Decline(why)
        except Decline as e:
            report.misses.append(f"{place}: {e}")
            continue
        detail = steps.rewrite(graph, ctx, m)
        kept = {id(t) for t in m.outputs}
        for node in m.nodes:
            if not any(id(t) in kept for t in node.outputs):
                node.inputs.clear()
                node.outputs.clear()
                removed.add(id(node))
        report.fused += 1
        if detail:
            report.details.append(detail)
    return report
