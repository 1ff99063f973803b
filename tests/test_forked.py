"""forked.py runs a script as ``python script.py`` would: a rank that fails must fail the test that started it."""

from __future__ import annotations

import json
from pathlib import Path

from forked import ScriptProcess

SCRIPT = """
import json, os, sys
json.dump({"argv": sys.argv[1:], "env": os.environ.get("PROBE"), "cwd": os.getcwd(), "name": __name__},
          open("seen.json", "w"))
if sys.argv[1] == "raise":
    raise ValueError("injected")
if sys.argv[1] == "exit":
    sys.exit(3)
"""


def _run(tmp_path: Path, how: str) -> tuple[int | None, str]:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    process = ScriptProcess(script, [how, "--flag"], {"PROBE": "yes"}, tmp_path)
    stderr = process.wait(60)
    return process.returncode, stderr


def test_a_script_sees_its_argv_environment_folder_and_main(tmp_path: Path) -> None:
    code, _ = _run(tmp_path, "ok")
    assert code == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"argv": ["ok", "--flag"], "env": "yes", "cwd": str(tmp_path), "name": "__main__"}


def test_an_exception_or_exit_status_fails_the_process_with_its_traceback(tmp_path: Path) -> None:
    code, stderr = _run(tmp_path, "raise")
    assert code != 0 and "ValueError: injected" in stderr
    assert _run(tmp_path, "exit")[0] == 3
