"""Encoder-decoder generation (runtime/seq2seq.py): small random-weight T5 and Whisper folders, our greedy loop against
transformers' own generate in PyTorch and in ONNX Runtime, the recipe `compile --model` writes for them, and a
measured pipeline (TTFT/TPOT, INT8 and fusion over both graphs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import write_recipe

from optimizer.core.errors import OptimizerError, RecipeError
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.accuracy import generation_agreement as agreement
from optimizer.recipe.auto import recipe_for_model
from optimizer.recipe.loading import load_recipe, parse_recipe
from optimizer.recipe.schema import Recipe
from optimizer.runtime.models import load_module
from optimizer.runtime.runners.gen_runner import ort_generator
from optimizer.runtime.seq2seq import OrtSeq2SeqGenerator, TorchSeq2SeqGenerator, cross_names, prompt_of

VOCAB = 300
MELS, SOURCE_POSITIONS = 16, 32  # Whisper's spectrogram: 16 mel bins x 64 frames
T5 = {"vocab_size": VOCAB, "d_model": 64, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
      "d_kv": 16, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
      "initializer_factor": 10.0}  # transformers' own init makes greedy repeat one token; these vary
WHISPER = {"vocab_size": VOCAB, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
           "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": MELS,
           "max_source_positions": SOURCE_POSITIONS, "max_target_positions": 64, "pad_token_id": 0,
           "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1, "suppress_tokens": [],
           "begin_suppress_tokens": [], "tie_word_embeddings": False, "init_std": 0.5}
BENCH = {"warmup": 1, "rounds": 2, "iterations": 1, "memory": "inline", "settle_ms": 5}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A T5ForConditionalGeneration and a WhisperForConditionalGeneration folder (d_model 64, 2 layers each)."""
    import transformers as tf

    tmp = tmp_path_factory.mktemp("seq2seq")
    torch.manual_seed(0)
    tf.T5ForConditionalGeneration(tf.T5Config(**T5)).save_pretrained(tmp / "t5")
    tf.WhisperForConditionalGeneration(tf.WhisperConfig(**WHISPER)).save_pretrained(tmp / "whisper")
    return {"t5": tmp / "t5", "whisper": tmp / "whisper"}


def _recipe(tmp: Path, folder: Path, **changes: Any) -> Recipe:
    """The recipe `compile --model FOLDER` writes, with `changes` (passes, scenarios...) and fast benchmark settings."""
    _, text = recipe_for_model(str(folder))
    data = {**yaml.safe_load(text), "benchmark": BENCH, "target": {"device": "cpu", "threads": 1}, **changes}
    return load_recipe(write_recipe(tmp, data))


def _prompt(kind: str, batch: int = 2) -> np.ndarray:
    rng = np.random.default_rng(1)
    if kind == "t5":
        return rng.integers(2, VOCAB, (batch, 12))
    return rng.uniform(-1, 1, (batch, MELS, 2 * SOURCE_POSITIONS)).astype(np.float32)


def hf_greedy(model: Any, kind: str, prompt: np.ndarray, new: int) -> np.ndarray:
    """transformers' generate, greedy, exactly `new` tokens (no EOS, so min_new_tokens suppresses nothing)."""
    if kind == "t5":
        ids = torch.from_numpy(prompt)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        inputs = {"input_features": torch.from_numpy(prompt)}
    out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[:, -new:].numpy()  # T5's starts with decoder_start_token_id, Whisper's generate drops it


def test_auto_writes_a_generation_recipe_for_t5_and_whisper(folders: dict[str, Path]) -> None:
    t5, t5_text = recipe_for_model(str(folders["t5"]))
    assert t5.workload == "generation" and t5.model.task == "text2text-generation"  # type: ignore[union-attr]
    assert [(i.name, i.shape) for i in t5.inputs] == [("input_ids", ["batch", "seq"])]
    assert [s.name for s in t5.scenarios] == ["low_latency_inference", "short_text_generation"]
    assert [p.stage_name for p in t5.passes] == ["export", "ort_session", "int8_dynamic", "fuse"]
    assert "decoder_start_token_id 0" in t5_text
    whisper, text = recipe_for_model(str(folders["whisper"]))
    assert whisper.model.task == "automatic-speech-recognition"  # type: ignore[union-attr]
    assert [(i.name, i.dtype, i.shape) for i in whisper.inputs] == [("input_features", "float32", ["batch", 16, 64])]
    assert [(s.name, s.seq, s.new_tokens) for s in whisper.scenarios] == [("audio-64frames-new8", 64, 8)]
    assert "not a prompt length" in text and whisper.accuracy.metric == "token_agreement"
    with pytest.raises(OptimizerError, match="built for the CPU only so far; use --device cpu"):
        recipe_for_model(str(folders["whisper"]), device="cuda")


def test_generation_takes_encoder_decoder_tasks_only_by_name(folders: dict[str, Path]) -> None:
    data = {"name": "x", "workload": "generation", "model": {"source": "hf_folder", "path": str(folders["t5"])},
            "inputs": [{"name": "input_ids", "shape": ["batch", "seq"]}], "scenarios": [{"name": "s"}]}
    with pytest.raises(RecipeError, match="causal-lm or text2text-generation or automatic-speech-recognition"):
        parse_recipe(data)
    data["model"]["task"] = "text2text-generation"
    assert parse_recipe(data).model.task == "text2text-generation"  # type: ignore[union-attr]
    assert prompt_of({"input_features": np.zeros(1)}).shape == (1,)
    with pytest.raises(OptimizerError, match="input_ids or input_features; the inputs are pixel_values"):
        prompt_of({"pixel_values": np.zeros(1)})


@pytest.mark.parametrize("kind", ["t5", "whisper"])
def test_torch_loop_matches_transformers_generate(tmp_path: Path, folders: dict[str, Path], kind: str) -> None:
    """Stage 0's loop (encoder once, then the decoder over EncoderDecoderCache) gives generate's tokens, twice."""
    module = load_module(_recipe(tmp_path, folders[kind]))
    prompt = _prompt(kind)
    expected = hf_greedy(module, kind, prompt, 10)
    gen = TorchSeq2SeqGenerator(module, 1)
    first, second = gen.generate(prompt, 10), gen.generate(prompt, 10, keep_logits=False)
    np.testing.assert_array_equal(first.tokens, expected)
    np.testing.assert_array_equal(second.tokens, expected)
    assert len(first.step_logits) == 10 and len(second.tpot_ms) == 9 and second.step_logits == []
    # Random weights, yet a real check: each row is more than one token repeated, and the source changes them.
    assert all(len(set(row)) > 1 for row in expected.tolist()) and (expected[0] != expected[1]).any()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["t5", "whisper"])
def test_onnx_loop_matches_transformers_generate(tmp_path: Path, folders: dict[str, Path], kind: str) -> None:
    """The exported pair: prefill outputs the cross-attention K/V once, decode takes them as fixed inputs and does
    not give them back; ONNX Runtime's tokens are generate's, its logits PyTorch's."""
    import onnx

    recipe = _recipe(tmp_path, folders[kind], passes=[{"type": "export"}])
    records = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    export = records[1]
    assert export.notes["check"]["token_agreement"] == 1.0 and export.artifact.layers == 2
    prefill = onnx.load(str(export.artifact.path), load_external_data=False).graph
    decode = onnx.load(str(export.artifact.decode_path()), load_external_data=False).graph
    cross = cross_names(2)
    assert [o.name for o in prefill.output][-4:] == cross
    assert {i.name for i in decode.input} >= set(cross) and not {o.name for o in decode.output} & set(cross)
    encoder = ["input_ids", "attention_mask"] if kind == "t5" else ["input_features"]
    assert [i.name for i in prefill.input] == encoder
    assert ("encoder_attention_mask" in {i.name for i in decode.input}) == (kind == "t5")
    module = load_module(recipe)
    prompt = _prompt(kind)
    expected = hf_greedy(module, kind, prompt, 10)
    onnx_gen = ort_generator(export.artifact, recipe)
    assert isinstance(onnx_gen, OrtSeq2SeqGenerator)
    ours = onnx_gen.generate(prompt, 10)
    np.testing.assert_array_equal(ours.tokens, expected)
    assert agreement(TorchSeq2SeqGenerator(module, 1).generate(prompt, 10), ours)["logits_cosine_min"] > 0.99999
    if kind == "t5":  # another source length and batch than the export's sample: the dims are dynamic
        short = _prompt(kind, batch=1)[:, :5]
        np.testing.assert_array_equal(onnx_gen.generate(short, 6).tokens, hf_greedy(module, kind, short, 6))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["t5", "whisper"])
def test_measured_pipeline_times_and_judges_every_stage(tmp_path: Path, folders: dict[str, Path], kind: str) -> None:
    """The recipe auto writes, measured: TTFT/TPOT per stage against its parent, token agreement with stage 0, INT8
    over both graphs, fusion's outcome stated."""
    scen = ({"name": "s", "batch": 1, "seq": 12, "new_tokens": 6} if kind == "t5"
            else {"name": "audio", "batch": 1, "seq": 64, "new_tokens": 6})
    # Whisper's stages also served once in a fresh process for their memory, as the recipe auto writes has it.
    bench = {**BENCH, "memory": "process"} if kind == "whisper" else BENCH
    recipe = _recipe(tmp_path, folders[kind], scenarios=[scen], benchmark=bench)
    records = Pipeline(recipe, tmp_path / "out").execute()
    by_name = {r.name: r for r in records}
    assert [r.name for r in records] == ["source", "export", "ort_session", "int8_dynamic", "fuse"]
    assert all(r.status != "failed" for r in records), [(r.name, r.reason) for r in records]
    for name in ("source", "export", "ort_session", "int8_dynamic"):
        m = by_name[name].metrics["scenarios"][scen["name"]]
        assert m["new_tokens"] == 6 and m["tpot"]["n"] == 2 * 5 and m["iterations"] == 2
        assert 0 < m["ttft"]["p50_ms"] < m["latency"]["p50_ms"]
        assert m["prompt_tokens"] == scen["seq"]  # T5: source tokens; Whisper: the spectrogram's frames
        assert by_name[name].metrics["runtime"]["cross_attention_cache"].startswith("computed once by prefill")
    assert by_name["export"].metrics["accuracy"]["generation"]["token_agreement"] == 1.0
    memory = by_name["export"].metrics["memory"]
    assert memory["method"] == bench["memory"] and memory.get("reason") is None, memory
    assert "vs_parent" in by_name["export"].metrics["scenarios"][scen["name"]]
    assert by_name["export"].metrics["nodes_executed"] > 10  # the decode graph profiled by ONNX Runtime
    int8 = by_name["int8_dynamic"]
    assert int8.status == "ran" and "DynamicQuantizeLinear" in int8.metrics["graph"]["op_types"]
    fuse = by_name["fuse"]  # kv_attention declines an encoder-decoder's graphs, saying why: nothing else to time
    assert fuse.status == "unchanged", (fuse.status, fuse.reason)
    assert "an encoder-decoder's graph" in fuse.notes["rules"]["kv_attention"]["skipped"]


def test_static_kv_cache_declines_encoder_decoders(tmp_path: Path, folders: dict[str, Path]) -> None:
    from optimizer.core.artifact import Artifact
    from optimizer.core.pass_base import PassContext
    from optimizer.measure.services import MeasureServices
    from passes.static_kv_cache import StaticKVCachePass

    recipe = _recipe(tmp_path, folders["t5"])
    ctx = PassContext(recipe, "static_kv_cache", tmp_path, None, MeasureServices())  # type: ignore[arg-type]
    reason = StaticKVCachePass(StaticKVCachePass.Config()).skip_reason(Artifact("torch", None), ctx)
    assert reason is not None and "encoder-decoder generation keeps transformers' dynamic cache" in reason


WHISPER_ENCODER = '''
import torch
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder


def encoder():
    torch.manual_seed(0)
    config = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                           num_mel_bins=16, max_source_positions=32)
    return WhisperEncoder(config).eval()
'''


@pytest.mark.slow
def test_a_whisper_encoder_factory_compiles_as_a_forward_model(tmp_path: Path) -> None:
    """Whisper's encoder alone from a factory: a spectrogram in, its states out (it was refused as a seq2seq)."""
    (tmp_path / "whisper_enc.py").write_text(WHISPER_ENCODER)
    target = f"{tmp_path / 'whisper_enc.py'}:encoder"
    recipe, text = recipe_for_model(target)
    assert recipe.workload == "forward" and recipe.outputs == ["last_hidden_state"]
    assert [(i.name, i.shape) for i in recipe.inputs] == [("input_features", ["batch", 16, 64])]
    data = {**yaml.safe_load(text), "benchmark": BENCH, "passes": [{"type": "export"}, {"type": "ort_session"}]}
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    assert [r.status for r in records] == ["ran", "ran", "ran"], [(r.name, r.reason) for r in records]
    assert records[1].metrics["accuracy"]["last_hidden_state"]["cosine"] > 0.9999
