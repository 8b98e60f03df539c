"""The report's findings: plain sentences about what went wrong or backwards in a run (failures, rejections, a busy
machine, unstable timings, slowdowns beyond noise, an unreliable parent ratio, denormal costs, extra kernel
launches), read from the typed report alone; nothing is measured here."""

from __future__ import annotations

from optimizer.core.metrics import CudaKernels, ScenarioMetrics
from optimizer.core.stage import StageReport
from optimizer.measure.machine import busy_sentence, busy_summary, window_busy
from optimizer.report.explain import main_parts
from optimizer.report.schema import BusySummary, RunReport
from passes.fuse import FuseNotes
from passes.fuse.kernel_choice import KernelChoiceNote

UNSTABLE_CV = 0.25  # like trtexec's variance warning: beyond this the latency distribution is not one number


def machine_busy(report: RunReport) -> BusySummary | None:
    """measure.machine's one statement about a busy machine, over this report's stages (None when it was quiet)."""
    loads = [
        {"name": st.name, "metrics": {"machine_load": st.metrics.machine_load.to_json()}}
        for st in report.stages
        if st.metrics is not None and st.metrics.machine_load is not None
    ]
    calibration = report.machine.calibration if report.machine is not None else None
    busy = busy_summary(loads, calibration.to_json() if calibration is not None else None)
    return BusySummary.model_validate(busy) if busy else None


def _window_busy(st: StageReport) -> bool:
    load = st.metrics.machine_load if st.metrics is not None else None
    return window_busy(load.to_json() if load is not None else None)


def _kernel_choices(stage: StageReport) -> list[KernelChoiceNote]:
    """A fuse stage's measured rules (passes/fuse/kernel_choice.py), read through its notes model."""
    if "kernel_choice" not in stage.notes:
        return []
    return list((FuseNotes.model_validate(stage.notes).kernel_choice or {}).values())


def findings(report: RunReport) -> list[str]:
    """Plain sentences about what went wrong or backwards: failures, rejections, performance inversions."""
    out: list[str] = []
    busy = machine_busy(report)
    if busy is not None:
        out.append(busy_sentence(busy.to_json()))
    by_name = {st.name: st for st in report.stages}
    flushing = [st.name for st in report.stages if st.ok and st.artifact is not None
                and st.artifact.runtime.get("denormal_as_zero")]
    for st in report.stages:
        label = f"{st.name} ({st.type})"
        out += _launch_findings(st, by_name.get(st.parent or ""), label)
        out += _denormal_findings(st, label, flushing)
        for choice in _kernel_choices(st):
            if not choice.kept:
                why = "its kernel measured slower on this target than the ops it replaces"
                out.append(f"{label}: a fusion left out ({why}): {choice.line}")
        said_why = st.status in ("failed", "skipped", "unchanged", "interrupted")
        if st.reason and (said_why or st.reason.startswith("not measured")):
            out.append(f"{label} {st.status}: {st.reason}")
        m = st.metrics
        if m is None:
            continue
        if m.nonfinite_reference:
            out.append(
                f"{label} produces NaN/inf in {m.nonfinite_reference} output elements on the recipe's inputs: every "
                "stage is compared against them, and NaN agrees with NaN, so accuracy figures cannot catch an error "
                "there; check the inputs (ranges, masks) or the model"
            )
        if not m.within_budget:
            out.append(f"{label} is REJECTED: accuracy outside the budget ({m.budget})")
        elif m.budget_edge:
            out.append(f"{label} is at the accuracy budget's edge: within it by its worst sample, not known to be "
                       f"({m.budget}); more accuracy samples would resolve it")
        for scen, sm in m.scenarios.items():
            mixed = sm.inputs is not None and sm.inputs.seq_min != sm.inputs.seq_max
            # A busy machine is said once, above; a natural-length mix spreads by design.
            if sm.latency.cv > UNSTABLE_CV and not _window_busy(st) and not mixed:
                out.append(
                    f"{label} on {scen}: timing was unstable (coefficient of variation {sm.latency.cv:.0%}); "
                    "treat its P99 with care, or raise benchmark.rounds / set benchmark.target_ci"
                )
            out += _parent_drift(st, by_name.get(st.parent or ""), scen, sm, label)
            vs = sm.vs_parent
            if vs is not None and vs.verdict == "slower":
                why = main_parts(report, st, scen)  # one per part: the call, or the prefill and the decode step
                out.append(
                    f"{label} on {scen}: {1 / vs.ratio:.2f}x slower than its input "
                    f"({st.parent}), beyond noise (CI {vs.low:.2f}-{vs.high:.2f}x)"
                    + "".join(
                        f"; by op type, {e.summary(3)} ({e.coverage()})"
                        + (f"; {e.nodes.line(2)}" if e.nodes is not None else "")
                        for e in why
                    )
                )
    return out


PARENT_DRIFT = 3.0  # the parent's P50 beside a stage against its own: beyond this factor the ratio is not trusted


def _parent_drift(st: StageReport, parent: StageReport | None, scen: str, sm: ScenarioMetrics, label: str) -> list[str]:
    """The interleaved ratio assumes the parent ran beside the stage as it runs alone; when its P50 there is far
    from its own measurement (a tiny PyTorch model beside ONNX Runtime on a loaded machine ran 200x slower), the
    ratio measures the disturbance, not the stage."""
    own_sm = parent.scenario(scen) if parent is not None else None
    beside = sm.parent_latency.p50_ms if sm.parent_latency is not None else None
    own = own_sm.latency.p50_ms if own_sm is not None else None
    if parent is None or not beside or not own or max(beside / own, own / beside) <= PARENT_DRIFT:
        return []
    ratio = f" {sm.vs_parent.ratio:.2f}x" if sm.vs_parent is not None else ""
    return [
        f"{label} on {scen}: its input ({parent.name}) ran {beside:.3g} ms (P50) beside this stage against "
        f"{own:.3g} ms on its own ({beside / own:.1f}x): the ratio{ratio} is unreliable; re-run on a quiet machine"
    ]


DENORMAL_GAIN = 1.10  # a stage >= 10% faster (and beyond noise) with denormals flushed is worth a line


def _denormal_findings(st: StageReport, label: str, flushing: list[str]) -> list[str]:
    """Where the denormal probe (measure.denormal_probe) found the stage faster with denormals flushed: one line
    per stage, every such scenario with its figure, and what to do about it."""
    parts = []
    for scen, sm in (st.metrics.scenarios if st.metrics is not None else {}).items():
        vs = sm.denormal_probe
        if vs is None or vs.verdict != "faster" or vs.ratio < DENORMAL_GAIN:
            continue
        padded = sm.inputs.padded_share if sm.inputs is not None else None
        pad = f", {padded:.0%} of positions padding" if padded else ""
        parts.append(f"{scen} {vs.ratio:.2f}x (CI {vs.low:.2f}-{vs.high:.2f}x{pad})")
    if not parts:
        return []
    fix = (f"the run's {', '.join(flushing)} flush{'es' if len(flushing) == 1 else ''} them"
           if flushing else "an ort_session stage with `denormal_as_zero: true` flushes them, measured as a stage")
    return [f"{label} runs faster with denormal floats flushed to zero: {'; '.join(parts)}. It computes on "
            f"denormal numbers (on padded inputs: the masked attention probabilities); {fix}"]


MORE_LAUNCHES = 0.10  # a stage issuing >= 10% more kernel launches per call than its input is worth a line


def _kernels(st: StageReport | None, scenario: str) -> CudaKernels | None:
    sm = st.scenario(scenario) if st is not None else None
    k = sm.cuda_kernels if sm is not None else None
    return k if k is not None and k.launches is not None else None


def _launch_findings(st: StageReport, parent: StageReport | None, label: str) -> list[str]:
    """The seeds' "37% more kernel launches": said per scenario where a stage launches more than its input."""
    out = []
    for scen in st.metrics.scenarios if st.metrics is not None else {}:
        mine, theirs = _kernels(st, scen), _kernels(parent, scen)
        if mine and theirs and parent is not None and theirs.launches:
            more = mine.launches / theirs.launches - 1  # type: ignore[operator]
            if more >= MORE_LAUNCHES:
                out.append(
                    f"{label} on {scen}: {more:.0%} more kernel launches per call than its input "
                    f"({parent.name}): {mine.launches:.0f} vs {theirs.launches:.0f}"
                )
    return out
