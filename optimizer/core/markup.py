"""The one writer of text we generate from a model into YAML and Markdown (HTML has html.escape in report/html.py).

A tensor name, a file name, a reason or a finding is a value, whatever it holds: in YAML it is written by the
emitter (yaml_document), the header comments included (one_line: a comment cannot be broken out of once no line
break is left in it); in Markdown it stays inside its line and its table cell (md_inline).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import yaml

# What may not stand raw in one comment line of YAML: its line breaks and what its reader refuses as non-printable
# (ESC among them: a YAML file holding one fails to load at all).
_NOT_IN_A_LINE = re.compile("[^\\x09\\x20-\\x7e\\xa0-\\u2027\\u202a-\\ud7ff\\ue000-\\ufffd\\U00010000-\\U0010ffff]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text: str) -> str:
    """`text` on one line that every YAML reader takes: line breaks and non-printable characters as their escapes
    (newline -> \\x0a), the rest unchanged."""
    return _NOT_IN_A_LINE.sub(_escape, str(text))


def yaml_document(data: Any, header: Iterable[str] = (), dumper: type[yaml.SafeDumper] = yaml.SafeDumper,
                  **kwargs: Any) -> str:
    """A YAML file: each header entry as one comment line, then `data` written by the emitter."""
    comments = "".join(f"# {one_line(h)}\n" for h in header)
    return comments + yaml.dump(data, Dumper=dumper, sort_keys=False, **kwargs)


_MD_SPECIAL = {"|": "\\|", "<": "&lt;", "&": "&amp;"}


def md_inline(text: Any) -> str:
    """`text` as Markdown that stays in its line and its table cell: line breaks become spaces, `|` is escaped,
    a `<` that would open an HTML tag and an `&` that would spell an entity become entities (a viewer renders no
    HTML from it; "P99 <= 5 ms" stays as it is), control characters are their escapes."""
    flat = re.sub("\r\n|[\n\r\x0b\x0c\x85\u2028\u2029]", " ", str(text))
    flat = re.sub("[|]|<(?=[A-Za-z/!?])|&(?=#|[A-Za-z]+;)", lambda m: _MD_SPECIAL[m[0]], flat)
    return re.sub("[\\x00-\\x08\\x0e-\\x1f\\x7f-\\x9f]", _escape, flat)
