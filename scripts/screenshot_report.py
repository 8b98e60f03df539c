"""Save report.png beside a run's report.html (headless Chromium).

python scripts/screenshot_report.py runs/minilm-cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

from optimizer.report.screenshot import screenshot

if __name__ == "__main__":
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/minilm-cpu")
    print(screenshot(run / "report.html", run / "report.png"))
