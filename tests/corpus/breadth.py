"""Model breadth (issue 33): `optimizer compile --model` end to end on a small random-weight model of each family
users bring, built offline from its transformers config class (no download, no tokenizer fetched).

Each case builds its model folder (or .onnx file) under OUT/models/<case>, then runs
`optimizer compile --model PATH --out OUT/runs/<case> --no-history [--no-bench]` as a subprocess with a time limit,
and reads what came back: the exit code, the wall time, report.json's stages (ran, skipped, failed) and best stage,
and for a refusal or failure the one error line. EXPECTED says what each case does today: "ok" (compiles end to
end; T5 and Whisper as encoder-decoder generation, runtime/seq2seq.py) or "refused" (the tool declines with one
clear line). An outcome other than the expected one, and any crash, is what the breadth run exists to catch.

Text encoders get a small word-level tokenizer (tokenizers' WordLevel over the sentences auto feeds, saved as
PreTrainedTokenizerFast), so the generated recipe takes the real-text path: sentences tokenized, the inputs the
tokenizer returns. T5, the T5 encoder and the decoders have none: their inputs are ids generated from the config's
vocab_size, as auto does for a folder without a tokenizer; Whisper's is a generated log-mel spectrogram.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The outcome of every case today. A change here is a change in what users can compile: say it in the README table.
EXPECTED: dict[str, str] = {
    "bert": "ok",
    "distilbert": "ok",
    "roberta": "ok",
    "xlm-roberta": "ok",
    "bert-seqcls": "ok",
    "vit-imgcls": "ok",
    "resnet-imgcls": "ok",
    "t5": "ok",
    "t5-encoder": "ok",
    "whisper": "ok",
    "bart": "refused",
    "gpt2": "ok",
    "llama": "ok",
    "qwen2": "ok",
    "mistral": "ok",
    "phi3": "ok",
    "onnx-external-data": "ok",
    "onnx-torchscript-bert": "ok",
}
SIZES = ("smallest", "small")
TIMEOUT_S = 900  # one case, build excluded
VOCAB = 256  # every text model's vocabulary: the tokenizer's words fit in it

# Dimensions by size: `smallest` is the least that still exercises the model (attention with 2 heads, one layer;
# decoders with grouped-query attention where the family has it); `small` doubles the width and depth.
_DIMS = {
    "smallest": {"hidden": 32, "ffn": 64, "layers": 1, "heads": 2, "kv_heads": 1, "positions": 128},
    "small": {"hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "kv_heads": 2, "positions": 256},
}


# ------------------------------------------------------------------ building the models
def _tokenizer(folder: Path, input_names: list[str]) -> None:
    """A word-level tokenizer over the sentences auto feeds (optimizer.recipe.auto.SENTENCES), with BERT's special
    tokens, saved beside the model; input_names: what it returns (RoBERTa's and DistilBERT's: no token_type_ids)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from optimizer.recipe.auto import SENTENCES

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w for s in SENTENCES for w in re.findall(r"\w+|[^\w\s]", s.lower())})
    vocab = {w: i for i, w in enumerate([*specials, *words])}
    assert len(vocab) <= VOCAB, len(vocab)
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_input_names=input_names, model_max_length=128)
    fast.save_pretrained(folder)


def _text_config(kind: str, d: dict[str, int]) -> Any:
    import transformers as tf

    if kind == "distilbert":
        return tf.DistilBertConfig(vocab_size=VOCAB, dim=d["hidden"], hidden_dim=d["ffn"], n_layers=d["layers"],
                                   n_heads=d["heads"], max_position_embeddings=d["positions"])
    common = {"vocab_size": VOCAB, "hidden_size": d["hidden"], "intermediate_size": d["ffn"],
              "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"]}
    if kind == "bert":
        return tf.BertConfig(**common, max_position_embeddings=d["positions"])
    cls = tf.RobertaConfig if kind == "roberta" else tf.XLMRobertaConfig  # positions start after the padding id
    return cls(**common, max_position_embeddings=d["positions"] + 2, type_vocab_size=1, pad_token_id=1,
               bos_token_id=0, eos_token_id=2)


def _encoder(kind: str, model_cls: str, names: list[str], **extra: Any) -> Callable[[Path, str], Path]:
    def build(folder: Path, size: str) -> Path:
        import transformers as tf

        config = _text_config(kind, _DIMS[size])
        for k, v in extra.items():
            setattr(config, k, v)
        getattr(tf, model_cls)(config).save_pretrained(folder)
        _tokenizer(folder, names)
        return folder

    return build


def _vit(folder: Path, size: str) -> Path:
    from transformers import ViTConfig, ViTForImageClassification

    d = _DIMS[size]
    config = ViTConfig(hidden_size=d["hidden"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                       intermediate_size=d["ffn"], image_size=32, patch_size=8, num_labels=5)
    ViTForImageClassification(config).save_pretrained(folder)
    return folder


def _resnet(folder: Path, size: str) -> Path:
    from transformers import ResNetConfig, ResNetForImageClassification

    d = _DIMS[size]
    widths = [d["hidden"] // 2, d["hidden"]]
    config = ResNetConfig(embedding_size=widths[0], hidden_sizes=widths, depths=[d["layers"]] * 2,
                          layer_type="basic", num_labels=5)
    ResNetForImageClassification(config).save_pretrained(folder)
    return folder


def _t5_config(size: str) -> Any:
    from transformers import T5Config

    d = _DIMS[size]
    return T5Config(vocab_size=VOCAB, d_model=d["hidden"], d_ff=d["ffn"], num_layers=d["layers"],
                    num_decoder_layers=d["layers"], num_heads=d["heads"], d_kv=d["hidden"] // d["heads"],
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def _t5(folder: Path, size: str) -> Path:
    from transformers import T5ForConditionalGeneration

    T5ForConditionalGeneration(_t5_config(size)).save_pretrained(folder)
    return folder


def _t5_encoder(folder: Path, size: str) -> Path:
    from transformers import T5EncoderModel

    T5EncoderModel(_t5_config(size)).save_pretrained(folder)
    return folder


def _whisper(folder: Path, size: str) -> Path:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    d = _DIMS[size]
    config = WhisperConfig(
        vocab_size=VOCAB, d_model=d["hidden"], encoder_layers=d["layers"], decoder_layers=d["layers"],
        encoder_attention_heads=d["heads"], decoder_attention_heads=d["heads"], encoder_ffn_dim=d["ffn"],
        decoder_ffn_dim=d["ffn"], num_mel_bins=16, max_source_positions=32, max_target_positions=d["positions"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[],
        begin_suppress_tokens=[])
    WhisperForConditionalGeneration(config).save_pretrained(folder)
    return folder


def _bart(folder: Path, size: str) -> Path:
    """An encoder-decoder auto has not checked (the seq2seq workload is built and tested for T5 and Whisper)."""
    from transformers import BartConfig, BartForConditionalGeneration

    d = _DIMS[size]
    config = BartConfig(vocab_size=VOCAB, d_model=d["hidden"], encoder_layers=d["layers"], decoder_layers=d["layers"],
                        encoder_attention_heads=d["heads"], decoder_attention_heads=d["heads"],
                        encoder_ffn_dim=d["ffn"], decoder_ffn_dim=d["ffn"], max_position_embeddings=d["positions"])
    BartForConditionalGeneration(config).save_pretrained(folder)
    return folder


def _decoder(family: str) -> Callable[[Path, str], Path]:
    def build(folder: Path, size: str) -> Path:
        import transformers as tf

        d = _DIMS[size]
        if family == "gpt2":
            config = tf.GPT2Config(vocab_size=VOCAB, n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"],
                                   n_positions=d["positions"], bos_token_id=0, eos_token_id=0)
            tf.GPT2LMHeadModel(config).save_pretrained(folder)
            return folder
        cls_config, cls_model = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM), "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        }[family]
        config = cls_config(
            vocab_size=VOCAB, hidden_size=d["hidden"], intermediate_size=d["ffn"], num_hidden_layers=d["layers"],
            num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], max_position_embeddings=d["positions"],
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
        if family == "phi3":  # Phi-3's default original_max_position_embeddings (4096) exceeds the tiny positions
            config.original_max_position_embeddings = d["positions"]
        cls_model(config).save_pretrained(folder)
        return folder

    return build


def _bert_for_export(size: str) -> Any:
    """BERT as ONNX exports usually have it: named inputs in, last_hidden_state out (no pooler), eager attention."""
    import torch
    from transformers import BertModel

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = _text_config("bert", _DIMS[size])
            config._attn_implementation = "eager"  # the attention older exports (and most on disk) have
            self.bert = BertModel(config, add_pooling_layer=False)

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    return Encoder().eval()


NAMES = ["input_ids", "attention_mask", "token_type_ids"]
AXES = {**{n: {0: "batch", 1: "seq"} for n in NAMES}, "last_hidden_state": {0: "batch", 1: "seq"}}


def _torchscript_bert(folder: Path, size: str) -> Path:
    """The TorchScript exporter's BERT (torch.onnx.export dynamo=False, opset 17): what most exported models on
    disk are."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        torch.onnx.export(_bert_for_export(size), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path),
                          dynamo=False, opset_version=17, input_names=NAMES, output_names=["last_hidden_state"],
                          dynamic_axes=AXES)
    return path


def _external_data(folder: Path, size: str) -> Path:
    """A BERT ONNX whose weights live in a file beside it (onnx.save_model save_as_external_data=True): how any
    model over 2 GB is saved, and what exporters write for large models."""
    import onnx

    tmp = folder / "_export"
    onnx_path = _torchscript_bert(tmp, size)
    model = onnx.load(str(onnx_path))
    path = folder / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    shutil.rmtree(tmp)
    assert (folder / "model.onnx.data").is_file()
    return path


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # as the README names it
    source: str  # what is handed to --model
    build: Callable[[Path, str], Path]


CASES: list[Case] = [
    Case("bert", "BERT", "BertModel folder + tokenizer",
         _encoder("bert", "BertModel", ["input_ids", "token_type_ids", "attention_mask"])),
    Case("distilbert", "DistilBERT", "DistilBertModel folder + tokenizer",
         _encoder("distilbert", "DistilBertModel", ["input_ids", "attention_mask"])),
    Case("roberta", "RoBERTa", "RobertaModel folder + tokenizer",
         _encoder("roberta", "RobertaModel", ["input_ids", "attention_mask"])),
    Case("xlm-roberta", "XLM-R", "XLMRobertaModel folder + tokenizer",
         _encoder("xlm-roberta", "XLMRobertaModel", ["input_ids", "attention_mask"])),
    Case("bert-seqcls", "BERT + head", "BertForSequenceClassification folder + tokenizer",
         _encoder("bert", "BertForSequenceClassification", ["input_ids", "token_type_ids", "attention_mask"],
                  num_labels=3)),
    Case("vit-imgcls", "ViT", "ViTForImageClassification folder", _vit),
    Case("resnet-imgcls", "ResNet (HF)", "ResNetForImageClassification folder", _resnet),
    Case("t5", "T5", "T5ForConditionalGeneration folder", _t5),
    Case("t5-encoder", "T5 encoder", "T5EncoderModel folder", _t5_encoder),
    Case("whisper", "Whisper", "WhisperForConditionalGeneration folder", _whisper),
    Case("bart", "BART", "BartForConditionalGeneration folder", _bart),
    Case("gpt2", "GPT-2", "GPT2LMHeadModel folder", _decoder("gpt2")),
    Case("llama", "Llama", "LlamaForCausalLM folder", _decoder("llama")),
    Case("qwen2", "Qwen2", "Qwen2ForCausalLM folder", _decoder("qwen2")),
    Case("mistral", "Mistral", "MistralForCausalLM folder", _decoder("mistral")),
    Case("phi3", "Phi-3", "Phi3ForCausalLM folder", _decoder("phi3")),
    Case("onnx-external-data", "ONNX, external data", "BERT .onnx + model.onnx.data", _external_data),
    Case("onnx-torchscript-bert", "BERT ONNX (TorchScript export)", "torch.onnx.export(dynamo=False), opset 17",
         _torchscript_bert),
]
assert [c.name for c in CASES] == list(EXPECTED)


def select(names: str | None) -> list[Case]:
    """The cases named (comma-separated), in the table's order; all of them for None."""
    if not names:
        return list(CASES)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in EXPECTED]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(EXPECTED)}")
    return [c for c in CASES if c.name in wanted]


# ------------------------------------------------------------------ running them
@dataclass
class Result:
    case: str
    family: str
    source: str
    expected: str
    outcome: str = "not run"  # ok | refused | failed | crash | timeout | build-error
    rc: int | None = None
    seconds: float = 0.0  # the compile's wall time (the build excluded)
    build_seconds: float = 0.0
    stages: dict[str, int] = field(default_factory=dict)  # status -> how many (stage 0 included)
    best: str | None = None
    message: str = ""  # the refusal, the failure or the crash, in one line
    command: str = ""
    measured: bool = False  # --bench: stages timed and judged against the accuracy budget (so a best stage)

    @property
    def as_expected(self) -> bool:
        return self.outcome == self.expected


def _env() -> dict[str, str]:
    """The compile's environment: offline (nothing fetched), and its library noise quiet."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return re.sub(r"\s+", " ", lines[-1]) if lines else ""


def _error_line(stderr: str) -> str:
    """The tool's one error line (`error: ...`, wrapped by the console over several lines), else the last line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", stderr)
    m = re.search(r"(?ms)^error: (.*)", text)
    if m:
        return re.sub(r"\s+", " ", m.group(1)).strip()
    return _last_line(text)


def _read_report(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_case(case: Case, out: Path, *, size: str = "smallest", bench: bool = False, timeout: float = TIMEOUT_S,
             debug: bool = False) -> Result:
    """Build the case's model under out/models/<case> (anew) and compile it into out/runs/<case> (anew)."""
    res = Result(case.name, case.family, case.source, EXPECTED[case.name], measured=bench)
    model_dir, run_dir = out / "models" / case.name, out / "runs" / case.name
    for d in (model_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    start = time.perf_counter()
    try:
        import torch

        from optimizer.core.quiet import quiet

        torch.manual_seed(0)
        with quiet():  # the exporters' and save_pretrained's chatter
            path = case.build(model_dir, size)
    except Exception as e:  # the script's or transformers' problem, not the tool's: said as such
        res.outcome, res.message = "build-error", f"{type(e).__name__}: {e}"
        res.build_seconds = time.perf_counter() - start
        return res
    res.build_seconds = time.perf_counter() - start
    cmd = [sys.executable, "-m", "optimizer.cli.app", *(["--debug"] if debug else []), "compile", "--model",
           str(path), "--out", str(run_dir), "--no-history", *([] if bench else ["--no-bench"])]
    res.command = " ".join(["optimizer", *cmd[3:]])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        res.seconds = time.perf_counter() - start
        res.outcome, res.message = "timeout", f"no result after {timeout:.0f} s"
        _read_stages(res, run_dir)
        return res
    res.seconds = time.perf_counter() - start
    res.rc = proc.returncode
    _read_stages(res, run_dir)
    res.outcome, res.message = _classify(proc.returncode, proc.stderr, res, run_dir)
    res.message = res.message.replace(f"--model {path}: ", "").replace(str(out) + os.sep, "")  # no temp paths
    return res


def _read_stages(res: Result, run_dir: Path) -> None:
    report = _read_report(run_dir)
    if report is None:
        return
    counts: dict[str, int] = {}
    for stage in report.get("stages") or []:
        status = stage.get("status", "?")
        status = "ran" if status == "cached" else status
        counts[status] = counts.get(status, 0) + 1
    res.stages = counts
    res.best = (report.get("best") or {}).get("stage")
    if report.get("failed_stages"):
        failed = [s for s in report["stages"] if s.get("status") == "failed"]
        res.message = "; ".join(f"{s['name']}: {_last_line(s.get('reason') or '')}" for s in failed)


def _classify(rc: int, stderr: str, res: Result, run_dir: Path) -> tuple[str, str]:
    if "Traceback (most recent call last)" in stderr or "run with --debug for the traceback" in stderr:
        return "crash", _last_line(stderr)
    if rc == 0:
        return "ok", res.message
    if rc == 2 and not (run_dir / "report.json").is_file():  # said no before building anything: one clear line
        return "refused", _error_line(stderr)
    return "failed", res.message or _error_line(stderr)


def run_cases(cases: list[Case], out: Path, *, size: str = "smallest", bench: bool = False,
              timeout: float = TIMEOUT_S, debug: bool = False,
              progress: Callable[[Result], None] | None = None) -> list[Result]:
    results = []
    for case in cases:
        results.append(run_case(case, out, size=size, bench=bench, timeout=timeout, debug=debug))
        if progress:
            progress(results[-1])
    return results


# ------------------------------------------------------------------ the table
def stages_cell(res: Result) -> str:
    if not res.stages:
        return "-"
    ran = res.stages.get("ran", 0)
    parts = [f"{ran} ran"]
    parts += [f"{res.stages[k]} {k}" for k in ("unchanged", "skipped", "failed", "not run") if res.stages.get(k)]
    return ", ".join(parts)


def outcome_cell(res: Result) -> str:
    cell = res.outcome if res.as_expected else f"{res.outcome} (expected {res.expected})"
    return cell


def rows(results: list[Result]) -> list[list[str]]:
    return [[r.family, r.source, outcome_cell(r), stages_cell(r), best_cell(r), f"{r.seconds:.0f}", r.message]
            for r in results]


def best_cell(res: Result) -> str:
    if res.best:
        return res.best
    return "none" if res.measured and res.stages else "-"  # not measured (--no-bench), or nothing ran


HEADER = ["model", "what --model is given", "outcome", "stages", "best", "seconds", "notes"]


def markdown(results: list[Result]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows(results)]
    return "\n".join(lines)


def unexpected(results: list[Result]) -> list[Result]:
    """The cases whose outcome is not the expected one (a crash never is)."""
    return [r for r in results if not r.as_expected]
