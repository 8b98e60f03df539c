"""The adversarial corpus holds on every case (its counts are the table in docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import mlp_recipe
from corpus.adversarial import Outcome, recipe_cases, run_corpus


def test_the_recipe_cases_hold(tmp_path: Path) -> None:
    """The corpus's recipe classes (names, numbers, YAML that would run code) alone: no compile, seconds."""
    out = Outcome()
    recipe_cases(out, mlp_recipe(), tmp_path)
    assert out.broke == [] and out.held == out.tried and len(out.tried) == 3


@pytest.mark.slow  # compiles, bundles and attacks a run: about 20 minutes on 2 cores
def test_every_adversarial_case_holds() -> None:
    result = run_corpus(mlp_recipe())
    assert result.broke == []
    assert sum(result.tried.values()) >= 181 and result.held == result.tried
    # every class has cases: the first rounds' 7, issue 28's nine (R3.1 .. R3.9), issue 47's classes done so far
    assert len(result.tried) == 23 and {k.split()[0] for k in result.tried if k.startswith("R3.")} == {
        f"R3.{n}" for n in range(1, 10)}
    assert {k.split()[0] for k in result.tried if k.startswith("R4.")} == {
        "R4.1", "R4.2", "R4.3", "R4.5", "R4.6", "R4.7", "R4.9"}
