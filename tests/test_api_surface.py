"""The GPU libraries' Python API as the project calls it, checked against the real packages on a machine without a
GPU. TensorRT: the bindings wheels of 10.x and 11.x (tensorrt-cu12-bindings, ~1.2 MB each, fetched by
scripts/setup.sh into .cache/api-wheels) import once the three libraries they link can be loaded; tiny stub
libraries with those sonames, compiled here with the system C compiler, satisfy the loader (the bindings call
into them only when an object is made, which these checks never do). Each major is introspected in its own
process. A test fails when the project uses a class, method, keyword or enum member a supported version lacks.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
WHEELS = ROOT / ".cache" / "api-wheels"
TRT_VERSIONS = {10: "10.13.3.9", 11: "11.4.0.106"}
TRT_SOURCES = [ROOT / "passes" / "tensorrt.py", ROOT / "optimizer" / "runtime" / "runners" / "trt_runner.py"]

# Members of TensorRT objects the project uses on instances (not reachable from `trt.` statically), by class.
TRT_MEMBERS = {
    "IProgressMonitor": ["phase_start", "step_complete", "phase_finish"],
    "ICudaEngine": [
        "get_tensor_name",
        "num_io_tensors",
        "get_tensor_mode",
        "get_tensor_dtype",
        "create_execution_context",
    ],
    "IExecutionContext": ["set_input_shape", "get_tensor_shape", "set_tensor_address", "execute_async_v3"],
    "TensorIOMode": ["INPUT", "OUTPUT"],
    "MemoryPoolType": ["WORKSPACE"],
    "HardwareCompatibilityLevel": ["AMPERE_PLUS", "SAME_COMPUTE_CAPABILITY"],
    "DataType": ["FLOAT", "HALF", "BF16", "INT8", "UINT8", "INT32", "INT64", "BOOL"],
}
# What Polygraphy's loaders call, unguarded, on the path we take (NetworkFromOnnxPath -> CreateConfig ->
# EngineBytesFromNetwork; EngineFromPath), read from polygraphy/backend/trt/{loader,config,util}.py 0.53.
TRT_THROUGH_POLYGRAPHY = {
    "Builder": ["create_network", "create_builder_config", "create_optimization_profile", "build_serialized_network"],
    "OnnxParser": ["parse_from_file", "get_error", "num_errors", "flags"],
    "IBuilderConfig": [
        "builder_optimization_level",
        "set_memory_pool_limit",
        "hardware_compatibility_level",
        "progress_monitor",
        "add_optimization_profile",
        "create_timing_cache",
        "set_timing_cache",
        "get_timing_cache",
        "profiling_verbosity",
    ],
    "ITimingCache": ["serialize", "combine"],
    "IOptimizationProfile": ["set_shape"],
    "Runtime": ["deserialize_cuda_engine"],
    "ILogger": ["log"],
    "Logger": ["INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE"],
    "NetworkDefinitionCreationFlag": ["STRONGLY_TYPED"],
    "ProfilingVerbosity": ["DETAILED"],
    "": ["init_libnvinfer_plugins"],
}
# Keywords Polygraphy passes on our path, by "Class.method".
TRT_KEYWORDS = {
    "IBuilderConfig.set_timing_cache": ["ignore_mismatch"],
    "ITimingCache.combine": ["ignore_mismatch"],
    "Builder.create_network": ["flags"],
}

STUB = """
void *createInferBuilder_INTERNAL(void *l, int v) { return 0; }
void *createInferRefitter_INTERNAL(void *e, void *l, int v) { return 0; }
void *createInferRuntime_INTERNAL(void *l, int v) { return 0; }
void *createNvOnnxParserRefitter_INTERNAL(void *r, void *l, int v) { return 0; }
void *createNvOnnxParser_INTERNAL(void *n, void *l, int v) { return 0; }
void *getBuilderPluginRegistry(int c) { return 0; }
int getNvOnnxParserVersion(void) { return 0; }
void *getPluginRegistry(void) { return 0; }
int initLibNvInferPlugins(void *l, const char *n) { return 1; }
"""

PROBE = """
import ctypes, json, sys
stubs, site, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for lib in ("nvinfer", "nvinfer_plugin", "nvonnxparser"):
    ctypes.CDLL(f"{stubs}/lib{lib}.so.{spec['major']}", mode=ctypes.RTLD_GLOBAL)
sys.path.insert(0, site)
import tensorrt_bindings as trt
missing = []
for chain in spec["chains"]:
    obj = trt
    for part in chain.split("."):
        if not hasattr(obj, part):
            missing.append(chain)
            break
        obj = getattr(obj, part)
for cls, members in spec["members"].items():
    for m in members:
        if not hasattr(getattr(trt, cls, None) if cls else trt, m):
            missing.append(f"{cls}.{m}")
for method, kws in spec["keywords"].items():
    cls, name = method.split(".")
    doc = getattr(getattr(trt, cls), name).__doc__ or ""
    missing += [f"{method}({kw}=)" for kw in kws if kw not in doc]
print(json.dumps({"version": trt.__version__, "missing": missing}))
"""


def _chain(node: ast.Attribute) -> str | None:
    """'Logger.WARNING' for `trt.Logger.WARNING` or `self.trt.Logger.WARNING`, else None."""
    parts: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        if cur.attr == "trt" and parts:
            return ".".join(reversed(parts))
        parts.append(cur.attr)
        cur = cur.value
    return ".".join(reversed(parts)) if isinstance(cur, ast.Name) and cur.id == "trt" else None


def trt_chains() -> set[str]:
    """Every `trt.X.Y` attribute chain in the TensorRT-using modules (AST, so comments and strings do not count)."""
    chains = {
        c
        for path in TRT_SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and (c := _chain(node))
    }
    return {c for c in chains if not c.startswith("_")}


def _bindings(major: int, tmp: Path) -> tuple[Path, Path]:
    wheel = next(WHEELS.glob(f"tensorrt_cu12_bindings-{TRT_VERSIONS[major]}-*.whl"), None)
    if wheel is None:
        pytest.fail(f"{WHEELS} has no tensorrt-cu12-bindings {TRT_VERSIONS[major]} wheel: run scripts/setup.sh")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler to build the stub TensorRT libraries")
    site, stubs = tmp / f"site{major}", tmp / f"stubs{major}"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    stubs.mkdir()
    (tmp / "stub.c").write_text(STUB)
    for lib in ("nvinfer", "nvinfer_plugin", "nvonnxparser"):
        so = f"lib{lib}.so.{major}"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(stubs / so), f"-Wl,-soname,{so}", str(tmp / "stub.c")],
                       check=True)
    return site, stubs


@pytest.mark.parametrize("major", sorted(TRT_VERSIONS))
def test_tensorrt_api_used_exists_in_each_major(major: int, tmp_path: Path) -> None:
    site, stubs = _bindings(major, tmp_path)
    chains = trt_chains()
    assert {"MemoryPoolType.WORKSPACE", "IProgressMonitor", "TensorIOMode.INPUT"} <= chains  # the scan sees our calls
    members = {**TRT_MEMBERS}
    for cls, names in TRT_THROUGH_POLYGRAPHY.items():
        members[cls] = members.get(cls, []) + names
    spec = {"major": major, "chains": sorted(chains), "members": members, "keywords": TRT_KEYWORDS}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(stubs), str(site), json.dumps(spec)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["version"] == TRT_VERSIONS[major]
    assert result["missing"] == [], f"TensorRT {result['version']} lacks: {result['missing']}"


def test_the_instance_member_table_matches_the_code() -> None:
    """Every member listed is really used, so the table cannot rot into checking names nobody calls."""
    source = "\n".join(p.read_text() for p in TRT_SOURCES)
    for cls, members in TRT_MEMBERS.items():
        for m in members:
            if cls in ("DataType", "HardwareCompatibilityLevel"):
                continue  # reached by name at run time (a dtype table, a config value upper-cased)
            assert f".{m}" in source or f"def {m}" in source, f"{cls}.{m} is listed but not used"


def test_a_name_missing_from_a_major_is_caught(tmp_path: Path) -> None:
    """The check itself: a member TensorRT 11 removed (EXPLICIT_BATCH) is reported missing there."""
    site, stubs = _bindings(11, tmp_path)
    spec = {"major": 11, "chains": ["NetworkDefinitionCreationFlag.EXPLICIT_BATCH"], "members": {}, "keywords": {}}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(stubs), str(site), json.dumps(spec)], capture_output=True, text=True
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1])["missing"] == [
        "NetworkDefinitionCreationFlag.EXPLICIT_BATCH"
    ]


# ---------------------------------------------------------------- onnxruntime (the GPU build has the same Python layer)
def test_onnxruntime_io_binding_api_exists() -> None:
    import onnxruntime as ort

    assert hasattr(ort.OrtValue, "ortvalue_from_numpy")
    binding_cls = ort.capi.onnxruntime_inference_collection.IOBinding
    for name in ("bind_ortvalue_input", "bind_output", "copy_outputs_to_cpu"):
        assert hasattr(binding_cls, name), name
    for name in ("io_binding", "run_with_iobinding", "get_providers"):
        assert hasattr(ort.InferenceSession, name), name
    options = ort.SessionOptions()
    for name in ("graph_optimization_level", "intra_op_num_threads", "inter_op_num_threads", "execution_mode"):
        assert hasattr(options, name), name


def test_nvml_names_exist() -> None:
    pynvml = pytest.importorskip("pynvml")
    source = (ROOT / "optimizer" / "runtime" / "gpu" / "nvml.py").read_text()
    import re

    used = set(re.findall(r"pynvml\.(nvml\w+)\(", source))
    assert {"nvmlInit", "nvmlShutdown", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetPowerUsage"} <= used
    missing = [n for n in sorted(used) if not callable(getattr(pynvml, n, None))]
    assert missing == [], f"nvidia-ml-py lacks {missing}"


def test_onnxruntime_gpu_offers_what_we_call() -> None:
    """Against the onnxruntime-gpu wheel itself (recorded by scripts/ort_gpu_surface.py from its Python source and
    binaries): the IO-binding methods, and every CUDA provider and run option key the runner passes."""
    import re

    from optimizer.runtime.sessions import CUDA_PROVIDER_KEYS, CUDA_RUN_KEYS

    path = WHEELS / "onnxruntime-gpu.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run scripts/setup.sh")
    surface = json.loads(path.read_text())
    api = surface["python_api"]
    for cls, names in {
        "IOBinding": ["bind_ortvalue_input", "bind_input", "bind_output", "copy_outputs_to_cpu"],
        "Session": ["io_binding", "run_with_iobinding", "get_providers"],
        "OrtValue": ["ortvalue_from_numpy", "update_inplace"],
    }.items():
        missing = [n for n in names if n not in api.get(cls, [])]
        assert not missing, f"onnxruntime-gpu {surface['version']} {cls} lacks {missing}"
    assert all(surface["keys"].values()), f"keys missing from onnxruntime-gpu: {surface['keys']}"
    source = (ROOT / "optimizer" / "runtime" / "runners" / "ort_runner.py").read_text()
    assert set(re.findall(r'add_run_config_entry\("(\w+)"', source)) <= set(CUDA_RUN_KEYS)
    assert set(CUDA_PROVIDER_KEYS) | set(CUDA_RUN_KEYS) == set(surface["keys"])


def test_provider_options_are_the_checked_keys() -> None:
    from optimizer.runtime.sessions import CUDA_PROVIDER_KEYS, providers_for

    (_, options), _ = providers_for({}, "cuda", compute_stream=1)
    assert set(options) <= set(CUDA_PROVIDER_KEYS)
