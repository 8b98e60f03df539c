"""One informative line from a model library's error message, for a failed stage's reason.

torch.onnx.export's errors open with a banner ("Failed to export the model with torch.export. This is step 1/3 ...
Next steps:", with terminal colour codes) and give the actual problem further down, after "## Exception summary",
with the user's line of code after "The following call raised this error:". The first line says none of that.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CLASS = re.compile(r"^<class '(?:[\w.]+\.)?(\w+)'>:\s*")
_FILE = re.compile(r'^File "([^"]+)", line (\d+)')
# banner lines torch prints around the cause: they name no problem of the model
_BOILERPLATE = (
    "Failed to export the model with torch.export",
    "The error above occurred when calling",
    "(Refer to the full stack trace above",
    "For more information, run with",
    "For extended logs",
    "For C++ stack trace",
    "For more debugging help",
    "If you suspect the guard",
)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _call_site(lines: list[str]) -> str:
    """' (at file.py:33: `code`)' from torch's "The following call raised this error:" block, or ''."""
    for i, line in enumerate(lines):
        if line.startswith("The following call raised this error") and i + 1 < len(lines):
            m = _FILE.match(lines[i + 1])
            if m:
                code = lines[i + 2] if i + 2 < len(lines) and not _FILE.match(lines[i + 2]) else ""
                return f" (at {m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}" + (f": `{code}`)" if code else ")")
    return ""


def error_line(text: str, fallback: str = "") -> str:
    """The line of an error message that names the problem, without colour codes or the library's banner."""
    lines = [x.strip() for x in strip_ansi(text).splitlines() if x.strip()]
    if not lines:
        return fallback
    if "## Exception summary" in lines:  # torch.onnx's exporter: the cause follows this heading
        after = lines[lines.index("## Exception summary") + 1 :]
        if after:
            return _CLASS.sub(r"\1: ", after[0]) + _call_site(lines)
    for line in lines:
        if not line.startswith(_BOILERPLATE) and not line.startswith("- ") and not line.startswith("#"):
            return _CLASS.sub(r"\1: ", line)
    return lines[0]
