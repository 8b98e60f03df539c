"""The pass registry and the type names: every registry key is its class's `name`, each pass is generic in the
Config it declares, and no class name means two things across optimizer/ and passes/."""

from __future__ import annotations

import ast
import typing
from collections import defaultdict
from pathlib import Path

import pytest

from optimizer.core.pass_base import Pass, PassConfig, PassNotes
from optimizer.core.registry import PASSES, UnknownPass, pass_class

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key", sorted(PASSES))
def test_every_registry_key_is_its_class_s_name(key: str) -> None:
    cls = pass_class(key)
    assert issubclass(cls, Pass)
    assert cls.name == key, f"registry key {key!r} loads {cls.__qualname__}, whose name is {cls.name!r}"
    assert PASSES[key].split(":")[1] == cls.__name__


@pytest.mark.parametrize("key", sorted(PASSES))
def test_every_pass_is_generic_in_the_config_it_declares(key: str) -> None:
    cls = pass_class(key)
    params = [typing.get_args(base) for base in getattr(cls, "__orig_bases__", ()) if typing.get_origin(base) is Pass]
    assert params == [(cls.Config,)], f"{cls.__name__} is Pass[{params}], its Config is {cls.Config.__name__}"
    assert issubclass(cls.Config, PassConfig)


@pytest.mark.parametrize("key", sorted(PASSES))
def test_every_pass_declares_a_notes_model(key: str) -> None:
    """A pass's notes are its Notes model (PassNotes: the keys read back typed, the rest kept): an empty account
    reads and writes back as empty."""
    cls = pass_class(key)
    assert issubclass(cls.Notes, PassNotes)
    assert cls.Notes.model_validate({}).to_json() == {}


def test_an_unknown_pass_names_the_known_ones() -> None:
    with pytest.raises(UnknownPass, match="unknown pass 'fusee' \\(known: .*fuse.*\\)"):
        pass_class("fusee")


def test_no_class_name_is_defined_twice() -> None:
    """One type per thing: a class name defined in two modules (measure's Speedup beside the report's, two
    `Unfused`) reads as one type and is two; the second gets a name that says what it is."""
    where: dict[str, list[str]] = defaultdict(list)
    for folder in ("optimizer", "passes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, twice
