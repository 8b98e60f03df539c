"""Decoder runtime settings as stages: spinning, a thread pool shared by the prefill and decode sessions, thread
counts. Each is a session option the ort_session pass sets; here: the sessions get what was asked, the stage
records it, and the tokens do not change.

ONNX Runtime's shared (global) pool is process-wide: once created, ORT refuses every session with a pool of its
own. So whatever creates it runs in a subprocess (SHARED below), never in the test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_recipe
from test_generation import GPT2

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.runners.gen_runner import ort_generator
from optimizer.runtime.sessions import SPIN_KEYS, session_options, thread_settings
from passes.ort_session import SHARED_POOL_REASON

POOL = 2
PROMPT = np.random.default_rng(4).integers(1, 300, (1, 12))

# Run in a fresh process: the shared pool's session options, its one size, ORT's refusal of a per-session session
# once it exists, and the tokens of a generation artifact run on it (argv: recipe, artifact json, prompt json).
SHARED = """
import json, sys
import numpy as np
from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.runners.gen_runner import ort_generator
from optimizer.runtime.sessions import SPIN_KEYS, session_options, shared_pool

out = {}
so = session_options({"shared_thread_pool": True, "allow_spinning": False}, 2)
try:
    spin = so.get_session_config_entry(SPIN_KEYS[0])
except Exception:  # ORT raises for an entry never set
    spin = None
out["options"] = [so.use_per_session_threads, so.intra_op_num_threads, spin]
out["pool"] = shared_pool(2)
for call in (lambda: shared_pool(3), lambda: session_options({}, 2)):
    try:
        call()
    except OptimizerError as e:
        out.setdefault("errors", []).append(str(e))
recipe, art = load_recipe(sys.argv[1]), Artifact.from_json(json.loads(sys.argv[2]))
gen = ort_generator(art.with_runtime(shared_thread_pool=True), recipe)
out["per_session"] = [s.get_session_options().use_per_session_threads for s in (gen.prefill, gen.decode)]
out["tokens"] = gen.generate(np.array(json.loads(sys.argv[3])), 10).tokens.tolist()
print(json.dumps(out))
"""


def test_per_session_options_as_asked() -> None:
    own = session_options({"allow_spinning": False, "intra_op_threads": 1}, POOL)
    assert own.use_per_session_threads is True and own.intra_op_num_threads == 1
    assert all(own.get_session_config_entry(k) == "0" for k in SPIN_KEYS)
    assert thread_settings({"shared_thread_pool": True, "allow_spinning": False}, POOL) == {
        "pool": "shared",
        "intra_op_threads": POOL,
        "allow_spinning": True,  # the global pool spins: Python cannot set its spin control
    }


def _recipe(tmp: Path) -> Path:
    passes = [
        {"type": "export"},
        {"type": "ort_session"},
        {"type": "ort_session", "name": "shared_pool", "config": {"shared_thread_pool": True}},
        {"type": "ort_session", "name": "no_spin", "from": "ort_session", "config": {"allow_spinning": False}},
        {"type": "ort_session", "name": "one_thread", "config": {"intra_op_threads": 1}},
    ]
    data = {
        "name": "tiny-decoder-settings",
        "workload": "generation",
        "model": GPT2,
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [1, 300]}],
        "scenarios": [{"name": "s", "batch": 1, "seq": 12, "new_tokens": 10}],
        "target": {"threads": POOL},
        "benchmark": {"warmup": 1, "rounds": 2, "iterations": 1, "memory": "inline"},
        "accuracy": {"metric": "token_agreement", "min": 1.0, "samples": 1},
        "passes": passes,
    }
    return write_recipe(tmp, data)


@pytest.fixture(scope="module")
def settings_run(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    tmp = tmp_path_factory.mktemp("settings")
    path = _recipe(tmp)
    recipe = load_recipe(path)
    records = Pipeline(recipe, tmp / "out", measure=False).execute()
    assert all(r.ok or r.name == "shared_pool" for r in records), [(r.name, r.reason) for r in records]
    return recipe, {r.name: r for r in records}, path


@pytest.mark.slow
def test_each_setting_is_a_stage_that_records_what_its_sessions_run_with(settings_run: tuple) -> None:
    _, by, _ = settings_run
    threads = {name: by[name].notes["threads"] for name in ("ort_session", "no_spin", "one_thread")}
    assert threads == {
        "ort_session": {"pool": "per_session", "intra_op_threads": POOL, "allow_spinning": None},
        "no_spin": {"pool": "per_session", "intra_op_threads": POOL, "allow_spinning": False},
        "one_thread": {"pool": "per_session", "intra_op_threads": 1, "allow_spinning": False},
    }
    assert by["one_thread"].artifact.runtime["allow_spinning"] is False  # inherited from no_spin, its parent
    assert by["one_thread"].artifact.runtime["intra_op_threads"] == 1
    # The shared pool cannot be timed against a per-session parent in one process: skipped, with the reason.
    assert by["shared_pool"].status == "skipped" and by["shared_pool"].reason == SHARED_POOL_REASON


@pytest.mark.slow
def test_shared_pool_sessions_as_asked_and_same_tokens(settings_run: tuple, tmp_path: Path) -> None:
    recipe, by, path = settings_run
    art = by["ort_session"].artifact
    own = ort_generator(art, recipe)
    assert [s.get_session_options().use_per_session_threads for s in (own.prefill, own.decode)] == [True, True]
    expected = own.generate(PROMPT, 10).tokens
    for name in ("no_spin", "one_thread"):  # same graphs, other pools: the same tokens
        np.testing.assert_array_equal(ort_generator(by[name].artifact, recipe).generate(PROMPT, 10).tokens, expected)
    args = [str(path), json.dumps(art.to_json()), json.dumps(PROMPT.tolist())]
    proc = subprocess.run([sys.executable, "-c", SHARED, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Session options: the global pool, no per-session sizes (ORT would only warn they are ignored), no spin entry.
    assert out["options"] == [False, 0, None]
    assert out["pool"] == {"intra_op_threads": POOL, "inter_op_threads": 1, "allow_spinning": True}
    assert out["errors"][0].startswith(f"runtime.shared_thread_pool: this process's shared pool has {POOL} intra-op")
    assert "refuses a session with a pool of its own" in out["errors"][1]
    assert out["per_session"] == [False, False]  # both the prefill and the decode session on the shared pool
    np.testing.assert_array_equal(np.array(out["tokens"]), expected)
