"""What a pass may read of the recipe, and the part of its stage's cache key that follows from it.

A pass declares the recipe fields it reads (`Pass.reads`, or `Pass.recipe_reads` where they depend on its config),
as dotted paths of the recipe: "accuracy.min", "target" (the whole section), "benchmark". The stage key holds
each declared field's value (`key_part`), and the pass gets the recipe as a `RecipeView` that answers only those
fields and the ones every stage key already holds (`KEYED`, below): reading any other field raises
UndeclaredRead. So a pass cannot depend on a part of the recipe its key leaves out, and editing that part (the
hybrid search's accuracy budget, say) builds the stage again instead of reusing one built under another value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from pydantic import BaseModel

from optimizer.recipe.schema import Recipe

# Fields every stage's key holds without a pass declaring them: stage 0's key (the model source, the digests of
# the files it reads, the workload where it is not the default) is the root of every parent chain, and every
# stage's key holds the feeds' hash (made from inputs, text, data_file, scenarios, seed and accuracy.samples) and
# target.device. base_dir: where the model's and the recipe's relative paths are found (Recipe.resolve).
KEYED: frozenset[str] = frozenset({
    "model", "base_dir", "inputs", "text", "data_file", "outputs", "scenarios", "seed", "workload",
    "accuracy.samples", "target.device",
})
# Readable by any pass without entering its key: the threads the sessions it opens to check, inspect or compile
# a model run with. What those sessions compute does not depend on them; what they time does, so timing (ctx.time,
# measure.services) requires TIMED, declared.
SESSION: frozenset[str] = frozenset({"target.threads"})
TIMED: tuple[str, ...] = ("target.threads", "benchmark")
# Methods of the recipe a view answers, and the field each reads.
METHODS: dict[str, str] = {"resolve": "base_dir"}


class UndeclaredRead(AssertionError):
    """A pass read a recipe field it does not declare (its stage key leaves it out): a bug of ours, not the user's.
    An AssertionError, so triage treats it as one (it fails loudly under tests and --debug)."""


def _covers(allowed: Iterable[str], path: str) -> bool:
    """Whether `path` is one of `allowed` or inside one ("target" covers "target.threads")."""
    return any(path == a or path.startswith(a + ".") for a in allowed)


class RecipeView:
    """A recipe (or one of its sections) that answers only what a pass may read: the fields it declares, KEYED and
    SESSION. A covered field gives its value as it is, a section holding some of them gives a view of it, anything
    else raises UndeclaredRead. Typed as the Recipe it stands for where a pass reads it (`restricted`)."""

    __slots__ = ("_obj", "_declared", "_allowed", "_prefix", "_who")

    def __init__(self, obj: BaseModel, declared: frozenset[str], prefix: str = "", who: str = "a pass") -> None:
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_declared", declared)
        object.__setattr__(self, "_allowed", declared | KEYED | SESSION)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_who", who)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        obj, path = self._obj, self._prefix + name
        if name in type(obj).model_fields:
            value = getattr(obj, name)
            if _covers(self._allowed, path):
                return value
            if isinstance(value, BaseModel) and any(a.startswith(path + ".") for a in self._allowed):
                return RecipeView(value, self._declared, path + ".", self._who)
            raise UndeclaredRead(
                f"{self._who} read recipe field {path!r}, which it does not declare (Pass.reads): its stage key "
                "would leave it out"
            )
        field = METHODS.get(path)
        if field is not None and _covers(self._allowed, field):
            return getattr(obj, name)
        if not hasattr(obj, name):
            raise AttributeError(name)
        raise UndeclaredRead(f"{self._who} used recipe {path}, which reads fields beyond what it declares")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the recipe a pass gets is read-only")

    def __reduce__(self) -> tuple[Any, ...]:  # ctx.map sends the context to worker processes
        return (RecipeView, (self._obj, self._declared, self._prefix, self._who))

    def __repr__(self) -> str:
        return f"RecipeView({self._prefix or 'recipe'}, declared={sorted(self._declared)})"


def restricted(recipe: Recipe, reads: Iterable[str], who: str = "a pass") -> Recipe:
    """The recipe as a pass that declares `reads` may read it: those fields, KEYED and SESSION."""
    return cast(Recipe, RecipeView(unwrap(recipe), frozenset(reads), "", who))


def unwrap(recipe: Recipe) -> Recipe:
    """The whole recipe behind a view (the engine's and the measure layer's own reads), or the recipe itself."""
    return cast(Recipe, recipe._obj) if isinstance(recipe, RecipeView) else recipe


def rewrap(like: Recipe, recipe: Recipe) -> Recipe:
    """`recipe` restricted as `like` is (a copy of the recipe handed to a worker, with what it may read)."""
    if isinstance(like, RecipeView):
        return cast(Recipe, RecipeView(unwrap(recipe), like._declared, "", like._who))
    return recipe


def require(recipe: Recipe, paths: Iterable[str], why: str) -> None:
    """Raise UndeclaredRead unless the pass behind `recipe` declares every one of `paths` (readable is not enough:
    SESSION fields count only when declared). Timing needs TIMED in the key, for one."""
    if not isinstance(recipe, RecipeView):
        return
    missing = [p for p in paths if not _covers(recipe._declared | KEYED, p)]
    if missing:
        raise UndeclaredRead(f"{recipe._who} uses {why}, which reads {', '.join(missing)}: declare them (Pass.reads)")


def key_part(recipe: Recipe, reads: Iterable[str]) -> dict[str, Any]:
    """The values of the declared fields, for the stage key: {path: JSON value}. Fields KEYED already are left
    out (the key holds them); an empty result adds nothing to the key, so a pass that reads nothing more keeps
    its key."""
    recipe = unwrap(recipe)
    part: dict[str, Any] = {}
    for path in sorted(set(reads)):
        if path in KEYED:
            continue
        value: Any = recipe
        for name in path.split("."):
            value = getattr(value, name)
        part[path] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return part
