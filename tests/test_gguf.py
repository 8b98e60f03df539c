"""The GGUF the llama.cpp yardstick runs holds the same model our stages run (issue 44): a Llama built from a
config, written by optimizer.runtime.gguf_writer, generates the same greedy tokens in llama.cpp as in PyTorch,
with close logits; llama.cpp's quantizer makes smaller files of it. Needs llama-cpp-python
(`bash scripts/setup_llamacpp.sh`); skipped with that reason where it is not built."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from optimizer.recipe.schema import HFConfigSource

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not built: bash scripts/setup_llamacpp.sh")
pytest.importorskip("gguf")

CONFIG = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256, "bos_token_id": 1,
          "eos_token_id": 2, "tie_word_embeddings": False}


def model() -> object:
    from optimizer.runtime.models import _from_config

    source = HFConfigSource(source="hf_config", architecture="llama", task="causal-lm", config=CONFIG)
    return _from_config(source).float().eval()


def torch_greedy(m: object, prompt: list[int], new: int) -> tuple[list[int], list[np.ndarray]]:
    import torch

    ids = torch.tensor([prompt])
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(new):
            out = m(ids).logits[0, -1]  # type: ignore[operator]
            logits.append(out.numpy())
            tokens.append(int(out.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logits


def test_llamacpp_generates_what_pytorch_generates_from_the_written_gguf(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from compare_llamacpp import LlamaCppSide

    from optimizer.runtime.gguf_writer import quantize_gguf, write_llama_gguf

    m = model()
    path = write_llama_gguf(m, tmp_path / "m.gguf")
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 1000, 24)]
    want, want_logits = torch_greedy(m, prompt, 8)
    side = LlamaCppSide(path, threads=1, n_ctx=64)
    got = side.generate(np.array([prompt]), 8, keep_logits=True)
    assert list(got["tokens"]) == want
    for a, b in zip(got["logits"], want_logits, strict=True):
        assert float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) > 0.9999
    q8 = quantize_gguf(path, tmp_path / "q8.gguf", "Q8_0", threads=1)
    assert q8.stat().st_size < 0.5 * path.stat().st_size
    again = LlamaCppSide(q8, threads=1, n_ctx=64).generate(np.array([prompt]), 8)
    assert again["e2e"] > 0 and len(again["tokens"]) == 8 and len(again["tpot"]) == 7
