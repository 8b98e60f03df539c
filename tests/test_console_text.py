"""Issue 47, class 2: a terminal never receives bytes a file chose. Tensor names, file names, stage names and
reasons come from models, bundles and run folders; whatever the command, they reach the terminal escaped (one
function at the console boundary, optimizer.cli.options.terminal_text), while our own styles still colour.

The consoles here are not terminals, so rich writes no escape sequence of its own: any ESC in what was captured
came from a file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import compile_mlp

from optimizer.cli.app import main

PAYLOAD = "\x1b[2J\x1b[32mok\x1b[0m\x1b]0;owned\x07\x9b31m"  # clear the screen, paint "ok" green, set the title, CSI


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Exit code and stdout + stderr of `optimizer ARGS`."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    got = capsys.readouterr()
    return int(e.value.code or 0), got.out + got.err


def assert_escaped(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, repr(text)
    assert "\\x1b[2J" in text, text  # shown, escaped, not dropped: the user sees what the file holds


def one_matmul(path: Path, name: str, scale: float = 1.0) -> Path:
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [16, 4], (np.random.default_rng(0).random(64) * scale).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", [f"x{name}", "w"], [f"y{name}"])], "g",
        [helper.make_tensor_value_info(f"x{name}", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info(f"y{name}", TensorProto.FLOAT, ["batch", 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_mlp(tmp_path_factory.mktemp("console") / "run")


def test_verify_escapes_a_planted_file_name(compiled: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from optimizer.deploy.export import export_bundle
    from optimizer.report.history import load_report

    bundle = export_bundle(load_report(str(compiled)), "ort_session", "onnx", tmp_path / "b")
    (bundle / f"extra{PAYLOAD}.bin").write_bytes(b"x")
    code, text = cli(capsys, "verify", str(bundle))
    assert code == 1
    assert_escaped(text)


def test_report_escapes_a_run_folders_text(compiled: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(compiled, run)
    data = json.loads((run / "report.json").read_text())
    data["findings"] = [f"finding {PAYLOAD}"]
    data["stages"][2]["reason"] = f"reason {PAYLOAD}"
    (run / "report.json").write_text(json.dumps(data))
    code, text = cli(capsys, "report", str(run))
    assert code == 0
    assert_escaped(text)
    assert "finding \\x1b[2J" in text


@pytest.mark.parametrize("fmt", ["table", "md"])
def test_diff_escapes_stage_names_in_every_format(compiled: Path, tmp_path: Path, fmt: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for side in ("a", "b"):
        run = tmp_path / side
        shutil.copytree(compiled, run)
        data = json.loads((run / "report.json").read_text())
        data["stages"][2]["name"] = f"ort{PAYLOAD}"
        (run / "report.json").write_text(json.dumps(data))
        runs.append(str(run))
    code, text = cli(capsys, "diff", *runs, "--format", fmt)
    assert code == 0
    assert_escaped(text)


def test_compare_escapes_tensor_and_file_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = one_matmul(tmp_path / "a.onnx", PAYLOAD)
    b = one_matmul(tmp_path / f"b{PAYLOAD}.onnx", PAYLOAD, scale=2.0)
    code, text = cli(capsys, "compare", str(a), str(b), "--bench", "rounds=2,iterations=1", "--threads", "1",
                     "--out", str(tmp_path / "cmp"), "--no-cache")
    assert code == 0, text
    assert_escaped(text)


def test_a_terminal_gets_our_styles_and_never_the_files_sequences() -> None:
    import io

    from rich.table import Table

    from optimizer.cli.options import stdout_console, styled

    buf = io.StringIO()
    console = stdout_console(file=buf, force_terminal=True, color_system="standard")
    table = Table()
    table.add_column(f"col{PAYLOAD}")
    table.add_row(f"cell{PAYLOAD}")
    console.print(styled(("ok", "green"), f" {PAYLOAD}"))
    console.print(table)
    console.print(f"plain {PAYLOAD}")
    out = buf.getvalue()
    assert "\x1b[32mok" in out  # our own green
    assert "\x1b[2J" not in out and "\x1b]0" not in out and "\x07" not in out and "\x9b" not in out, repr(out)
    assert out.count("owned") == 4  # every payload shown (the highlighter may style its brackets)


def test_terminal_text_keeps_printable_text_and_layout() -> None:
    from optimizer.cli.options import terminal_text

    assert terminal_text("models[v2] é 模型 a/b:0\tx\n") == "models[v2] é 模型 a/b:0\tx\n"
    assert terminal_text("a\x1bb\x00c\x7fd\u202ee\r") == "a\\x1bb\\x00c\\x7fd\\u202ee\\x0d"
