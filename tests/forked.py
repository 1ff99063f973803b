"""Script processes forked from a server that imported torch and Lightning once.

A multi-process test starts one process per rank, and each fresh interpreter spends seconds of CPU importing
torch and both Lightning namespaces before it trains for a second or two: on the 2-core CI host that import
was most of the slow tests' time. A ``forkserver`` imports them once; each rank is forked from it (a clean,
single-threaded process that never ran torch code) and runs the script as ``python script.py`` would:
``__main__``, its own argv, environment, working directory and stderr.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
import warnings
from pathlib import Path
from typing import Any

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "lightning.pytorch", "pytorch_lightning", "lightning_naspipe"])


def _run_script(script: str, args: list[str], env: dict[str, str], cwd: str, stderr: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    with open(stderr, "w") as err, open(os.devnull, "w") as out:
        os.dup2(err.fileno(), 2)
        os.dup2(out.fileno(), 1)
    if env.get("PYTHONWARNINGS") == "ignore":  # read at interpreter start, which a fork skips
        warnings.simplefilter("ignore")
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # a forked child leaves through os._exit: run what the script registered, as an interpreter would
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


class ScriptProcess:
    """``python script *args`` with ``env`` in ``cwd``, forked from the preloaded server; stdout is dropped."""

    def __init__(self, script: Path, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self._stderr = cwd / f".stderr.{id(self)}"
        self._process: Any = _CONTEXT.Process(target=_run_script,
                                              args=(str(script), args, env, str(cwd), str(self._stderr)))
        self._process.start()

    def wait(self, timeout: float) -> str:
        """Wait up to ``timeout`` seconds (then kill it); what it wrote to stderr."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            self.kill()
        return self._stderr.read_text() if self._stderr.exists() else ""

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode
