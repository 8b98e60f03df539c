"""Run every pass over the onnx package's test models and print the table (see tests/corpus/robustness.py).

python scripts/robustness_corpus.py [--details]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the corpus package (tests/corpus)

from corpus.robustness import corpus_dirs, run_corpus, table  # noqa: E402

from optimizer.core.quiet import quiet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--details", action="store_true", help="list every decline and mismatch with its reason")
    args = ap.parse_args()
    dirs = corpus_dirs()

    def progress(i: int, n: int, name: str) -> None:
        print(f"\r{i}/{n} {name[:50]:50}", end="", file=sys.stderr, flush=True)

    with quiet():
        result = run_corpus(dirs, progress)
    print(file=sys.stderr)
    print(table(result))
    if args.details:
        print("\nstage 0 declined:", *result.source_declined, sep="\n- ")
        for kind, entries in (("declined", result.declined), ("mismatched", result.mismatched)):
            for name, rows in entries.items():
                if rows:
                    print(f"\n{name} {kind}:", *rows, sep="\n- ")
    if result.crashed:
        print("\ncrashed:", *result.crashed, sep="\n- ")
        sys.exit(1)


if __name__ == "__main__":
    main()
