"""Record what the onnxruntime-gpu wheel offers for the API-surface test, without installing it (it replaces
onnxruntime and needs CUDA to import): the methods of its Python IOBinding / InferenceSession / OrtValue classes
(parsed from its own source) and whether each provider and run option key we pass appears in its binaries.
Writes .cache/api-wheels/onnxruntime-gpu.json; the wheel (~300 MB) is deleted afterwards. Run by scripts/setup.sh.

    python scripts/ort_gpu_surface.py [--version 1.23.2]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
OUT = ROOT / ".cache" / "api-wheels" / "onnxruntime-gpu.json"
CLASSES = ("IOBinding", "InferenceSession", "Session", "OrtValue")


def python_api(source: str) -> dict[str, list[str]]:
    tree = ast.parse(source)
    return {
        node.name: sorted(n.name for n in node.body if isinstance(n, ast.FunctionDef))
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name in CLASSES
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="1.23.2")
    ap.add_argument("--if-stale", action="store_true", help="only when the record lacks a key the code passes now")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from optimizer.runtime.sessions import CUDA_PROVIDER_KEYS, CUDA_RUN_KEYS

    if args.if_stale and OUT.is_file():
        recorded = json.loads(OUT.read_text())
        if recorded.get("version") == args.version and set(recorded["keys"]) == {*CUDA_PROVIDER_KEYS, *CUDA_RUN_KEYS}:
            return

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
             f"onnxruntime-gpu=={args.version}"],
            check=True,
        )
        wheel = next(Path(tmp).glob("onnxruntime_gpu-*.whl"))
        found: dict[str, bool] = {k: False for k in (*CUDA_PROVIDER_KEYS, *CUDA_RUN_KEYS)}
        with zipfile.ZipFile(wheel) as z:
            api = python_api(z.read("onnxruntime/capi/onnxruntime_inference_collection.py").decode())
            for name in z.namelist():
                if not re.search(r"(providers_cuda|pybind11_state).*\.so$", name):
                    continue
                with z.open(name) as f:
                    tail = b""
                    while chunk := f.read(1 << 24):  # 16 MB at a time; the tail carries keys split across reads
                        window = tail + chunk
                        for key in found:
                            found[key] = found[key] or key.encode() in window
                        tail = chunk[-64:]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"version": args.version, "python_api": api, "keys": found}, indent=1))
    print(f"{OUT}: {sum(found.values())}/{len(found)} keys found, classes {sorted(api)}")


if __name__ == "__main__":
    main()
