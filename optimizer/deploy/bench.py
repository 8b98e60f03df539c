"""`optimizer bench`: a bundle timed on its reference inputs by the same harness as compile, per scenario, holding
the host's bench slot, beside the P50 the run recorded for the stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from optimizer.deploy.generation import bench_generation
from optimizer.deploy.manifest import load_bundle
from optimizer.deploy.openvino_bundle import bench_openvino
from optimizer.deploy.shared import REFERENCE, bundle_session, feed_for, reference_feeds


def bench_bundle(root: Path, rounds: int, iterations: int) -> dict[str, Any]:
    """The bundle timed by the same harness as compile (alone: there is no parent), per reference scenario, holding
    the host's bench slot as compile's timings do (a compile's timing and this one never overlap)."""
    from optimizer.measure.bench_slot import bench_slot
    from optimizer.measure.harness import time_calls, warm_up
    from optimizer.measure.stats import latency_stats

    manifest = load_bundle(root)  # checked: files inside it and as exported, options and threads in bounds
    if manifest.get("workload") == "generation":
        with bench_slot(f"bench {root.name}"):  # its loading too: deploy.generation loads and times in one go
            return bench_generation(root, manifest, rounds, iterations)
    if "openvino" in (manifest.get("runtime") or {}):
        with bench_slot(f"bench {root.name}"):
            return bench_openvino(root, manifest, rounds, iterations)
    session = bundle_session(root, manifest)

    class Bare:
        def run(self, prepared: Any) -> Any:
            return session.run(None, prepared)

    out = {}
    with np.load(root / REFERENCE) as ref, bench_slot(f"bench {root.name}"):
        for scen, feed in reference_feeds(ref).items():
            feed = feed_for(feed, [i.name for i in session.get_inputs()], scen)
            warm_up(Bare(), feed, 5)  # type: ignore[arg-type]
            samples = [x for _ in range(rounds) for x in time_calls(Bare(), feed, iterations)]  # type: ignore[arg-type]
            out[scen] = {
                "latency": latency_stats(samples).to_json(),
                "recorded_p50_ms": manifest["benchmark"].get(scen, {}).get("latency", {}).get("p50_ms"),
            }
    return out
