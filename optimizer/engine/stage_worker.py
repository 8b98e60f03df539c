"""One stage built and measured in a worker process of its own, so that a stage the kernel kills for memory, or
one that crashes in native code, is recorded as failed with the cause while the run goes on, and so that what a
stage loaded is given back to the machine when it ends (a Python process rarely returns freed pages).

The worker is `python -m optimizer.engine.worker_process`: it reads the recipe, the records of the stages before it
and its own record from stdin, runs the stage with the same Pipeline code the compile process uses (the stage
folder, stage.json and metrics.json are written as an in-process stage writes them), reports progress as lines on
stderr and prints its filled record as the last line on stdout. The compile process holds the run folder's lock
meanwhile; the worker only writes into the stage's own folder and the run's reference file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from typing import Any, Protocol

from optimizer.core.stage import StageRecord


class StageRunner(Protocol):
    """What a worker is started from: the Pipeline (not imported here: the worker's process imports it)."""

    recipe: Any
    run: Any
    records: list[StageRecord]
    events: Any
    use_cache: bool
    measure: bool
    debug: bool

PROGRESS = "\x1eoptimizer-progress "  # a stderr line of the worker's progress (record separator: no file has it)
RESULT = "\x1eoptimizer-result "
# "STAGE:SIGNAL" (SIGNAL default SIGKILL): the worker of stage STAGE kills itself with it before running the stage,
# as the kernel's out-of-memory killer would; how the tests show a dying stage is recorded and the run goes on.
FAULT_ENV = "OPTIMIZER_INJECT_WORKER_DEATH"


class WorkerDied(Exception):
    """The worker ended without a result: killed, crashed, or exited early. `reason` is the stage's line."""

    def __init__(self, reason: str, peak_bytes: int | None) -> None:
        super().__init__(reason)
        self.reason, self.peak_bytes = reason, peak_bytes


def _death_reason(status: int, peak_kb: int, tail: list[str]) -> str:
    """The line a stage's record gets when its worker ended without a result."""
    peak = f"{peak_kb / 2**20:.1f} GiB"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        if sig == signal.SIGKILL:
            from optimizer.engine.memory_plan import available_bytes, gib

            return (f"the stage's worker was killed (SIGKILL) at a peak of {peak} resident, most likely by the "
                    f"kernel for memory ({gib(available_bytes())} available now); the run went on without it")
        return f"the stage's worker crashed ({name}, peak {peak} resident) in native code; the run went on"
    code = os.WEXITSTATUS(status)
    last = next((line for line in reversed(tail) if line.strip()), f"exit code {code}")
    return f"the stage's worker exited with code {code} before it finished: {last.strip()}"


def run_in_worker(pipe: StageRunner, rec: StageRecord) -> StageRecord:
    """Run `rec` in a worker and return the record it filled. Raises WorkerDied when it ended without one, and
    KeyboardInterrupt (after stopping the worker) when the compile is interrupted meanwhile."""
    from optimizer.recipe.schema import recipe_dict
    from optimizer.runtime.childpath import child_env

    spec = {
        "recipe": recipe_dict(pipe.recipe),
        "recipe_dir": str(pipe.recipe.base_dir),
        "out": str(pipe.run.root),
        "records": [r.to_json() for r in pipe.records[: rec.index]],
        "record": rec.to_json(),
        "use_cache": pipe.use_cache,
        "measure": pipe.measure,
        "debug": pipe.debug,
    }
    proc = subprocess.Popen([sys.executable, "-m", "optimizer.engine.worker_process"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            env=child_env())
    tail: deque[str] = deque(maxlen=40)
    out: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith(PROGRESS):
                what, done, total = json.loads(line[len(PROGRESS):])
                pipe.events.stage_progress(rec, what, done, total)
            else:
                tail.append(line.rstrip("\n"))

    def read_stdout() -> None:
        assert proc.stdout is not None
        out.extend(proc.stdout)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stderr, read_stdout)]
    try:
        assert proc.stdin is not None
        for t in readers:
            t.start()
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    except BaseException:  # Ctrl-C or SIGTERM: the worker goes too (its half-built folder is its own to remove)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    for t in readers:
        t.join(timeout=10)
    result = next((line for line in reversed(out) if line.startswith(RESULT)), None)
    if proc.returncode == 130:
        raise KeyboardInterrupt
    if pipe.debug and proc.returncode > 0:  # under tests and --debug a bug of ours fails loudly, as inline
        raise RuntimeError("the stage worker failed:\n" + "\n".join(tail))
    if result is None or proc.returncode != 0:
        raise WorkerDied(_death_reason(status, usage.ru_maxrss, list(tail)), usage.ru_maxrss * 1024)
    filled = StageRecord.from_json(json.loads(result[len(RESULT):]))
    if filled.metrics:  # measured: what the stage cost the machine goes beside what it measured
        filled.metrics["worker_peak_mb"] = round(usage.ru_maxrss / 1024, 1)
    return filled
