"""Adversarial cases of issue 28 (handover); see optimizer/qa/adversarial.py."""

from __future__ import annotations

from optimizer.qa.adversarial import Round3


def add_cases(r: Round3) -> None:
    r.work.mkdir(parents=True, exist_ok=True)
