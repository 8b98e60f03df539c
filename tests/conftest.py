from __future__ import annotations

import os
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
