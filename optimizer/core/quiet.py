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


def silence_libraries() -> None:
    """Our process's output is ours: no progress bars or info lines from the libraries we drive (transformers'
    "Loading weights" bars and advice, huggingface_hub's download bars, Polygraphy's `[I] Saving ...` lines),
    while their errors (and Polygraphy's warnings) still show. Called where our processes start (the command line,
    pool and Ray workers, the memory probe). Environment variables, which our child processes inherit and a user
    may set otherwise, cover the libraries not imported yet; the libraries' own switches those already imported
    (Polygraphy, which has no variable, also where we use it: silence_polygraphy)."""
    import os
    import sys

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars follow this too
    if "huggingface_hub" in sys.modules:
        with contextlib.suppress(ImportError, AttributeError):
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
    if "transformers" in sys.modules:
        silence_transformers()
    if "polygraphy" in sys.modules:  # not imported here otherwise: light commands import no heavy library
        silence_polygraphy()


def silence_polygraphy() -> None:
    """Polygraphy's logger down to its warnings and errors (no `[I] Saving ...` or `[I] Loading ...` lines), and
    without colours (they need the `colored` package, and without it Polygraphy prints a line saying so). Called
    where we use Polygraphy (deploy.export, runtime.crosscheck, the TensorRT runner): its logger is global."""
    try:
        from polygraphy.logger import G_LOGGER
    except ImportError:
        return
    G_LOGGER.module_severity = G_LOGGER.WARNING
    G_LOGGER.colors = False


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
