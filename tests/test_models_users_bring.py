"""Models users bring (issue 33, items 3 and 4): a folder is loaded as the class it was saved as, an image
classifier keeps its head and is judged by its top-1 class, and a load that leaves weights at random values is
refused with the reason instead of passing silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import mlp_recipe, write_recipe

from optimizer.core.errors import OptimizerError
from optimizer.recipe.auto import recipe_for_model
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.models import load_module

VIT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
       "image_size": 32, "patch_size": 8, "num_labels": 5}


@pytest.fixture(scope="module")
def vit_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import ViTConfig, ViTForImageClassification

    folder = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    ViTForImageClassification(ViTConfig(**VIT)).save_pretrained(folder)
    return folder


def _load(tmp_path: Path, model: dict) -> torch.nn.Module:
    inputs = [{"name": "pixel_values", "dtype": "float32", "shape": ["batch", 3, 32, 32]}]
    return load_module(load_recipe(write_recipe(tmp_path, mlp_recipe(model=model, inputs=inputs))))


def test_an_image_classifier_keeps_its_head_and_its_weights(tmp_path: Path, vit_classifier: Path) -> None:
    model = {"source": "hf_folder", "path": str(vit_classifier), "task": "image-classification"}
    first, second = _load(tmp_path, model), _load(tmp_path, model)
    assert type(first).__name__ == "ViTForImageClassification"
    x = torch.rand(1, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(first(pixel_values=x).logits, second(pixel_values=x).logits)  # no random weights


def test_a_load_with_missing_weights_is_refused_with_the_task_to_set(tmp_path: Path, vit_classifier: Path) -> None:
    """Loaded as the bare ViTModel, the pooler is not in the checkpoint: new random weights on every load."""
    with pytest.raises(OptimizerError, match=r"pooler\.dense.*random on every load.*model\.task: image-classification"):
        _load(tmp_path, {"source": "hf_folder", "path": str(vit_classifier)})


def test_a_t5_encoder_folder_loads_as_the_encoder(tmp_path: Path) -> None:
    from transformers import T5Config, T5EncoderModel

    folder = tmp_path / "t5enc"
    T5EncoderModel(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=100, d_kv=16)).save_pretrained(
        folder)
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 100]}]
    recipe = mlp_recipe(model={"source": "hf_folder", "path": str(folder)}, inputs=inputs)
    assert type(load_module(load_recipe(write_recipe(tmp_path, recipe)))).__name__ == "T5EncoderModel"


def test_generated_recipe_of_an_image_classifier_judges_its_logits(vit_classifier: Path) -> None:
    recipe, _ = recipe_for_model(str(vit_classifier))
    assert recipe.model.task == "image-classification"  # type: ignore[union-attr]
    assert recipe.outputs == ["logits"] and recipe.accuracy.metric == "top1"
