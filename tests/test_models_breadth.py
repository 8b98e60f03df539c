"""Model breadth (issue 33): `optimizer compile --model` on a small random-weight model of each family users bring
(tests/corpus/breadth.py, scripts/models_breadth.py), each outcome the one breadth.EXPECTED says.

The refusal (an encoder-decoder auto has not checked: BART) takes seconds and runs in the fast tier; the compiles run
in the slow one, on a subset that covers every kind auto tells apart (a text encoder with its tokenizer, a classifier
head, a ViT and a CNN image classifier, a decoder with GenAI's stages, both ONNX cases): about 6 minutes on 2 busy
cores, where the whole set takes 18; and the encoder-decoders (T5, Whisper) at the `small` size (2 layers), the
seq2seq generation workload's graphs built and checked. The whole set: `python scripts/models_breadth.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from corpus.breadth import CASES, EXPECTED, markdown, run_cases, select, unexpected

# Every kind auto tells apart and every kind of source, in a third of the whole set's time.
COMPILED = ["bert", "bert-seqcls", "vit-imgcls", "resnet-imgcls", "llama", "onnx-external-data",
            "onnx-torchscript-bert"]


def test_every_case_has_its_expected_outcome() -> None:
    assert [c.name for c in CASES] == list(EXPECTED)
    assert set(EXPECTED.values()) <= {"ok", "refused"}
    assert set(COMPILED) <= {n for n, e in EXPECTED.items() if e == "ok"}
    with pytest.raises(ValueError, match="unknown case"):
        select("bert,nope")


def test_unchecked_encoder_decoders_are_refused_with_the_reason(tmp_path: Path) -> None:
    results = run_cases(select("bart"), tmp_path)
    assert unexpected(results) == [], markdown(results)
    for r in results:
        assert r.rc == 2 and not r.stages  # one error line, before anything is built
        assert "encoder-decoder (seq2seq)" in r.message and "write a recipe by hand" in r.message, r.message
        assert "T5ForConditionalGeneration and WhisperForConditionalGeneration only" in r.message, r.message
        assert str(tmp_path) not in r.message  # the table names no temporary folder


@pytest.mark.slow
def test_t5_and_whisper_compile_end_to_end(tmp_path: Path) -> None:
    """Both encoder-decoders through `compile --model FOLDER` (build only): the generation recipe auto writes, the
    export of the prefill and decode graphs (checked token for token against PyTorch), ORT, INT8 and fusion."""
    import yaml

    results = run_cases(select("t5,whisper"), tmp_path, size="small")
    print(markdown(results))
    assert unexpected(results) == [], markdown(results)
    for r in results:
        assert r.stages.get("ran", 0) >= 3 and not r.stages.get("failed"), (r.case, r.stages, r.message)
        recipe = yaml.safe_load((tmp_path / "runs" / r.case / "recipe.yaml").read_text())
        assert recipe["workload"] == "generation"
        task = {"t5": "text2text-generation", "whisper": "automatic-speech-recognition"}[r.case]
        assert recipe["model"]["task"] == task
        assert [p.get("name") or p["type"] for p in recipe["passes"]] == ["export", "ort_session", "int8_dynamic",
                                                                          "fuse"]


@pytest.mark.slow
def test_the_compiled_families_compile_end_to_end(tmp_path: Path) -> None:
    results = run_cases(select(",".join(COMPILED)), tmp_path)
    print(markdown(results))
    assert unexpected(results) == [], markdown(results)
    for r in results:
        assert r.stages.get("ran", 0) >= 2 and not r.stages.get("failed"), (r.case, r.stages)
        assert (tmp_path / "runs" / r.case / "recipe.yaml").is_file()
