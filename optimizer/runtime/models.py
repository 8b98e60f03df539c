"""Model sources -> a torch module with a fixed calling convention.

Every PyTorch model is wrapped so that it takes the recipe's inputs by name, in recipe order, and returns a
tuple of tensors in a fixed order. The same wrapper is what stage 0 runs and what the export pass exports, so
the ONNX graph's inputs and outputs line up with the reference by construction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.core.errors import OptimizerError
from optimizer.recipe.factory import load_factory
from optimizer.recipe.schema import FactorySource, HFConfigSource, HFFolderSource, OnnxSource, Recipe

if TYPE_CHECKING:
    import torch


def hf_folder(source: HFFolderSource, recipe: Recipe) -> Path:
    if source.package is None:
        return recipe.resolve(source.path)
    from optimizer.recipe.packages import package_dir

    base = package_dir(source.package)
    if base is None:
        raise OptimizerError(f"model.package: package {source.package!r} is not installed")
    folder = base / source.path
    if not folder.is_dir():
        raise OptimizerError(f"model.path: {folder} does not exist inside package {source.package!r}")
    return folder


def _auto_class(task: str) -> Any:
    import transformers

    from optimizer.core.quiet import silence_transformers

    silence_transformers()
    return {
        "feature-extraction": transformers.AutoModel,
        "causal-lm": transformers.AutoModelForCausalLM,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "image-classification": transformers.AutoModelForImageClassification,
        "text2text-generation": transformers.AutoModelForSeq2SeqLM,
        "automatic-speech-recognition": transformers.AutoModelForSpeechSeq2Seq,
    }[task]


def _folder_class(task: str, folder: Path) -> Any:
    """The class a folder is loaded with: the task's Auto class, except that feature extraction takes the base class
    the folder's config.json names when it names one (T5EncoderModel: AutoModel would build the whole T5Model,
    decoder weights missing)."""
    import transformers

    from optimizer.core.quiet import silence_transformers

    silence_transformers()  # no "Loading weights" bar, whichever class loads it
    if task == "feature-extraction":
        try:
            archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError):
            archs = []
        for arch in archs:
            if isinstance(arch, str) and arch.endswith("Model") and isinstance(getattr(transformers, arch, None), type):
                return getattr(transformers, arch)
    return _auto_class(task)


def _missing_weights(folder: Path, cls: Any, info: dict[str, Any]) -> str | None:
    """Why a load left parameters at random initial values (transformers' load report), or None: a model whose
    weights differ on every load would be optimized and judged on noise (ViTModel's pooler from a classifier's
    checkpoint)."""
    missing = sorted(info.get("missing_keys") or [])
    if not missing:
        return None
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        archs = []
    hint = next((f"model.task: {task}" for suffix, task in (("ForImageClassification", "image-classification"),
                ("ForSequenceClassification", "sequence-classification"), ("ForCausalLM", "causal-lm"))
                if any(str(a).endswith(suffix) for a in archs)), "the task the checkpoint was saved for")
    return (f"model.path: {folder} has no weights for {len(missing)} parameters of {cls.__name__} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they would be random on every load; "
            f"the checkpoint is {', '.join(map(str, archs)) or 'of another class'}: set {hint}")


def _config_of(source: HFConfigSource) -> Any:
    import transformers

    config_cls = {
        "gpt2": transformers.GPT2Config,
        "llama": transformers.LlamaConfig,
        "bert": transformers.BertConfig,
    }[source.architecture]
    try:
        return config_cls(**source.config)
    except TypeError as e:
        raise OptimizerError(f"model.config: {e}") from None


def config_param_bytes(source: HFConfigSource) -> int:
    """The FP32 bytes of the model an HF config builds, counted on PyTorch's meta device (nothing allocated)."""
    import torch

    with torch.device("meta"):
        module = _auto_class(source.task).from_config(_config_of(source))
    return sum(p.numel() * 4 for p in module.parameters())


def _from_config(source: HFConfigSource) -> torch.nn.Module:
    import torch

    config = _config_of(source)
    torch.manual_seed(source.seed)
    extra = {"attn_implementation": source.attn_implementation} if source.attn_implementation else {}
    return _auto_class(source.task).from_config(config, **extra)


def _from_factory(source: FactorySource, seed: int, base_dir: Path) -> torch.nn.Module:
    """The factory's module. Called with torch's, numpy's and Python's generators seeded (recipe.seed): stage 0,
    the export and any later process build the module more than once, and a factory that draws random weights
    without a seed of its own must give the same weights each time. The target is found as recipe/factory.py
    says: on Python's path, or beside the user or the recipe, or by its file's path."""
    import random

    import numpy as np
    import torch

    try:
        fn = load_factory(source.target, base_dir)
    except OptimizerError as e:
        raise OptimizerError(f"model.target: {e}") from None
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    return fn(**source.kwargs)


# The weights each factory built first in this process: a factory that gives other weights on a second call
# (seeded as above) would make stage 0 and the export two different models.
_FACTORY_WEIGHTS: dict[str, str] = {}


def _weights_digest(module: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def _check_deterministic(source: FactorySource, module: torch.nn.Module) -> None:
    key = json.dumps([source.target, source.kwargs], sort_keys=True, default=str)
    digest = _weights_digest(module)
    first = _FACTORY_WEIGHTS.setdefault(key, digest)
    if first != digest:
        raise OptimizerError(
            f"model.target: {source.target} built different weights on a second call, even with torch, numpy and "
            "random seeded (recipe.seed): make it deterministic (load weights from a file, or seed its own "
            "generator), or stage 0 and the export would be two different models"
        )


def load_module(recipe: Recipe) -> torch.nn.Module:
    """Build the source model (eval mode, FP32) without wrapping."""
    import torch

    source = recipe.model
    if isinstance(source, OnnxSource):
        raise OptimizerError("model: the source is an ONNX file; there is no PyTorch module")
    if isinstance(source, HFFolderSource):
        folder = hf_folder(source, recipe)
        cls = _folder_class(source.task, folder)
        try:
            extra = {"attn_implementation": source.attn_implementation} if source.attn_implementation else {}
            module, info = cls.from_pretrained(str(folder), output_loading_info=True, **extra)
        except (OSError, ValueError) as e:
            raise OptimizerError(f"model.path: cannot load a model from {folder} ({e})") from None
        if (why := _missing_weights(folder, cls, info)) is not None:
            raise OptimizerError(why)
    elif isinstance(source, HFConfigSource):
        module = _from_config(source)
    else:
        module = _from_factory(source, recipe.seed, recipe.base_dir)
        if isinstance(module, torch.nn.Module):
            _check_deterministic(source, module)
    if not isinstance(module, torch.nn.Module):
        raise OptimizerError(f"model: the source returned {type(module).__name__}, not a torch.nn.Module")
    return module.float().eval()


def flatten_outputs(out: Any) -> list[tuple[str, Any]]:
    """(name, tensor) pairs of a model output: ModelOutput/dict keys, tuple positions, or a single tensor."""
    import torch

    if isinstance(out, torch.Tensor):
        return [("output", out)]
    if isinstance(out, dict):  # transformers ModelOutput is a dict
        return [(k, v) for k, v in out.items() if isinstance(v, torch.Tensor)]
    if isinstance(out, (tuple, list)):
        return [(f"output_{i}", v) for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
    raise OptimizerError(f"model output of type {type(out).__name__} has no tensors")


class NamedIO:
    """Builds the wrapper module: inputs by name -> tuple of the selected outputs."""

    @staticmethod
    def wrap(module: torch.nn.Module, input_names: list[str], output_names: list[str]) -> torch.nn.Module:
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = module

            def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
                kwargs = dict(zip(input_names, args, strict=True))
                if getattr(self.model, "config", None) is not None and hasattr(self.model.config, "use_cache"):
                    kwargs["use_cache"] = False  # no KV cache outputs in the encoder/prefill graph
                found = dict(flatten_outputs(self.model(**kwargs)))
                return tuple(found[n] for n in output_names)

        return Wrapped().eval()


def discover_outputs(module: torch.nn.Module, input_names: list[str], sample: list[torch.Tensor]) -> list[str]:
    """Names of the tensor outputs the model returns for a sample input (ModelOutput keys)."""
    import torch

    kwargs = dict(zip(input_names, sample, strict=True))
    if getattr(module, "config", None) is not None and hasattr(module.config, "use_cache"):
        kwargs["use_cache"] = False
    with torch.inference_mode():
        return [name for name, _ in flatten_outputs(module(**kwargs))]
