"""Best per scenario: each scenario's winner (stage 0 included), where the overall best loses, and the export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_report_schema import report_of

from optimizer.core.errors import OptimizerError
from optimizer.deploy.export import pick_stage
from optimizer.report.build import best_with_scenarios
from optimizer.report.html import to_html
from optimizer.report.markdown import to_markdown
from optimizer.report.schema import RunReport
from optimizer.report.select import recommend

SCENARIOS = [{"name": "b1-s128", "batch": 1, "seq": 128}, {"name": "b1-s512", "batch": 1, "seq": 512}]


def _scen(vs: float | None, p50: float) -> dict[str, Any]:
    lat = {"n": 12, "p50_ms": p50, "p90_ms": p50, "p99_ms": p50, "mean_ms": p50, "std_ms": 0.0, "min_ms": p50,
           "cv": 0}
    out: dict[str, Any] = {"latency": lat, "throughput": {"samples_per_s": 1000 / p50}}
    if vs is not None:  # a +-3% interval: every ratio below is far outside noise
        out["vs_parent"] = {"ratio": vs, "low": vs * 0.97, "high": vs * 1.03, "verdict": "faster"}
    return out


def _stage(index: int, name: str, parent: str | None, vs: dict[str, float] | None, **kw: Any) -> dict[str, Any]:
    return {
        "index": index, "name": name, "type": kw.get("type", "quantize"), "parent": parent, "status": "ran",
        "measured_against": name,
        "artifact": {"kind": kw.get("kind", "onnx"), "path": f"/nowhere/{name}.onnx", "runtime": {}},
        "notes": {},
        "metrics": {
            "within_budget": True, "budget": "y cosine 0.999", "size_bytes": 100, "memory_mb": 10.0,
            "accuracy": {"y": {"cosine": 0.999}},
            "scenarios": {s["name"]: _scen(vs[s["name"]] if vs else None, 10.0) for s in SCENARIOS},
        },
    }


def report(stages: list[dict[str, Any]]) -> RunReport:
    rep = report_of(stages, SCENARIOS)
    for st in rep.stages:  # select reads the chained ratios the report keeps
        st.vs_source = {s["name"]: 1.0 for s in SCENARIOS}
    rep.best = best_with_scenarios(rep)
    return rep


def different_winners() -> RunReport:
    """`short` wins at 128 tokens (2.0x vs 1.2x), `long` at 512 (1.6x vs 1.1x); overall `short` (geometric mean)."""
    source = _stage(0, "source", None, None, kind="torch", type="source")
    export = _stage(1, "export", "source", {"b1-s128": 1.0, "b1-s512": 1.0}, type="export")
    short = _stage(2, "short", "export", {"b1-s128": 2.0, "b1-s512": 1.1})
    long = _stage(3, "long", "export", {"b1-s128": 1.2, "b1-s512": 1.6})
    return report([source, export, short, long])


def test_two_scenarios_with_different_winners() -> None:
    rep = different_winners()
    assert rep.best is not None and rep.best.stage == "short"
    winners = {s: w.stage for s, w in rep.best.per_scenario.items()}
    assert winners == {"b1-s128": "short", "b1-s512": "long"}
    assert [(x.scenario, x.winner) for x in rep.best.losses] == [("b1-s512", "long")]
    loss = rep.best.losses[0]
    assert loss.ratio == pytest.approx(1.1 / 1.6) and loss.high < 1.0
    assert "; but on b1-s512 it is 0.69x `long`" in rep.best.why  # the headline says where it loses
    advice = rep.best.advice or ""
    assert "route requests of up to 128 tokens to `short` and of 512 or more to `long`" in advice
    assert "`short` keeps at least 0.69x the speed of each scenario's winner (worst on b1-s512)" in advice
    assert pick_stage(rep, "best").name == "short"
    assert pick_stage(rep, "best", "b1-s512").name == "long"  # export --stage best --scenario b1-s512
    md, html = to_markdown(rep), to_html(rep)
    assert "| b1-s512 | `long` | 1.60x (1.53-1.67) | - |" in md and "**Per scenario**: the winners differ" in md
    assert "<td>b1-s512</td><td><code>long</code></td>" in html
    _, lines = recommend(rep, {"latency": 1.0})
    assert any(line.startswith("b1-s512:") and "fastest within budget: `long`, 1.60x" in line for line in lines)


def test_the_headline_says_where_the_best_is_slower_than_pytorch() -> None:
    """Every deployable stage is slower than stage 0 at 512 tokens: "keep PyTorch" wins there, the headline says
    the overall best loses to stage 0 there, and exporting that scenario's best is refused with the reason."""
    source = _stage(0, "source", None, None, kind="torch", type="source")
    export = _stage(1, "export", "source", {"b1-s128": 2.0, "b1-s512": 0.8}, type="export")
    int8 = _stage(2, "int8", "export", {"b1-s128": 2.0, "b1-s512": 1.05})
    rep = report([source, export, int8])
    assert rep.best is not None and rep.best.stage == "int8"
    w = rep.best.per_scenario["b1-s512"]
    assert w.keep_source and w.stage == "source" and "keep PyTorch" in w.why and "`int8`" in w.why
    assert rep.best.per_scenario["b1-s128"].stage == "int8"
    assert "; but on b1-s512 it is 0.84x PyTorch (stage 0)" in rep.best.why
    assert "to `int8` and of 512 or more to PyTorch (stage 0)" in (rep.best.advice or "")
    with pytest.raises(OptimizerError, match=r"--scenario b1-s512: keep PyTorch \(stage 0\): the fastest other"):
        pick_stage(rep, "best", "b1-s512")
    with pytest.raises(OptimizerError, match="--scenario: no scenario 'b9'"):
        pick_stage(rep, "best", "b9")
    assert pick_stage(rep, "best", "b1-s128").name == "int8"


def test_one_winner_everywhere_gives_no_advice_and_no_loss() -> None:
    source = _stage(0, "source", None, None, kind="torch", type="source")
    export = _stage(1, "export", "source", {"b1-s128": 1.5, "b1-s512": 1.5}, type="export")
    fast = _stage(2, "fast", "export", {"b1-s128": 2.0, "b1-s512": 2.0})
    rep = report([source, export, fast])
    assert rep.best is not None and rep.best.stage == "fast" and not rep.best.losses and rep.best.advice is None
    assert {w.stage for w in rep.best.per_scenario.values()} == {"fast"}
    assert "; but" not in rep.best.why


# ---------------------------------------------------------------- end to end, with deterministically slowed stages
def _slowed(monkeypatch: pytest.MonkeyPatch, ms: dict[str, dict[int, float]]) -> None:
    """Every timed call of a stage sleeps ms[stage][batch] (stage 0 is "source"): the harness measures the sleeps,
    so each scenario's winner is known in advance."""
    import time

    from optimizer.runtime.runners.ort_runner import OrtRunner, OrtSession
    from optimizer.runtime.runners.torch_runner import TorchRunner, TorchSession

    for runner, session_cls in ((OrtRunner, OrtSession), (TorchRunner, TorchSession)):
        real_open, real_run = runner._open, session_cls.run

        def _open(self: Any, real: Any = real_open) -> Any:
            session = real(self)
            session.stage = "source" if self.artifact.path is None else self.artifact.path.parent.name.split("-", 1)[1]
            return session

        def run(self: Any, prepared: Any, real: Any = real_run) -> Any:
            first = prepared[0] if isinstance(prepared, list) else next(iter(prepared.values()))
            time.sleep(ms.get(getattr(self, "stage", ""), {}).get(int(first.shape[0]), 0.0) / 1000)
            return real(self, prepared)

        monkeypatch.setattr(runner, "_open", _open)
        monkeypatch.setattr(session_cls, "run", run)


def _compile(tmp_path: Path, passes: list[dict[str, Any]]) -> RunReport:
    from conftest import FAST_BENCH, mlp_recipe, write_recipe

    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import build_report

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = mlp_recipe(scenarios=[{"name": "b1", "batch": 1, "seq": 1}, {"name": "b8", "batch": 8, "seq": 1}],
                      benchmark={**FAST_BENCH, "rounds": 6, "instances": 1, "denormal_probe": False},
                      passes=passes)
    recipe = load_recipe(write_recipe(tmp_path, data))
    return build_report(recipe, Pipeline(recipe, tmp_path / "run").execute(), tmp_path / "run", 1.0)


@pytest.mark.slow
def test_end_to_end_different_winners_and_a_loss_to_pytorch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _slowed(monkeypatch, {"source": {1: 12.0, 8: 4.0}, "export": {1: 12.0, 8: 12.0},
                          "short": {1: 2.0, 8: 8.0}, "long": {1: 10.0, 8: 2.0}})
    rep = _compile(tmp_path, [{"type": "export"},
                              {"type": "ort_session", "name": "short", "from": "export"},
                              {"type": "ort_session", "name": "long", "from": "export",  # another key than short's
                               "config": {"allow_spinning": False}}])
    assert rep.best is not None and rep.best.stage == "short", rep.best
    assert {s: w.stage for s, w in rep.best.per_scenario.items()} == {"b1": "short", "b8": "long"}
    assert [x.winner for x in rep.best.losses] == ["long"] and "; but on b8 it is" in rep.best.why
    # Without `long`, stage 0 (4 ms at b8) beats every deployable stage there: keep PyTorch, and the headline says so.
    rep = _compile(tmp_path / "alone", [{"type": "export"}, {"type": "ort_session", "name": "short", "from": "export"}])
    assert rep.best is not None and rep.best.stage == "short"
    assert rep.best.per_scenario["b8"].keep_source and "; but on b8 it is" in rep.best.why
    assert "PyTorch (stage 0)" in rep.best.why


def test_an_onnx_source_that_wins_a_scenario_is_the_model_the_user_brought() -> None:
    """Stage 0 of an ONNX source is that file under ONNX Runtime: "keep the original model", and exportable."""
    source = _stage(0, "source", None, None, kind="onnx", type="source")
    ort = _stage(1, "ort_session", "source", {"b1-s128": 2.0, "b1-s512": 0.8}, type="ort_session")
    rep = report([source, ort])
    w = rep.best.per_scenario["b1-s512"] if rep.best is not None else None
    assert w is not None and w.keep_source
    assert w.why.startswith("keep the original model (stage 0): the fastest other stage within the budget, "
                            "`ort_session`, is 0.80x")
    assert pick_stage(rep, "best", "b1-s512").name == "source"
    with pytest.raises(OptimizerError, match="--scenario goes with --stage best"):
        pick_stage(rep, "ort_session", "b1-s512")
