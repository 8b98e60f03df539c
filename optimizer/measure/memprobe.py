"""Host memory of serving one stage, measured in a fresh process.

Resident-set growth inside the compile process says more about the allocator than about the stage: a stage
measured after another reuses the pages its predecessor freed (gpt2-cpu's static_kv_cache stage "grew" 62 MB
after stage 0's 402 MB for the same model), and stage 0 pays the libraries' one-time start-up. So each stage
is loaded in a new Python process that first imports the same libraries (numpy, onnxruntime, torch; the CUDA
context on a cuda target) and builds the inputs; then its peak resident set is reset to the current one
(/proc/self/clear_refs), the stage is loaded and run once per scenario (one call, or one whole generation), and
the peak (VmHWM) is read. The difference is what
serving this stage costs on top of the runtime, the same way for every stage.

    python -m optimizer.measure.memprobe < spec.json   (what `probe` runs; prints one JSON line)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.runtime.childpath import child_env

TIMEOUT_S = 900


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise OptimizerError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Start the high-water mark (VmHWM) from the current resident set. Not getrusage's ru_maxrss: Linux carries
    the parent's high-water mark across fork and exec, so a child of a big compile process starts "big".
    False where the kernel refuses: the peak then also covers the imports before the baseline."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def probe(artifact: Artifact, recipe: Any) -> dict[str, Any]:
    """{"peak_mb": ..., "runtime_mb": ...} from a fresh process, or {"reason": ...} when it could not run."""
    from optimizer.recipe.schema import recipe_dict

    spec = {"artifact": artifact.to_json(), "recipe": recipe_dict(recipe), "recipe_dir": str(recipe.base_dir)}
    # The child imports what this process can (a factory model's module may be importable only through this
    # process's sys.path), our package first: see runtime/childpath.py.
    env = child_env()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "optimizer.measure.memprobe"],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"reason": f"the memory probe took over {TIMEOUT_S} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"reason": f"the memory probe failed: {last}"}
    return dict(json.loads(lines[-1]))


def _serve_once(artifact: Artifact, recipe: Any, feeds: Any) -> None:
    """Load the stage as the benchmark does and run each scenario once."""
    if recipe.workload == "generation":
        from optimizer.runtime.runners.gen_runner import generator_for
        from optimizer.runtime.seq2seq import prompt_of

        gen = generator_for(artifact, recipe)
        for sf in feeds:
            gen.generate(prompt_of(sf.timing), sf.scenario.new_tokens, keep_logits=False)
        return
    from optimizer.runtime.runners import runner_for

    with runner_for(artifact, recipe).load() as session:
        for sf in feeds:
            session.run(session.prepare(sf.timing))


def main() -> None:
    import gc

    import numpy  # noqa: F401 - imported before the baseline on purpose: every probe pays the same
    import onnxruntime  # noqa: F401
    import torch

    from optimizer.core.quiet import silence_libraries
    from optimizer.recipe.loading import parse_recipe
    from optimizer.runtime.inputs import build_feeds

    silence_libraries()
    spec = json.loads(sys.stdin.read())
    recipe = parse_recipe(spec["recipe"], "report.json", Path(spec["recipe_dir"]))
    artifact = Artifact.from_json(spec["artifact"])
    if recipe.target.device == "cuda":
        torch.cuda.init()
    feeds = build_feeds(recipe, 1, per_scenario=False)
    gc.collect()
    reset = _reset_peak()
    baseline = _status_mb("VmRSS")
    _serve_once(artifact, recipe, feeds)
    result = {
        "peak_mb": round(_status_mb("VmHWM") - baseline, 1),  # what serving the stage must be provisioned for
        "steady_mb": round(_status_mb("VmRSS") - baseline, 1),  # still resident after the calls
        "runtime_mb": round(baseline, 1),  # the libraries and inputs, the same for every stage
    }
    print(json.dumps(result if reset else {**result, "note": "peak includes start-up (VmHWM not resettable)"}))


if __name__ == "__main__":
    main()
