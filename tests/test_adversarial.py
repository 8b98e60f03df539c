"""The adversarial corpus holds on every case (its counts are the README's reliability table)."""

from __future__ import annotations

from conftest import mlp_recipe

from optimizer.qa.adversarial import run_corpus


def test_every_adversarial_case_holds() -> None:
    result = run_corpus(mlp_recipe())
    assert result.broke == []
    assert sum(result.tried.values()) >= 85 and result.held == result.tried
    assert len(result.tried) == 7  # every class of the issue has cases
