"""ONNX Runtime GenAI's model builder, run on the recipe's decoder: the graph GenAI's own runtime serves
(GroupQueryAttention with the rotary embedding inside, SkipSimplifiedLayerNormalization, one QKV MatMul per layer,
MatMulNBits for int4/int8 weights with int8 activations on the CPU), written from the model's weights.

We run the builder rather than rewrite its fusions by hand: it is Microsoft's maintained recipe for these
families (Olive's ModelBuilder pass calls it too), and the graph it writes is what GenAI's runtime, our yardstick
for decoders, runs. It runs in a child process (it imports its modules from its own folder, prints progress, and
keeps module state), with the Hugging Face cache and hub access pointed inside the stage folder and offline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError, install_hint
from optimizer.runtime.errortext import strip_ansi

# Files the builder writes beside the graph that GenAI's runtime reads (genai_config.json first).
GENAI_SIDE_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def genai_reason() -> str | None:
    """Why GenAI-layout stages cannot be built here, or None."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        return f"onnxruntime-genai is not installed ({install_hint('genai')})"
    return None


def write_source_folder(model: Any, folder: Path) -> bool:
    """The decoder as a Hugging Face folder the builder reads. The builder also insists on a tokenizer: a model
    built from a config has none, so a placeholder word-level tokenizer of the model's vocabulary is written (the
    generation loop feeds token ids; the placeholder is never used to encode text). Returns whether it was."""
    save = getattr(model, "save_pretrained", None)
    if save is None:
        raise OptimizerError(f"model: {type(model).__name__} is not a transformers model (no save_pretrained)")
    save(str(folder))
    if any((folder / name).exists() for name in TOKENIZER_FILES):
        return False
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(int(model.config.vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>").save_pretrained(str(folder))
    return True


def builder_args(
    source: Path, out: Path, cache: Path, precision: str, options: dict[str, Any]
) -> list[str]:
    args = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out)]
    args += ["-p", precision, "-e", "cpu", "-c", str(cache)]
    extra = [f"{k}={_text(v)}" for k, v in options.items() if v is not None]
    return args + (["--extra_options", *extra] if extra else [])


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def run_builder(
    source: Path, out: Path, precision: str, options: dict[str, Any], scratch: Path, timeout_s: float = 3600
) -> str:
    """Build into `out`; returns the builder's log. Raises OptimizerError with the builder's own last error line."""
    cache = scratch / "builder_cache"
    env = {
        **os.environ,
        "HF_HOME": str(scratch / "hf_home"),  # nothing written outside the stage folder
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    try:
        proc = subprocess.run(
            builder_args(source, out, cache, precision, options),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise OptimizerError(f"onnxruntime-genai's model builder ran past {timeout_s:.0f} s") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(scratch / "hf_home", ignore_errors=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise OptimizerError(f"onnxruntime-genai's model builder failed: {last_error(log)}")
    return log


def last_error(log: str) -> str:
    """The line that says why: the last exception line of the builder's traceback, else its last line."""
    lines = [x.strip() for x in strip_ansi(log).splitlines() if x.strip()]
    errors = [x for x in lines if ":" in x and x.split(":")[0].endswith(("Error", "Exception"))]
    return errors[-1] if errors else (lines[-1] if lines else "no output")
