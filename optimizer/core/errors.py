"""Error types. Each carries a one-line message meant for the person at the terminal."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """How to add an optional extra to this tool: from a clone of this repository (the package is not on PyPI;
    `optimizer` there is an unrelated project), or with the set-up script, which installs every extra."""
    return f"pip install -e '.[{extra}]' in a clone of this repository, or bash scripts/setup.sh"


class OptimizerError(Exception):
    """Base class: the CLI prints str(error) on one line and exits non-zero."""


class RecipeError(OptimizerError):
    """The recipe file is unreadable or invalid. The message names the file and the field path."""

    def __init__(self, path: str, field: str | None, message: str) -> None:
        self.path, self.field, self.message = path, field, message
        where = f"{path}: {field}" if field else path
        super().__init__(f"{where}: {message}")


class PassError(OptimizerError):
    """A pass failed for real (as opposed to declining with a skip reason). The pass gives the message; the
    pipeline, which knows them, adds the stage and the stages that ran before it (`in_stage`)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.stage: str | None = None
        self.done: tuple[str, ...] = ()
        super().__init__(message)

    def in_stage(self, stage: str, done: tuple[str, ...]) -> PassError:
        self.stage, self.done = stage, done
        return self

    def __str__(self) -> str:
        if self.stage is None:
            return self.message
        after = f" (after {', '.join(self.done)})" if self.done else ""
        return f"stage {self.stage!r} failed{after}: {self.message}"


class InputError(OptimizerError):
    """Inputs in the recipe do not fit the model (names, dims, dtypes)."""
