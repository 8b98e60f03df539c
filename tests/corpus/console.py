"""Adversarial cases of issue 47, class 2: a terminal never receives bytes a file chose (cli.options)."""

from __future__ import annotations

import io
import json
import shutil

from .adversarial import Shared

KIND = "R4.2 control sequences reach the terminal"
PAYLOAD = "\x1b[2J\x1b[32mok\x1b[0m\x1b]0;t\x07\x9b1m"


def _cli(*args: str) -> tuple[int, str]:
    import contextlib

    from optimizer.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            return int(e.code or 0), out.getvalue() + err.getvalue()
    return 0, out.getvalue() + err.getvalue()


def _clean(text: str) -> bool | str:
    return True if not any(c in text for c in "\x1b\x07\x9b") else f"raw control bytes: {text[:120]!r}"


def add_cases(r: Shared) -> None:
    r.work.mkdir(parents=True, exist_ok=True)

    def verify_case() -> bool | str:
        root = r.work / "b"
        shutil.copytree(r.bundle, root)
        (root / f"x{PAYLOAD}").write_bytes(b"x")
        return _clean(_cli("verify", str(root))[1])

    def report_case() -> bool | str:
        run = r.work / "run"
        shutil.copytree(r.run, run)
        data = json.loads((run / "report.json").read_text())
        data["findings"] = [PAYLOAD]
        (run / "report.json").write_text(json.dumps(data))
        return _clean(_cli("report", str(run))[1])

    def diff_md_case() -> bool | str:
        run = r.work / "run2"
        shutil.copytree(r.run, run)
        data = json.loads((run / "report.json").read_text())
        data["stages"][1]["name"] = f"e{PAYLOAD}"
        (run / "report.json").write_text(json.dumps(data))
        return _clean(_cli("diff", str(run), str(run), "--format", "md")[1])

    def terminal_case() -> bool | str:
        from optimizer.cli.options import stdout_console, styled

        buf = io.StringIO()
        stdout_console(file=buf, force_terminal=True, color_system="standard").print(styled(("ok", "green"), PAYLOAD))
        out = buf.getvalue()
        return True if "\x1b[32mok" in out and "\x1b[2J" not in out and "\x07" not in out else repr(out)

    r.out.add(KIND, "verify: planted file name", verify_case)
    r.out.add(KIND, "report: finding from report.json", report_case)
    r.out.add(KIND, "diff --format md: stage name", diff_md_case)
    r.out.add(KIND, "a real terminal: our colours kept, theirs escaped", terminal_case)
