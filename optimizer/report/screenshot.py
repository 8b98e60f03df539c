"""A PNG of report.html, taken by headless Chromium (Debian's chromium package), for people and for tests."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from optimizer.core.errors import OptimizerError

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess[str]:
    exe = chromium()
    if exe is None:
        raise OptimizerError("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [exe, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout
        )


def screenshot(html_file: Path, png: Path, width: int = 1150, height: int = 2200) -> Path:
    proc = _run([f"--screenshot={png}", f"--window-size={width},{height}", html_file.resolve().as_uri()])
    if not png.is_file():
        raise OptimizerError(f"chromium did not write {png}: {proc.stderr.strip()[-300:]}")
    return png


def rendered_dom(html_file: Path) -> str:
    """The page's DOM after Chromium has parsed and laid it out."""
    return _run(["--dump-dom", html_file.resolve().as_uri()]).stdout
