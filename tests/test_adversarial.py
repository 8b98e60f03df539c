"""The adversarial corpus holds on every case (its counts are the README's reliability table)."""

from __future__ import annotations

from conftest import mlp_recipe

from optimizer.qa.adversarial import run_corpus


def test_every_adversarial_case_holds() -> None:
    result = run_corpus(mlp_recipe())
    assert result.broke == []
    assert sum(result.tried.values()) >= 160 and result.held == result.tried
    # every class of both issues has cases: the first rounds' 7, and issue 28's nine (R3.1 .. R3.9)
    assert len(result.tried) == 16 and {k.split()[0] for k in result.tried if k.startswith("R3.")} == {
        f"R3.{n}" for n in range(1, 10)}
