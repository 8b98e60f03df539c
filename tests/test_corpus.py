"""Every pass over the onnx package's test models: none may crash the pipeline or silently change outputs."""

from __future__ import annotations

import pytest
from corpus.robustness import PASSES, corpus_dirs, run_corpus, table


@pytest.mark.slow
def test_robustness_corpus() -> None:
    dirs = corpus_dirs()
    assert len(dirs) >= 100
    result = run_corpus(dirs)
    print(table(result))
    assert result.crashed == []
    ran = result.models - len(result.source_declined)
    assert ran >= 90, result.source_declined
    for name in PASSES:
        assert result.mismatched[name] == [], result.mismatched[name]
        assert result.matched[name] + len(result.declined[name]) == ran
        assert all(": " in reason for reason in result.declined[name])  # every decline says why
    assert result.matched["ort_session"] == ran
