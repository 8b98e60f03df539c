"""Runner interface: load (a context manager) -> Session; Session.prepare is untimed, Session.run is timed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact


class Session(ABC):
    """A loaded model. `run` is the only thing the benchmark times."""

    output_names: list[str]

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        """Turn a feed into whatever `run` takes (device tensors, bindings); done once, untimed."""
        return feed

    @abstractmethod
    def run(self, prepared: Any) -> Any: ...

    @abstractmethod
    def to_numpy(self, outputs: Any) -> list[np.ndarray]: ...

    def describe(self) -> dict[str, Any]:
        """Runtime settings in effect, stated in the report."""
        return {}


class Runner(ABC):
    def __init__(self, artifact: Artifact, recipe: Any, device: str | None = None) -> None:
        self.artifact = artifact
        self.recipe = recipe
        self.device = device  # None = the recipe's target; "cpu" for numeric checks inside passes

    @property
    def target_device(self) -> str:
        return self.device or self.recipe.target.device

    @abstractmethod
    def _open(self) -> Session: ...

    def _close(self, session: Session) -> None:  # noqa: B027 - optional hook
        pass

    @contextmanager
    def load(self) -> Iterator[Session]:
        session = self._open()
        try:
            yield session
        finally:
            self._close(session)
