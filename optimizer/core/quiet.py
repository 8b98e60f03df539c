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
