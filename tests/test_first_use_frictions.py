"""The smaller frictions a new user met with `optimizer compile --model` (issue 33, item 8): a factory module in the
working folder needs no PYTHONPATH, a quiet machine is not called busy for a drifting calibration, image scenarios
are titled by their image shape, libraries' progress lines stay out of our output, and a failed stage 0 is one
line, not tables of nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import TESTS, mlp_recipe, write_recipe

from optimizer.core.errors import OptimizerError
from optimizer.measure.machine import busy_sentence, busy_summary
from optimizer.recipe.auto import recipe_for_model
from optimizer.recipe.loading import load_recipe
from optimizer.recipe.schema import FactorySource
from optimizer.report.markdown import to_markdown
from optimizer.report.schema import parse_report
from optimizer.report.tables import scenario_title

NET = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


def build():
    return Net()
"""

# The `optimizer` console script: unlike `python -m optimizer`, its sys.path does not hold the working folder.
AS_CONSOLE_SCRIPT = "import sys; del sys.path[0]; from optimizer.cli.app import main; main()"


def _module(folder: Path, stem: str | None = None) -> str:
    """A fresh module name (never imported before in this process) with its file in `folder`."""
    stem = stem or f"user_net_{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.py").write_text(NET)
    return stem


def _env_without_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# ---------------------------------------------------------------- 1. module:function without PYTHONPATH
def test_a_module_in_the_working_folder_loads_without_pythonpath(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.runtime.models import load_module

    stem = _module(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    recipe, _ = recipe_for_model(f"{stem}:build", "cpu")
    assert isinstance(recipe.model, FactorySource) and [i.name for i in recipe.inputs] == ["x"]
    assert type(load_module(recipe)).__name__ == "Net"


def test_a_file_path_target_loads_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.runtime.models import load_module

    stem = _module(tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    recipe, text = recipe_for_model(f"models/{stem}.py:build", "cpu")
    # The generated recipe lives in the run folder: it names the file by its absolute path.
    assert isinstance(recipe.model, FactorySource)
    assert recipe.model.target == f"{tmp_path / 'models' / stem}.py:build", recipe.model.target
    monkeypatch.chdir(tmp_path.parent)
    assert type(load_module(recipe)).__name__ == "Net"
    # A hand-written recipe's relative file path is from the recipe's folder, as its other paths are.
    data = mlp_recipe(model={"source": "factory", "target": f"models/{stem}.py:build"},
                      inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 8]}])
    assert type(load_module(load_recipe(write_recipe(tmp_path, data)))).__name__ == "Net"


def test_a_module_that_cannot_be_found_says_where_it_looked_and_how_to_fix_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.runtime.models import load_module

    monkeypatch.chdir(tmp_path)
    with pytest.raises(OptimizerError) as e:
        recipe_for_model("no_such_user_module:build", "cpu")
    line = str(e.value)
    assert "\n" not in line and str(tmp_path) in line, line
    assert "PYTHONPATH" in line and "no_such_user_module.py:build" in line, line
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    data = mlp_recipe(model={"source": "factory", "target": "no_such_user_module:build"})
    with pytest.raises(OptimizerError) as e:
        load_module(load_recipe(write_recipe(recipe_dir, data)))
    line = str(e.value)
    assert line.startswith("model.target: ") and str(tmp_path) in line and str(recipe_dir) in line, line
    assert "PYTHONPATH" in line, line


@pytest.mark.slow
def test_compile_model_from_the_working_folder_as_the_console_script(tmp_path: Path) -> None:
    """The user's command, as the `optimizer` script runs it: no PYTHONPATH, the module beside them."""
    _module(tmp_path, "mynet")
    proc = subprocess.run(
        [sys.executable, "-c", AS_CONSOLE_SCRIPT, "compile", "--model", "mynet:build", "--no-bench", "--no-history",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=tmp_path, env=_env_without_pythonpath(), timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["stages"][0]["status"] == "ran", report["stages"][0]


@pytest.mark.slow
def test_a_fresh_process_resolves_the_module_as_the_compile_did(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory probe's child (a fresh Python) loads stage 0 from a module beside the recipe, run from
    elsewhere, with no PYTHONPATH."""
    from optimizer.core.artifact import Artifact
    from optimizer.measure.memprobe import probe

    stem = _module(tmp_path / "proj")
    data = mlp_recipe(model={"source": "factory", "target": f"{stem}:build"},
                      inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 8]}],
                      scenarios=[{"name": "b1", "batch": 1, "seq": 1}])
    recipe = load_recipe(write_recipe(tmp_path / "proj", data))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    result = probe(Artifact("torch", None, input_names=["x"], output_names=["output"]), recipe)
    assert "reason" not in result and result["peak_mb"] >= 0, result


# ---------------------------------------------------------------- 2. a quiet machine is not "busy"
QUIET = {"seconds": 3.0, "other_cpu_cores": 0.0, "own_cpu_cores": 1.0, "steal_share": 0.0, "load_avg_1m": 1.0,
         "cores": 2}


def _stages(*loads: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": f"stage{i}", "metrics": {"machine_load": load}} for i, load in enumerate(loads)]


@pytest.mark.parametrize("drift", [0.10, 0.20, 0.30, 0.35, -0.30])
def test_calibration_drift_on_a_quiet_machine_is_no_finding(drift: float) -> None:
    calibration = {"before_ms": 2.0, "after_ms": round(2.0 * (1 + drift), 4)}
    assert busy_summary(_stages(QUIET, QUIET, QUIET), calibration) is None


def test_other_processes_load_is_a_finding() -> None:
    loaded = {**QUIET, "other_cpu_cores": 1.2, "load_avg_1m": 3.1}
    summary = busy_summary(_stages(QUIET, loaded), {"before_ms": 2.0, "after_ms": 2.02})
    assert summary is not None and summary["stages"] == ["stage1"]
    assert "other processes" in busy_sentence(summary) and "1.20" in busy_sentence(summary)
    stolen = {**QUIET, "steal_share": 0.2}
    assert busy_summary(_stages(stolen), None) is not None
    # With load seen, the calibration's drift is said too.
    both = busy_summary(_stages(loaded), {"before_ms": 2.0, "after_ms": 2.6})
    assert both is not None and "+30%" in busy_sentence(both)


# ---------------------------------------------------------------- 3. scenario titles say the shape
def _report(inputs: list[dict[str, Any]], scenarios: list[dict[str, Any]]) -> Any:
    data = json.loads((TESTS / "data" / "report_v1_minilm.json").read_text())
    data["recipe"]["inputs"] = inputs
    data["scenarios"] = scenarios
    return parse_report(data, "report.json")


def test_image_scenarios_are_titled_by_the_image_shape() -> None:
    image = [{"name": "pixel_values", "dtype": "float32", "shape": ["batch", 3, 224, 224]}]
    report = _report(image, [{"name": "b1", "batch": 1, "seq": 1}, {"name": "b8", "batch": 8, "seq": 1}])
    titles = [scenario_title(report, s) for s in report.scenarios]
    assert titles == ["b1 (batch 1, 3x224x224)", "b8 (batch 8, 3x224x224)"], titles
    markdown = to_markdown(report)
    assert "## Scenario b1 (batch 1, 3x224x224)" in markdown and "seq 1" not in markdown
    assert "## Batch sweep of `int8_dynamic` (3x224x224)" in markdown  # the sweep's shape, at each batch
    symbolic = [{"name": "input", "dtype": "float32", "shape": ["batch", 3, "height", "width"]}]
    report = _report(symbolic, [{"name": "b1", "batch": 1, "seq": 1, "dims": {"height": 96, "width": 128}}])
    assert scenario_title(report, report.scenarios[0]) == "b1 (batch 1, 3x96x128)"
    text = [{"name": "input_ids", "shape": ["batch", "seq"]}, {"name": "attention_mask", "shape": ["batch", "seq"]}]
    report = _report(text, [{"name": "b1-s128", "batch": 1, "seq": 128}])
    assert scenario_title(report, report.scenarios[0]).startswith("b1-s128 (batch 1, seq 128")  # as before


# ---------------------------------------------------------------- 4. libraries' progress lines
LIBRARY_CHATTER = """
import sys
from optimizer.cli.app import main
try:
    main(["validate", sys.argv[1]])
except SystemExit:
    pass
from pathlib import Path
import numpy as np
from optimizer.deploy.export import _polygraphy_reference  # what `optimizer export` writes into a bundle
_polygraphy_reference(Path(sys.argv[2]), [{"x": np.zeros(2)}], [{"y": np.ones(2)}])
from polygraphy.logger import G_LOGGER
G_LOGGER.info("an info line")
G_LOGGER.error("a polygraphy error that matters")
from transformers.utils import logging as hf_logging
for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
    pass
hf_logging.get_logger("transformers.modeling_utils").info("advisory")
hf_logging.get_logger("transformers.modeling_utils").error("a transformers error that matters")
"""


@pytest.mark.slow
def test_library_progress_lines_stay_out_and_errors_stay_in(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, mlp_recipe())
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", LIBRARY_CHATTER, str(recipe), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[I]" not in out and "Saving" not in out and "'colored' module" not in out, out
    assert (tmp_path / "polygraphy_inputs.json").is_file() and (tmp_path / "polygraphy_outputs.json").is_file()
    assert "Loading weights" not in out and "advisory" not in out, out
    assert "a polygraphy error that matters" in out and "a transformers error that matters" in out, out


# ---------------------------------------------------------------- 5. a failed stage 0 is one line
@pytest.mark.slow
def test_a_failed_stage_0_is_one_line_not_tables(tmp_path: Path) -> None:
    data = mlp_recipe(model={"source": "factory", "target": "tiny_models:not_a_module"})
    recipe = write_recipe(tmp_path, data)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OPTIMIZER_DEBUG": "0"}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "optimizer", "compile", str(recipe), "--no-bench", "--no-history",
                           "--out", str(run)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "scenario" not in proc.stdout and "not run" not in proc.stdout + proc.stderr, proc.stdout
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "stage 0" in lines[0] and "returned str, not a torch.nn.Module" in lines[0], lines[0]
    assert str(run / "report.json") in lines[0], lines[0]
    shown = subprocess.run([sys.executable, "-m", "optimizer", "report", str(run)], capture_output=True, text=True,
                           env=env, timeout=300)
    assert shown.returncode == 0, shown.stderr
    shown_lines = [line for line in shown.stdout.strip().splitlines() if line.strip()]
    assert len(shown_lines) == 1 and "returned str, not a torch.nn.Module" in shown_lines[0], shown.stdout


def test_nncf_info_lines_stay_out_of_our_output() -> None:
    """NNCF logs every step of its accuracy-aware search at INFO (dozens of "INFO:nncf:..." lines, each node it
    reverts) into the user's terminal; our stage's progress and notes say what happened. Warnings still show."""
    import logging

    pytest.importorskip("nncf")
    from optimizer.runtime.ov_engine import nncf_module

    nncf_module()
    assert not logging.getLogger("nncf").isEnabledFor(logging.INFO)
    assert logging.getLogger("nncf").isEnabledFor(logging.WARNING)
