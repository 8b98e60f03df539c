"""Every pass over the onnx package's test models: none may crash the pipeline or silently change outputs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from corpus.robustness import PASSES, corpus_dirs, run_corpus, table

# What docs/reliability.md states (test_the_docs_state_these_counts keeps them equal): the test models the onnx
# package ships, and how many of them stage 0 runs (the rest declined with reasons). A change in either (another
# onnx version, a source that declines more or fewer) fails here and is written up there.
MODELS, RAN = 140, 97
DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def test_the_docs_state_these_counts() -> None:
    text = " ".join(DOC.read_text().split())
    assert f"every pass over the {MODELS} test models" in text
    stated = re.search(r"stage 0 runs on (\d+) \((\d+) declined", text)
    assert stated is not None and (int(stated[1]), int(stated[2])) == (RAN, MODELS - RAN), stated
    assert f"{RAN} matched, 0 mismatched" in text


@pytest.mark.slow
def test_robustness_corpus() -> None:
    dirs = corpus_dirs()
    assert len(dirs) == MODELS
    result = run_corpus(dirs)
    print(table(result))
    assert result.crashed == []
    ran = result.models - len(result.source_declined)
    assert ran == RAN, result.source_declined
    for name in PASSES:
        assert result.mismatched[name] == [], result.mismatched[name]
        assert result.matched[name] + len(result.declined[name]) == ran
        assert all(": " in reason for reason in result.declined[name])  # every decline says why
    assert result.matched["ort_session"] == ran
