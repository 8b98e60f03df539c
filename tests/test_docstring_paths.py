"""Files the code's docstrings and comments name by path (optimizer/..., passes/..., tests/..., scripts/...) exist:
eight named files that had moved (issue 50 item 5)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
NAMED = re.compile(r"(?<![\w./-])((?:optimizer|passes|tests|scripts|recipes|docs)/[\w./-]*\w\.(?:py|yaml|md|sh))\b")


def test_files_named_in_the_code_exist() -> None:
    missing = []
    for package in ("optimizer", "passes"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                for name in NAMED.findall(line):
                    if not (ROOT / name).exists() and not (ROOT / "optimizer" / name).exists():
                        missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, missing
