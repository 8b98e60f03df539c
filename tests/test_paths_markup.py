"""Issue 28, classes 3 and 4: paths and folders the user did not mean, and user text printed as rich markup.

Every test goes through the real command line (optimizer.cli.app.main, in this process) or the run folder's own
writer, and checks what the user sees and what is left on disk.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import yaml
from conftest import mlp_recipe

from optimizer.cli.app import main
from optimizer.core.errors import OptimizerError
from optimizer.engine.rundir import RunDir, write_text


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `optimizer ARGS`."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    got = capsys.readouterr()
    return int(e.value.code or 0), got.out, got.err


def recipe_at(path: Path, **overrides: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(mlp_recipe(**overrides), sort_keys=False))
    return path


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


# --- class 3: paths and folders the user did not mean -------------------------------------------------------


def test_lock_symlink_is_refused_and_its_target_untouched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text('{"schema_version": 1}')  # a run folder, handed over with a planted lock
    (run / ".lock").symlink_to(victim)
    code, _, err = cli(capsys, "compile", str(recipe_at(tmp_path / "r.yaml")), "--out", str(run), "--no-history")
    assert code == 2
    assert str(run / ".lock") in one_error_line(err)
    assert victim.read_text() == "precious"
    assert (run / ".lock").is_symlink()


def test_lock_symlink_is_not_read_for_the_writer_pid(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("4242")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(victim)
    fd = os.open(victim, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held: a lock that followed the link would read the victim's "pid"
        assert RunDir(tmp_path / "run").writer_pid() is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["report.json", "machine.json"])
def test_atomic_write_never_follows_a_planted_temp_name(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / f".{name}.tmp-{os.getpid()}").symlink_to(victim)
    write_text(run / name, "ours")
    assert victim.read_text() == "precious"
    assert (run / name).read_text() == "ours"
    assert not (run / f".{name}.tmp-{os.getpid()}").exists()


def test_write_probe_never_follows_a_planted_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text("{}")  # a run folder, handed over
    (run / f".write-probe-{os.getpid()}").symlink_to(victim)
    rd = RunDir(run)
    rd.prepare()
    rd.release()
    assert victim.read_text() == "precious"


@pytest.mark.slow
def test_stage_zero_reference_never_follows_a_planted_temp_name(tmp_path: Path) -> None:
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    recipe = load_recipe(recipe_at(tmp_path / "r.yaml", passes=[]))
    run = tmp_path / "run"
    Pipeline(recipe, run).execute()
    (run / "00-source" / "reference.npz").unlink()  # measured again: the reference is written anew
    (run / "00-source" / ".reference.tmp.npz").symlink_to(victim)
    Pipeline(recipe, run).execute()
    assert victim.read_text() == "precious"
    assert (run / "00-source" / "reference.npz").is_file()


def test_out_folder_of_the_users_files_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine"
    (mine / "01-export").mkdir(parents=True)
    (mine / "01-export" / "thesis.tex").write_text("chapter 1")
    (mine / "report.md").write_text("my report")
    before = sorted(p.relative_to(mine) for p in mine.rglob("*"))
    code, _, err = cli(capsys, "compile", str(recipe_at(tmp_path / "r.yaml")), "--out", str(mine), "--no-history")
    assert code == 2
    assert str(mine) in one_error_line(err)
    assert sorted(p.relative_to(mine) for p in mine.rglob("*")) == before  # nothing written, nothing deleted
    assert (mine / "01-export" / "thesis.tex").read_text() == "chapter 1"
    assert (mine / "report.md").read_text() == "my report"


def test_users_folder_is_refused_by_the_run_folder_itself(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(OptimizerError, match="not a run folder"):
        RunDir(tmp_path).prepare()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_model_flow_refuses_a_users_folder_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("keep")
    code, _, err = cli(capsys, "compile", "--model", "tiny_models:mlp", "--out", str(tmp_path), "--no-history")
    assert code == 2
    assert str(tmp_path) in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("leftover", ["lock only", "stage folder, no lock", "recipe.yaml only"])
def test_run_folders_still_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str], leftover: str) -> None:
    """A compile killed early (only its lock), a run folder of an older version (no lock) and a folder with
    just the recipe in it (the --model flow's rerun) are all compiled into."""
    run = tmp_path / "run"
    run.mkdir()
    recipe = recipe_at(tmp_path / "r.yaml")
    if leftover == "lock only":
        (run / ".lock").write_text("")
    elif leftover == "stage folder, no lock":
        (run / "00-source").mkdir()
        (run / "00-source" / "stage.json").write_text("{}")
    else:
        recipe = recipe_at(run / "recipe.yaml")
    code, _, err = cli(capsys, "compile", str(recipe), "--out", str(run), "--no-history", "--no-bench")
    assert code == 0, err
    assert (run / "report.json").is_file()


# --- class 4: user text is never parsed as markup -----------------------------------------------------------


def test_validate_prints_a_path_with_closing_tag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = recipe_at(tmp_path / "odd[/x]" / "r.yaml")
    code, out, err = cli(capsys, "validate", str(path))
    assert code == 0, err
    assert f"ok {path}: 2 passes" in out


def test_error_keeps_brackets_in_a_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = recipe_at(tmp_path / "models[v2]" / "r.yaml", passes=[{"type": "nope"}])
    code, _, err = cli(capsys, "validate", str(path))
    assert code == 2
    assert str(path) in one_error_line(err)


@pytest.mark.slow
def test_compile_out_with_closing_tag_then_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history = tmp_path / "history.sqlite"
    out = tmp_path / "runs" / "r[/x]"
    recipe = recipe_at(tmp_path / "r.yaml")
    code, stdout, err = cli(capsys, "--history", str(history), "compile", str(recipe), "--out", str(out))
    assert code == 0, err
    assert f"report: {out / 'report.json'}" in stdout
    code, stdout, err = cli(capsys, "--history", str(history), "runs")
    assert code == 0, err
    assert "r[/x]" in stdout


def test_factory_error_with_closing_tag_keeps_tables_and_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPTIMIZER_DEBUG", raising=False)  # the user's view: a failing factory is a failed stage
    (tmp_path / "r3_markup_factory.py").write_text(
        "def broken():\n    raise OSError('cannot read the weights at [/data]/w.bin [bold]')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    history = tmp_path / "history.sqlite"
    recipe = recipe_at(tmp_path / "r.yaml", model={"source": "factory", "target": "r3_markup_factory:broken"})
    code, stdout, err = cli(capsys, "--history", str(history), "compile", str(recipe), "--out", str(tmp_path / "run"))
    assert code == 1, err
    assert "00 source" in stdout  # the stage table
    assert "cannot read the weights at [/data]/w.bin [bold]" in stdout
    assert (tmp_path / "run" / "report.json").is_file()
    code, stdout, err = cli(capsys, "--history", str(history), "runs")
    assert code == 0, err
    assert str(tmp_path / "run") in stdout
