"""Issue 47, class 6: a recipe file is read once, strictly: text that is not UTF-8, a key given twice, and aliases
that expand beyond a bound (in values or in characters) are refused at load, one line naming the file and where,
exit 2 from validate; nothing is taken silently as the last value or left to die of MemoryError in compile."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import mlp_recipe

from optimizer.cli.app import main
from optimizer.core.errors import RecipeError
from optimizer.recipe.loading import load_recipe


def _text() -> str:
    return yaml.safe_dump(mlp_recipe(description="café"), sort_keys=False, allow_unicode=True)


def _validate(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["validate", str(path)])
    return int(e.value.code or 0), capsys.readouterr().err


def test_latin1_recipe_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(_text().encode("latin-1"))
    with pytest.raises(RecipeError, match="UTF-8"):
        load_recipe(path)
    code, err = _validate(path, capsys)
    assert code == 2 and str(path) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("key", ["passes", "name", "seed"])
def test_a_key_given_twice_is_refused(tmp_path: Path, key: str) -> None:
    path = tmp_path / "r.yaml"
    extra = {"passes": "passes: []\n", "name": "name: other\n", "seed": "seed: 1\nseed: 2\n"}[key]
    path.write_text(_text() + extra)
    with pytest.raises(RecipeError, match=f"'{key}' given twice"):
        load_recipe(path)


def test_a_nested_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(_text().replace("  threads: 1\n", "  threads: 1\n  threads: 2\n"))
    with pytest.raises(RecipeError, match="'threads' given twice"):
        load_recipe(path)


def test_aliases_of_a_long_string_are_refused_at_load(tmp_path: Path) -> None:
    """0.9 MB of text whose aliases expand to gigabytes: refused before anything builds on it."""
    lines = ["big: &big " + "x" * 900_000, "l0: &l0 [*big, *big, *big, *big, *big, *big, *big, *big, *big, *big]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 4)]
    path = tmp_path / "r.yaml"
    path.write_text("\n".join(lines) + "\n" + _text())
    assert path.stat().st_size < 1 << 20
    with pytest.raises(RecipeError, match="expand"):
        load_recipe(path)


def test_a_real_recipe_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(_text())
    assert load_recipe(path).name == "tiny-mlp"
