"""The one reader of a run folder's files (export reads artifacts through it): a stage's artifact as it lies in the
folder given (report.run_dir, which history.load_report sets to the folder it read), never where report.json says it
once was.

report.json names artifacts by absolute path, and a folder may have been copied, moved, edited or compiled again
since. So an artifact is found by its stage folder's name and its file names, every file must lie inside the run
folder (no `..`, no symlink out), the stage folder's stage.json must still be the one of this run (its cache key),
and every file must have the size and sha256 stage.json recorded when the stage wrote it (rundir.changed_files, the
check the cache uses). The one file allowed outside is the recipe's own ONNX model, for the source stage.
"""

from __future__ import annotations

from pathlib import Path

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.core.stage import StageReport
from optimizer.engine import rundir as rd
from optimizer.report.schema import RunReport


def _plain_names(artifact: Artifact, where: str) -> None:
    """The files beside the model are named relative to its folder, never above it (report.json is user-editable
    text)."""
    fields = {
        "external_data": artifact.external_data,
        "decode": [artifact.decode] if artifact.decode else [],
        "decode_external_data": artifact.decode_external_data,
        "genai_files": artifact.genai_files,
    }
    for field, names in fields.items():
        for name in names:
            parts = Path(name).parts if isinstance(name, str) else ()
            if not parts or Path(name).is_absolute() or ".." in parts or "\x00" in name:
                raise OptimizerError(f"{where}: artifact.{field}: {name!r} is not a file below the model's folder (a "
                                     "run's files lie in its stage folders)")


def _owner(report: RunReport, folder: str) -> StageReport | None:
    """The stage whose folder this is (an unchanged stage's artifact lies in its input's folder)."""
    return next((s for s in report.stages if s.folder == folder), None)


def _recipe_model(report: RunReport) -> Path | None:
    """The recipe's ONNX model file, where the run read it (stage 0 of an ONNX source is that file)."""
    model = report.recipe.model
    if model.get("source") != "onnx" or not model.get("path"):
        return None
    base = Path(report.recipe_dir or report.run_dir)
    return (base / str(model["path"])).resolve()


def stage_artifact(report: RunReport, stage: StageReport) -> Artifact:
    """The stage's artifact with its files in this run folder, checked (see the module's docstring); one
    OptimizerError naming the file and what is wrong otherwise."""
    artifact = stage.artifact
    root = Path(report.run_dir)
    where = f"{root / 'report.json'}: stage {stage.name!r}"
    if artifact is None or artifact.path is None:
        return artifact  # type: ignore[return-value]  # a torch source: no file (the formats refuse it)
    _plain_names(artifact, where)
    recorded = Path(artifact.path)
    folder_name = recorded.parent.name if recorded.is_absolute() else stage.folder
    owner = _owner(report, folder_name or "")
    if owner is not None:
        folder = root / str(owner.folder)
        located = artifact.derive(path=folder / recorded.name)
        inside = root.resolve()
        outside = [f for f in located.files() if not f.resolve().is_relative_to(inside)]
        if outside:
            raise OptimizerError(f"{where}: {outside[0]} resolves outside the run folder {root} (a symlink?); "
                                 "export ships only the run's own files")
    elif stage.index == 0 and recorded.resolve() == _recipe_model(report):
        owner, folder, located = stage, root / str(stage.folder), artifact  # the user's model, named in the recipe
    else:
        raise OptimizerError(f"{where}: artifact.path {str(recorded)!r} is in no stage folder of this run; export "
                             "ships only the run's own files")
    info = rd.read_json(folder / rd.STAGE_FILE)
    if not isinstance(info, dict) or info.get("key") != owner.key:
        raise OptimizerError(
            f"{folder / rd.STAGE_FILE}: not the stage this report measured (missing, or the folder was compiled "
            "again since); export the run's current report, or compile again"
        )
    if info.get("file_sha256") is None:
        raise OptimizerError(f"{folder / rd.STAGE_FILE}: records no sha256 of the stage's files (an older "
                             "optimizer wrote it); compile again to export it")
    changed = rd.changed_files(located.files(), info)
    if changed:
        what = "missing" if not changed[0].is_file() else "its sha256 differs from what the run recorded"
        raise OptimizerError(f"{changed[0]}: {what} (changed after the run measured it); compile again to export it")
    return located
