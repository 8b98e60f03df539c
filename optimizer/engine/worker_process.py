"""The stage worker's process (`python -m optimizer.engine.worker_process`, started by engine.stage_worker): the
recipe, the earlier stages' records and its own record from stdin; the stage run with the Pipeline's own code;
progress on stderr, the filled record as the last stdout line."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from optimizer.core.stage import StageRecord
from optimizer.engine.stage_worker import FAULT_ENV, PROGRESS, RESULT


class _WorkerEvents:
    def stage_start(self, rec: StageRecord) -> None: ...

    def stage_progress(self, rec: StageRecord, what: str, done: int, total: int) -> None:
        sys.stderr.write(PROGRESS + json.dumps([what, done, total]) + "\n")
        sys.stderr.flush()

    def stage_end(self, rec: StageRecord) -> None: ...


def main() -> None:
    from optimizer.core.quiet import silence_libraries
    from optimizer.engine.pipeline import Pipeline
    from optimizer.engine.reference_files import feeds_hash
    from optimizer.recipe.loading import parse_recipe
    from optimizer.runtime.inputs import build_feeds

    silence_libraries()
    spec = json.loads(sys.stdin.read())
    recipe = parse_recipe(spec["recipe"], "report.json", Path(spec["recipe_dir"]))
    pipe = Pipeline(recipe, Path(spec["out"]), events=_WorkerEvents(), use_cache=spec["use_cache"],
                    measure=spec["measure"], debug=spec["debug"])
    pipe.records = [StageRecord.from_json(d) for d in spec["records"]]
    rec = StageRecord.from_json(spec["record"])
    pipe.records.append(rec)
    pipe.feeds = build_feeds(recipe, recipe.accuracy.samples)
    pipe.feeds_key = feeds_hash(pipe.feeds)
    pipe.isolated = True  # what the stage's measurement knows of where it runs (its memory: this fresh process)
    fault = os.environ.get(FAULT_ENV, "")
    if fault.partition(":")[0] == rec.name:  # injected: this stage's worker dies as the kernel would kill it
        os.kill(os.getpid(), getattr(signal, fault.partition(":")[2] or "SIGKILL"))
    try:
        pipe.run_stage_here(rec)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.stdout.write("\n" + RESULT + json.dumps(rec.to_json()) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

