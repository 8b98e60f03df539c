"""Real model sizes (issue 43): a stage whose worker dies is recorded failed with the cause and the run goes on;
a stage that cannot fit the memory available is not run, with the reason, before it loads anything; the timing
steps down (one session a side, then the stage alone) when the memory is short; a stage that does not change the
weights links its parent's file instead of copying it; no temporary files are left in stage folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import FAST_BENCH, mlp_recipe
from test_onnx_sources import external_model, onnx_source

from optimizer.core.artifact import Artifact, own_bytes
from optimizer.engine import memory_plan
from optimizer.engine.memory_plan import HEADROOM_BYTES, measure_plan, pass_reason
from optimizer.engine.pipeline import Pipeline
from optimizer.engine.stage_worker import FAULT_ENV
from optimizer.recipe.loading import parse_recipe
from optimizer.report.build import write_report

GIB = 2**30


def execute(data: dict, out: Path) -> dict[str, object]:
    records = Pipeline(parse_recipe(data, "<test>", out.parent), out).execute()
    return {r.name: r for r in records}


@pytest.mark.slow
def test_a_killed_worker_is_a_failed_stage_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setenv(FAULT_ENV, "ort_session:SIGKILL")  # as the kernel's out-of-memory killer ends a process
    data = mlp_recipe(isolation="process", passes=[
        {"type": "export"},
        {"type": "ort_session"},
        {"type": "ort_session", "name": "no_spin", "from": "export", "config": {"allow_spinning": False}},
    ])
    records = execute(data, tmp_path / "out")
    killed = records["ort_session"]
    assert killed.status == "failed"
    assert "killed (SIGKILL)" in killed.reason and "memory" in killed.reason
    assert not any(p.name.startswith(".building") for p in (tmp_path / "out").iterdir())
    # on_failure is "stop" (the default), yet a machine's limit does not end the run: the sibling ran and was timed
    assert records["no_spin"].status == "ran"
    assert records["no_spin"].metrics["scenarios"]["b1"]["latency"]["p50_ms"] > 0
    assert records["export"].status == "ran" and records["export"].metrics["scenarios"]


@pytest.mark.slow
def test_stages_in_workers_measure_as_inline_ones(tmp_path: Path) -> None:
    """The worker fills the same record: artifact in the run folder, metrics, notes, pass time."""
    data = mlp_recipe(isolation="process", benchmark={**FAST_BENCH, "memory": "process"})
    records = execute(data, tmp_path / "out")
    ort = records["ort_session"]
    assert ort.status == "ran" and ort.artifact.path.is_file()
    # the worker is a fresh process for its stage: its own growth is the memory, no second process loads it
    assert ort.metrics["memory"]["method"] == "inline" and "own worker process" in ort.metrics["memory"]["note"]
    assert ort.metrics["scenarios"]["b1"]["vs_parent"]["ratio"] > 0
    assert ort.pass_seconds is not None and ort.notes["session_options"]
    # what the stage cost the machine: its worker's peak, above what an empty Python with onnxruntime holds
    assert 60 < ort.metrics["worker_peak_mb"] < 4000
    recipe = parse_recipe(data, "<test>", tmp_path)
    write_report(recipe, list(records.values()), tmp_path / "out", 0.0)
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"the stage's worker peaked at {ort.metrics['worker_peak_mb']:.0f} MB resident" in report
    again = execute(data, tmp_path / "out")  # the cache holds across processes
    assert again["ort_session"].status == "cached"


def test_a_pass_that_cannot_fit_is_not_run_before_it_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from passes.quantize.quantize_pass import QuantizePass

    def loads(*_: object) -> None:
        raise AssertionError("the pass ran: it should have been refused before loading anything")

    model = external_model(tmp_path / "model")
    weights = sum(f.stat().st_size for f in model.parent.iterdir())
    # enough to load and time the source alone, not for a pass holding 3x its input
    monkeypatch.setenv(memory_plan.ENV_AVAILABLE, str(HEADROOM_BYTES + int(weights * 1.5)))
    monkeypatch.setattr(QuantizePass, "run", loads)
    records = execute(onnx_source(model, [{"type": "quantize", "config": {"mode": "int8_dynamic"}}]),
                      tmp_path / "out")
    q = records["quantize"]
    assert q.status == "skipped" and q.reason.startswith("not run: it would need about")
    assert "available" in q.reason
    assert records["source"].status == "ran" and records["source"].metrics["scenarios"]


def test_the_timing_steps_down_with_the_memory_there_is(tmp_path: Path) -> None:
    child = Artifact("torch", None, param_bytes=GIB)
    parent = Artifact("torch", None, param_bytes=GIB)
    one = memory_plan.instance_bytes(child)
    room = HEADROOM_BYTES
    assert measure_plan(child, parent, 2, room + 4 * one) == memory_plan.MeasurePlan(2, True)
    ones = measure_plan(child, parent, 2, room + 2 * one)
    assert (ones.instances, ones.with_parent) == (1, True) and "one a side" in ones.note
    alone = measure_plan(child, parent, 2, room + one)
    assert (alone.instances, alone.with_parent) == (1, False) and "timed alone" in alone.note
    none = measure_plan(child, parent, 2, room + one // 2)
    assert none.instances == 0 and none.reason.startswith("not measured: loading it needs about")


def test_a_decoder_pair_counts_two_sessions(tmp_path: Path) -> None:
    path = tmp_path / "prefill.onnx"
    path.write_bytes(b"\0" * 1000)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 99_000)
    pair = Artifact("onnx", path, external_data=["weights.bin"], decode="decode.onnx", layers=1)
    (tmp_path / "decode.onnx").write_bytes(b"\0" * 1000)
    single = Artifact("onnx", path, external_data=["weights.bin"])
    assert memory_plan.sessions_of(pair) == 2 and memory_plan.sessions_of(single) == 1
    assert memory_plan.instance_bytes(pair) > 1.9 * memory_plan.instance_bytes(single)


def test_pass_reason_names_the_need_and_what_is_available() -> None:
    src = Artifact("torch", None, param_bytes=2 * GIB)
    assert pass_reason(src, 3.0, HEADROOM_BYTES + 7 * GIB) is None
    why = pass_reason(src, 3.0, HEADROOM_BYTES + 5 * GIB)
    assert why == "not run: it would need about 6.0 GiB (3 x the input's 2.0 GiB of weights), 5.0 GiB available"


def test_an_hf_config_source_is_sized_before_it_is_built() -> None:
    data = {"name": "l", "workload": "generation",
            "model": {"source": "hf_config", "architecture": "llama", "task": "causal-lm",
                      "config": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 1000]}],
            "scenarios": [{"name": "s", "batch": 1, "seq": 8, "new_tokens": 2}]}
    recipe = parse_recipe(data, "<test>", Path("."))
    embed, head = 1000 * 64, 64 * 1000
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert memory_plan.source_bytes(recipe) == 4 * (embed + head + 2 * layer + 64)
    assert not memory_plan.isolate(recipe, memory_plan.source_bytes(recipe))  # auto: small stays inline
    assert memory_plan.isolate(recipe, memory_plan.ISOLATE_FROM_BYTES)


@pytest.mark.slow
def test_a_session_stage_refers_to_its_parents_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that changes session options only refers to its input's files (no second copy of the weights),
    and the passes after it read them: onnx refuses hard-linked external data, so links are not the way."""
    import passes.ort_session as ort_session

    monkeypatch.setattr(ort_session, "REFER_FROM_BYTES", 1)  # the tiny model as if it were large
    model = external_model(tmp_path / "model")
    passes = [{"type": "ort_session", "name": "first"},
              {"type": "ort_session", "name": "no_spin", "config": {"allow_spinning": False}},
              {"type": "quantize", "config": {"mode": "int8_dynamic"}}]
    records = execute(onnx_source(model, passes), tmp_path / "out")
    first, second = records["first"].artifact, records["no_spin"].artifact
    # the user's file is copied (editing it in place must not reach the run folder); the run's own is referred to
    assert first.path.parent.name == records["first"].folder
    assert second.path == first.path and second.runtime["allow_spinning"] is False
    assert records["no_spin"].metrics["own_bytes"] == 0
    assert not (tmp_path / "out" / records["no_spin"].folder / "model.onnx").exists()
    assert records["quantize"].status == "ran", records["quantize"].reason  # it read the referred weights
    again = execute(onnx_source(model, passes), tmp_path / "out")
    assert [again[n].status for n in ("first", "no_spin", "quantize")] == ["cached"] * 3


def test_own_bytes_counts_a_linked_file_once(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 100)
    os.link(a, b)
    c = tmp_path / "c"
    c.write_bytes(b"y" * 7)
    assert own_bytes([b, c], [a]) == 7 and own_bytes([a, b, c], []) == 107


def test_the_plan_says_what_the_run_will_take_before_it_starts() -> None:
    import yaml

    data = yaml.safe_load((Path(__file__).parent.parent / "recipes" / "llama-cpu.yaml").read_text())
    data["model"]["config"].update(num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=False)
    recipe = parse_recipe(data, "<test>", Path(__file__).parent.parent / "recipes")
    lines = memory_plan.run_plan(recipe, available=HEADROOM_BYTES + 8 * GIB)
    assert lines[0] == "plan: 15 stages over a source of 2.3 GiB (FP32); each stage in a worker process of its own"
    assert "more than the 8.0 GiB available: stages that do not fit step down" in lines[1]
    assert lines[2].startswith("disk: at most about 21.1 GiB (8 stages write weights")


def test_the_report_gives_each_stages_own_disk() -> None:
    from optimizer.report.markdown import disk_line

    class M:
        def __init__(self, b: int | None) -> None:
            self.own_bytes = b

    class S:
        def __init__(self, name: str, b: int | None) -> None:
            self.name, self.metrics = name, M(b)

    class R:
        stages = [S("source", None), S("export", 3 * 2**30), S("no_spin", 4096)]

    line = disk_line(R())  # type: ignore[arg-type]
    assert line == ["- disk: 3072 MiB written by the measured stages: export 3072 MiB (a stage that links its "
                    "input's weights adds only its graph)"]


def test_a_long_generation_is_profiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a real size a whole generation takes seconds (3.1 s for the 0.5B decoder on 2 cores): the op profile
    takes one generation after its warm-up, not three; a small model's keeps three."""
    from types import SimpleNamespace

    from optimizer.measure import generation

    asked: list[int] = []
    monkeypatch.setattr(generation, "generation_profile",
                        lambda *a: asked.append(a[-1]) or SimpleNamespace(decode={}, source=None, prefill={}))
    monkeypatch.setattr(generation, "scenario_profile", lambda *a: None)
    for task_ms, reps in ((3133.8, 1), (41.0, 3)):
        latency = SimpleNamespace(p50_ms=task_ms)
        scenarios = {"s": SimpleNamespace(latency=latency, profile=None)}
        feeds = [SimpleNamespace(scenario=SimpleNamespace(name="s", new_tokens=8), timing={})]
        monkeypatch.setattr(generation, "prompt_of", lambda timing: None)
        generation._profile(None, None, None, feeds, scenarios, lambda *a: None, "t")
        assert asked[-1] == reps
