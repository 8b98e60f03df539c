from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
# A bug of ours (TypeError, KeyError... raised in optimizer/ or passes/) fails the test that hits it instead of
# becoming a "failed" stage; subprocesses the tests start inherit it. A test of the user-facing behaviour unsets it.
os.environ.setdefault("OPTIMIZER_DEBUG", "1")
# A script that starts the tests in the background (`cmd &`, as CI does) hands them SIGINT ignored, and every
# subprocess would inherit the ignore: the Ctrl-C tests' compiles would run to the end and exit 0. A Python handler
# is reset to the default at exec, so the compiles the tests start get SIGINT as at a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# memory: inline keeps the many small compiles in the tests fast; test_pipeline checks the fresh-process probe.
FAST_BENCH = {"warmup": 2, "rounds": 4, "iterations": 3, "memory": "inline", "settle_ms": 5}


def mlp_recipe(**overrides: Any) -> dict[str, Any]:
    """A recipe for the tiny MLP: fast enough to compile many times in tests."""
    recipe: dict[str, Any] = {
        "name": "tiny-mlp",
        "model": {"source": "factory", "target": "tiny_models:mlp"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}],
        "scenarios": [{"name": "b1", "batch": 1, "seq": 1}, {"name": "b8", "batch": 8, "seq": 1}],
        "target": {"device": "cpu", "threads": 1},
        "benchmark": FAST_BENCH,
        "accuracy": {"metric": "cosine", "min": 0.99, "samples": 2},
        "passes": [{"type": "export"}, {"type": "ort_session"}],
    }
    recipe.update(overrides)
    return recipe


def compile_mlp(folder: Path) -> Path:
    """The tiny MLP compiled into `folder` with its report written: a run folder to read, export or damage."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe
    from optimizer.report.build import write_report

    recipe = parse_recipe(mlp_recipe(), "recipe.yaml", folder.parent)
    write_report(recipe, Pipeline(recipe, folder).execute(), folder, 0.0)
    return folder


def write_recipe(folder: Path, data: dict[str, Any], name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, mlp_recipe())


@pytest.fixture(autouse=True, scope="session")
def _private_history(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Compiles run by tests record into a throwaway history, never the user's."""
    import os

    os.environ["OPTIMIZER_HISTORY"] = str(tmp_path_factory.mktemp("history") / "history.sqlite")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU-marked tests skip, with the reason, where there is no CUDA device."""
    from optimizer.runtime.gpu import cuda_reason

    reason = cuda_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device: {reason}"))
