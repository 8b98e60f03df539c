"""Keep libraries' chatter (exporter step banners, warnings, progress bars) out of the terminal.

What they print is captured, not thrown away: the export pass keeps it in its stage notes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet(sink: io.StringIO | None = None) -> Iterator[io.StringIO]:
    sink = sink or io.StringIO()
    handler = logging.StreamHandler(sink)
    loggers = [logging.getLogger(n) for n in ("torch", "torch.onnx", "torch.export", "onnxscript", "transformers")]
    saved = [(lg, lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield sink
    finally:
        for lg, level, propagate in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def silence_transformers() -> None:
    """No weight-loading progress bars or advisory logs from transformers (our own progress is shown)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


@contextlib.contextmanager
def drop_native_lines(pattern: str, fd: int = 2) -> Iterator[None]:
    """Lines matching `pattern` written to file descriptor `fd` by native code (which quiet()'s Python-level
    redirect never sees, e.g. Kineto's "USDT: ... profiler_start" on every torch.profiler session) are dropped;
    the other lines are written through when the block ends."""
    import os
    import re
    import sys
    import tempfile

    regex = re.compile(pattern)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().splitlines(keepends=True)
            kept = [x for x in lines if not regex.search(x.decode(errors="replace"))]
            if kept:
                os.write(fd, b"".join(kept))
