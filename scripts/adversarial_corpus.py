"""Run the adversarial corpus (tests/corpus/adversarial.py) on the tiny test MLP and print cases tried / held.

python scripts/adversarial_corpus.py   (about a minute; exit 1 when any case broke)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the corpus package and the tiny models the recipe builds

from conftest import mlp_recipe  # noqa: E402
from corpus.adversarial import run_corpus, table  # noqa: E402

from optimizer.core.quiet import quiet  # noqa: E402


def main() -> None:
    with quiet():
        result = run_corpus(mlp_recipe())
    print(table(result))
    for line in result.broke:
        print("- broke:", line)
    sys.exit(1 if result.broke else 0)


if __name__ == "__main__":
    main()
