"""Error types. Each carries a one-line message meant for the person at the terminal."""

from __future__ import annotations


class OptimizerError(Exception):
    """Base class: the CLI prints str(error) on one line and exits non-zero."""


class RecipeError(OptimizerError):
    """The recipe file is unreadable or invalid. The message names the file and the field path."""

    def __init__(self, path: str, field: str | None, message: str) -> None:
        self.path, self.field, self.message = path, field, message
        where = f"{path}: {field}" if field else path
        super().__init__(f"{where}: {message}")


class PassError(OptimizerError):
    """A pass failed for real (as opposed to declining with a skip reason)."""

    def __init__(self, stage: str, message: str, done: tuple[str, ...] = ()) -> None:
        self.stage, self.message, self.done = stage, message, done
        after = f" (after {', '.join(done)})" if done else ""
        super().__init__(f"stage {stage!r} failed{after}: {message}")


class InputError(OptimizerError):
    """Inputs in the recipe do not fit the model (names, dims, dtypes)."""
