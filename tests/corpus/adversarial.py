"""Adversarial corpus: the classes of bad input an adversarial user tries (issue: nothing written outside,
nothing trusted blindly), each case run in-process and judged "held" or not.

Held means: bad recipes are refused at load with a RecipeError naming the field; a tampered bundle gives a list
of problems and reads nothing outside it; a tampered run folder is rebuilt or measured again, and says so;
unreadable history or reports are one OptimizerError. Anything else (a raw exception, a silent acceptance) is
"broke", with what happened. `scripts/adversarial_corpus.py` prints the table; tests/test_adversarial.py runs it.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError, RecipeError

BAD_NAMES = ["..", ".", "/", "a/../../b", "/etc/passwd", "a\x00b", "x" * 65, "a|b", "-a", ".hidden", "a b", ""]
BAD_NUMBERS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("accuracy.min nan", lambda d: d["accuracy"].update(min=math.nan)),
    ("accuracy.min inf", lambda d: d["accuracy"].update(min=math.inf)),
    ("accuracy.max -inf", lambda d: d["accuracy"].update(max=-math.inf)),
    ("accuracy.samples 0", lambda d: d["accuracy"].update(samples=0)),
    ("scenario batch 0", lambda d: d["scenarios"][0].update(batch=0)),
    ("scenario batch -1", lambda d: d["scenarios"][0].update(batch=-1)),
    ("scenario seq 0", lambda d: d["scenarios"][0].update(seq=0)),
    ("input dim -3", lambda d: d["inputs"][0].update(shape=["batch", -3])),
    ("input range reversed", lambda d: d["inputs"][0].update(range=[1.0, 0.0])),
    ("input range nan", lambda d: d["inputs"][0].update(range=[math.nan, 1.0])),
    ("input range inf", lambda d: d["inputs"][0].update(range=[0.0, math.inf])),
    ("benchmark rounds 0", lambda d: d["benchmark"].update(rounds=0)),
    ("benchmark rounds -1", lambda d: d["benchmark"].update(rounds=-1)),
    ("benchmark iterations 0", lambda d: d["benchmark"].update(iterations=0)),
    ("benchmark warmup -1", lambda d: d["benchmark"].update(warmup=-1)),
    ("sweep batch 0", lambda d: d.update(batch_sweep={"batches": [0, 1], "latency_budget_ms": 5})),
    ("sweep batch -4", lambda d: d.update(batch_sweep={"batches": [-4], "latency_budget_ms": 5})),
    ("sweep no batches", lambda d: d.update(batch_sweep={"batches": [], "latency_budget_ms": 5})),
    ("sweep budget 0 ms", lambda d: d.update(batch_sweep={"batches": [1], "latency_budget_ms": 0})),
    ("threads 0", lambda d: d["target"].update(threads=0)),
]


@dataclass
class Outcome:
    tried: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    broke: list[str] = field(default_factory=list)

    def add(self, kind: str, name: str, fn: Callable[[], bool | str]) -> None:
        self.tried[kind] = self.tried.get(kind, 0) + 1
        try:
            result = fn()
        except Exception as e:  # the corpus records every escape instead of stopping
            result = f"{type(e).__name__}: {str(e)[:120]}"
        if result is True:
            self.held[kind] = self.held.get(kind, 0) + 1
        else:
            self.broke.append(f"{kind} / {name}: {result or 'accepted'}")


def _refused(load: Callable[[], Any], error: type[Exception] = RecipeError) -> bool | str:
    """Held when `load` raises `error` (our one-line errors); anything else escapes to Outcome.add."""
    try:
        load()
    except error:
        return True
    return "accepted"


def recipe_cases(out: Outcome, base: dict[str, Any], work: Path) -> None:
    from optimizer.recipe.loading import load_recipe, parse_recipe

    def parse(data: dict[str, Any]) -> Callable[[], Any]:
        return lambda: parse_recipe(data, "adversarial.yaml", work)

    for where in ("recipe", "stage", "scenario"):
        for name in BAD_NAMES:
            data = copy.deepcopy(base)
            if where == "recipe":
                data["name"] = name
            elif where == "stage":
                data["passes"][0]["name"] = name
            else:
                data["scenarios"][0]["name"] = name
            out.add("1 names become paths", f"{where} {name!r}", lambda d=data: _refused(parse(d)))
    for label, change in BAD_NUMBERS:
        data = copy.deepcopy(base)
        change(data)
        out.add("3 impossible numbers", label, lambda d=data: _refused(parse(d)))

    def write(name: str, text: str) -> Callable[[], Any]:
        path = work / name
        path.write_text(text)
        return lambda: load_recipe(path)

    bomb = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    yaml_cases = {
        "alias bomb": "\n".join(bomb) + "\nname: bomb\n",
        "deep nesting": "name: deep\ndescription: " + "[" * 5000 + "]" * 5000 + "\n",
        "3 MB file": "name: huge\ndescription: " + "x" * 3_000_000 + "\n",
        "a list, not a mapping": "- a\n- b\n",
        "binary garbage": "\x00\x01\x02\xff" * 100,
        "python tag": "name: !!python/object/apply:os.system ['true']\n",
    }
    for label, text in yaml_cases.items():
        out.add("6 code that runs unasked", f"YAML {label}", lambda t=text, n=label: _refused(write(f"{n}.yaml", t)))

    def package_not_imported() -> bool | str:
        import sys

        site = work / "site"
        pkg = site / "sneaky_pkg"
        (pkg / "models" / "mini").mkdir(parents=True, exist_ok=True)
        marker = work / "imported"
        for init in (pkg / "__init__.py", pkg / "models" / "__init__.py"):
            init.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
        data = copy.deepcopy(base)
        data["model"] = {"source": "hf_folder", "package": "sneaky_pkg.models", "path": "mini"}
        sys.path.insert(0, str(site))
        try:
            parse_recipe(data, "adversarial.yaml", work)
        finally:
            sys.path.remove(str(site))
        return True if not marker.exists() else "validate imported the package"

    out.add("6 code that runs unasked", "hf_folder package with side effects", package_not_imported)


def bundle_cases(out: Outcome, bundle_dir: Path, work: Path) -> None:
    from optimizer.deploy import manifest as bundle_manifest
    from optimizer.deploy.verify import verify_bundle

    manifest = json.loads((bundle_dir / bundle_manifest.MANIFEST).read_text())
    (work / "outside.txt").write_text("not the bundle's")

    def tampered(change: Callable[[Path, dict[str, Any]], None], expect: str) -> Callable[[], bool | str]:
        def run() -> bool | str:
            root = work / "b"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(bundle_dir, root)
            m = copy.deepcopy(manifest)
            (root / bundle_manifest.MANIFEST).write_text(json.dumps(m))
            change(root, m)  # changes the files, or the manifest (then written again below)
            if m != manifest:
                (root / bundle_manifest.MANIFEST).write_text(json.dumps(m))
            read: list[Path] = []
            real = bundle_manifest.file_sha256
            bundle_manifest.file_sha256 = lambda p, *a: (read.append(Path(p).resolve()), real(p, *a))[1]  # type: ignore
            try:
                problems = verify_bundle(root)
            finally:
                bundle_manifest.file_sha256 = real
            if any(not p.is_relative_to(root.resolve()) for p in read):
                return "read a file outside the bundle"
            return True if any(expect in p for p in problems) else f"problems: {problems}"

        return run

    model = manifest.get("model") or next(iter(manifest["files"]))
    cases: dict[str, tuple[Callable[[Path, dict[str, Any]], None], str]] = {
        "file name ../": (lambda r, m: m["files"].update({"../outside.txt": "0" * 64}), "outside"),
        "absolute file name": (lambda r, m: m["files"].update({str(work / "outside.txt"): "0" * 64}), "outside"),
        "model path ../": (lambda r, m: m.update(model="../outside.txt"), "outside"),
        "NUL in a name": (lambda r, m: m["files"].update({"a\x00b": "0"}), "not a bundle manifest"),
        "files not a mapping": (lambda r, m: m.update(files=["x"]), "not a bundle manifest"),
        "no files key": (lambda r, m: m.pop("files"), "not a bundle manifest"),
        "unknown format": (lambda r, m: m.update(format="zip"), "not a bundle manifest"),
        "model file changed": (lambda r, m: (r / model).write_bytes((r / model).read_bytes() + b"\0"), "sha256"),
        "model file deleted": (lambda r, m: (r / model).unlink(), "missing"),
        "file added": (lambda r, m: (r / "extra.bin").write_bytes(b"x"), "not in the manifest"),
        "manifest not JSON": (lambda r, m: (r / bundle_manifest.MANIFEST).write_text("{"), "not a bundle manifest"),
    }
    for label, (change, expect) in cases.items():
        out.add("4 bundle bounds", label, tampered(change, expect))


def cache_cases(out: Outcome, base: dict[str, Any], work: Path) -> None:
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe

    recipe = parse_recipe(base, "adversarial.yaml", work)
    run = work / "run"
    Pipeline(recipe, run).execute()

    def after(tamper: Callable[[], None], check: Callable[[list[Any]], bool | str]) -> Callable[[], bool | str]:
        def go() -> bool | str:
            tamper()
            return check(Pipeline(recipe, run).execute())

        return go

    def edit_metrics() -> None:
        path = run / "02-ort_session" / "metrics.json"
        data = json.loads(path.read_text())
        first = next(iter(data["metrics"]["scenarios"].values()))
        first["latency"]["p50_ms"] = 1e-9
        path.write_text(json.dumps(data))

    def flip_model() -> None:
        path = run / "01-export" / "model.onnx"
        data = bytearray(path.read_bytes())
        data[-20] ^= 0xFF
        path.write_bytes(bytes(data))

    def note(index: int, words: str) -> Callable[[list[Any]], bool | str]:
        return lambda recs: words in (recs[index].cache_note or "") or f"cache_note {recs[index].cache_note!r}"

    out.add("2 cache integrity", "metrics.json edited", after(edit_metrics, note(2, "measured again")))
    out.add("2 cache integrity", "model bytes changed, same size", after(flip_model, note(1, "rebuilt")))
    out.add("2 cache integrity", "model file deleted",
            after(lambda: (run / "01-export" / "model.onnx").unlink(), note(1, "rebuilt")))
    out.add("2 cache integrity", "reference.npz truncated", after(
        lambda: (run / "00-source" / "reference.npz").write_bytes(b"PK\x03\x04"),
        lambda recs: True if all(r.ok for r in recs) else [r.reason for r in recs]))
    out.add("2 cache integrity", "stage.json removed", after(
        lambda: (run / "02-ort_session" / "stage.json").unlink(),
        lambda recs: True if recs[2].status == "ran" else recs[2].status))


def factory_cases(out: Outcome, base: dict[str, Any], work: Path) -> None:
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe

    def unseeded() -> bool | str:
        data = copy.deepcopy(base)
        data["model"] = {"source": "factory", "target": "tiny_models:unseeded_mlp"}
        records = Pipeline(parse_recipe(data, "adversarial.yaml", work), work / "unseeded").execute()
        export = records[1]
        return True if export.ok and (export.metrics or {}).get("within_budget") else f"export: {export.reason}"

    out.add("7 unseeded factories", "random weights, no seed", unseeded)


def outcome_cases(out: Outcome, run: Path, work: Path) -> None:
    from optimizer.report.diff import different_models
    from optimizer.report.history import list_runs, load_report, record
    from optimizer.report.schema import parse_report, read_report

    report = json.loads((run / "report.json").read_text())
    typed = read_report(run / "report.json")

    def refuses(fn: Callable[[], Any]) -> bool | str:
        return _refused(fn, OptimizerError)

    newer = work / "newer.json"
    newer.write_text(json.dumps({**report, "schema_version": 99}))
    out.add("5 honest outcomes", "unknown schema_version", lambda: refuses(lambda: load_report(str(newer))))
    other = copy.deepcopy(report)
    other["recipe"]["model"] = {"source": "factory", "target": "x:y", "kwargs": {}}
    out.add("5 honest outcomes", "diff of different models",
            lambda: True if different_models(typed, parse_report(other, "other.json")) else "not noticed")
    garbage = work / "garbage.sqlite"
    garbage.write_bytes(b"not a database" * 100)
    out.add("5 honest outcomes", "history not a database", lambda: refuses(lambda: list_runs(garbage)))

    def page_corrupt() -> bool | str:
        db = work / "history.sqlite"
        for _ in range(3):
            record(typed, db)
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'runs'").fetchone()[0]
            size = conn.execute("PRAGMA page_size").fetchone()[0]
        data = bytearray(db.read_bytes())
        data[(root - 1) * size : root * size] = b"\xff" * size
        db.write_bytes(bytes(data))
        return refuses(lambda: list_runs(db))

    out.add("5 honest outcomes", "history page corrupted", page_corrupt)
    killed = work / "killed.json"
    killed.write_text(json.dumps({**report, "outcome": "incomplete"}))
    out.add("5 honest outcomes", "report of a killed run", lambda: True if load_report(str(killed)).outcome
            == "incomplete" else "read as finished")


TOPICS = ("handover", "paths", "validation", "sources", "edge", "generated", "console", "claims", "recipe_files",
          "data", "signals")


@dataclass
class Shared:
    """What a case module (tests/corpus/<topic>.py) gets: the outcome to add to, the base recipe, a scratch folder
    of its own, a compiled run folder of the base recipe and an onnx bundle exported from its ort_session stage
    (copy them before changing them: other modules read them too)."""

    out: Outcome
    base: dict[str, Any]
    work: Path
    run: Path
    bundle: Path


def run_corpus(base: dict[str, Any]) -> Outcome:
    """Every class on the given (small) recipe: it is compiled once for the bundle, cache and outcome cases."""
    from optimizer.deploy.export import export_bundle
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe
    from optimizer.report.build import write_report

    out = Outcome()
    with tempfile.TemporaryDirectory(prefix="adversarial-") as tmp:
        work = Path(tmp)
        recipe_cases(out, base, work)
        recipe = parse_recipe(base, "adversarial.yaml", work)
        run = work / "compiled"
        report = write_report(recipe, Pipeline(recipe, run).execute(), run, 0.0)
        bundle_dir = export_bundle(report, "ort_session", "onnx", work / "bundle")
        bundle_cases(out, bundle_dir, work)
        cache_cases(out, base, work)
        factory_cases(out, base, work)
        outcome_cases(out, run, work)
        for topic in TOPICS:  # one module each, named by what it checks (tests/corpus/<topic>.py)
            import importlib

            importlib.import_module(f".{topic}", __package__).add_cases(
                Shared(out=out, base=base, work=work / f"r3-{topic}", run=run, bundle=bundle_dir))
    return out


def table(out: Outcome) -> str:
    lines = ["| class | cases tried | held |", "|---|---:|---:|"]
    for kind in sorted(out.tried):
        lines.append(f"| {kind} | {out.tried[kind]} | {out.held.get(kind, 0)} |")
    lines.append(f"| all | {sum(out.tried.values())} | {sum(out.held.values())} |")
    return "\n".join(lines)

